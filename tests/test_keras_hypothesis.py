"""Random small Keras functional models through tfremat.keras: bitwise equal to Keras.

Hypothesis draws a model (conv, depthwise and separable conv, dense, add, multiply,
a sigmoid gate, concat, dropout, batch and layer normalization, ReLU / GELU / swish,
max and average pooling; random widths, random wiring to earlier tensors; a global
pooling or flattening head; Adam, AdamW, RMSprop or SGD with momentum; with or without
sample weights), trains it 2 steps with Keras' own
step and, identically seeded, with ``tfremat.keras.remat`` at the solver's smallest
budget + 10 % (so the plan recomputes as much as it can), and compares the losses and
every variable bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tfremat  # noqa: E402
import tfremat.keras  # noqa: E402

L = keras.layers
MAX_EXAMPLES = max(8, min(40, settings().max_examples // 5))  # ci: 8, dev: 40

LAYER_KINDS = ("conv", "conv", "bn", "dropout", "add", "concat", "relu",
               "dwconv", "sepconv", "ln", "gelu", "swish", "pool", "avgpool", "mul", "gate")
HEAD_KINDS = ("dense", "dense_bn", "dense_dropout", "dense_gelu", "dense_ln")


@st.composite
def model_specs(draw):
    n = draw(st.integers(2, 6))
    layers = []
    for i in range(n):
        kind = draw(st.sampled_from(LAYER_KINDS))
        width = draw(st.sampled_from((4, 8, 12)))
        a = draw(st.integers(0, i))  # index into the tensors so far (0 = input)
        b = draw(st.integers(0, i))
        layers.append((kind, width, a, b))
    head = draw(st.lists(st.tuples(st.sampled_from(HEAD_KINDS), st.sampled_from((8, 16))), max_size=2))
    optimizer = draw(st.sampled_from(("adam", "sgd", "adamw", "rmsprop")))
    pool = draw(st.sampled_from(("gap", "gmp", "flatten")))
    sample_weights = draw(st.booleans())
    return layers, head, optimizer, pool, sample_weights


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adamw": lambda: keras.optimizers.AdamW(1e-3),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
}


def build(spec):
    layers, head, optimizer, *rest = spec
    pool = rest[0] if rest else "gap"
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    ts = [inp]

    def channels_of(x, y):  # y with x's channels
        return y if x.shape[-1] == y.shape[-1] else L.Conv2D(x.shape[-1], 1)(y)

    for kind, width, a, b in layers:
        x, y = ts[a], ts[b]
        if kind == "conv":
            out = L.Conv2D(width, 3, padding="same", activation="relu")(x)
        elif kind == "dwconv":
            out = L.DepthwiseConv2D(3, padding="same")(x)
        elif kind == "sepconv":
            out = L.SeparableConv2D(width, 3, padding="same", activation="relu")(x)
        elif kind == "bn":
            out = L.BatchNormalization()(x)
        elif kind == "ln":
            out = L.LayerNormalization()(x)
        elif kind == "dropout":
            out = L.Dropout(0.3)(x)
        elif kind == "relu":
            out = L.ReLU()(x)
        elif kind in ("gelu", "swish"):
            out = L.Activation(kind)(x)
        elif kind == "pool":
            out = L.MaxPooling2D(3, 1, padding="same")(x)
        elif kind == "avgpool":
            out = L.AveragePooling2D(3, 1, padding="same")(x)
        elif kind == "add":
            out = L.Add()([x, channels_of(x, y)])
        elif kind == "mul":
            out = L.Multiply()([x, channels_of(x, y)])
        elif kind == "gate":
            out = L.Multiply()([x, L.Conv2D(x.shape[-1], 1, activation="sigmoid")(y)])
        else:  # concat
            out = L.Concatenate()([x, y])
        ts.append(out)
    h = {"gap": L.GlobalAveragePooling2D, "gmp": L.GlobalMaxPooling2D, "flatten": L.Flatten}[pool]()(ts[-1])
    for kind, width in head:
        h = L.Dense(width, activation="gelu" if kind == "dense_gelu" else "relu")(h)
        if kind == "dense_bn":
            h = L.BatchNormalization()(h)
        elif kind == "dense_ln":
            h = L.LayerNormalization()(h)
        elif kind == "dense_dropout":
            h = L.Dropout(0.2)(h)
    model = keras.Model(inp, L.Dense(5)(h))
    opt = OPTIMIZERS[optimizer]()
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def state(model):
    return [v.numpy() for v in model.variables] + [v.numpy() for v in model.optimizer.variables]


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=model_specs(), seed=st.integers(0, 2**16))
def test_random_keras_models_bitwise_equal(spec, seed):
    tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal((8, 8, 8, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 5, (8,)).astype("int32"))
    # (Keras casts the weights in the loss and in each metric: CSE twins)
    sw = tf.constant(rng.random(8).astype("float32")) if spec[4:] and spec[4] else None

    ref = build(spec)
    ref_logs = [ref.train_on_batch(x, y, sample_weight=sw, return_dict=True) for _ in range(2)]

    model = build(spec)
    tfremat.keras.remat(model, budget_gib=1e-6)
    try:
        tfremat.keras.get_plan(model, x, y, sw)
        budget = 1e-6 * 2**30
    except tfremat.InfeasibleBudgetError as e:
        budget = 1.1 * e.min_feasible_bytes
    tfremat.keras.remat(model, budget_gib=budget / 2**30)
    plan = tfremat.keras.get_plan(model, x, y, sw)
    assert plan.predicted_peak_bytes <= budget
    logs = [model.train_on_batch(x, y, sample_weight=sw, return_dict=True) for _ in range(2)]

    assert logs == ref_logs
    for i, (a, b) in enumerate(zip(state(ref), state(model))):
        assert np.array_equal(a, b), f"variable {i} differs by {np.max(np.abs(a - b))}"


def test_dense_batchnorm_sgd_bitwise():
    """Found by this test's random search on a clean CI clone (~5e-10 in one SGD
    momentum slot): a strict-ordering edge from the gradients' ``IdentityN`` kept
    Grappler's dependency optimizer from removing it, so the arithmetic optimizer did
    not reorder ``lr * (dL/dgamma)`` as in Keras' step. Ordering edges are now re-seated
    (tfremat/rewrite.py, ``_anchor_ordering_edges``)."""
    test_random_keras_models_bitwise_equal.hypothesis.inner_test(
        spec=([("conv", 4, 0, 0), ("conv", 4, 0, 0)], [("dense", 8), ("dense_bn", 8)], "sgd"),
        seed=0,
    )


def test_common_subexpression_bitwise():
    """Found by this test's random search (dev profile; 2e-8 in a BatchNorm beta after 2
    Adam steps): ``input + BatchNorm(input)`` twice. Grappler merges the two ``Add``
    ops in Keras' step; an ordering gate on one of them kept them apart, and the
    gradients meeting at the BatchNorm were summed differently. Ops with such a twin
    get no ordering edge (tfremat/rewrite.py, ``_cse_twins``)."""
    test_random_keras_models_bitwise_equal.hypothesis.inner_test(
        spec=([("bn", 4, 0, 0), ("add", 4, 0, 1), ("add", 4, 0, 1), ("relu", 8, 2, 0), ("concat", 4, 3, 4)],
              [("dense_dropout", 8)], "adam"),
        seed=5525,
    )
