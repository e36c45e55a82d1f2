"""Rewritten steps compute bit-for-bit what the original computes (3 steps, op determinism)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import tfremat  # noqa: E402
from tf_models import make_data, make_step  # noqa: E402

CASES = [
    ("mlp", "sgd", dict(layers=10, width=128)),
    ("mlp", "adam", dict(layers=10, width=128)),
    ("cnn", "sgd", dict(channels=8, blocks=4, size=16)),
    ("cnn", "adam", dict(channels=8, blocks=4, size=16)),
    # XLA-compiled calls, their outputs planned apart (graph.with_call_outputs)
    ("grouped", "adam", dict(channels=8, blocks=4, size=16)),
]


@pytest.fixture(autouse=True, scope="module")
def _determinism():
    tf.config.experimental.enable_op_determinism()
    yield


def run_steps(step, x, y, n=3):
    return [float(step(x, y)) for _ in range(n)]


@pytest.mark.parametrize("kind,optimizer,kw", CASES, ids=[f"{k}-{o}" for k, o, _ in CASES])
def test_rewritten_step_is_bitwise_identical(kind, optimizer, kw):
    data_kw = dict(width=kw["width"]) if kind == "mlp" else dict(size=kw["size"])
    x, y = make_data(kind, batch=1024 if kind == "mlp" else 128, **data_kw)

    ref_model, ref_step = make_step(kind, optimizer, **kw)
    ref_losses = [float(ref_step(x, y)) for _ in range(3)]
    ref_vars = [v.numpy() for v in ref_model.variables]

    model, step = make_step(kind, optimizer, **kw)
    # A budget that forces recomputation: well under the predicted no-remat peak.
    probe = tfremat.remat(step, budget_gib=1e3).get_plan(x, y)
    activations = probe.baseline_peak_bytes - probe.fixed_bytes
    fn = tfremat.remat(step, budget_gib=(probe.fixed_bytes + 0.8 * activations) / 0.95 / 2**30)
    try:
        plan = fn.get_plan(x, y)
    except tfremat.InfeasibleBudgetError as e:
        # The time-bound solver's plans vary with the machine's load; where this one
        # misses the allocator's limit (the grouped CNN in one CI run: 34.1 MiB
        # needed for a 32.6 MiB budget), the smallest budget it names.
        fn = tfremat.remat(step, budget_gib=e.min_feasible_bytes / 2**30)
        plan = fn.get_plan(x, y)
    assert plan.recomputed, "the budget should force at least one recomputation"
    assert plan.predicted_peak_bytes < plan.baseline_peak_bytes

    losses = [float(fn(x, y)) for _ in range(3)]
    assert losses == ref_losses
    got = [v.numpy() for v in model.variables]
    assert len(got) == len(ref_vars)
    for a, b in zip(got, ref_vars):
        np.testing.assert_array_equal(a, b)


def test_original_function_keeps_working_and_is_untouched():
    x, y = make_data("mlp", batch=64, width=64)
    _, step = make_step("mlp", "sgd", layers=4, width=64)
    before = step.get_concrete_function(x, y).graph.as_graph_def()
    fn = tfremat.remat(step, budget_gib=1.0)
    fn(x, y)
    after = step.get_concrete_function(x, y).graph.as_graph_def()
    assert before == after
    assert np.isfinite(float(step(x, y)))


def test_decorator_forms_above_and_below_tf_function():
    x, y = make_data("mlp", batch=32, width=32)
    model, _ = make_step("mlp", "sgd", layers=2, width=32)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(0.1)

    def body(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss}

    above = tfremat.remat(budget_gib=1.0)(tf.function(body))
    below = tf.function(tfremat.remat(budget_gib=1.0)(body))
    plain = tfremat.remat(body, budget_gib=1.0)
    for f in (above, plain):
        out = f(x, y)
        assert set(out) == {"loss"} and np.isfinite(out["loss"].numpy())
    out = below(x, y)
    assert np.isfinite(out["loss"].numpy())


def test_traces_once_per_input_signature():
    _, step = make_step("mlp", "sgd", layers=2, width=32)
    fn = tfremat.remat(step, budget_gib=1.0)
    x, y = make_data("mlp", batch=32, width=32)
    p1 = fn.get_plan(x, y)
    fn(x, y)
    assert fn.get_plan(x, y) is p1  # cached
    x2, y2 = make_data("mlp", batch=16, width=32)
    p2 = fn.get_plan(x2, y2)
    assert p2 is not p1 and p2.baseline_peak_bytes < p1.baseline_peak_bytes
