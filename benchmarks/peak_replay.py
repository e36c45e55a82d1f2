"""Why a step measured more than predicted: the allocator's live set at its peak.

    python benchmarks/peak_replay.py NAME MIB [--calls N]

A debugging aid (sessions 12-36 found the pool model's and the planning graph's gaps
with it; docs/design.md, "The allocator's chunks"). Builds the Keras model ``NAME`` of
``tests/test_models.py`` or ``benchmarks/keras_sweep.py``, puts it under
``tfremat.keras.remat`` at ``MIB`` (``fuzz:FAMILY:K``: model ``K`` of
``benchmarks/keras_fuzz.py``'s family; ``steps:K``: step ``K`` of
``benchmarks/steps_fuzz.py`` under ``tfremat.remat``), trains ``N`` steps (default 2), then profiles one
more step and prints:

- the allocations live at the measured peak (TensorFlow's profiler events
  ``MemoryAllocation``/``MemoryDeallocation``: op, requested bytes, chunk bytes);
- the same events replayed in their measured order through
  :class:`tfremat.allocator.BFCPool` from an empty pool and from one holding what was
  in use before the call (the chunks the model gives the real order: where this
  matches the measured peak, the pool rules hold and the gap is in the order or the
  graph);
- the simulator's live set at the plan's own peak (bytes of 256 KiB and more).
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

MIB = 2**20
SHOWN = 256 * 1024  # smaller buffers are left out of the listings


def profile_events(call) -> list[tuple[str, dict]]:
    """``call()`` under TensorFlow's profiler: its allocator events in time order."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
        try:
            call()
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        with open(sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))[-1], "rb") as f:
            space.ParseFromString(f.read())
    rows = []
    for plane in space.planes:
        names, stats = plane.event_metadata, plane.stat_metadata
        for line in plane.lines:
            for ev in line.events:
                kind = names[ev.metadata_id].name
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                st = {}
                for s in ev.stats:
                    ref = stats[s.ref_value].name if s.ref_value else None
                    st[stats[s.metadata_id].name] = s.str_value or ref or s.int64_value or s.uint64_value
                rows.append((line.timestamp_ns * 1000 + ev.offset_ps, kind, st))
    rows.sort(key=lambda r: r[0])
    return [(kind, st) for _, kind, st in rows]


def live_at_peak(events):
    """(peak bytes, index of the event reaching it, {addr: allocation stats} live there)."""
    live, best = {}, (0, -1, {})
    for i, (kind, st) in enumerate(events):
        if kind == "MemoryAllocation":
            live[st["addr"]] = dict(st, index=i)
        else:
            live.pop(st["addr"], None)
        if st["bytes_allocated"] > best[0]:
            best = (st["bytes_allocated"], i, dict(live))
    return best


def replay(events, before: int, smallest: int) -> int:
    """The pool model's peak for the measured order: requests of ``smallest`` bytes and
    more pooled, after one buffer of ``before`` bytes (0: none)."""
    from tfremat.allocator import BFCPool

    pool, handles = BFCPool(), {}
    if before:
        pool.allocate(before)
    peak = pool.in_use
    for kind, st in events:
        if kind == "MemoryAllocation":
            if st["requested_bytes"] >= smallest:
                handles[st["addr"]] = pool.allocate(st["requested_bytes"])
        elif st["addr"] in handles:
            pool.free(handles.pop(st["addr"]))
        peak = max(peak, pool.in_use)
    return peak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("mib", type=float)
    ap.add_argument("--calls", type=int, default=2, help="steps before the profiled one")
    ap.add_argument("--profiled", type=int, default=1,
                    help="profile this many steps and show the one with the highest peak")
    args = ap.parse_args(argv)

    import keras
    import keras_sweep  # noqa: F401  (adds the sweep's models to test_models')
    import tensorflow as tf
    import test_models as tm

    import tfremat
    import tfremat.keras
    from tfremat.simulate import buffer_lifetimes, simulate

    tf.config.experimental.enable_op_determinism()
    if args.name.startswith("steps:"):
        import steps_fuzz

        step, data, _ = steps_fuzz.case(int(args.name.split(":")[1]))
        fn = tfremat.remat(tf.function(step), budget_gib=args.mib / 1024)
        fn.get_plan(*data[0])
        call, get_plan = (lambda: fn(*data[0])), (lambda: fn.get_plan(*data[0]))
    elif args.name.startswith("fuzz:"):
        import random

        import keras_fuzz

        _, family, k = args.name.split(":")
        spec = keras_fuzz.draw(random.Random(7919 * int(k) + len(family)), family)
        x, y, sw = keras_fuzz.data(spec)
        extra = {} if sw is None else {"sample_weight": sw}
        model = keras_fuzz.build(spec)  # compiled
    else:
        batch, shape = tm.MODELS[args.name]
        x, y, extra = tm._data(args.name, batch, shape)
        keras.utils.set_random_seed(0)
        model = tm._builders()[args.name]()
        model.compile(**tm._compile_kwargs(args.name))
    if not args.name.startswith("steps:"):
        tfremat.keras.remat(model, budget_gib=args.mib / 1024)
        if args.name.startswith("fuzz:"):  # planned before the first call, as keras_fuzz.py does
            tfremat.keras.get_plan(model, x, y, **extra)
        call = lambda: model.train_on_batch(x, y, **extra)  # noqa: E731
        get_plan = lambda: tfremat.keras.get_plan(model, x, y, **extra)  # noqa: E731
    for i in range(args.calls):
        tf.config.experimental.reset_memory_stats("CPU:0")
        call()
        print(f"call {i}: {tf.config.experimental.get_memory_info('CPU:0')['peak'] / MIB:.2f} MiB")
    plan = get_plan()
    print(f"plan: tensors {plan.predicted_peak_bytes / MIB:.2f}, chunks checked "
          f"{(plan.allocator_peak_bytes or 0) / MIB:.2f}, expected {plan.expected_peak_bytes / MIB:.2f}, "
          f"fixed {plan.fixed_bytes / MIB:.2f} MiB; {len(plan.recomputed)} ops recomputed")

    worst = None
    for _ in range(args.profiled):  # the executor's order varies from call to call
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        events = profile_events(call)
        measured = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        print(f"profiled: {measured / MIB:.2f} MiB")
        if worst is None or measured > worst[2]:
            worst = (before, events, measured)
    before, events, measured = worst
    peak, at, live = live_at_peak(events)
    print(f"\nprofiled call: {measured / MIB:.2f} MiB ({before / MIB:.2f} in use before it); "
          f"peak at event {at} of {len(events)}, live there:")
    requested = chunks = 0
    for st in sorted(live.values(), key=lambda s: s["index"]):
        requested += st.get("requested_bytes") or 0
        chunks += st.get("allocation_bytes") or 0
        if (st.get("allocation_bytes") or 0) >= SHOWN:
            print(f"  {st['index']:6d} {str(st.get('tf_op'))[:72]:72s} {st['requested_bytes'] / MIB:7.2f} "
                  f"{st['allocation_bytes'] / MIB:7.2f} {st.get('shape')}")
    print(f"  this call's buffers: {requested / MIB:.2f} MiB requested, {chunks / MIB:.2f} in chunks")
    smallest = 256 * 1024 if "mklcpu" in {st.get("allocator_name") for _, st in events} else 0
    for pre in (0, before):
        print(f"pool model on the measured order, {pre / MIB:.2f} MiB pooled before: "
              f"{(replay(events, pre, smallest) + before - pre) / MIB:.2f} MiB")

    entry = next(iter([o for o in gc.get_objects() if isinstance(o, tfremat.api.RematFunction)][-1]._cache.values()))
    g = entry.step_graph.graph  # the plan's schedule is in its ops (no scratch nodes)
    schedule = list(entry.plan.schedule)
    sizes, last, _ = buffer_lifetimes(g, schedule)
    sim = simulate(g, schedule, plan.fixed_bytes)
    pos = sim.peak_position
    print(f"\nsimulator: {sim.peak_bytes / MIB:.2f} MiB at position {pos} ({schedule[pos]}), live there:")
    for j in range(pos + 1):
        if last[j] >= pos and sizes[j] >= SHOWN:
            print(f"  {j:6d} {str(schedule[j])[:72]:72s} {sizes[j] / MIB:7.2f}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
