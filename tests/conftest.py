import os

from hypothesis import HealthCheck, settings

# `ci`: sized for CI's 2 cores; `dev`: more examples for local runs.
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
