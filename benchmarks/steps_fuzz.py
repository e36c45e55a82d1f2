"""Random hand-written ``tf.function`` train steps through ``tfremat.remat``: bitwise and under budget.

    python benchmarks/steps_fuzz.py [FIRST [COUNT]]      # steps FIRST .. FIRST+COUNT-1 (default 0 8)
    python benchmarks/steps_fuzz.py --show K             # print step K's drawn spec
    python benchmarks/steps_fuzz.py --keras [FIRST [COUNT]]  # keras_fuzz models, custom steps

A search for bugs in the decorator's own use case (``keras_fuzz.py`` searches Keras'
``fit`` path): step ``k`` is drawn from ``random.Random(104729 * k + 11)`` (the same
steps on every machine) as a stack of blocks written in raw TensorFlow ops on
``tf.Variable``s, in one of three shapes:

- ``dense`` (batch 1024): linear, residual, gated (GLU), layer norm and batch norm
  from ``tf.nn.moments``, stateless dropout from a seed input, a
  ``tf.custom_gradient`` activation, a ``tf.recompute_grad`` block, clipping, a
  split-and-gate block, a softmax gate;
- ``conv`` (batch 64, 16x16 or 24x24): convolution + bias, residual convolutions,
  depthwise convolution, moments batch norm, ``fused_batch_norm``, stride-1 pooling,
  one 2x down-sampling, squeeze-and-excitation, stateless dropout;
- ``seq`` (batch 64, 64 steps, token ids through ``tf.gather`` or projected features):
  single-head ``einsum`` attention (causal or not), feed-forward, layer norm,
  ``conv1d``, stateless dropout;

one of twelve activations, a loss (sparse softmax cross-entropy, sigmoid
cross-entropy, squared error, Huber from ``tf.where``) with or without an L2 term, and
an update (SGD and momentum written with ``assign``, global-norm clipping, Keras' Adam
or SGD). Each step runs 3 times as a plain ``tf.function`` in one fresh process and
through ``tfremat.remat`` in another (``steps_sweep.py``'s harness: budget 60 % of the
plain step's measured peak, or the smallest feasible budget + 10 %, op determinism on).
One JSON line per step, then a summary. ``--keras``: the models of
``keras_fuzz.py`` (its families in turn, other seeds) trained by a hand-written
``GradientTape`` step instead of Keras' own. Results: docs/design.md ("Random
hand-written steps").
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile

import numpy as np

STEPS = 3
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "softplus", "elu", "selu",
               "leaky_relu", "relu6", "mish")
BLOCKS = {
    "dense": ("linear", "residual", "gated", "ln", "bn", "dropout", "custom_grad", "recompute", "clip", "split", "softmax_gate"),
    "conv": ("conv", "resconv", "depthwise", "bn", "fused_bn", "pool", "down", "se", "dropout"),
    "seq": ("attn", "causal_attn", "ffn", "ln", "conv1d", "dropout"),
}


def draw(k: int) -> dict:
    r = random.Random(104729 * k + 11)
    shape = r.choice(tuple(BLOCKS))
    return {
        "shape": shape,
        "blocks": [r.choice(BLOCKS[shape]) for _ in range(r.randint(3, 7))],
        "act": r.choice(ACTIVATIONS),
        "width": r.choice((128, 256)) if shape == "dense" else r.choice((16, 32)) if shape == "conv" else 64,
        "size": r.choice((16, 24)),
        "tokens": r.random() < 0.5,
        "loss": r.choice(("ce", "sigmoid", "mse", "huber")),
        "l2": r.random() < 0.4,
        "update": r.choice(("sgd", "momentum", "clip_sgd", "adam", "keras_sgd")),
        "out": r.choice(("loss", "tuple", "dict")),
        "seed": r.randint(0, 10**6),
    }


def case(k: int):
    """``(step, data, state)`` of step ``k``, as ``steps_sweep._case`` returns them."""
    import keras
    import steps_sweep
    import tensorflow as tf

    s = draw(k)
    rng = np.random.default_rng(s["seed"])
    keras.utils.set_random_seed(0)
    variables, kernels = [], []

    def var(shape, scale=None, kernel=True):
        fan_in = int(np.prod(shape[:-1])) or 1
        v = tf.Variable((rng.standard_normal(shape) * (scale or fan_in**-0.5)).astype("float32"))
        variables.append(v)
        if kernel:
            kernels.append(v)
        return v

    def const(value):
        v = tf.Variable(np.full(value[1], value[0], "float32"))
        variables.append(v)
        return v

    def act(h):
        a = s["act"]
        if a == "gelu_tanh":
            return tf.nn.gelu(h, approximate=True)
        if a == "mish":
            return h * tf.tanh(tf.nn.softplus(h))
        if a == "leaky_relu":
            return tf.nn.leaky_relu(h, 0.1)
        return {"relu": tf.nn.relu, "gelu": tf.nn.gelu, "silu": tf.nn.silu, "tanh": tf.tanh,
                "sigmoid": tf.sigmoid, "softplus": tf.nn.softplus, "elu": tf.nn.elu,
                "selu": tf.nn.selu, "relu6": tf.nn.relu6}[a](h)

    clipped_swish = steps_sweep.clipped_swish_op()

    def dropout(h, seed, i):
        keep = tf.random.stateless_uniform(tf.shape(h), seed=seed + i) >= 0.2
        return tf.where(keep, h / 0.8, tf.zeros_like(h))

    def norm(axes, kind, c):
        """A normalization over ``axes`` with its scale and offset (made now, not in the trace)."""
        g, b = const((1.0, (c,))), const((0.0, (c,)))

        def f(h):
            m, v = tf.nn.moments(h, axes, keepdims=True)
            if kind == "bn":
                return tf.nn.batch_normalization(h, m, v, b, g, 1e-3)
            return (h - m) * tf.math.rsqrt(v + 1e-5) * g + b

        return f

    builders = []  # (i, kind) -> a function of (h, seed) built with its variables now
    w = s["width"]
    B = 1024 if s["shape"] == "dense" else 64
    T, C = 64, 5  # seq steps, classes
    size = s["size"]
    for i, kind in enumerate(s["blocks"]):
        if kind == "dropout":
            builders.append(lambda h, seed, i=i: dropout(h, seed, i))
        elif s["shape"] == "dense":
            if kind == "linear":
                def make():
                    w1, b1 = var((w, w)), const((0.0, (w,)))
                    return lambda h, seed: act(h @ w1 + b1)
                builders.append(make())
            elif kind == "residual":
                def make():
                    w1, w2 = var((w, 2 * w)), var((2 * w, w), 0.5 / np.sqrt(2 * w))
                    return lambda h, seed: h + act(h @ w1) @ w2
                builders.append(make())
            elif kind == "gated":
                def make():
                    w1, w2, w3 = var((w, w)), var((w, w)), var((w, w), 0.5 / np.sqrt(w))
                    return lambda h, seed: h + (act(h @ w1) * (h @ w2)) @ w3
                builders.append(make())
            elif kind in ("ln", "bn"):
                builders.append(lambda h, seed, f=norm([-1] if kind == "ln" else [0], kind, w): f(h))
            elif kind == "custom_grad":
                def make():
                    w1 = var((w, w))
                    return lambda h, seed: clipped_swish(h @ w1)
                builders.append(make())
            elif kind == "recompute":
                def make():
                    w1, w2 = var((w, w)), var((w, w), 0.5 / np.sqrt(w))
                    block = tf.recompute_grad(lambda h: h + act(h @ w1) @ w2)
                    return lambda h, seed: block(h)
                builders.append(make())
            elif kind == "clip":
                builders.append(lambda h, seed: tf.clip_by_value(h, -2.0, 2.0))
            elif kind == "split":
                def make():
                    w1 = var((w, w))
                    def f(h, seed):
                        a, b = tf.split(h @ w1, 2, axis=1)
                        return tf.concat([act(a), b * tf.sigmoid(a)], 1)
                    return f
                builders.append(make())
            elif kind == "softmax_gate":
                builders.append(lambda h, seed: h * (1.0 + tf.nn.softmax(h, axis=-1)))
        elif s["shape"] == "conv":
            if kind == "conv":
                def make():
                    k1, b1 = var((3, 3, w, w)), const((0.0, (w,)))
                    return lambda h, seed: act(tf.nn.bias_add(tf.nn.conv2d(h, k1, 1, "SAME"), b1))
                builders.append(make())
            elif kind == "resconv":
                def make():
                    k1, k2 = var((3, 3, w, w)), var((3, 3, w, w), 0.5 / np.sqrt(9 * w))
                    return lambda h, seed: h + tf.nn.conv2d(act(tf.nn.conv2d(h, k1, 1, "SAME")), k2, 1, "SAME")
                builders.append(make())
            elif kind == "depthwise":
                def make():
                    dw = var((3, 3, w, 1), 1 / 3)
                    return lambda h, seed: act(tf.nn.depthwise_conv2d(h, dw, [1, 1, 1, 1], "SAME"))
                builders.append(make())
            elif kind == "bn":
                builders.append(lambda h, seed, f=norm([0, 1, 2], "bn", w): act(f(h)))
            elif kind == "fused_bn":
                def make():
                    g, b = const((1.0, (w,))), const((0.0, (w,)))
                    return lambda h, seed: tf.compat.v1.nn.fused_batch_norm(h, g, b, is_training=True)[0]
                builders.append(make())
            elif kind == "pool":
                builders.append(lambda h, seed, m=i % 2: (tf.nn.max_pool2d if m else tf.nn.avg_pool2d)(h, 3, 1, "SAME"))
            elif kind == "down":
                builders.append(lambda h, seed: tf.nn.max_pool2d(h, 2, 2, "SAME") if h.shape[1] >= 8 else h)
            elif kind == "se":
                def make():
                    w1, w2 = var((w, w // 4)), var((w // 4, w))
                    def f(h, seed):
                        z = tf.reduce_mean(h, [1, 2])
                        g = tf.sigmoid(tf.nn.relu(z @ w1) @ w2)
                        return h * g[:, None, None, :]
                    return f
                builders.append(make())
        else:  # seq
            if kind in ("attn", "causal_attn"):
                def make(causal=kind == "causal_attn"):
                    wq, wk, wv, wo = (var((w, w)) for _ in range(4))
                    def f(h, seed):
                        q, kk, v = (tf.einsum("btd,de->bte", h, m) for m in (wq, wk, wv))
                        scores = tf.einsum("btd,bsd->bts", q, kk) / float(np.sqrt(w))
                        if causal:
                            mask = tf.linalg.band_part(tf.ones((T, T)), -1, 0)
                            scores = tf.where(mask > 0, scores, -1e9 * tf.ones_like(scores))
                        a = tf.nn.softmax(scores, axis=-1)
                        return h + tf.einsum("bts,bsd->btd", a, v) @ wo
                    return f
                builders.append(make())
            elif kind == "ffn":
                def make():
                    w1, w2 = var((w, 2 * w)), var((2 * w, w), 0.5 / np.sqrt(2 * w))
                    return lambda h, seed: h + tf.einsum("btf,fd->btd", act(tf.einsum("btd,df->btf", h, w1)), w2)
                builders.append(make())
            elif kind == "ln":
                builders.append(lambda h, seed, f=norm([-1], "ln", w): f(h))
            elif kind == "conv1d":
                def make():
                    k1 = var((3, w, w))
                    return lambda h, seed: act(tf.nn.conv1d(h, k1, 1, "SAME"))
                builders.append(make())

    # input and head
    if s["shape"] == "dense":
        x = rng.standard_normal((B, 32)).astype("float32")
        w_in = var((32, w))
        stem = lambda x: x @ w_in  # noqa: E731
    elif s["shape"] == "conv":
        x = rng.standard_normal((B, size, size, 3)).astype("float32")
        k_in = var((3, 3, 3, w))
        stem = lambda x: act(tf.nn.conv2d(x, k_in, 1, "SAME"))  # noqa: E731
    elif s["tokens"]:
        x = rng.integers(0, 100, (B, T)).astype("int32")
        emb = var((100, w), 0.3)
        stem = lambda x: tf.gather(emb, x)  # noqa: E731
    else:
        x = rng.standard_normal((B, T, 8)).astype("float32")
        w_in = var((8, w))
        stem = lambda x: tf.einsum("btf,fd->btd", x, w_in)  # noqa: E731
    w_out, b_out = var((w, C)), const((0.0, (C,)))
    if s["loss"] == "ce":
        y = rng.integers(0, C, (B,)).astype("int32")
    elif s["loss"] == "sigmoid":
        y = (rng.random((B, C)) < 0.3).astype("float32")
    else:
        y = rng.standard_normal((B, C)).astype("float32")
    seed = np.array([s["seed"] % 1000, 7], "int32")
    trainable = list(variables)

    def loss_of(logits, y):
        if s["loss"] == "ce":
            per = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
        elif s["loss"] == "sigmoid":
            per = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(y, logits), 1)
        elif s["loss"] == "mse":
            per = tf.reduce_mean(tf.square(logits - y), 1)
        else:
            d = tf.abs(logits - y)
            per = tf.reduce_mean(tf.where(d < 1.0, 0.5 * d * d, d - 0.5), 1)
        loss = tf.reduce_mean(per)
        if s["l2"]:
            loss += 1e-4 * tf.add_n([tf.nn.l2_loss(v) for v in kernels])
        return loss

    opt = slots = None
    if s["update"] == "adam":
        opt = keras.optimizers.Adam(1e-3)
    elif s["update"] == "keras_sgd":
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
    elif s["update"] == "momentum":
        slots = [tf.Variable(tf.zeros_like(v)) for v in trainable]

    def step(x, y, seed):
        with tf.GradientTape() as tape:
            h = stem(x)
            for f in builders:
                h = f(h, seed)
            h = tf.reduce_mean(h, [1, 2]) if s["shape"] == "conv" else tf.reduce_max(h, 1) if s["shape"] == "seq" else h
            logits = h @ w_out + b_out
            loss = loss_of(logits, y)
        grads = tape.gradient(loss, trainable)
        gnorm = tf.linalg.global_norm(grads)
        if opt is not None:
            opt.apply_gradients(zip(grads, trainable))
        else:
            # hand-written updates take dense gradients (tf.gather's are IndexedSlices)
            grads = [tf.convert_to_tensor(g) for g in grads]
            if s["update"] == "clip_sgd":
                grads, _ = tf.clip_by_global_norm(grads, 1.0, use_norm=gnorm)
            for j, (v, g) in enumerate(zip(trainable, grads)):
                if slots is not None:
                    slots[j].assign(0.9 * slots[j] + g)
                    g = slots[j]
                v.assign_sub(0.01 * g)
        if s["out"] == "tuple":
            return loss, gnorm
        if s["out"] == "dict":
            return {"loss": loss, "gnorm": gnorm, "logit_mean": tf.reduce_mean(logits)}
        return loss

    def state():
        return trainable + (slots or []) + (list(opt.variables) if opt is not None else [])

    data = (tf.constant(x), tf.constant(y), tf.constant(seed))
    return step, [data] * STEPS, state


KERAS_FAMILIES = ("unet", "multi", "rnn", "attn", "conv", "mlp", "fp16mlp", "fp16attn")


def keras_spec(k: int) -> dict:
    """The ``keras_fuzz.py`` model of custom step ``k``: the families in turn, from
    seeds that family's own search does not use."""
    import keras_fuzz

    family = KERAS_FAMILIES[k % len(KERAS_FAMILIES)]
    return keras_fuzz.draw(random.Random(7919 * (k // len(KERAS_FAMILIES)) + 1009 + len(family)), family)


def keras_case(k: int):
    """A Keras model of ``keras_fuzz.py`` trained by a hand-written step: ``model(x)``
    under a ``GradientTape``, ``compute_loss`` (losses, their weights, sample weights,
    regularizers), ``scale_loss`` (a ``LossScaleOptimizer`` under ``mixed_float16``)
    and the compiled optimizer's ``apply_gradients``."""
    import keras_fuzz
    import tensorflow as tf

    spec = keras_spec(k)
    model = keras_fuzz.build(spec)
    opt = model.optimizer
    x, y, sw = keras_fuzz.data(spec)
    opt.build(model.trainable_variables)

    def step(x, y, sw=None):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=True)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    data = tf.nest.map_structure(tf.constant, (x, y) if sw is None else (x, y, sw))
    return step, [data] * STEPS, lambda: list(model.variables) + list(opt.variables)


def main(argv: list[str]) -> None:
    import steps_sweep

    keras_steps = argv[:1] == ["--keras"]
    if keras_steps:
        argv = argv[1:]
    spec_of = keras_spec if keras_steps else draw
    if argv[:1] == ["--show"]:
        print(json.dumps(spec_of(int(argv[1]))))
        return
    first = int(argv[0]) if argv else 0
    count = int(argv[1]) if len(argv) > 1 else 8
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(first, first + count):
            name, st = f"{'kfuzz' if keras_steps else 'fuzz'}:{k}", os.path.join(tmp, str(k))
            ref = steps_sweep.run(name, "ref", st)
            if "error" in ref:
                row = {"k": k, "error": "reference: " + ref["error"][-300:]}
            elif not max(ref["peaks"]):
                row = {"k": k, "skipped": "no allocation the allocator's statistics count"}
            else:
                json.dump(ref, open(st + ".json", "w"))
                r = steps_sweep.run(name, "remat", st)
                if "error" in r:
                    row = {"k": k, "error": r["error"][-300:]}
                else:
                    row = {"k": k, "bitwise": r["n_unequal"] == 0 and not r["shape_mismatch"],
                           "under": max(r["peaks"]) <= r["budget"], "baseline": max(ref["peaks"]),
                           "budget": int(r["budget"]), "kind": r["kind"], "measured": max(r["peaks"]),
                           "calls": r["peaks"], "predicted": r["predicted"], "chunks": r["chunks"],
                           "expected": r["expected"], "recomputed": r["recomputed"],
                           "unequal": f"{r['n_unequal']} of {r['n_values']}, max {r['max_abs_diff']:.1e}"}
            rows.append(row)
            print(json.dumps({**row, "spec": spec_of(k)}), flush=True)
    ran = [r for r in rows if "bitwise" in r]
    bad = [f"{r['k']}: {r.get('error') or ('over' if not r['under'] else 'not bitwise')}"
           for r in rows if "skipped" not in r and not (r.get("bitwise") and r.get("under"))]
    print(f"steps {first}-{first + count - 1}: {len(ran)} ran, {sum(r['bitwise'] for r in ran)} bitwise, "
          f"{sum(r['under'] for r in ran)} under budget; failures: {'; '.join(bad) or '-'}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
