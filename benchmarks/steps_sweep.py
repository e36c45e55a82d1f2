"""Robustness sweep: hand-written ``tf.function`` train steps through ``tfremat.remat``.

    python benchmarks/steps_sweep.py [NAME ...]

The decorator's own use case, beyond ``model.fit``: two tapes (a GAN), a gradient
penalty (a tape inside a tape), ``tf.custom_gradient``, ``tf.recompute_grad``, sparse
embedding gradients, ``tf.cond`` and ``tf.while_loop`` in the forward pass, a
persistent tape with global-norm clipping, a ``LossScaleOptimizer`` in float16,
stateful dropout (``tf.nn.dropout``, ``tf.random.Generator``), float64, a contrastive
loss over two augmented views, raw ``tf.nn`` ops, dict inputs and outputs.

For each step (default: all), the plain ``tf.function`` runs 3 steps in one fresh
process and ``tfremat.remat``'s in another (budget 60 % of the plain step's measured
peak, or the solver's smallest budget + 10 % where 60 % is infeasible; op determinism
on), and one table row is printed: baseline, budget, predicted and measured peak (MiB,
the process's default CPU allocator: start it with ``TF_ENABLE_ONEDNN_OPTS=1`` where
oneDNN is not on by default), ops recomputed, and whether every output and variable is
bitwise equal. About 5 minutes on 2 cores. Results: docs/design.md ("Hand-written
steps").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
MIB = 2**20


def clipped_swish_op():
    """``x * sigmoid(x)`` as a ``tf.custom_gradient`` whose gradient is clipped to [-1, 1]."""
    import tensorflow as tf

    @tf.custom_gradient
    def clipped_swish(x):
        y = x * tf.sigmoid(x)

        def grad(dy):
            s = tf.sigmoid(x)
            return tf.clip_by_value(dy * (s + x * s * (1 - s)), -1.0, 1.0)

        return y, grad

    return clipped_swish


def _case(name):
    if name.startswith("fuzz:"):  # a random step of steps_fuzz.py
        import steps_fuzz

        return steps_fuzz.case(int(name.removeprefix("fuzz:")))
    if name.startswith("kfuzz:"):  # a keras_fuzz.py model in a hand-written step
        import steps_fuzz

        return steps_fuzz.keras_case(int(name.removeprefix("kfuzz:")))
    import tensorflow as tf
    import keras

    L = keras.layers
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    tf.random.set_seed(0)

    def sgd(tape, loss, vs, lr=0.01):
        for w, g in zip(vs, tape.gradient(loss, vs)):
            w.assign_sub(lr * g)

    def mlp_case(n, B, D, layer, lr=0.01, dtype="float32"):
        """n square layers ``h = layer(i, h @ w)``, a squared loss, plain SGD."""
        ws = [var((D, D), dtype=dtype) for _ in range(n)]
        x = tf.constant(rng.standard_normal((B, D)).astype(dtype))
        y = tf.constant(rng.standard_normal((B, D)).astype(dtype))

        def step(x, y):
            with tf.GradientTape() as tape:
                h = x
                for i, w in enumerate(ws):
                    h = layer(i, h @ w)
                loss = tf.reduce_mean((h - y) ** 2)
            sgd(tape, loss, ws, lr)
            return loss

        return step, [(x, y)] * STEPS, lambda: ws

    def var(shape, scale=None, dtype="float32"):
        scale = scale or (1.0 / np.sqrt(shape[0] if len(shape) == 2 else np.prod(shape[:-1])))
        return tf.Variable((rng.standard_normal(shape) * scale).astype(dtype))

    if name == "gan":
        B, Z = 256, 64
        gen = keras.Sequential([keras.Input((Z,)), L.Dense(256, activation="relu"), L.Dense(512, activation="relu"), L.Dense(784, activation="tanh")])
        disc = keras.Sequential([keras.Input((784,)), L.Dense(512), L.LeakyReLU(0.2), L.Dense(256), L.LeakyReLU(0.2), L.Dense(1)])
        g_opt, d_opt = keras.optimizers.Adam(1e-4), keras.optimizers.Adam(1e-4)
        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        real = tf.constant(rng.uniform(-1, 1, (B, 784)).astype("float32"))
        noise = tf.constant(rng.standard_normal((B, Z)).astype("float32"))

        def step(real, noise):
            with tf.GradientTape() as gt, tf.GradientTape() as dt:
                fake = gen(noise, training=True)
                rl, fl = disc(real, training=True), disc(fake, training=True)
                g_loss = bce(tf.ones_like(fl), fl)
                d_loss = bce(tf.ones_like(rl), rl) + bce(tf.zeros_like(fl), fl)
            g_opt.apply_gradients(zip(gt.gradient(g_loss, gen.trainable_variables), gen.trainable_variables))
            d_opt.apply_gradients(zip(dt.gradient(d_loss, disc.trainable_variables), disc.trainable_variables))
            return g_loss, d_loss

        state = lambda: gen.variables + disc.variables + g_opt.variables + d_opt.variables
        return step, [(real, noise)] * STEPS, state

    if name == "wgan_gp":
        B = 128
        disc = keras.Sequential([keras.Input((16, 16, 3)), L.Conv2D(32, 3, padding="same"), L.LeakyReLU(0.2),
                                 L.Conv2D(64, 3, strides=2, padding="same"), L.LeakyReLU(0.2), L.Flatten(), L.Dense(1)])
        opt = keras.optimizers.Adam(1e-4)
        real = tf.constant(rng.standard_normal((B, 16, 16, 3)).astype("float32"))
        fake = tf.constant(rng.standard_normal((B, 16, 16, 3)).astype("float32"))
        alpha = tf.constant(rng.uniform(size=(B, 1, 1, 1)).astype("float32"))

        def step(real, fake, alpha):
            with tf.GradientTape() as tape:
                with tf.GradientTape() as inner:
                    mix = real + alpha * (fake - real)
                    inner.watch(mix)
                    d_mix = disc(mix, training=True)
                g = inner.gradient(d_mix, mix)
                gp = tf.reduce_mean((tf.sqrt(tf.reduce_sum(g**2, axis=[1, 2, 3]) + 1e-12) - 1.0) ** 2)
                loss = tf.reduce_mean(disc(fake, training=True)) - tf.reduce_mean(disc(real, training=True)) + 10.0 * gp
            opt.apply_gradients(zip(tape.gradient(loss, disc.trainable_variables), disc.trainable_variables))
            return loss

        return step, [(real, fake, alpha)] * STEPS, lambda: disc.variables + opt.variables

    if name == "custom_grad":
        B, D = 512, 512
        clipped_swish = clipped_swish_op()
        return mlp_case(8, B, D, lambda i, h: clipped_swish(h))

    if name == "recompute_grad":
        B, D = 512, 512
        ws = [var((D, D)) for _ in range(8)]
        x = tf.constant(rng.standard_normal((B, D)).astype("float32"))
        y = tf.constant(rng.standard_normal((B, D)).astype("float32"))

        def block(h, w1, w2):
            return tf.nn.relu(tf.nn.relu(h @ w1) @ w2) + h

        rblock = tf.recompute_grad(block)

        def step(x, y):
            with tf.GradientTape() as tape:
                h = x
                for i in range(0, 8, 2):
                    h = (rblock if i == 0 else block)(h, ws[i], ws[i + 1])
                loss = tf.reduce_mean((h - y) ** 2)
            sgd(tape, loss, ws, 0.001)
            return loss

        return step, [(x, y)] * STEPS, lambda: ws

    if name == "embedding_sparse":
        B, T, V, E = 64, 32, 20000, 128
        emb = var((V, E), 0.05)
        w1, w2 = var((E, 512)), var((512, 10))
        opt = keras.optimizers.Adam(1e-3)
        ids = tf.constant(rng.integers(0, V, (B, T)).astype("int32"))
        lab = tf.constant(rng.integers(0, 10, (B,)).astype("int32"))
        vs = [emb, w1, w2]

        def step(ids, lab):
            with tf.GradientTape() as tape:
                h = tf.nn.embedding_lookup(emb, ids)  # (B, T, E)
                h = tf.nn.gelu(tf.einsum("bte,ef->btf", h, w1))
                h = tf.reduce_max(h, axis=1) @ w2
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(lab, h))
            opt.apply_gradients(zip(tape.gradient(loss, vs), vs))
            return loss

        return step, [(ids, lab)] * STEPS, lambda: vs + list(opt.variables)

    if name == "cond_loop":
        B, D = 256, 512
        ws = [var((D, D)) for _ in range(6)]
        u = var((D, D), 0.02)
        x = tf.constant(rng.standard_normal((B, D)).astype("float32"))
        y = tf.constant(rng.standard_normal((B, D)).astype("float32"))
        flag = tf.constant(True)

        def step(x, y, flag):
            with tf.GradientTape() as tape:
                h = x
                for i, w in enumerate(ws):
                    h = tf.nn.relu(h @ w)
                    if i == 2:
                        h = tf.cond(flag, lambda: h * 0.5 + 0.1, lambda: h)
                    if i == 4:
                        h = tf.while_loop(lambda k, a: k < 3, lambda k, a: (k + 1, tf.tanh(a @ u) + a), (0, h))[1]
                loss = tf.reduce_mean((h - y) ** 2)
            vs = ws + [u]
            sgd(tape, loss, vs, 0.01)
            return loss

        return step, [(x, y, flag)] * STEPS, lambda: ws + [u]

    if name == "persistent_clip":
        B, D = 512, 512
        enc = [var((D, D)) for _ in range(5)]
        head_a, head_b = var((D, 10)), var((D, 1))
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        x = tf.constant(rng.standard_normal((B, D)).astype("float32"))
        ya = tf.constant(rng.integers(0, 10, (B,)).astype("int32"))
        yb = tf.constant(rng.standard_normal((B, 1)).astype("float32"))

        def step(x, ya, yb):
            with tf.GradientTape(persistent=True) as tape:
                h = x
                for w in enc:
                    h = tf.nn.elu(h @ w)
                la = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(ya, h @ head_a))
                lb = tf.reduce_mean(tf.square(h @ head_b - yb))
            ga = tape.gradient(la, enc + [head_a])
            gb = tape.gradient(lb, enc + [head_b])
            del tape
            g_enc = [a + 0.5 * b for a, b in zip(ga[:-1], gb[:-1])]
            grads, norm = tf.clip_by_global_norm(g_enc + [ga[-1], gb[-1]], 1.0)
            opt.apply_gradients(zip(grads, enc + [head_a, head_b]))
            return {"la": la, "lb": lb, "norm": norm}

        return step, [(x, ya, yb)] * STEPS, lambda: enc + [head_a, head_b] + list(opt.variables)

    if name == "lossscale_fp16":
        B, D = 512, 512
        ws = [var((D, D)) for _ in range(6)]
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        x = tf.constant(rng.standard_normal((B, D)).astype("float32"))
        y = tf.constant(rng.standard_normal((B, D)).astype("float32"))

        def step(x, y):
            with tf.GradientTape() as tape:
                h = tf.cast(x, tf.float16)
                for w in ws:
                    h = tf.nn.relu(h @ tf.cast(w, tf.float16))
                loss = tf.reduce_mean(tf.square(tf.cast(h, tf.float32) - y))
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, ws)
            opt.apply_gradients(zip(grads, ws))
            return loss

        return step, [(x, y)] * STEPS, lambda: ws + list(opt.variables)

    if name == "stateful_dropout":
        B, D = 512, 512
        gen = tf.random.Generator.from_seed(1)

        def layer(i, h):
            h = tf.nn.relu(h)
            if i % 2:
                return tf.nn.dropout(h, 0.2, seed=i)  # stateful RNG op
            return h * tf.cast(gen.uniform(tf.shape(h)) > 0.1, h.dtype)  # generator state

        return mlp_case(8, B, D, layer)

    if name == "float64":
        B, D = 256, 512
        return mlp_case(6, B, D, lambda i, h: tf.nn.softplus(h), dtype="float64")

    if name == "contrastive":
        B = 128
        enc = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(32, 3, activation="relu", padding="same"),
                                L.BatchNormalization(), L.Conv2D(64, 3, strides=2, activation="relu", padding="same"),
                                L.BatchNormalization(), L.GlobalAveragePooling2D(), L.Dense(128)])
        opt = keras.optimizers.Adam(1e-3)
        x = tf.constant(rng.standard_normal((B, 32, 32, 3)).astype("float32"))
        seed = tf.constant([3, 4])

        def step(x, seed):
            v1 = tf.image.stateless_random_flip_left_right(x, seed)
            v2 = tf.image.stateless_random_brightness(x, 0.2, seed + 1)
            with tf.GradientTape() as tape:
                z = tf.math.l2_normalize(enc(tf.concat([v1, v2], 0), training=True), axis=1)
                sim = z @ tf.transpose(z) / 0.1 - 1e9 * tf.eye(2 * B)
                lab = tf.concat([tf.range(B, 2 * B), tf.range(B)], 0)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(lab, sim))
            opt.apply_gradients(zip(tape.gradient(loss, enc.trainable_variables), enc.trainable_variables))
            return loss

        return step, [(x, seed)] * STEPS, lambda: enc.variables + opt.variables

    if name == "raw_ops_cnn":
        B = 32
        k1, k2 = var((3, 3, 3, 32)), var((3, 3, 32, 64))
        dw = var((3, 3, 64, 1))
        kt = var((3, 3, 32, 64))  # conv2d_transpose: (h, w, out, in)
        scale, offset = tf.Variable(tf.ones(64)), tf.Variable(tf.zeros(64))
        x = tf.constant(rng.standard_normal((B, 32, 32, 3)).astype("float32"))
        y = tf.constant(rng.standard_normal((B, 32, 32, 32)).astype("float32"))
        vs = [k1, k2, dw, kt, scale, offset]

        def step(x, y):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME"))
                h = tf.nn.max_pool2d(h, 2, 2, "SAME")
                h = tf.nn.conv2d(h, k2, 1, "SAME")
                m, v = tf.nn.moments(h, [0, 1, 2])
                h = tf.nn.relu(tf.nn.batch_normalization(h, m, v, offset, scale, 1e-3))
                h = tf.nn.relu6(tf.nn.depthwise_conv2d(h, dw, [1, 1, 1, 1], "SAME"))
                h = tf.nn.avg_pool2d(h, 3, 1, "SAME")
                h = tf.nn.conv2d_transpose(h, kt, [B, 32, 32, 32], 2, "SAME")
                loss = tf.reduce_mean(tf.abs(h - y))
            sgd(tape, loss, vs, 0.01)
            return loss

        return step, [(x, y)] * STEPS, lambda: vs

    if name == "dict_io":
        B, D = 512, 256
        ws = {f"w{i}": var((D, D)) for i in range(6)}
        opt = keras.optimizers.RMSprop(1e-3)
        feats = {"a": tf.constant(rng.standard_normal((B, D)).astype("float32")),
                 "b": tf.constant(rng.standard_normal((B, D)).astype("float32"))}
        y = tf.constant(rng.standard_normal((B, D)).astype("float32"))

        def step(feats, y):
            with tf.GradientTape() as tape:
                h = tf.concat([feats["a"], feats["b"]], 1)[:, ::2] * 2.0
                for k in sorted(ws):
                    h = tf.nn.selu(h @ ws[k]) + 0.1 * feats["a"]
                loss = tf.reduce_mean(tf.math.squared_difference(h, y))
            keys = sorted(ws)
            grads = tape.gradient(loss, [ws[k] for k in keys])
            opt.apply_gradients(zip(grads, [ws[k] for k in keys]))
            return {"loss": loss, "gnorm": tf.linalg.global_norm(grads), "mean": tf.reduce_mean(h)}

        return step, [(feats, y)] * STEPS, lambda: list(ws.values()) + list(opt.variables)

    raise KeyError(name)


NAMES = ["gan", "wgan_gp", "custom_grad", "recompute_grad", "embedding_sparse", "cond_loop",
         "persistent_clip", "lossscale_fp16", "stateful_dropout", "float64", "contrastive",
         "raw_ops_cnn", "dict_io"]


def worker(name, role, state_file):
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    step, data, state = _case(name)
    out = {"name": name}
    if role == "ref":
        fn = tf.function(step)
    else:
        import tfremat

        ref = json.load(open(state_file + ".json"))
        baseline = max(ref["peaks"])
        budget = 0.6 * baseline
        fn = tfremat.remat(tf.function(step), budget_gib=budget / 2**30)
        try:
            plan = fn.get_plan(*data[0])
            out["kind"] = "60 %"
        except tfremat.InfeasibleBudgetError as e:
            budget = e.min_feasible_bytes * 1.1
            fn = tfremat.remat(tf.function(step), budget_gib=budget / 2**30)
            plan = fn.get_plan(*data[0])
            out["kind"] = "min+10 %"
        out.update(budget=budget, predicted=plan.predicted_peak_bytes, recomputed=len(plan.recomputed),
                   chunks=plan.allocator_peak_bytes, expected=plan.expected_peak_bytes)
    outs, peaks, times = [], [], []
    for args in data:
        tf.config.experimental.reset_memory_stats("CPU:0")
        t0 = time.perf_counter()
        r = fn(*args)
        times.append(time.perf_counter() - t0)
        peaks.append(int(tf.config.experimental.get_memory_info("CPU:0")["peak"]))
        outs.append([np.asarray(t) for t in tf.nest.flatten(r)])
    vals = [np.asarray(v.numpy()) for v in state()] + [o for s in outs for o in s]
    out["peaks"] = peaks
    if role == "ref":
        np.savez(state_file, *vals)
        return out
    with np.load(state_file + ".npz") as f:
        ref_vals = [f[f"arr_{i}"] for i in range(len(f.files))]
    diffs = [float(np.max(np.abs(a.astype("float64") - b.astype("float64")))) if a.size else 0.0
             for a, b in zip(vals, ref_vals)]
    out["n_values"] = len(vals)
    # NaN where the plain step has NaN is equal (a diverging random step)
    out["n_unequal"] = sum(1 for a, b in zip(vals, ref_vals)
                           if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    out["max_abs_diff"] = max(diffs) if diffs else 0.0
    out["unequal_at"] = [i for i, (a, b) in enumerate(zip(vals, ref_vals))
                         if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")][:40]
    out["n_state"] = len(vals) - sum(len(s) for s in outs)
    out["shape_mismatch"] = len(vals) != len(ref_vals)
    return out


def run(name, role, state):
    p = subprocess.run([sys.executable, __file__, "--worker", name, role, state], capture_output=True, text=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), cwd=ROOT)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode or not lines:
        return {"error": "\n".join((p.stderr.strip().splitlines() or ["no output"])[-6:])}
    return json.loads(lines[-1])


def main(names):
    print("| step | baseline | budget | predicted | measured | ops recomputed | bitwise equal |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            st = os.path.join(tmp, name)
            ref = run(name, "ref", st)
            if "error" in ref:
                print(f"| {name} | reference failed: {ref['error']} |", flush=True)
                continue
            json.dump(ref, open(st + ".json", "w"))
            r = run(name, "remat", st)
            if "error" in r:
                print(f"| {name} | tfremat failed: {r['error']} |", flush=True)
                continue
            eq = r["n_unequal"] == 0 and not r["shape_mismatch"]
            over = " **over**" if max(r["peaks"]) > r["budget"] else ""
            print(f"| {name} | {max(ref['peaks'])/MIB:.1f} | {r['budget']/MIB:.1f} ({r['kind']}) | {r['predicted']/MIB:.1f} "
                  f"| {max(r['peaks'])/MIB:.1f}{over} | {r['recomputed']} | "
                  f"{'yes' if eq else 'no (%d of %d, max %.1e)' % (r['n_unequal'], r['n_values'], r['max_abs_diff'])} |",
                  flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(*sys.argv[2:5])))
    else:
        main(sys.argv[1:] or NAMES)
