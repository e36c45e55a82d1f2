"""Real Keras models: peak, prediction, step time, and the largest batch under a cap.

    python benchmarks/models.py --models cnn transformer mobilenetv2 \
        --cap-models cnn transformer --cap-mb 256 --out docs/models-benchmark.md

Part 1, per model (CPU, op determinism, Adam; Keras' step and tfremat's each in a
fresh process): batch, Keras' measured baseline peak, the fixed memory of tfremat's
plan (weights, optimizer slots, inputs, constants), the budget (60 % of it, or the solver's minimum + 10 % when 60 %
is infeasible), tfremat's predicted and measured peak, and the step-time ratio
(rewritten / original: the median of 15 interleaved rounds in one process, with the
lowest and highest round; see ``worker_time``).

Part 2, per model in ``--cap-models``: the largest batch that trains 2 steps under a hard
CPU allocator cap (``TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=N
TF_ENABLE_ONEDNN_OPTS=0``; with oneDNN on an OOM under the cap can segfault instead of
raising) for: Keras' own step, ``keras.RematScope`` in modes ``full`` and
``activations`` (best reported), and tfremat with a budget of 90 % of the cap.
``tf.recompute_grad`` per block does not apply to these models as they are: it re-runs
a block's Python function in the backward pass, and their blocks hold state that the
re-run would change (BatchNorm's moving-average assigns would run twice; Keras' dropout
draws its seed from a SeedGenerator variable that the first run advanced, so the re-run
draws a different mask and the gradient is wrong without an error). RematScope is
Keras' per-layer wrapper of the same mechanism; its ``full`` mode fails in a compiled
graph-mode train step (Keras 3.15: "The custom_gradient decorator currently supports
keywords arguments only when eager execution is enabled"), reported as batch 0.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_models import MODELS  # noqa: E402  (name -> (batch, input shape), as the tests use)

# "cnn" is the tests' cnn_fp16 model in float32 (see _make).
SHAPES = {"cnn": MODELS["cnn_fp16"], **MODELS}


def _setup():
    import keras
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    return keras, tf


def _make(name, scope_mode=None):
    keras, _ = _setup()
    from test_models import _builders  # the same models the tests check

    builders = _builders()
    builders["cnn"] = builders["cnn_fp16"]
    keras.utils.set_random_seed(0)
    if name.endswith("fp16"):
        keras.mixed_precision.set_global_policy("mixed_float16")
    if scope_mode:
        with keras.RematScope(mode=scope_mode):
            model = builders[name]()
    else:
        model = builders[name]()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data(name, batch):
    import numpy as np
    import tensorflow as tf

    shape = SHAPES[name][1]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch,) + shape).astype("float32"))
    y = tf.constant(rng.integers(0, 10, (batch,)).astype("int32"))
    return x, y


def worker_table(name: str, role: str, baseline: int = 0, fraction: float = 0.6, steps: int = 8) -> dict:
    """One side of a table row, in a process of its own.

    ``role="reference"``: Keras' own step (baseline peak). ``"remat"``:
    tfremat at ``fraction`` of ``baseline``. Separate processes, because the
    allocator's ``current`` counts everything in the process and tfremat plans around
    what it finds there (a reference model's leftovers would shrink its room).
    """
    keras, tf = _setup()
    import tfremat
    import tfremat.keras

    batch = SHAPES[name][0]
    x, y = _data(name, batch)

    def train(model):
        peaks = []
        for _ in range(steps):
            tf.config.experimental.reset_memory_stats("CPU:0")
            model.train_on_batch(x, y)
            peaks.append(int(tf.config.experimental.get_memory_info("CPU:0")["peak"]))
        return peaks

    if role == "reference":
        return dict(baseline=max(train(_make(name))))
    model = _make(name)
    budget = fraction * baseline
    tfremat.keras.remat(model, budget_gib=budget / 2**30)
    at_fraction = True
    try:
        plan = tfremat.keras.get_plan(model, x, y)
    except tfremat.InfeasibleBudgetError as e:
        at_fraction = False
        budget = 1.1 * e.min_feasible_bytes
        tfremat.keras.remat(model, budget_gib=budget / 2**30)
        plan = tfremat.keras.get_plan(model, x, y)
    peaks = train(model)
    plan = tfremat.keras.get_plan(model, x, y)  # the plan the later steps ran
    return dict(
        name=name, batch=batch, baseline=baseline, budget=budget, at_fraction=at_fraction,
        predicted=plan.predicted_peak_bytes, chunks=plan.allocator_peak_bytes,  # None: not checked that way
        expected=plan.expected_peak_bytes,
        first=peaks[0], measured=max(peaks[1:]), last=max(peaks[-3:]),
        over=sum(p > budget for p in peaks),
        recomputed=len(plan.recomputed), fixed=plan.fixed_bytes,
    )


def worker_time(name: str, budget: int, rounds: int = 15) -> dict:
    """Step-time ratio with both steps in one process, interleaved: Keras' step and
    tfremat's at ``budget`` (bytes), one after the other, ``rounds`` times; the median
    of the per-round ratios.

    Timed in separate processes, single runs of the same two steps gave ratios from
    1.04 to 2.39 (the Transformer, 2 cores): the machine's speed drifts between
    processes. Interleaving sees the same drift on both sides. tfremat's model plans
    and runs its checked first calls before the reference model exists, then its plan
    is frozen (no per-call re-plan: the reference model's memory would count as the
    step's), so the timed plan is the one the memory columns measured.
    """
    keras, tf = _setup()
    import tfremat.api
    import tfremat.keras

    x, y = _data(name, SHAPES[name][0])
    model = _make(name)
    tfremat.keras.remat(model, budget_gib=budget / 2**30)
    for _ in range(3):
        model.train_on_batch(x, y)
    for entry in tfremat.keras._step_for(model)._cache.values():
        entry.calibrations = tfremat.api._MAX_CALIBRATIONS  # freeze the plan
    ref = _make(name)
    for _ in range(2):
        ref.train_on_batch(x, y)
    ratios = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ref.train_on_batch(x, y)
        t1 = time.perf_counter()
        model.train_on_batch(x, y)
        ratios.append((time.perf_counter() - t1) / (t1 - t0))
    return dict(ratio=statistics.median(ratios), low=min(ratios), high=max(ratios))


def worker_probe(name: str, method: str, batch: int, cap_mb: int) -> None:
    """Exit 0 if two train steps run under the cap, 3 on OOM / infeasible budget."""
    keras, tf = _setup()
    import tfremat
    import tfremat.keras

    x, y = _data(name, batch)
    try:
        if method.startswith("rematscope:"):
            model = _make(name, scope_mode=method.split(":", 1)[1])
        else:
            model = _make(name)
        if method.startswith("tfremat"):
            # "tfremat:F": a budget of F x the cap
            fraction = float(method.split(":", 1)[1]) if ":" in method else 0.9
            tfremat.keras.remat(model, budget_gib=fraction * cap_mb / 1024)
        for _ in range(2):
            model.train_on_batch(x, y)
    except (tf.errors.ResourceExhaustedError, tfremat.InfeasibleBudgetError, MemoryError) as e:
        # which of the two failures it was, for a person reading the probe's stderr
        print(f"probe failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        sys.exit(3)


def _bfc_env(limit_mb: int, onednn: bool = False) -> dict:
    """A process whose CPU allocator is BFC with ``limit_mb``: every allocation counted.

    oneDNN is off by default: under a cap it often turns the OOM into a segfault.
    """
    return dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="3",
        TF_CPU_ALLOCATOR_USE_BFC="true",
        TF_CPU_BFC_MEM_LIMIT_IN_MB=str(limit_mb),
        TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0",
    )


def probe(name, method, batch, cap_mb) -> bool:
    try:
        r = subprocess.run(
            [sys.executable, __file__, "--probe", name, method, str(batch), str(cap_mb)],
            env=_bfc_env(cap_mb), capture_output=True, text=True, timeout=900,
        )
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def worker_scale(name: str, batches=(8, 16)) -> list:
    """Keras' own step's peak at two batch sizes (BFC, no cap): where to start a search."""
    keras, tf = _setup()
    model = _make(name)
    peaks = []
    for b in batches:
        x, y = _data(name, b)
        model.train_on_batch(x, y)  # slots and the traced step exist before measuring
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.train_on_batch(x, y)
        peaks.append(int(tf.config.experimental.get_memory_info("CPU:0")["peak"]))
    return peaks


def guess_batch(name, cap_mb, batches=(8, 16), step=8) -> int:
    """The batch at which Keras' step would reach the cap, from a straight line through
    its peaks at two small batches (peak = fixed + per-sample bytes x batch)."""
    r = subprocess.run([sys.executable, __file__, "--scale-worker", name], env=_bfc_env(16384),
                       capture_output=True, text=True)
    rows = [l for l in r.stdout.splitlines() if l.startswith("[")]
    if not rows:
        return 16
    (b0, b1), (p0, p1) = batches, json.loads(rows[-1])
    per_sample = max((p1 - p0) / (b1 - b0), 1.0)
    b = (cap_mb * 2**20 - (p0 - per_sample * b0)) / per_sample
    return max(step, int(b) // step * step)


def largest_batch(name, method, cap_mb, start=16, grow=2.0, step=8, rel=0.04, limit=8192, tried=None) -> int:
    """Largest multiple of ``step`` that trains under the cap, to within ``rel`` of it.

    Starts at ``start`` (a guess: the line through Keras' small-batch peaks, or the
    result of a method known to need more memory), grows or shrinks it by ``grow`` to
    bracket the answer, then bisects until the bracket is narrower than ``max(step, rel x batch)``.
    A method that fails at ``step`` itself (``RematScope`` full in graph mode) is 0.
    Each batch tried is appended to ``tried`` (one process each).
    """
    tried = [] if tried is None else tried

    def fits(batch):
        tried.append(batch)
        return probe(name, method, batch, cap_mb)

    start = max(step, start // step * step)

    def up(b):
        return max(b + step, int(b * grow) // step * step)

    def down(b):
        return max(step, int(b / grow) // step * step)

    if fits(start):
        ok, bad = start, None
        while bad is None:
            if up(ok) > limit:
                return ok
            if fits(up(ok)):
                ok = up(ok)
            else:
                bad = up(ok)
    else:
        if start == step or not fits(step):
            return 0
        ok, bad = step, start
        while down(bad) > ok:
            if fits(down(bad)):
                ok = down(bad)
                break
            bad = down(bad)
    while bad - ok > max(step, rel * ok):
        mid = (ok + bad) // 2 // step * step
        if mid <= ok:
            break
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["cnn", "transformer", "mobilenetv2"])
    ap.add_argument("--cap-models", nargs="*", default=["cnn", "transformer"])
    ap.add_argument("--cap-mb", type=int, default=256)
    ap.add_argument("--cap", nargs="*", default=[], metavar="MODEL=MB",
                    help="a cap for one model (the keras.applications models need more than --cap-mb "
                         "for their weights and Adam slots)")
    ap.add_argument("--budget-of-cap", type=float, default=0.9,
                    help="tfremat's budget in part 2, as a fraction of the cap (default 0.9: BFC's "
                         "fragmentation and Eigen's scratch buffers under a hard cap are not modelled)")
    ap.add_argument("--allocator", choices=["default", "bfc"], default="default",
                    help="part 1's CPU allocator: TF's default (its statistics leave out allocations "
                         "under 256 KiB) or BFC with no practical limit (counts every allocation)")
    ap.add_argument("--onednn", choices=["on", "off"], default="on",
                    help="part 1 with oneDNN's kernels (set for every CPU; TF's own default only "
                         "with AVX-512 VNNI/BF16 or AMX) or Eigen's (off; only with --allocator bfc: "
                         "the default allocator reports nothing without oneDNN)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--table-worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--scale-worker", nargs=1, help=argparse.SUPPRESS)
    ap.add_argument("--time-worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe:
        name, method, batch, cap = a.probe
        worker_probe(name, method, int(batch), int(cap))
        return
    if a.table_worker:
        name, role, baseline = a.table_worker
        print(json.dumps(worker_table(name, role, int(baseline))))
        return
    if a.scale_worker:
        print(json.dumps(worker_scale(a.scale_worker[0])))
        return
    if a.time_worker:
        print(json.dumps(worker_time(a.time_worker[0], int(float(a.time_worker[1])))))
        return
    caps = {m: int(mb) for m, mb in (c.split("=", 1) for c in a.cap)}

    mib = 2**20
    lines = [
        "# Real Keras models: measured (CPU, 2 cores)",
        "",
        "Command: `python benchmarks/models.py " + " ".join(sys.argv[1:]) + "`",
        "",
        f"Allocator: {a.allocator}" + (f" (TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=16384 "
                                       f"TF_ENABLE_ONEDNN_OPTS={int(a.onednn == 'on')}: every allocation counted)"
                                       if a.allocator == "bfc"
                                       else " (its statistics leave out allocations under 256 KiB)"),
        "",
        "Measured: the highest peak of steps 2-8; the first call's is its own column; last 3: the",
        "highest of steps 6-8; over: calls over the budget of 8 (a call measured over the budget",
        "re-plans with that much more room, at most twice).",
        "",
        "| model | batch | baseline peak MiB | fixed MiB | budget MiB | predicted MiB | predicted chunks MiB | expected MiB | first call MiB | measured MiB | last 3 MiB | over | predicted / measured | chunks / measured | expected / measured | step-time ratio | recomputed ops |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    def run_worker(*args, kind="--table-worker"):
        env = (_bfc_env(16384, onednn=a.onednn == "on") if a.allocator == "bfc"
               else dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS=str(int(a.onednn == "on"))))
        r = subprocess.run([sys.executable, __file__, kind, *map(str, args)], env=env, capture_output=True, text=True)
        rows = [l for l in r.stdout.splitlines() if l.startswith("{")]
        if not rows:
            raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else str(r.returncode))
        return json.loads(rows[-1])

    def chunks(value, by, fmt):  # the allocator model's prediction, if the plan has one
        return "n/a" if value is None else format(value / by, fmt)

    for name in a.models:
        try:
            ref = run_worker(name, "reference", 0)
            d = run_worker(name, "remat", ref["baseline"])
            t = run_worker(name, d["budget"], kind="--time-worker")
        except RuntimeError as e:
            lines.append(f"| {name} | failed: {e} |")
            print(lines[-1], flush=True)
            continue
        budget_note = "60 %" if d["at_fraction"] else "min+10 %"
        lines.append(
            f"| {name} | {d['batch']} | {d['baseline'] / mib:.1f} | {d['fixed'] / mib:.1f} | "
            f"{d['budget'] / mib:.1f} ({budget_note}) | "
            f"{d['predicted'] / mib:.1f} | {chunks(d['chunks'], mib, '.1f')} | {d['expected'] / mib:.1f} | {d['first'] / mib:.1f} | "
            f"{d['measured'] / mib:.1f} | {d['last'] / mib:.1f} | {d['over']} | {d['predicted'] / d['measured']:.2f} | "
            f"{chunks(d['chunks'], d['measured'], '.2f')} | {d['expected'] / d['measured']:.2f} | "
            f"{t['ratio']:.2f} ({t['low']:.2f}-{t['high']:.2f}) | {d['recomputed']} |"
        )
        print(lines[-1], flush=True)
    if a.cap_models:
        lines += [
            "",
            "Largest batch (multiple of 8, to within 4 %) that trains 2 steps under a CPU allocator cap:",
            "",
            f"| model | cap MiB | no remat | RematScope full | RematScope activations | tfremat (budget {a.budget_of_cap:g} x cap) | tfremat / no remat | probes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in a.cap_models:
            cap = caps.get(name, a.cap_mb)
            tried: list = []
            res = {"none": largest_batch(name, "none", cap, start=guess_batch(name, cap), grow=1.25, tried=tried)}
            tf_method = f"tfremat:{a.budget_of_cap}"
            for m in ("rematscope:full", "rematscope:activations", tf_method):
                res[m] = largest_batch(name, m, cap, start=max(res["none"], 8), tried=tried)
            res["tfremat"] = res[tf_method]
            ratio = res["tfremat"] / res["none"] if res["none"] else float("inf")
            lines.append(
                f"| {name} | {cap} | {res['none']} | {res['rematscope:full']} | {res['rematscope:activations']} | "
                f"{res['tfremat']} | {ratio:.2f} | {len(tried)} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
