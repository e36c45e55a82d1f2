"""Real Keras models through tfremat.keras: exact, and under budget.

Each model runs in a fresh subprocess (``python tests/test_models.py NAME``): the
allocator's peak counts every live tensor in the process, so models of other tests
must not be alive. The subprocess trains the model for 3 steps with Keras' own step,
then an identically seeded copy with ``tfremat.keras.remat`` at 60 % of the measured
baseline peak (or, when the solver cannot reach that, at the smallest budget it
accepts plus 10 %), with op determinism on, and prints one JSON line.

Set ``TFREMAT_MODELS=all`` to also run the large keras.applications models
(ResNet50, DenseNet121, EfficientNetB0, VGG16: a few minutes each on 2 cores).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest

FRACTION = 0.6
STEPS = 3

# name -> (batch, input shape)
MODELS = {
    "cnn": (64, (32, 32, 3)),
    "transformer": (32, (64, 64)),
    "rnn": (64, (64, 32)),
    "cnn_fp16": (64, (32, 32, 3)),
    "mobilenetv2": (64, (32, 32, 3)),
    # hard-swish and squeeze-excite products: Grappler's reassociation of the gradient
    # of ``x * relu6(x + 3) / 6`` (tfremat.trace._live_ops, rewrite._MUL_FAMILY)
    "mobilenetv3small": (32, (32, 32, 3)),
    "efficientnetb0": (64, (32, 32, 3)),
    "vgg16": (32, (64, 64, 3)),
    "densenet121": (32, (32, 32, 3)),
    "resnet50": (32, (32, 32, 3)),
}
LARGE = {"efficientnetb0", "vgg16", "densenet121", "resnet50"}

# Known gaps, measured (see docs/keras.md). Each is an xfail that still runs: it
# turns into a pass (reported as XPASS) once the gap is fixed.
NOT_BITWISE: dict = {}  # name -> why it is never bitwise (strict xfail): none now
# name -> why some plans are not bitwise (non-strict xfail: it depends on the plan,
# and the plan on a time-limited search and the measured baseline).
SOMETIMES_NOT_BITWISE: dict = {
    # Session 14: at 78.7 MiB (60 % of a 131.1 MiB baseline; baselines vary from run to
    # run, and so the plan) the plan recomputing 63 ops differed by 1e-4 in the second
    # step's loss and 9.9e-4 in 89 variables, every run; other budgets' plans were
    # bitwise. Session 15 did not reproduce it: ~40 other plans (21-212 ops recomputed,
    # budgets 74-83 MiB and solver targets 50-100 MiB, old and current code) were all
    # bitwise, so it is not bisected (docs/keras.md). TFREMAT_BUDGET_MIB fixes a budget.
    "cnn_fp16": "some plans differ from Keras' step (a Grappler rewrite no rule covers yet)",
}
# The smallest budget + SLACK where 60 % is infeasible (default 10 %). VGG16's weights
# and Adam slots are half its peak even at 64x64: at the smallest budget + 10 % the
# plan recomputes nothing (the budget is 0.98x the baseline) and the bitwise test
# would check nothing; + 2 % recomputes 5 ops.
SLACK = {"vgg16": 0.02}
# (name, fraction) -> why the measured peak may go over the budget (it varies from run
# to run, so these are non-strict xfails).
OVER_BUDGET: dict = {
    # Found with the profiler replay (docs/keras.md, session 12): a second recomputation
    # of a 2 MiB Dense output whose only possible triggers are GELU-gradient products
    # Grappler rewrites runs beside the first (+2 MiB), and oneDNN's BFC pool puts 2 MiB
    # requests in 3.0-3.5 MiB chunks. Measured 12.5-15.5 MiB for a 15.2 MiB budget
    # (12.1 predicted) once LayerNorm's gradient stopped being held by a control edge
    # and the smallest budget fell from 15.8 MiB.
    ("transformer", 0): "an order the rewrite cannot enforce plus allocator chunk rounding "
                        "(docs/keras.md): up to 0.3 MiB over at the smallest budget + 10 %",
    # Session 23, one fresh-clone CI run (the whole suite on 2 cores): the first call
    # measured 52.8 MiB for a 52.6 MiB budget (41.5 predicted, 179 ops recomputed), the
    # two after it 46.9. The same plan run alone measured 44.0-44.8 on every call, four
    # times, with and without the covering-MILP member (it is not chosen there). The
    # executor's interleaving under load; the re-plan after a call covers the later ones.
    # Session 27, one fresh-clone CI run: the first call at 60 % measured 24.5 MiB for
    # a 23.1 MiB budget (the re-plan after it predicted 16.2); run alone the same code
    # measured 21.5-22.5 on every call of six runs, and main in session 26 23.5 once.
    # Session 28: its cause was the GELU gradient's Square, which waited on a product
    # Grappler rewrites and ran in the forward pass (fixed, docs/keras.md): 18.5-22.0
    # MiB alone for 23.7. Four runs at once on the 2 cores still measured up to 23.5
    # (another plan of the time-bound solver; allocator chunks, interleaving).
    ("transformer", FRACTION): "allocator chunk rounding and the executor's interleaving under load "
                               "(docs/keras.md): up to 1.4 MiB over on a first call at 60 % in one CI run",
    ("cnn_fp16", 0): "the first call can go over under CPU load (docs/keras.md): 0.2 MiB "
                     "over at the smallest budget + 10 % in one CI run",
}
CLOSE_ATOL: dict = {}  # name -> max |diff| for models known not to be bitwise


# -- the subprocess ------------------------------------------------------------------
def _builders():
    import keras

    L = keras.layers

    def transformer(seq=64, d=64, heads=4, blocks=2):
        inp = keras.Input((seq, d))
        h = inp
        for _ in range(blocks):
            a = L.MultiHeadAttention(heads, d // heads, dropout=0.1)(h, h)
            h = L.LayerNormalization()(L.Add()([h, L.Dropout(0.1)(a)]))
            f = L.Dense(4 * d, activation="gelu")(h)
            f = L.Dense(d)(f)
            h = L.LayerNormalization()(L.Add()([h, L.Dropout(0.1)(f)]))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def rnn(seq=64, d=32):
        inp = keras.Input((seq, d))
        h = inp
        for _ in range(3):
            h = L.Dense(256, activation="relu")(h)
        h = L.LSTM(32, return_sequences=True)(h)
        for _ in range(3):
            h = L.Dense(256, activation="relu")(h)
        h = L.GRU(16)(h)
        return keras.Model(inp, L.Dense(10)(h))

    def cnn():
        inp = keras.Input((32, 32, 3))
        h = inp
        for i in range(6):
            r = L.Conv2D(32, 3, padding="same")(h)
            r = L.BatchNormalization()(r)
            r = L.ReLU()(r)
            r = L.Dropout(0.2)(r)
            h = r if i == 0 else L.Add()([h, r])
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def app(cls):
        name = cls.lower()
        return lambda: getattr(keras.applications, cls)(
            weights=None, input_shape=MODELS[name][1], classes=10
        )

    return {
        "transformer": transformer,
        "rnn": rnn,
        "cnn": cnn,
        "cnn_fp16": cnn,
        "mobilenetv2": app("MobileNetV2"),
        "mobilenetv3small": app("MobileNetV3Small"),
        "efficientnetb0": app("EfficientNetB0"),
        "vgg16": app("VGG16"),
        "densenet121": app("DenseNet121"),
        "resnet50": app("ResNet50"),
    }


def _compile_kwargs(name: str) -> dict:
    """``model.compile``'s arguments (benchmarks/fit_sweep.py varies them)."""
    import keras

    return dict(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def _data(name: str, batch: int, shape: tuple):
    """One batch ``(x, y, train_on_batch's other keyword arguments)``."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch,) + shape).astype("float32"))
    y = tf.constant(rng.integers(0, 10, (batch,)).astype("int32"))
    return x, y, {}


def _check(name: str, fraction: float, role: str, state_file: str, slack: float = 0.1) -> dict:
    """Train ``name`` for 3 steps: Keras' own step (role "reference") or tfremat's.

    tfremat's budget is ``fraction`` of the reference's peak, or the solver's smallest
    budget + ``slack`` (10 %) when that is infeasible; ``fraction=0``: the smallest +
    ``slack``.

    The reference runs in its own process and leaves its logs, peaks and final
    variables in ``state_file``: the allocator's ``current`` counts everything the
    process holds, so a reference model trained in the same process would be counted
    as memory the rewritten step must live with.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat
    import tfremat.keras

    tf.config.experimental.enable_op_determinism()
    batch, shape = MODELS[name]
    build = _builders()[name]
    x, y, extra = _data(name, batch, shape)

    def make():
        keras.utils.set_random_seed(0)
        if name.endswith("fp16"):
            keras.mixed_precision.set_global_policy("mixed_float16")
        model = build()
        model.compile(**_compile_kwargs(name))
        return model

    def train(model):
        logs, peaks, times = [], [], []
        for _ in range(STEPS):
            tf.config.experimental.reset_memory_stats("CPU:0")
            t0 = time.perf_counter()
            logs.append({k: float(v) for k, v in model.train_on_batch(x, y, return_dict=True, **extra).items()})
            times.append(time.perf_counter() - t0)
            peaks.append(int(tf.config.experimental.get_memory_info("CPU:0")["peak"]))
        state = [v.numpy() for v in model.variables] + [v.numpy() for v in model.optimizer.variables]
        return logs, peaks, state, times

    if role == "reference":
        ref_logs, ref_peaks, ref_state, _ = train(make())
        np.savez(state_file, *ref_state)
        return {"logs": ref_logs, "peaks": ref_peaks}
    ref = json.loads(open(state_file + ".json").read())
    ref_logs, ref_peaks = ref["logs"], ref["peaks"]
    with np.load(state_file + ".npz") as f:
        ref_state = [f[f"arr_{i}"] for i in range(len(f.files))]
    baseline = max(ref_peaks)

    out = {"name": name, "batch": batch, "baseline_peaks": ref_peaks, "fraction": fraction}
    model = make()
    # fraction 0: a budget no plan meets (one byte), to learn the smallest one
    budget = fraction * baseline or 1.0
    if os.environ.get("TFREMAT_BUDGET_MIB"):  # a fixed budget (plans depend on it)
        budget = float(os.environ["TFREMAT_BUDGET_MIB"]) * 2**20
    tfremat.keras.remat(model, budget_gib=budget / 2**30)
    try:
        plan = tfremat.keras.get_plan(model, x, y, **extra)
    except tfremat.InfeasibleBudgetError as e:
        out["infeasible_at_fraction"] = True
        out["min_feasible"] = e.min_feasible_bytes
        budget = (1 + slack) * e.min_feasible_bytes
        tfremat.keras.remat(model, budget_gib=budget / 2**30)
        plan = tfremat.keras.get_plan(model, x, y, **extra)
    logs, peaks, state, _ = train(model)
    plan = tfremat.keras.get_plan(model, x, y, **extra)  # the plan the later steps ran (re-planned?)
    diffs = [
        float(np.max(np.abs(a.astype("float64") - b.astype("float64")))) if a.size else 0.0
        for a, b in zip(ref_state, state)
    ]
    out.update(
        budget=budget,
        predicted=plan.predicted_peak_bytes,
        # what the allocator's statistics are predicted to report: the cautious model
        # the budget is checked against (None where not checked that way), and the
        # best guess
        chunks=plan.allocator_peak_bytes,
        expected=plan.expected_peak_bytes,
        predicted_baseline=plan.baseline_peak_bytes,
        fixed=plan.fixed_bytes,
        peaks=peaks,
        recomputed=len(plan.recomputed),
        logs_equal=logs == ref_logs,
        n_variables=len(state),
        n_unequal=sum(d != 0 for d in diffs) + sum(a.dtype != b.dtype for a, b in zip(ref_state, state)),
        max_abs_diff=max(diffs, default=0.0),
        losses=[float(l["loss"]) for l in logs],
        ref_losses=[float(l["loss"]) for l in ref_logs],
    )
    return out


# -- pytest ----------------------------------------------------------------------------
def _selected():
    if os.environ.get("TFREMAT_MODELS", "") == "all":
        return list(MODELS)
    return [m for m in MODELS if m not in LARGE]


_TMP = None


@functools.lru_cache(maxsize=None)
def _reference(name: str) -> str:
    """Keras' own 3 steps of ``name``, in a process of its own: the state file's path."""
    import tempfile

    global _TMP
    if _TMP is None:
        _TMP = tempfile.TemporaryDirectory()
    state = os.path.join(_TMP.name, name)
    with open(state + ".json", "w") as f:
        f.write(_run(name, FRACTION, "reference", state))
    return state


def _run(name: str, fraction: float, role: str, state: str) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, __file__, name, str(fraction), role, state, str(SLACK.get(name, 0.1))],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{name} {role} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return lines[-1]


def _result(name: str, fraction: float = FRACTION) -> dict:
    """tfremat's 3 steps of ``name`` at ``fraction`` of the baseline (0: smallest + 10 %)."""
    if fraction == 0 and _result(name).get("infeasible_at_fraction"):
        return _result(name)  # that run already used the smallest budget + 10 %
    return _remat_result(name, fraction)


@functools.lru_cache(maxsize=None)
def _remat_result(name: str, fraction: float) -> dict:
    line = _run(name, fraction, "remat", _reference(name))
    if os.environ.get("TFREMAT_MODELS_JSON"):  # collect the measurements
        with open(os.environ["TFREMAT_MODELS_JSON"], "a") as f:
            f.write(line + "\n")
    return json.loads(line)


def _marks(name, known, strict=False):
    return [pytest.mark.xfail(reason=known[name], strict=strict)] if name in known else []


@pytest.mark.slow
@pytest.mark.parametrize(
    # strict: these fail deterministically; the peaks (OVER_BUDGET) vary from run to run
    "name,fraction",
    [pytest.param(m, f, marks=_marks(m, NOT_BITWISE, strict=True) + _marks(m, SOMETIMES_NOT_BITWISE),
                  id=f"{m}-{tag}")
     for m in _selected() for f, tag in ((FRACTION, "sixty_percent"), (0, "smallest_plus_slack"))],
)
def test_bitwise_equal_to_keras(name, fraction):
    """At 60 % of the baseline, and at the smallest budget + 10 % (the run the peak
    test makes): plans that recompute more meet more of Grappler's rewrites. Found
    there: the Transformer at 14.6 MiB, 99 variables apart until its Add-tree copies
    got their own inner Adds (docs/design.md, "Bitwise equality")."""
    pytest.importorskip("tensorflow")
    r = _result(name, fraction)
    if fraction == 0 and r["recomputed"] == 0:
        pytest.skip("the plan recomputes nothing")
    assert r["recomputed"] > 0, "the plan recomputes nothing: the test would prove nothing"
    assert r["logs_equal"], (r["losses"], r["ref_losses"])
    assert r["n_unequal"] == 0, f"{r['n_unequal']}/{r['n_variables']} variables differ, max {r['max_abs_diff']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [m for m in _selected() if m in CLOSE_ATOL])
def test_close_to_keras_where_not_bitwise(name):
    pytest.importorskip("tensorflow")
    r = _result(name)
    assert r["max_abs_diff"] <= CLOSE_ATOL[name], r["max_abs_diff"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,fraction",
    [pytest.param(m, f, marks=_marks((m, f), OVER_BUDGET), id=f"{m}-{tag}")
     for m in _selected() for f, tag in ((FRACTION, "sixty_percent"), (0, "smallest_plus_slack"))],
)
def test_measured_peak_under_budget(name, fraction):
    pytest.importorskip("tensorflow")
    r = _result(name, fraction)
    if fraction == 0:
        assert r.get("infeasible_at_fraction"), "asked for one byte, the solver must refuse it"
    assert max(r["peaks"]) <= r["budget"], (
        f"measured {max(r['peaks']) / 2**20:.1f} MiB > budget {r['budget'] / 2**20:.1f} MiB "
        f"(predicted {r['predicted'] / 2**20:.1f} MiB)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", _selected())
def test_budget_at_sixty_percent_of_baseline(name):
    pytest.importorskip("tensorflow")
    r = _result(name)
    if r.get("infeasible_at_fraction"):
        base = max(r["baseline_peaks"])
        pytest.xfail(
            f"the solver's smallest budget is {r['min_feasible'] / base:.2f}x the measured "
            f"baseline (fixed memory: weights, optimizer slots, inputs, constants, is "
            f"{r['fixed'] / base:.2f}x of it); tested at that budget + 10 % instead"
        )
    assert r["budget"] <= FRACTION * max(r["baseline_peaks"]) + 1


if __name__ == "__main__":
    # python tests/test_models.py NAME FRACTION reference|remat STATE_FILE [SLACK]
    # (TFREMAT_BUDGET_MIB=78.7 in the environment: that budget instead of FRACTION's)
    print(json.dumps(_check(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], *map(float, sys.argv[5:]))))
