"""tfremat.keras.remat: model.fit / train_on_batch with the rewritten step.

Every check compares a rewritten model against the same model trained by Keras'
own step (same seed, same data, op determinism on): losses, metrics and every
variable (weights, BatchNorm statistics, optimizer slots, seed generators) must be
bitwise equal.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tfremat  # noqa: E402
import tfremat.keras  # noqa: E402

L = keras.layers
MIB = 2**20


@pytest.fixture(autouse=True, scope="module")
def _determinism():
    tf.config.experimental.enable_op_determinism()
    yield


def cnn_bn_dropout(blocks: int = 4, width: int = 16):
    inp = keras.Input((32, 32, 3))
    h = inp
    for i in range(blocks):
        r = L.Conv2D(width, 3, padding="same")(h)
        r = L.BatchNormalization()(r)
        r = L.ReLU()(r)
        r = L.Dropout(0.2)(r)
        h = r if i == 0 else L.Add()([h, r])
    out = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    return keras.Model(inp, out)


def make(builder=cnn_bn_dropout, optimizer="adam", **kw):
    keras.utils.set_random_seed(0)
    model = builder(**kw)
    opt = keras.optimizers.Adam(1e-3) if optimizer == "adam" else keras.optimizers.SGD(0.01, momentum=0.9)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, (n,)).astype("int32")
    return x, y


def state(model):
    return [v.numpy() for v in model.variables] + [v.numpy() for v in model.optimizer.variables]


def assert_same_state(a, b):
    sa, sb = state(a), state(b)
    assert len(sa) == len(sb)
    for i, (u, v) in enumerate(zip(sa, sb)):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert np.array_equal(u, v), f"variable {i} differs by {np.max(np.abs(u - v))}"


def train(model, x, y, steps=3):
    logs, peaks = [], []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        logs.append(model.train_on_batch(x, y, return_dict=True))
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    return logs, peaks


# -- API -----------------------------------------------------------------------
def test_uncompiled_model_is_a_clear_error():
    model = cnn_bn_dropout(blocks=1)
    with pytest.raises(tfremat.RematError, match="not compiled"):
        tfremat.keras.remat(model, budget_gib=1.0)


def test_run_eagerly_is_refused():
    model = make(blocks=1)
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(tfremat.RematError, match="run_eagerly"):
        tfremat.keras.remat(model, budget_gib=1.0)


def test_a_model_compiled_with_xla_warns_that_the_rewritten_step_runs_without_it():
    """In a fresh process: Keras drops jit_compile under op determinism, which this
    module turns on."""
    import subprocess
    import sys

    code = (
        "import warnings, keras, tfremat.keras\n"
        "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])\n"
        "m.compile(optimizer='sgd', loss='mse', jit_compile=True)\n"
        "assert m.jit_compile\n"
        "with warnings.catch_warnings(record=True) as r:\n"
        "    warnings.simplefilter('always')\n"
        "    tfremat.keras.remat(m, budget_gib=1.0)\n"
        "print([str(w.message) for w in r])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "runs without XLA" in out.stdout


def test_not_a_model_and_bad_budget():
    with pytest.raises(TypeError):
        tfremat.keras.remat(object(), budget_gib=1.0)
    model = make(blocks=1)
    with pytest.raises(ValueError):
        tfremat.keras.remat(model, budget_gib=-1)
    assert not tfremat.keras.is_remat(model)


def test_returns_the_model_and_can_be_undone():
    model = make(blocks=1)
    assert tfremat.keras.remat(model, budget_gib=1.0) is model
    assert tfremat.keras.is_remat(model)
    tfremat.keras.remat(model, budget_gib=2.0)  # again: replaces the budget
    x, y = batch(4)
    assert tfremat.keras.get_plan(model, x, y).budget_bytes == 2 * 2**30
    tfremat.keras.unremat(model)
    assert not tfremat.keras.is_remat(model)
    model.train_on_batch(x, y)  # Keras' own step again


# -- exactness and memory ------------------------------------------------------
def test_train_on_batch_bitwise_equal_and_under_budget():
    x, y = batch(64)
    x, y = tf.constant(x), tf.constant(y)
    ref = make()
    ref_logs, ref_peaks = train(ref, x, y)
    baseline = max(ref_peaks)
    ref_state = state(ref)
    del ref
    gc.collect()

    model = make()
    budget = 0.85 * baseline
    tfremat.keras.remat(model, budget_gib=budget / 2**30)
    plan = tfremat.keras.get_plan(model, x, y)
    assert plan.recomputed, "the plan should recompute something at 85 % of the baseline"
    logs, peaks = train(model, x, y)
    assert logs == ref_logs
    for u, v in zip(ref_state, state(model)):
        assert np.array_equal(u, v)
    assert max(peaks) <= budget, f"measured {max(peaks) / MIB:.1f} MiB > budget {budget / MIB:.1f} MiB"
    assert "recompute" in tfremat.keras.explain(model, x, y)


def test_fit_matches_keras_including_last_partial_batch():
    x, y = batch(40)  # batch_size 16: two full batches and one of 8 (a second signature)
    ref = make(blocks=2)
    h_ref = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = make(blocks=2)
    tfremat.keras.remat(model, budget_gib=1.0)
    h = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert h.history == h_ref.history
    assert_same_state(ref, model)
    step = tfremat.keras._step_for(model)
    assert len(step._cache) == 2  # one plan per input signature


def test_fit_with_tf_data_and_steps_per_execution():
    x, y = batch(32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    ref = make(blocks=1)
    ref.compile(optimizer=keras.optimizers.SGD(0.01), loss=ref.loss, steps_per_execution=3)
    h_ref = ref.fit(ds, epochs=2, verbose=0)
    model = make(blocks=1)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=model.loss, steps_per_execution=3)
    tfremat.keras.remat(model, budget_gib=1.0)
    h = model.fit(ds, epochs=2, verbose=0)
    assert h.history == h_ref.history
    assert_same_state(ref, model)


def test_recompile_keeps_remat_and_replans_for_the_new_optimizer():
    x, y = batch(16)
    ref, model = make(blocks=2), make(blocks=2)
    tfremat.keras.remat(model, budget_gib=1.0)
    for m in (ref, model):
        m.train_on_batch(x, y)
    first = tfremat.keras._step_for(model)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=m.loss)
        m.train_on_batch(x, y)
        m.train_on_batch(x, y)
    assert tfremat.keras.is_remat(model)
    assert tfremat.keras._step_for(model) is not first
    assert_same_state(ref, model)


@pytest.mark.parametrize("factor", [1.0, 1.1])
def test_the_smallest_budget_an_error_names_is_met(monkeypatch, factor):
    """An infeasible budget's error names the smallest budget whose plan fits the
    allocator's chunks, checked on the plan at the solver's smallest target. The
    chunks do not fall with the target everywhere: on this model (found by a random
    Keras-model search) the plans the re-solves tried at 1.1x that budget had more
    chunks than the limit, and the budget was refused, naming a larger one. The
    re-solves now end with the smallest target's plan."""
    import tfremat.api

    # plan as in a fresh process: memory earlier tests left would count as held
    monkeypatch.setattr(tfremat.api, "_other_live_bytes", lambda *a: 0)
    L = keras.layers

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((8, 8, 3))
        r = L.ReLU()(inp)
        p = L.AveragePooling2D(3, 1, padding="same")(r)
        h = L.Conv2D(4, 3, padding="same", activation="relu")(p)
        model = keras.Model(inp, L.Dense(5)(L.GlobalMaxPooling2D()(h)))
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    rng = np.random.default_rng(23)
    x = tf.constant(rng.standard_normal((8, 8, 8, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 5, (8,)).astype("int32"))
    model = tfremat.keras.remat(build(), budget_gib=2**-20)
    with pytest.raises(tfremat.InfeasibleBudgetError) as info:
        tfremat.keras.get_plan(model, x, y)
    budget = factor * info.value.min_feasible_bytes
    tfremat.keras.remat(model, budget_gib=budget / 2**30)
    plan = tfremat.keras.get_plan(model, x, y)
    assert plan.predicted_peak_bytes <= budget
    assert plan.allocator_peak_bytes <= budget


def test_an_embedding_trained_with_rmsprop_plans_and_is_bitwise(monkeypatch):
    """Keras' RMSprop divides an embedding's ``IndexedSlices`` gradient by its slot in
    a ``tf.cond`` whose branches return different row counts (the union of the
    indices): a tensor of unknown rows, which made every such model an
    UnknownShapeError (found by a random search of sequence models). Its size is now
    taken at its largest input (tfremat.trace._tensor_info) and the step plans."""
    import tfremat.api

    # plan as in a fresh process: memory earlier tests left would count as held
    monkeypatch.setattr(tfremat.api, "_other_live_bytes", lambda *a: 0)
    L = keras.layers

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((16,), dtype="int32")
        h = L.Dense(32, activation="gelu")(L.Embedding(50, 16)(inp))
        model = keras.Model(inp, L.Dense(5)(L.GlobalAveragePooling1D()(h)))
        model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, 50, (16, 16)).astype("int32"))
    y = tf.constant(rng.integers(0, 5, (16,)).astype("int32"))
    ref = build()
    want = [ref.train_on_batch(x, y) for _ in range(2)]
    model = tfremat.keras.remat(build(), budget_gib=2**-20)
    with pytest.raises(tfremat.InfeasibleBudgetError) as info:
        tfremat.keras.get_plan(model, x, y)
    tfremat.keras.remat(model, budget_gib=1.1 * info.value.min_feasible_bytes / 2**30)
    assert tfremat.keras.get_plan(model, x, y).recomputed
    got = [model.train_on_batch(x, y) for _ in range(2)]
    assert got == want
    for a, b in zip(ref.variables + ref.optimizer.variables, model.variables + model.optimizer.variables):
        assert np.array_equal(a.numpy(), b.numpy())
