"""Command line: ``python -m tfremat solve GRAPH.json --budget-fraction 0.8``.

Subcommands are registered in :func:`build_parser`; each sets ``func`` to a callable
taking the parsed arguments and returning an exit status, so more can be added
without touching the others.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from typing import Sequence

__all__ = ["build_parser", "main"]

EXIT_INFEASIBLE = 3


class _Progress:
    """Prints elapsed time to stderr every ``every`` seconds while a solve runs."""

    def __init__(self, label: str, every: float = 2.0, stream=None):
        self.label, self.every = label, every
        self.stream = stream if stream is not None else sys.stderr
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # Silent for quick solves; a line every few seconds for the long ones.
        while not self._stop.wait(self.every):
            print(f"  {self.label}: {time.perf_counter() - self._t0:.0f} s ...",
                  file=self.stream, flush=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _cmd_solve(args: argparse.Namespace) -> int:
    from .errors import InfeasibleBudgetError, RematError
    from .io import load_graph
    from .plan import Problem
    from .simulate import reference_simulation, simulate, single_op_lower_bound
    from .solvers import SOLVERS, solve

    if args.solver not in SOLVERS:
        print(f"error: unknown solver {args.solver!r}; choose one of: {', '.join(SOLVERS)}",
              file=sys.stderr)
        return 2
    try:
        g = load_graph(args.graph)
    except (OSError, ValueError) as e:
        print(f"error: cannot read graph {args.graph!r}: {e}", file=sys.stderr)
        return 2
    ref = reference_simulation(g)
    if args.budget_bytes is not None:
        budget = int(args.budget_bytes)
    else:
        if not args.budget_fraction > 0:
            print("error: --budget-fraction must be > 0", file=sys.stderr)
            return 2
        budget = int(math.ceil(args.budget_fraction * ref.peak_bytes))
    name = os.path.basename(args.graph)
    peak_lb = single_op_lower_bound(g)
    of_ref = f" ({budget / ref.peak_bytes:.3f} x reference)" if ref.peak_bytes else ""
    print(f"{name}: {g.number_of_nodes()} nodes, {g.number_of_edges()} edges; reference "
          f"peak {ref.peak_bytes}, cost {ref.cost:g}; budget {budget}"
          f"{of_ref}; single-op lower bound {peak_lb}")
    problem = Problem(g, budget, 0, args.time_limit)
    t0 = time.perf_counter()
    out: dict = {"graph": name, "budget": budget, "solver": args.solver}
    try:
        with _Progress(f"solving with {args.solver!r}"):
            plan = solve(problem, args.solver)
    except InfeasibleBudgetError as e:
        out.update(status="infeasible", cost=None, peak=None, lower_bound=ref.cost,
                   solve_s=time.perf_counter() - t0, schedule=None,
                   min_feasible_bytes=e.min_feasible_bytes, peak_lower_bound=peak_lb)
        # The library's message speaks of budget_gib and batch sizes; here of bytes.
        print(f"infeasible: budget {budget} bytes is too small: the smallest budget "
              f"{args.solver!r} can meet is {e.min_feasible_bytes} bytes (single-op lower "
              f"bound {peak_lb}). Rerun with --budget-bytes {e.min_feasible_bytes} or more, "
              "or another --solver", file=sys.stderr)
        _write_json(args.json, out)
        return EXIT_INFEASIBLE
    except RematError as e:  # e.g. SolverUnavailableError: the message says what to install
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The README's accounting, recomputed here from the schedule alone.
    sim = simulate(g, plan.schedule)
    lower = plan.cost_lower_bound if plan.cost_lower_bound is not None else ref.cost
    out.update(status=plan.status, cost=sim.cost, peak=sim.peak_bytes, lower_bound=lower,
               solve_s=plan.solve_s, schedule=list(plan.schedule),
               reference_cost=ref.cost, reference_peak=ref.peak_bytes,
               peak_lower_bound=peak_lb)
    extra = (sim.cost - ref.cost) / ref.cost if ref.cost else 0.0
    of_budget = f" ({sim.peak_bytes / budget:.3f} x budget)" if budget else ""
    print(f"{plan.solver}: {plan.status}; peak {sim.peak_bytes}"
          f"{of_budget}; cost {sim.cost:g} (+{100 * extra:.2f}% "
          f"over every node once); {len(plan.recomputed)} nodes recomputed, "
          f"{len(plan.schedule) - g.number_of_nodes()} extra ops; lower bound {lower:g}; "
          f"{plan.solve_s:.2f} s")
    _write_json(args.json, out)
    return 0


def _write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f)
        print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    """The ``tfremat`` argument parser with all subcommands."""
    p = argparse.ArgumentParser(prog="tfremat", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "solve",
        help="plan rematerialization for a node-link graph file under a memory budget",
        description="Solve a graph file in the format of shared/benchmarks/checkmate-graphs.",
    )
    s.add_argument("graph", help="node-link JSON graph file")
    b = s.add_mutually_exclusive_group(required=True)
    b.add_argument("--budget-bytes", type=int, help="memory budget in bytes")
    b.add_argument("--budget-fraction", type=float,
                   help="budget = ceil(F x peak of the graph's reference order)")
    s.add_argument("--solver", default="auto", help="registered solver name (default: auto)")
    s.add_argument("--time-limit", type=float, default=None, help="solver time limit, seconds")
    s.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    s.set_defaults(func=_cmd_solve)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tfremat`` and the ``tfremat`` script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
