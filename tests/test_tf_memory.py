"""Measured allocator peaks: the rewritten step fits its budget and saves real memory.

Ground truth is TensorFlow's allocator (`get_memory_info('CPU:0')['peak']` after
`reset_memory_stats`), never the simulator. Each case runs in a fresh process: the
allocator's peak counts every live tensor of the process, and models of earlier
tests stay alive. The CPU allocator does not count allocations under 256 KiB, so the
models here use tensors of 1 MiB and more.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

HERE = Path(__file__).resolve().parent

CASE = r"""
import json, sys
sys.path.insert(0, {here!r})
import tfremat
from tf_models import make_data, make_step, measure_peak

kind, fraction = {kind!r}, {fraction!r}
model_kw, data_kw = {model_kw!r}, {data_kw!r}
x, y = make_data(kind, **data_kw)
_, ref = make_step(kind, "sgd", **model_kw)
baseline = [measure_peak(ref, x, y)[1] for _ in range(3)]
budget = fraction * max(baseline)
_, step = make_step(kind, "sgd", **model_kw)
fn = tfremat.remat(step, budget_gib=budget / 2**30)
plan = fn.get_plan(x, y)
peaks = [measure_peak(fn, x, y)[1] for _ in range(3)]
print(json.dumps(dict(baseline=baseline, budget=budget, peaks=peaks,
                      predicted=plan.predicted_peak_bytes, recomputed=len(plan.recomputed))))
"""

MODELS = {
    "mlp": (dict(layers=32, width=256), dict(batch=2048, width=256)),
    "cnn": (dict(channels=16, blocks=8, size=32), dict(batch=64, size=32)),
    # a hand-written gradient repeating forward ops, which Grappler merges (CSE): the
    # merged ops run in the forward pass and stay live until the gradient reads them
    "swish": (dict(layers=16, width=256), dict(batch=2048, width=256)),
    # grouped convolutions: XLA-compiled calls, whose outputs are freed apart
    "grouped": (dict(channels=16, blocks=8, size=32), dict(batch=64, size=32)),
}
CASES = [("mlp", 0.7), ("mlp", 0.6), ("cnn", 0.7), ("cnn", 0.6), ("swish", 0.7), ("grouped", 0.8)]


def run_case(kind: str, fraction: float) -> dict:
    model_kw, data_kw = MODELS[kind]
    code = CASE.format(here=str(HERE), kind=kind, fraction=fraction, model_kw=model_kw, data_kw=data_kw)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind,fraction", CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_measured_peak_fits_budget_and_beats_baseline(kind, fraction):
    r = run_case(kind, fraction)
    assert min(r["baseline"]) > 0, "the CPU allocator reported no peak"
    assert r["recomputed"] > 0
    assert r["predicted"] <= r["budget"]
    assert max(r["peaks"]) <= r["budget"], f"measured {r['peaks']} over budget {r['budget']:.0f}"
    assert max(r["peaks"]) < min(r["baseline"])
    # The prediction models the allocator: keep it honest (within 10 %).
    assert abs(max(r["peaks"]) - r["predicted"]) <= 0.10 * max(r["peaks"])


SCRATCH_CASE = r"""
import json, sys
sys.path.insert(0, {here!r})
import tfremat, tfremat.api
from tf_models import make_data, make_step, measure_peak

tfremat.api._MAX_CALIBRATIONS = {calibrations!r}
x, y = make_data("cnn", batch=64, size=32)
_, ref = make_step("cnn", "sgd", channels=16, blocks=8, size=32)
baseline = max(measure_peak(ref, x, y)[1] for _ in range(2))
del ref
budget = 0.7 * baseline
_, step = make_step("cnn", "sgd", channels=16, blocks=8, size=32)
fn = tfremat.remat(step, budget_gib=budget / 2**30)
fn.measure_scratch = {measure!r}
plan = fn.get_plan(x, y)
peaks = [measure_peak(fn, x, y)[1] for _ in range(3)]
print(json.dumps(dict(budget=budget, peaks=peaks, predicted=plan.predicted_peak_bytes)))
"""


def _scratch_case(calibrations: int, measure: bool) -> dict:
    # BFC counts every allocation, and with oneDNN off Eigen's Conv2DBackpropFilter
    # allocates a column buffer of up to 30 MiB per call (BFC served it from a
    # 47 MiB chunk): memory the per-tensor model does not see.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB="8192", TF_ENABLE_ONEDNN_OPTS="0")
    code = SCRATCH_CASE.format(here=str(HERE), calibrations=calibrations, measure=measure)
    return _run_case(code, env)


def _run_case(code: str, env=None) -> dict:
    """Run a case's script in a fresh process; the JSON line it prints last."""
    env = env or dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def _unmodelled_scratch_case() -> dict:
    """Neither measured nor calibrated: what the per-tensor model alone gives."""
    r = _scratch_case(calibrations=0, measure=False)
    assert max(r["peaks"]) > r["budget"], "the scratch space no longer matters here"
    return r


def test_kernel_scratch_is_measured_and_planned_for_from_the_first_call():
    """Each convolution kernel's scratch is measured while planning and is live in
    the plan's simulation while its op runs: every call fits, the first one too, and
    the prediction covers the measured peak."""
    _unmodelled_scratch_case()
    r = _scratch_case(calibrations=0, measure=True)
    assert max(r["peaks"]) <= r["budget"], f"measured {r['peaks']} over budget {r['budget']:.0f}"
    assert max(r["peaks"]) <= 1.05 * r["predicted"], (r["peaks"], r["predicted"])


def test_memory_the_model_misses_is_planned_for_after_the_first_call():
    """Without the scratch measurement, the first call's measured peak feeds the
    next plan: later calls fit."""
    _unmodelled_scratch_case()
    r = _scratch_case(calibrations=2, measure=False)
    assert max(r["peaks"][1:]) <= r["budget"], f"measured {r['peaks']} over budget {r['budget']:.0f}"


UNMEASURED_CASE = r"""
import json, sys, warnings
sys.path.insert(0, {here!r})
import tensorflow as tf
import tfremat
from tf_models import make_data, make_step

try:
    tf.config.experimental.get_memory_info("CPU:0")
    print(json.dumps(dict(stats=True)))
    raise SystemExit(0)
except ValueError:
    pass
x, y = make_data("mlp", batch=1024, width=256)
_, ref = make_step("mlp", "sgd", layers=16, width=256)
_, step = make_step("mlp", "sgd", layers=16, width=256)
baseline = tfremat.remat(step, budget_gib=1.0).get_plan(x, y).baseline_peak_bytes
fn = tfremat.remat(step, budget_gib=0.75 * baseline / 2**30)
assert fn.get_plan(x, y).recomputed
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    losses = [float(fn(x, y)) for _ in range(2)]
expected = [float(ref(x, y)) for _ in range(2)]
print(json.dumps(dict(stats=False, losses=losses, expected=expected,
                      warnings=[str(w.message) for w in caught])))
"""


def test_a_step_runs_and_warns_where_the_allocator_reports_no_statistics():
    """With oneDNN off and the default CPU allocator, TensorFlow reports no memory
    statistics: the rewritten step still runs and computes the same losses, and says
    once that its calls are not measured and how to have them measured."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    out = subprocess.run([sys.executable, "-c", UNMEASURED_CASE.format(here=str(HERE))],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["stats"]:
        pytest.skip("this TensorFlow reports CPU allocator statistics with oneDNN off")
    assert r["losses"] == r["expected"]
    mine = [w for w in r["warnings"] if "no allocator statistics" in w]
    assert len(mine) == 1 and "TF_ENABLE_ONEDNN_OPTS=1" in mine[0], r["warnings"]


MOMENTUM_CASE = r"""
import json, sys
sys.path.insert(0, {here!r})
import tfremat
from tfremat.simulate import free_running_order, simulate
from tf_models import make_data, make_step, measure_peak

x, y = make_data("mlp", batch=512, width=512)
_, step = make_step("mlp", "momentum", layers=6, width=512)
probe = tfremat.remat(step, budget_gib=1.0)
plan = probe.get_plan(x, y)
g = list(probe._cache.values())[0].step_graph.graph
free = simulate(g, free_running_order(g, plan.schedule), plan.fixed_bytes).peak_bytes
largest = max(d["bytes"] for _, d in g.nodes(data=True))
# the program order fits the plan's target with nothing recomputed; the free order not
budget = (plan.predicted_peak_bytes + largest + 0.25 * (free - plan.predicted_peak_bytes)) / 0.95
fn = tfremat.remat(step, budget_gib=budget / 2**30)
p = fn.get_plan(x, y)
peaks = [measure_peak(fn, x, y)[1] for _ in range(3)]
print(json.dumps(dict(budget=budget, peaks=peaks, predicted=p.predicted_peak_bytes, free=free,
                      recomputed=len(p.recomputed))))
"""


def test_a_plan_that_recomputes_nothing_is_ordered_where_the_executor_order_would_not_fit():
    """SGD's ``momentum * m`` reads variables only: the executor runs it at the start of
    the step and holds it to the end. Where that order is over the plan's target, the
    step runs with the plan's ordering edges, nothing recomputed."""
    code = MOMENTUM_CASE.format(here=str(HERE))
    r = _run_case(code)
    assert r["free"] >= r["predicted"] + 4 * 2**20, "the momentum products no longer run early"
    assert r["recomputed"] == 0
    assert max(r["peaks"]) <= r["budget"], f"measured {r['peaks']} over budget {r['budget']:.0f}"


SIDE_BY_SIDE_CASE = r"""
import json, sys
sys.path.insert(0, {here!r})
import numpy as np
import tensorflow as tf
import tfremat
from tfremat.simulate import free_running_order, simulate
from tf_models import measure_peak

B, T, D = 16, 32, 64  # an additive-attention score tensor [B, T, T, D]: 4 MiB of float32
rng = np.random.default_rng(0)
q = tf.constant(rng.standard_normal((B, T, D)).astype("float32"))
k = tf.constant(rng.standard_normal((B, T, D)).astype("float32"))


def make():
    w = tf.Variable(tf.ones((D,)))
    wq = tf.Variable(tf.eye(D))

    @tf.function
    def step(q, k):
        with tf.GradientTape() as tape:
            t = tf.tanh(tf.matmul(q, wq)[:, :, None, :] + k[:, None, :, :])
            s = tf.reduce_sum(w * t, -1)
            loss = tf.reduce_sum(tf.nn.softmax(s) * s)
        g, gq = tape.gradient(loss, [w, wq])
        w.assign_sub(0.01 * g)
        wq.assign_sub(0.01 * gq)
        return loss

    return step


plain = max(measure_peak(make(), q, k)[1] for _ in range(3))
probe = tfremat.remat(make(), budget_gib=1.0)
plan = probe.get_plan(q, k)
g = list(probe._cache.values())[0].step_graph.graph
order = free_running_order(g, plan.schedule)
free = simulate(g, order, plan.fixed_bytes, free=True).peak_bytes
ordered = simulate(g, order, plan.fixed_bytes).peak_bytes
largest = max(d["bytes"] for _, d in g.nodes(data=True))
# a target between the two: the plan recomputes nothing and must order the step
budget = (ordered + 0.5 * (free - ordered) + largest) / 0.95
fn = tfremat.remat(make(), budget_gib=budget / 2**30)
p = fn.get_plan(q, k)
peaks = [measure_peak(fn, q, k)[1] for _ in range(3)]
print(json.dumps(dict(plain=plain, free=free, ordered=ordered, predicted=p.predicted_peak_bytes,
                      recomputed=len(p.recomputed), peaks=peaks)))
"""


def test_the_step_as_traced_is_not_counted_in_buffers_that_side_by_side_readers_hold():
    """The gradient of ``sum(w * tanh(.))`` multiplies one 4 MiB ``Tile`` twice (by
    ``tanh`` for ``w``, by ``w`` for the rest); the executor runs both products at
    once, so neither reuses the ``Tile``'s buffer. The step as traced is simulated
    that way (``free=True``), so its measured peak is not above the model's, and a
    budget the ordered step fits gets the ordering edges (nothing recomputed) and
    measures what the plan predicted: 12.0 MiB where the step as traced ran at 16.0."""
    code = SIDE_BY_SIDE_CASE.format(here=str(HERE))
    r = _run_case(code)
    mib = 2**20
    assert r["plain"] <= r["free"], f"as traced: measured {r['plain'] / mib:.1f} MiB, modelled {r['free'] / mib:.1f}"
    assert r["free"] >= r["ordered"] + 2 * mib, "the two products no longer run side by side in the model"
    assert r["recomputed"] == 0
    assert max(r["peaks"]) <= r["predicted"] + mib // 2, (
        f"measured {[p / mib for p in r['peaks']]} MiB for {r['predicted'] / mib:.1f} predicted")


REGROUP_CASE = r"""
import json, sys
sys.path.insert(0, {here!r})
import numpy as np
import tensorflow as tf
import tfremat
from tfremat.graph import regrouped
from tfremat.simulate import free_running_order, simulate
from tf_models import measure_peak

B, T, D, BLOCKS = 32, 128, 32, 5  # attention scores [B, T, T]: 2 MiB of float32
x = tf.constant(np.random.default_rng(0).standard_normal((B, T, D)).astype("float32"))


def make():
    ws = [tf.Variable(tf.eye(D) + 0.01 * k) for k in range(3 * BLOCKS)]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for b in range(BLOCKS):
                q, k, v = (tf.matmul(h, w) for w in ws[3 * b:3 * b + 3])
                a = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * 0.125)
                h = h + tf.matmul(a, v)
            loss = tf.reduce_sum(h * h)
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(0.001 * g)
        return loss

    return step


plain = max(measure_peak(make(), x)[1] for _ in range(3))
probe = tfremat.remat(make(), budget_gib=1.0)
plan = probe.get_plan(x)
g = list(probe._cache.values())[0].step_graph.graph
h = regrouped(g)
as_planned = simulate(g, free_running_order(g, plan.schedule), plan.fixed_bytes, free=True).peak_bytes
as_run = simulate(h, free_running_order(h, plan.schedule), plan.fixed_bytes, free=True).peak_bytes
budget = 0.6 * plain
fn = tfremat.remat(make(), budget_gib=budget / 2**30)
p = fn.get_plan(x)
peaks = [measure_peak(fn, x)[1] for _ in range(3)]
print(json.dumps(dict(plain=plain, as_planned=as_planned, as_run=as_run, regrouped=len(g.graph["regrouped"]),
                      budget=budget, predicted=p.predicted_peak_bytes, peaks=peaks)))
"""


def test_products_grappler_regroups_stay_where_the_plan_put_them():
    """Each block's softmax gradient times the attention scale, ``(g * softmax) * s``,
    is computed by Grappler as ``g * (softmax * s)``, and ``softmax * s`` (2 MiB) runs
    in the forward pass. The model of the step as traced has those edges
    (``tfremat.graph.regrouped``), and the rewritten step keeps each product after
    ``g``: measured 20.5-21.0 MiB for 18.6-19.1 predicted (a 21.9 MiB budget) with the
    gates, 30.5 MiB without. Since session 36 (the pool as the step finds it, Softmax
    in place): 18.0-20.5 MiB for 18.1-18.6 predicted at budgets of 21.5-23.2 MiB,
    where 23.0 MiB for a 22.8 MiB budget had failed two CI runs."""
    code = REGROUP_CASE.format(here=str(HERE))
    r = _run_case(code)
    mib = 2**20
    assert r["regrouped"] == 5
    # as traced: the regrouped model accounts for what the unregrouped one misses
    assert r["plain"] <= r["as_run"] + 4 * mib, r
    assert r["plain"] > r["as_planned"] + 4 * mib, r
    assert max(r["peaks"]) <= r["budget"], f"measured {[p / mib for p in r['peaks']]} MiB, budget {r['budget'] / mib:.1f}"
    assert max(r["peaks"]) <= r["predicted"] + 4 * mib, f"measured {r['peaks']}, predicted {r['predicted']}"
