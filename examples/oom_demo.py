"""tfremat demo: a train step that hits the real OOM under an allocator cap, then fits.

Runs each part in a fresh Python process, because the CPU allocator cap
(TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=N) is read when
TensorFlow starts. oneDNN is turned off in the capped processes
(TF_ENABLE_ONEDNN_OPTS=0): with it on, an OOM under a capped allocator often
crashes the process (segfault) instead of raising ResourceExhaustedError.

    python examples/oom_demo.py            # or: make demo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 2**20
LAYERS, WIDTH, BATCH, STEPS = 16, 256, 8192, 3


def build():
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inp = keras.Input((WIDTH,))
    h = inp
    for _ in range(LAYERS):
        h = keras.layers.Dense(WIDTH, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    opt = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x = tf.random.stateless_normal((BATCH, WIDTH), seed=(1, 0))
    y = tf.random.stateless_uniform((BATCH,), seed=(1, 1), minval=0, maxval=10, dtype=tf.int32)
    return train_step, x, y


def peak_of(fn, *args):
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats("CPU:0")
    t0 = time.perf_counter()
    out = fn(*args)
    float(out)  # wait for the result
    dt = time.perf_counter() - t0
    return tf.config.experimental.get_memory_info("CPU:0")["peak"], dt, float(out)


def worker(mode: str, budget_gib: float | None) -> dict:
    import tfremat

    step, x, y = build()
    result: dict = {"mode": mode}
    if mode == "measure":
        # Uncapped: baseline peak, plan, and the step-time ratio in one process.
        peaks, times = [], []
        for _ in range(STEPS + 1):
            p, dt, _ = peak_of(step, x, y)
            peaks.append(p)
            times.append(dt)
        fast = tfremat.remat(step, budget_gib=budget_gib)
        plan = fast.get_plan(x, y)
        rpeaks, rtimes = [], []
        for _ in range(STEPS + 1):
            p, dt, _ = peak_of(fast, x, y)
            rpeaks.append(p)
            rtimes.append(dt)
        result.update(
            baseline_peak=max(peaks),
            predicted=plan.expected_peak_bytes,
            predicted_baseline=plan.baseline_peak_bytes,
            measured=max(rpeaks),
            recomputed=len(plan.recomputed),
            extra_cost=plan.extra_cost_fraction,
            time_ratio=statistics.median(rtimes[1:]) / statistics.median(times[1:]),
        )
        return result
    fn = step if mode == "plain" else tfremat.remat(step, budget_gib=budget_gib)
    losses = []
    for _ in range(STEPS):
        losses.append(float(fn(x, y)))
    result["losses"] = losses
    return result


def run(mode: str, budget_gib: float | None, cap_mib: int | None) -> tuple[int, str, dict]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
    if cap_mib is not None:
        env.update(TF_CPU_BFC_MEM_LIMIT_IN_MB=str(cap_mib), TF_ENABLE_ONEDNN_OPTS="0")
    cmd = [sys.executable, __file__, "--worker", mode]
    if budget_gib is not None:
        cmd += ["--budget-gib", repr(budget_gib)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if out.returncode == 0 and lines else {}
    return out.returncode, out.stdout + out.stderr, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["measure", "plain", "remat"])
    ap.add_argument("--budget-gib", type=float)
    ap.add_argument("--cap-fraction", type=float, default=0.6,
                    help="allocator cap as a fraction of the plain step's peak (default 0.6)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.budget_gib)))
        return 0

    print(f"Model: {LAYERS} x Dense({WIDTH}, relu), batch {BATCH}, SGD; {STEPS} train steps.\n")
    # 1. Uncapped: how much does the plain step need?
    code, out, r = run("measure", 1e3, None)
    if code:
        print(out)
        return code
    base = r["baseline_peak"]
    cap = int(args.cap_fraction * base / MiB)
    budget_gib = 0.9 * cap / 1024  # leave the allocator room for fragmentation
    print(f"plain step, uncapped: allocator peak {base / MiB:.1f} MiB")
    print(f"cap the allocator at {cap} MiB ({100 * args.cap_fraction:.0f} %); tfremat budget {budget_gib * 1024:.1f} MiB\n")

    # 2. The plain step under the cap: the real OOM.
    code, out, _ = run("plain", None, cap)
    oom = [line for line in out.splitlines() if "OOM when allocating" in line]
    oom += [line for line in out.splitlines() if "ResourceExhaustedError" in line]
    if code == 0:
        print("plain step under the cap: it fit (raise the model size to see the OOM)")
    else:
        print("plain step under the cap: FAILED as expected")
        print("   " + (oom[0].strip()[:200] if oom else out.strip().splitlines()[-1][:200]))

    # 3. The same step, decorated, under the same cap.
    code, out, r = run("remat", budget_gib, cap)
    if code:
        print("tfremat step under the cap: FAILED\n" + out[-2000:])
        return 1
    losses = r["losses"]
    print(f"tfremat step under the cap: trained {len(losses)} steps, losses {[round(v, 6) for v in losses]}")

    # 4. Numbers, measured uncapped in one process.
    code, out, r = run("measure", budget_gib, None)
    if code:
        print(out)
        return code
    print("\n| baseline peak | budget | predicted | measured | recomputed ops | extra compute (cost model) | step time |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {r['baseline_peak'] / MiB:.1f} MiB | {budget_gib * 1024:.1f} MiB | {r['predicted'] / MiB:.1f} MiB "
        f"| {r['measured'] / MiB:.1f} MiB | {r['recomputed']} | {100 * r['extra_cost']:.1f} % "
        f"| {r['time_ratio']:.2f} x |"
    )
    ok = r["measured"] <= budget_gib * 2**30
    print("\nmeasured peak within budget:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
