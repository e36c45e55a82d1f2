"""Planning time on the op-level graph of a real train step (issue #3's last target).

    python benchmarks/oplevel.py trace --out /tmp/resnet50_oplevel.json   # TensorFlow
    python benchmarks/oplevel.py plan /tmp/resnet50_oplevel.json           # no TensorFlow

``trace`` builds ``keras.applications.ResNet50(weights=None)`` (64x64x3 inputs, 10
classes, batch 32 by default) and a plain ``tf.function`` train step (forward,
``GradientTape`` gradients, Adam update), traces it with tfremat's own tracing
(``tfremat.trace.trace`` then ``tfremat.graph.build_graph``, what ``tfremat.remat``
does on a first call) and writes the planning graph as node-link JSON
(``tfremat.io.to_node_link``; graph attributes ``fixed_bytes`` and the timings). With
``--end-to-end`` it also times ``tfremat.remat(step, ...).get_plan(x, y)`` (trace,
graph, solve, rewrite, emit: a user's first-call planning latency) at each fraction.

``plan`` loads that file in a process without TensorFlow and times ``auto`` on it at
budgets ``ceil(f x reference peak)`` (fixed bytes included) or, with ``--of
activations``, ``fixed + ceil(f x (reference peak - fixed))``, printing one JSON line per
fraction, with the single-op bound and ``fixed_order_lower_bound`` (the proven floor
for plans that keep the traced order, as tfremat's rewriter does).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

FRACTIONS = (0.7, 0.6)


def budget_for(f: float, peak: int, fixed: int, of: str) -> int:
    """``ceil(f x peak)``, or with ``of="activations"`` ``fixed + ceil(f x (peak - fixed))``."""
    if of == "activations":
        return fixed + math.ceil(f * (peak - fixed))
    return math.ceil(f * peak)


def cmd_trace(args):
    t0 = time.perf_counter()
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_models import gradient_step  # the tests' train step
    from tfremat.graph import build_graph
    from tfremat.io import to_node_link
    from tfremat.simulate import reference_simulation
    from tfremat.trace import trace

    t_import = time.perf_counter() - t0
    keras.utils.set_random_seed(0)
    t = time.perf_counter()
    model = keras.applications.ResNet50(weights=None, input_shape=(args.size, args.size, 3),
                                        classes=10, classifier_activation=None)
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((args.batch, args.size, args.size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, (args.batch,)).astype("int32"))
    step = gradient_step(model, opt, loss_fn)

    t_model = time.perf_counter() - t
    t = time.perf_counter()
    traced = trace(step, (x, y))
    t_trace = time.perf_counter() - t
    t = time.perf_counter()
    sg = build_graph(traced.records, traced.arg_placeholders, traced.handle_bytes, traced.gradients)
    t_graph = time.perf_counter() - t
    g = sg.graph
    ref = reference_simulation(g, sg.fixed_bytes)
    data = to_node_link(g)
    # Keep JSON-serializable graph attributes only (the order, the loss name).
    data["graph"] = {k: v for k, v in data["graph"].items()
                     if isinstance(v, (str, int, float, list)) or v is None}
    data["graph"].update(
        name=f"ResNet50_b{args.batch}_{args.size}x{args.size}_oplevel",
        fixed_bytes=int(sg.fixed_bytes),
        timings_s={"import": t_import, "model": t_model, "trace": t_trace,
                   "build_graph": t_graph},
    )
    Path(args.out).write_text(json.dumps(data))
    info = {"nodes": g.number_of_nodes(), "edges": g.number_of_edges(),
            "recomputable": sum(1 for v in g if g.nodes[v]["recomputable"]),
            "fixed_bytes": sg.fixed_bytes, "reference_peak": ref.peak_bytes,
            "import_s": round(t_import, 2), "model_s": round(t_model, 2),
            "trace_s": round(t_trace, 2), "build_graph_s": round(t_graph, 2), "out": args.out}
    print(json.dumps(info), flush=True)
    if args.end_to_end:
        import tfremat

        for f in args.fractions:
            budget = budget_for(f, ref.peak_bytes, sg.fixed_bytes, args.of)
            fn = tfremat.remat(tf.function(step), budget_gib=budget / 2**30)
            t = time.perf_counter()
            try:
                plan = fn.get_plan(x, y)
                res = {"status": plan.status, "predicted_peak": plan.predicted_peak_bytes,
                       "extra_cost_fraction": plan.extra_cost_fraction,
                       "solve_s": plan.solve_s}
            except tfremat.InfeasibleBudgetError as e:
                res = {"status": "infeasible", "min_feasible": e.min_feasible_bytes}
            res.update(fraction=f, of=args.of, budget=budget, end_to_end_s=time.perf_counter() - t)
            print(json.dumps(res), flush=True)


def cmd_plan(args):
    from tfremat import InfeasibleBudgetError, Problem, solve
    from tfremat.io import load_graph
    from tfremat.simulate import reference_simulation, single_op_lower_bound
    from tfremat.solvers.bounds import fixed_order_lower_bound

    t = time.perf_counter()
    g = load_graph(args.graph)
    t_load = time.perf_counter() - t
    fixed = int(g.graph.get("fixed_bytes", 0))
    ref = reference_simulation(g, fixed)
    # Proven floor for plans that keep the traced order with the non-recomputable
    # (backward, update, stateful) ops run once: what tfremat's rewriter emits.
    floor = fixed_order_lower_bound(g, fixed)
    for f in args.fractions:
        budget = budget_for(f, ref.peak_bytes, fixed, args.of)
        t = time.perf_counter()
        try:
            plan = solve(Problem(g, budget, fixed), args.solver)
            res = {"status": plan.status, "peak": plan.predicted_peak_bytes,
                   "extra_cost_fraction": round(plan.extra_cost_fraction, 5),
                   "recomputed_ops": len(plan.recomputed)}
        except InfeasibleBudgetError as e:
            res = {"status": "infeasible", "min_feasible": e.min_feasible_bytes,
                   "min_feasible_fraction": round(e.min_feasible_bytes / ref.peak_bytes, 4)}
        res.update(graph=g.graph.get("name"), nodes=g.number_of_nodes(), fraction=f, of=args.of,
                   budget=budget, reference_peak=ref.peak_bytes, fixed_bytes=fixed,
                   single_op_bound=single_op_lower_bound(g, fixed), fixed_order_bound=floor,
                   load_s=round(t_load, 2), solve_s=round(time.perf_counter() - t, 2),
                   traced_s=g.graph.get("timings_s"))
        print(json.dumps(res), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace", help="trace a ResNet50 train step and save its planning graph")
    t.add_argument("--out", default="/tmp/resnet50_oplevel.json")
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--size", type=int, default=64)
    t.add_argument("--end-to-end", action="store_true",
                   help="also time tfremat.remat(...).get_plan at each fraction")
    t.add_argument("--fractions", type=float, nargs="*", default=list(FRACTIONS))
    t.add_argument("--of", choices=("peak", "activations"), default="peak",
                   help="fraction of the whole reference peak, or of its part above the "
                   "fixed bytes (variables, optimizer slots, inputs, constants)")
    t.set_defaults(func=cmd_trace)
    s = sub.add_parser("plan", help="time the solver on a saved graph (no TensorFlow)")
    s.add_argument("graph")
    s.add_argument("--solver", default="auto")
    s.add_argument("--fractions", type=float, nargs="*", default=list(FRACTIONS))
    s.add_argument("--of", choices=("peak", "activations"), default="peak")
    s.set_defaults(func=cmd_plan)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
