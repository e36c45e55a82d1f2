import os

# The memory tests read the CPU allocator's peak (get_memory_info('CPU:0')), which
# TensorFlow's default CPU allocator reports only with oneDNN on; TF turns oneDNN on by
# itself only on CPUs with AVX-512 VNNI/BF16 or AMX, so on an AVX2-only AMD EPYC every
# measured test failed with "Cannot reset memory stats". Set before TensorFlow is
# imported; subprocesses inherit it. Tests that need it off say so in their own env.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

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


import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_garbage_of_earlier_tests():
    """Free the models and traced functions earlier tests left in reference cycles.

    The allocator's ``current`` counts them as memory held outside the step, which
    tfremat plans around: tests that size a budget from one plan and check the next
    saw a 28 MiB leftover of the test before them and found no plan that fit.
    """
    gc.collect()
    yield
