"""Random Keras models of seven kinds through ``tfremat.keras``: bitwise and under budget.

    python benchmarks/keras_fuzz.py FAMILY [FIRST [COUNT]]     # FAMILY: unet, fp16,
                                     # multi, fp16multi, rnn, attn, fp16attn, conv, fp16conv, mlp, fp16mlp
    python benchmarks/keras_fuzz.py all [COUNT]               # every family, a table

A search for bugs, not a benchmark of speed: each model ``k`` of a family is drawn
from ``random.Random(7919 * k + len(FAMILY))`` (the same models on every machine),
trained for 3 steps by Keras' own step and then, in the same process, by tfremat's at
60 % of Keras' measured peak, or at the solver's smallest budget + 10 % where 60 % is
infeasible (op determinism on). One JSON line per model: whether every loss, metric
and variable is bitwise equal, the measured peak against the budget, the prediction,
and the ops recomputed. ``all`` runs each family in its own process and prints a table.

Families (small shapes, batch 64 unless said, so a model takes seconds):

- ``unet``: a U-Net (strided conv or pooling down, transposed conv or upsampling up,
  concatenated or added skips), BatchNorm/GroupNorm/LayerNorm or none, four
  activations, dropout, L2 kernel regularizers, per-pixel sample weights;
- ``fp16``: the same under ``mixed_float16`` (Keras' loss-scale optimizer; on CPUs
  without AVX-512 TensorFlow runs Eigen's float16 convolution gradients, with 32 MiB
  of scratch each);
- ``multi``: two inputs (image, table) and two outputs (class, value) with loss
  weights, metrics per output, kernel and activity regularizers, sample weights;
  ``fp16multi`` under ``mixed_float16`` (no activity regularizer: Keras cannot sum a
  float16 one with the float32 loss);
- ``rnn``: LSTM, GRU, bidirectional ones, Conv1D and TimeDistributed Dense stacks;
- ``attn``: Transformer encoders (session 40): token embeddings or projected
  features, 1-3 blocks of MultiHeadAttention (1, 2 or 4 heads, attention dropout,
  a causal mask or none) and a feed-forward of four activations, pre- or post-norm,
  average, max or first-token pooling; ``fp16attn`` under ``mixed_float16``;
- ``conv``: image classifiers (session 40) of plain, depthwise-separable,
  inverted-residual and squeeze-and-excitation blocks, residual or not, six
  activations (hard swish, ReLU6, leaky ReLU among them), pooling;
  ``fp16conv`` under ``mixed_float16``;
- ``mlp``: residual MLPs (session 42, batch 1024) of 2-5 blocks, plain or gated
  (GLU), BatchNorm, LayerNorm, RMS norm or none, one of 14 activations (exact and
  tanh GELU, Mish, SiLU, hard SiLU, SELU, softplus, softsign, hard sigmoid among
  them); ``fp16mlp`` under ``mixed_float16``.

Every family draws its optimizer among Adam, SGD (momentum, Nesterov), RMSprop,
AdamW, Adam with clipnorm / global_clipnorm / EMA. Results: docs/keras.md
("Session 39", "Session 40").
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import traceback

FAMILIES = ("unet", "fp16", "multi", "fp16multi", "rnn", "attn", "fp16attn", "conv", "fp16conv", "mlp", "fp16mlp")
STEPS = 3
BATCH = 64
MLP_BATCH = 1024  # activations of 0.25-1 MiB per layer


def draw(r: random.Random, family: str) -> dict:
    return {
        "family": family,
        "depth": r.randint(1, 2),
        "width": r.choice((16, 32)),
        "norm": r.choice(("bn", "gn", "ln", "none")),
        "up": r.choice(("transpose", "upsample")),
        "down": r.choice(("stride", "maxpool", "avgpool")),
        "act": r.choice(("relu", "gelu", "swish", "elu")),
        "skip": r.choice(("concat", "add")),
        "dropout": r.choice((0.0, 0.2)),
        "rnn": [r.choice(("lstm", "bigru", "gru", "conv1d", "td_dense", "bilstm")) for _ in range(r.randint(1, 3))],
        "opt": r.choice(("adam", "sgd", "rmsprop", "adamw", "adam_clip", "adam_gclip", "adam_ema", "sgd_nesterov")),
        "reg": 0.0 if family.startswith("fp16") else r.choice((0.0, 1e-3)),
        "sw": r.random() < 0.5,
        "seed": r.randint(0, 10**6),
        # drawn after the seed, so the first families' models stay those of session 39
        # attn: token or feature inputs, blocks, heads, pre- or post-norm, causal mask
        "tokens": r.random() < 0.5,
        "blocks": r.randint(1, 3),
        "heads": r.choice((1, 2, 4)),
        "prenorm": r.random() < 0.5,
        "causal": r.random() < 0.3,
        "pool": r.choice(("avg", "max", "first")),
        # conv: stages of plain, depthwise-separable or inverted-residual blocks
        "blocks_kind": [r.choice(("plain", "separable", "inverted", "se")) for _ in range(r.randint(2, 4))],
        "residual": r.random() < 0.6,
        "conv_act": r.choice(("relu", "relu6", "hard_swish", "swish", "gelu", "leaky_relu")),
        # mlp (session 42): residual Dense blocks, a wider set of activations
        "mlp_act": r.choice(MLP_ACTIVATIONS),
        "mlp_blocks": r.randint(2, 5),
        "mlp_norm": r.choice(("bn", "ln", "rms", "none")),
        "mlp_gated": r.random() < 0.3,
    }


MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "mish", "silu", "softplus", "selu", "tanh", "sigmoid",
                   "hard_sigmoid", "elu", "softsign", "relu6", "leaky_relu", "hard_silu")


def _optimizer(keras, name: str):
    o = keras.optimizers
    return {
        "adam": lambda: o.Adam(1e-2),
        "sgd": lambda: o.SGD(0.05, momentum=0.9),
        "sgd_nesterov": lambda: o.SGD(0.05, momentum=0.9, nesterov=True),
        "rmsprop": lambda: o.RMSprop(1e-3),
        "adamw": lambda: o.AdamW(1e-3),
        "adam_clip": lambda: o.Adam(1e-2, clipnorm=0.5),
        "adam_gclip": lambda: o.Adam(1e-2, global_clipnorm=0.5),
        "adam_ema": lambda: o.Adam(1e-2, use_ema=True, ema_overwrite_frequency=2),
    }[name]()


def _norm(L, kind: str):
    return {"bn": L.BatchNormalization, "gn": lambda: L.GroupNormalization(4),
            "ln": L.LayerNormalization, "none": L.Identity}[kind]()


def _unet(keras, s):
    L = keras.layers
    reg = keras.regularizers.L2(s["reg"]) if s["reg"] else None
    inp = keras.Input((16, 16, 3))
    h = L.Conv2D(s["width"], 3, padding="same", kernel_regularizer=reg)(inp)
    skips, w = [], s["width"]
    for _ in range(s["depth"]):
        h = L.Activation(s["act"])(_norm(L, s["norm"])(h))
        skips.append(h)
        if s["down"] == "stride":
            h = L.Conv2D(w * 2, 3, strides=2, padding="same")(h)
        else:
            pool = L.MaxPooling2D(2) if s["down"] == "maxpool" else L.AveragePooling2D(2)
            h = pool(L.Conv2D(w * 2, 3, padding="same")(h))
        if s["dropout"]:
            h = L.Dropout(s["dropout"])(h)
        w *= 2
    for d in reversed(range(s["depth"])):
        w //= 2
        h = L.Conv2DTranspose(w, 2, strides=2)(h) if s["up"] == "transpose" else L.Conv2D(w, 1)(L.UpSampling2D()(h))
        h = L.Concatenate()([h, skips[d]]) if s["skip"] == "concat" else L.Add()([h, skips[d]])
        h = L.Activation(s["act"])(L.Conv2D(w, 3, padding="same", kernel_regularizer=reg)(h))
    model = keras.Model(inp, L.Conv2D(4, 1)(h))
    model.compile(optimizer=_optimizer(keras, s["opt"]), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _multi(keras, s):
    L = keras.layers
    reg = keras.regularizers.L2(s["reg"]) if s["reg"] else None
    a, b = keras.Input((8, 8, 3), name="img"), keras.Input((10,), name="tab")
    h = L.Conv2D(s["width"], 3, padding="same", activation=s["act"], kernel_regularizer=reg)(a)
    h = _norm(L, s["norm"])(h)
    h = L.Conv2D(s["width"], 3, padding="same", activation=s["act"], activity_regularizer=reg)(h)
    h = L.GlobalAveragePooling2D()(h)
    t = L.Dense(s["width"], activation=s["act"])(b)
    if s["dropout"]:
        t = L.Dropout(s["dropout"])(t)
    j = L.Dense(s["width"] * 2, activation=s["act"], kernel_regularizer=reg)(L.Concatenate()([h, t]))
    model = keras.Model([a, b], [L.Dense(3, name="cls")(j), L.Dense(1, name="val")(j)])
    model.compile(optimizer=_optimizer(keras, s["opt"]), loss_weights=[1.0, 0.5], metrics=[["accuracy"], ["mae"]],
                  loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.losses.MeanSquaredError()])
    return model


def _rnn(keras, s):
    L = keras.layers
    w = s["width"]
    layer = {
        "lstm": lambda: L.LSTM(w, return_sequences=True, dropout=s["dropout"]),
        "gru": lambda: L.GRU(w, return_sequences=True),
        "bigru": lambda: L.Bidirectional(L.GRU(w // 2, return_sequences=True)),
        "bilstm": lambda: L.Bidirectional(L.LSTM(w // 2, return_sequences=True)),
        "conv1d": lambda: L.Conv1D(w, 3, padding="same", activation=s["act"]),
        "td_dense": lambda: L.TimeDistributed(L.Dense(w, activation=s["act"])),
    }
    inp = keras.Input((32, 5))
    h = L.Dense(w)(inp)
    for kind in s["rnn"]:
        h = layer[kind]()(h)
        if s["norm"] == "ln":
            h = L.LayerNormalization()(h)
    model = keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling1D()(h)))
    model.compile(optimizer=_optimizer(keras, s["opt"]), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _attn(keras, s):
    L = keras.layers
    w, seq = 2 * s["width"], 48  # attention scores of 0.6-2.4 MiB per head group
    if s["tokens"]:
        inp = keras.Input((seq,), dtype="int32")
        h = L.Embedding(50, w)(inp)
    else:
        inp = keras.Input((seq, 6))
        h = L.Dense(w)(inp)
    for _ in range(s["blocks"]):
        x = L.LayerNormalization()(h) if s["prenorm"] else h
        a = L.MultiHeadAttention(s["heads"], w // s["heads"], dropout=s["dropout"])(x, x, use_causal_mask=s["causal"])
        h = L.Add()([h, L.Dropout(s["dropout"])(a) if s["dropout"] else a])
        if not s["prenorm"]:
            h = L.LayerNormalization()(h)
        x = L.LayerNormalization()(h) if s["prenorm"] else h
        f = L.Dense(w, kernel_regularizer=keras.regularizers.L2(s["reg"]) if s["reg"] else None)(
            L.Dense(2 * w, activation=s["act"])(x))
        h = L.Add()([h, L.Dropout(s["dropout"])(f) if s["dropout"] else f])
        if not s["prenorm"]:
            h = L.LayerNormalization()(h)
    if s["prenorm"]:
        h = L.LayerNormalization()(h)
    h = {"avg": L.GlobalAveragePooling1D(), "max": L.GlobalMaxPooling1D(), "first": L.Lambda(lambda t: t[:, 0])}[s["pool"]](h)
    model = keras.Model(inp, L.Dense(3, dtype="float32")(h))
    model.compile(optimizer=_optimizer(keras, s["opt"]), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _conv(keras, s):
    L = keras.layers
    act, w = s["conv_act"], s["width"]
    inp = keras.Input((24, 24, 3))
    h = L.Activation(act)(L.BatchNormalization()(L.Conv2D(w, 3, strides=2, padding="same", use_bias=False)(inp)))
    for k, kind in enumerate(s["blocks_kind"]):
        x = h
        if kind == "plain":
            h = L.Activation(act)(L.BatchNormalization()(L.Conv2D(w, 3, padding="same")(h)))
        elif kind == "separable":
            h = L.Activation(act)(L.BatchNormalization()(L.SeparableConv2D(w, 3, padding="same")(h)))
        else:  # inverted residual, with a squeeze-and-excitation gate for "se"
            h = L.Activation(act)(L.BatchNormalization()(L.Conv2D(2 * w, 1, use_bias=False)(h)))
            h = L.Activation(act)(L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same", use_bias=False)(h)))
            if kind == "se":
                g = L.Dense(2 * w, activation="sigmoid")(L.Dense(w // 4, activation="relu")(L.GlobalAveragePooling2D(keepdims=True)(h)))
                h = L.Multiply()([h, g])
            h = L.BatchNormalization()(L.Conv2D(w, 1, use_bias=False)(h))
        if s["residual"]:
            h = L.Add()([x, h])
        if k == 1:
            h = L.MaxPooling2D(2)(h) if s["down"] == "maxpool" else L.AveragePooling2D(2)(h)
    h = L.GlobalAveragePooling2D()(h) if s["pool"] != "max" else L.GlobalMaxPooling2D()(h)
    if s["dropout"]:
        h = L.Dropout(s["dropout"])(h)
    model = keras.Model(inp, L.Dense(5, dtype="float32")(h))
    model.compile(optimizer=_optimizer(keras, s["opt"]), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _mlp(keras, s):
    L = keras.layers
    w = 4 * s["width"]
    act = s["mlp_act"]
    if act == "gelu_tanh":
        act = lambda t: keras.activations.gelu(t, approximate=True)  # noqa: E731
    norm = {"bn": L.BatchNormalization, "ln": L.LayerNormalization, "none": L.Identity,
            "rms": lambda: L.LayerNormalization(rms_scaling=True)}[s["mlp_norm"]]
    inp = keras.Input((24,))
    h = L.Dense(w)(inp)
    for _ in range(s["mlp_blocks"]):
        x = norm()(h)
        if s["mlp_gated"]:  # a GLU: act(x W) * (x V)
            f = L.Multiply()([L.Dense(2 * w, activation=act)(x), L.Dense(2 * w)(x)])
        else:
            f = L.Dense(2 * w, activation=act)(x)
        if s["dropout"]:
            f = L.Dropout(s["dropout"])(f)
        h = L.Add()([h, L.Dense(w, kernel_regularizer=keras.regularizers.L2(s["reg"]) if s["reg"] else None)(f)])
    model = keras.Model(inp, L.Dense(3, dtype="float32")(norm()(h)))
    model.compile(optimizer=_optimizer(keras, s["opt"]), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build(s: dict):
    import keras

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16" if s["family"].startswith("fp16") else "float32")
    base = s["family"].removeprefix("fp16") or "unet"
    return {"unet": _unet, "multi": _multi, "rnn": _rnn, "attn": _attn, "conv": _conv, "mlp": _mlp}[base](keras, s)


def data(s: dict):
    import numpy as np

    rng, n = np.random.default_rng(s["seed"]), BATCH
    base = s["family"].removeprefix("fp16") or "unet"
    if base == "unet":
        x = rng.standard_normal((n, 16, 16, 3)).astype("float32")
        y = rng.integers(0, 4, (n, 16, 16)).astype("int32")
    elif base == "multi":
        x = [rng.standard_normal((n, 8, 8, 3)).astype("float32"), rng.standard_normal((n, 10)).astype("float32")]
        y = [rng.integers(0, 3, (n,)).astype("int32"), rng.standard_normal((n, 1)).astype("float32")]
    elif base == "attn":
        x = rng.integers(0, 50, (n, 48)).astype("int32") if s["tokens"] else rng.standard_normal((n, 48, 6)).astype("float32")
        y = rng.integers(0, 3, (n,)).astype("int32")
    elif base == "mlp":
        x = rng.standard_normal((MLP_BATCH, 24)).astype("float32")
        y = rng.integers(0, 3, (MLP_BATCH,)).astype("int32")
        sw = rng.random(MLP_BATCH).astype("float32") if s["sw"] else None
        return x, y, sw
    elif base == "conv":
        x = rng.standard_normal((n, 24, 24, 3)).astype("float32")
        y = rng.integers(0, 5, (n,)).astype("int32")
    else:
        x = rng.standard_normal((n, 32, 5)).astype("float32")
        y = rng.integers(0, 3, (n,)).astype("int32")
    sw = rng.random((n, 16, 16) if base == "unet" else n).astype("float32") if s["sw"] else None
    return x, y, sw


def run(s: dict) -> dict:
    import numpy as np
    import tensorflow as tf

    import tfremat
    import tfremat.keras

    tf.config.experimental.enable_op_determinism()
    x, y, sw = data(s)

    def train(model):
        logs, peaks = [], []
        for _ in range(STEPS):
            tf.config.experimental.reset_memory_stats("CPU:0")
            logs.append(model.train_on_batch(x, y, sample_weight=sw, return_dict=True))
            peaks.append(int(tf.config.experimental.get_memory_info("CPU:0")["peak"]))
        return logs, peaks, [v.numpy() for v in model.variables] + [v.numpy() for v in model.optimizer.variables]

    ref_logs, ref_peaks, ref_state = train(build(s))
    if not max(ref_peaks):
        return {"skipped": "no allocation the allocator's statistics count (a model too small)"}
    model = build(s)
    budget = 0.6 * max(ref_peaks)
    tfremat.keras.remat(model, budget_gib=budget / 2**30)
    try:
        tfremat.keras.get_plan(model, x, y, sw)
        kind = "60 %"
    except tfremat.InfeasibleBudgetError as e:
        budget, kind = 1.1 * e.min_feasible_bytes, "min+10 %"
        tfremat.keras.remat(model, budget_gib=budget / 2**30)
    plan = tfremat.keras.get_plan(model, x, y, sw)
    logs, peaks, state = train(model)
    bad = [i for i, (a, b) in enumerate(zip(ref_state, state)) if not np.array_equal(a, b)]
    return {
        "bitwise": logs == ref_logs and not bad, "under": max(peaks) <= budget,
        "baseline": max(ref_peaks), "budget": int(budget), "kind": kind, "measured": max(peaks), "calls": peaks,
        "predicted": plan.predicted_peak_bytes, "chunks": plan.allocator_peak_bytes, "expected": plan.expected_peak_bytes,
        "recomputed": len(plan.recomputed), "variables_apart": len(bad),
    }


def _failure(row: dict) -> str:
    """What went wrong with one model's row."""
    if "error" in row:
        return row["error"]
    if not row["under"]:
        return f"over {row['measured'] / 2**20:.1f}/{row['budget'] / 2**20:.1f} MiB"
    return "not bitwise"


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in FAMILIES + ("all",):
        sys.exit(__doc__)
    if argv[0] == "all":
        count = int(argv[1]) if len(argv) > 1 else 8
        print("| family | models | bitwise | under budget | measured / predicted (median) | failures |")
        print("|---|---|---|---|---|---|")
        for family in FAMILIES:
            out = subprocess.run([sys.executable, __file__, family, "0", str(count)], capture_output=True, text=True)
            rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            ran = [r for r in rows if "bitwise" in r]
            ratios = sorted(r["measured"] / r["predicted"] for r in ran if r["predicted"])
            failed = [f"{r['k']}: {_failure(r)}" for r in rows if "skipped" not in r and not (r.get("bitwise") and r.get("under"))]
            print(f"| {family} | {len(ran)} of {len(rows)} | {sum(r['bitwise'] for r in ran)} | "
                  f"{sum(r['under'] for r in ran)} | {ratios[len(ratios) // 2] if ratios else float('nan'):.2f} | "
                  f"{'; '.join(failed) or '-'} |", flush=True)
        return
    family = argv[0]
    first = int(argv[1]) if len(argv) > 1 else 0
    count = int(argv[2]) if len(argv) > 2 else 8
    for k in range(first, first + count):
        s = draw(random.Random(7919 * k + len(family)), family)
        try:
            out = run(s)
        except Exception as e:  # a search: report and go on
            here = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
            out = {"error": repr(e)[:300], "where": f"line {here[-1].lineno}: {here[-1].line}" if here else "?"}
        print(json.dumps({"k": k, **out, "spec": s}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
