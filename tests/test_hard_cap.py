"""Under a hard CPU allocator cap the plain step raises the real OOM; the decorated one trains.

Each run is a fresh process: the cap (TF_CPU_ALLOCATOR_USE_BFC=true
TF_CPU_BFC_MEM_LIMIT_IN_MB=N) is read when TensorFlow starts. oneDNN is off in the
capped processes because with it an OOM under a capped allocator can segfault
instead of raising.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

HERE = Path(__file__).resolve().parent

STEP = r"""
import json, sys
sys.path.insert(0, {here!r})
import tensorflow as tf
import tfremat
from tf_models import make_data, make_step, measure_peak
x, y = make_data("mlp", batch=2048, width=256)
_, step = make_step("mlp", "sgd", layers=32, width=256)
budget = {budget!r}
fn = step if budget is None else tfremat.remat(step, budget_gib=budget)
peaks, losses = [], []
for _ in range(3):
    out, peak = measure_peak(fn, x, y)
    losses.append(float(out)); peaks.append(peak)
print(json.dumps(dict(peaks=peaks, losses=losses)))
"""


def run(budget_gib, cap_mib):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
    if cap_mib is not None:
        env.update(TF_CPU_BFC_MEM_LIMIT_IN_MB=str(cap_mib), TF_ENABLE_ONEDNN_OPTS="0")
    code = STEP.format(here=str(HERE), budget=budget_gib)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_plain_step_ooms_under_cap_and_remat_step_trains():
    free = run(None, None)
    assert free.returncode == 0, free.stderr[-2000:]
    baseline = max(json.loads(free.stdout.strip().splitlines()[-1])["peaks"])
    cap_mib = int(0.6 * baseline / 2**20)

    plain = run(None, cap_mib)
    assert plain.returncode != 0
    assert "ResourceExhaustedError" in plain.stderr
    assert "OOM when allocating tensor with shape" in plain.stderr

    budget_gib = 0.9 * cap_mib / 1024
    fitted = run(budget_gib, cap_mib)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    r = json.loads(fitted.stdout.strip().splitlines()[-1])
    assert max(r["peaks"]) <= budget_gib * 2**30
    # The same training as the plain step uncapped (oneDNN differs between the two
    # processes, so not bitwise here: tests/test_tf_numerics.py checks bitwise).
    expected = json.loads(free.stdout.strip().splitlines()[-1])["losses"]
    assert r["losses"] == pytest.approx(expected, rel=1e-5)
