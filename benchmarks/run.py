"""End-to-end benchmark: measured peaks and step times of rewritten train steps.

For each model, one fresh process: the plain step's allocator peak and median step
time, then for each budget (a fraction of that peak) the plan's prediction, the
measured peak and the median step time, as a ratio to the plain step in the same
process. Prints a Markdown table.

    python benchmarks/run.py [--quick] [--repeats N]      # or: make bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

MODELS = {
    "mlp": dict(model=dict(layers=16, width=256), data=dict(batch=8192, width=256),
                label="MLP 16 x Dense(256), batch 8192"),
    "cnn": dict(model=dict(channels=32, blocks=8, size=32), data=dict(batch=64, size=32),
                label="ResNet-style CNN, 8 blocks x 32 ch, 32x32, batch 64"),
}
FRACTIONS = (0.8, 0.7, 0.6, 0.5)


def worker(kind: str, optimizer: str, fractions, repeats: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    import tensorflow as tf

    import tfremat
    from tf_models import make_data, make_step

    spec = MODELS[kind]
    x, y = make_data(kind, **spec["data"])
    _, step = make_step(kind, optimizer, **spec["model"])

    def measure(fn):
        peaks, times = [], []
        for _ in range(repeats + 1):
            tf.config.experimental.reset_memory_stats("CPU:0")
            t0 = time.perf_counter()
            float(fn(x, y))
            times.append(time.perf_counter() - t0)
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
        return max(peaks), statistics.median(times[1:])  # the first call traces

    base_peak, base_time = measure(step)
    rows = []
    for f in fractions:
        budget = f * base_peak
        row = dict(model=kind, optimizer=optimizer, fraction=f, baseline=base_peak, budget=budget)
        fn = tfremat.remat(step, budget_gib=budget / 2**30)
        t0 = time.perf_counter()
        try:
            plan = fn.get_plan(x, y)
        except tfremat.InfeasibleBudgetError as e:
            row.update(status="infeasible", min_feasible=e.min_feasible_bytes)
            rows.append(row)
            continue
        plan_s = time.perf_counter() - t0
        peak, t = measure(fn)
        row.update(status="ok", predicted=plan.predicted_peak_bytes, measured=peak,
                   time_ratio=t / base_time, extra=plan.extra_cost_fraction,
                   recomputed=len(plan.recomputed), plan_s=plan_s)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "OPTIMIZER"))
    ap.add_argument("--quick", action="store_true", help="SGD only, two budgets")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    fractions = (0.7, 0.5) if args.quick else FRACTIONS
    if args.worker:
        print(json.dumps(worker(*args.worker, fractions, args.repeats)))
        return 0
    optimizers = ("sgd",) if args.quick else ("sgd", "adam")
    print("| model | opt | baseline peak | budget | predicted | measured | fits | step time | extra compute (cost model) | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for kind in MODELS:
        for opt in optimizers:
            # The default CPU allocator reports its peak only with oneDNN on, which TF
            # turns on by itself only on CPUs with AVX-512 VNNI/BF16 or AMX.
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
            env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
            out = subprocess.run(
                [sys.executable, __file__, "--worker", kind, opt, "--repeats", str(args.repeats)]
                + (["--quick"] if args.quick else []),
                capture_output=True, text=True, env=env,
            )
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            for r in json.loads(out.stdout.strip().splitlines()[-1]):
                head = (f"| {kind} | {opt} | {r['baseline'] / MiB:.1f} MiB | {r['budget'] / MiB:.1f} MiB "
                        f"({100 * r['fraction']:.0f} %)")
                if r["status"] != "ok":
                    print(f"{head} | infeasible (needs {r['min_feasible'] / MiB:.1f} MiB) | | | | | |")
                    continue
                fits = r["measured"] <= r["budget"]
                bad += not fits
                print(f"{head} | {r['predicted'] / MiB:.1f} MiB | {r['measured'] / MiB:.1f} MiB | "
                      f"{'yes' if fits else 'NO'} | {r['time_ratio']:.2f} x | {100 * r['extra']:.1f} % | "
                      f"{r['plan_s']:.1f} |")
    print()
    for kind, spec in MODELS.items():
        print(f"- {kind}: {spec['label']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
