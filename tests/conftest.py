import os

from hypothesis import HealthCheck, settings

# `ci`: sized for CI's 2 cores; `dev`: more examples for local runs.
# `ci` is derandomized: CI must give the same verdict on the same commit. Random
# exploration happens in `dev` runs; what it finds is fixed or recorded as a known gap.
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
