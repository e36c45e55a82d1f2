"""Benchmark every registered solver on the Checkmate/Moccasin graphs.

Usage (from the repository root)::

    python benchmarks/solvers.py run [--graphs SUBSTR ...] [--exact-time-limit S]
    python benchmarks/solvers.py report > docs/solver-benchmarks-table.md
    python benchmarks/solvers.py curves          # docs/solver-curves.png

``run`` solves every graph of ``../shared/benchmarks/checkmate-graphs`` at budget
fractions 0.9, 0.8, 0.7, 0.6 (budget = ceil(f x reference peak)) with every solver
in ``tfremat.SOLVERS`` and stores one JSON per graph under ``benchmarks/results/``
(so runs can be split across processes). ``report`` prints the markdown tables:
cost relative to checkpoint-all's (every node once), peak/budget, status and solve
seconds, the default's extra cost against the best known extra from the graphs'
README, and the smallest budget the default meets against the proven lower bound.
Skips with a message when the shared graphs are absent.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfremat import InfeasibleBudgetError, Problem, RematError, solve  # noqa: E402
from tfremat.io import load_graph  # noqa: E402
from tfremat.simulate import reference_simulation, single_op_lower_bound  # noqa: E402
from tfremat.solvers import SOLVERS  # noqa: E402
from tfremat.solvers.isolate import call_isolated  # noqa: E402
from tfremat.solvers.bounds import backward_once, once_lower_bound, recompute_lower_bound  # noqa: E402

GRAPHS = ROOT.parent / "shared" / "benchmarks" / "checkmate-graphs"
RESULTS = ROOT / "benchmarks" / "results"
FRACTIONS = (0.9, 0.8, 0.7, 0.6)
#: Unrolling depth of the recomputation lower bound in the tables (n1000: 6 s).
BOUND_DEPTH = 20


def recompute_bound(g):
    return recompute_lower_bound(g, depth=BOUND_DEPTH, max_steps=1_000_000)


def graph_files():
    if not GRAPHS.is_dir():
        print(f"skipped: {GRAPHS} is absent (the shared benchmark graphs are not here)")
        return []
    return sorted(GRAPHS.glob("*.json"))


def best_known():
    """(file, fraction) -> best known total cost, from the graphs' README table."""
    out = {}
    readme = GRAPHS / "README.md"
    if not readme.exists():
        return out
    for line in readme.read_text().splitlines():
        m = re.match(r"\| (\S+\.json) \| (0\.\d) \| (\d+) \| (\d+|—) \| (\d+) \| (.*) \|", line)
        if m and m.group(4) != "—":
            out[(m.group(1), float(m.group(2)))] = int(m.group(4))
    return out


def run_one(g, budget, name, time_limit, mem_gib=None):
    """Solve one point; with ``mem_gib``, in a child process with that address space.

    Why the cap: a session-9 curves run grew past 21 GB on random_layered_n500's low
    points with ``exact`` solves in one process (each solve alone: 18 s, 160 MB). A
    child per solve returns its memory to the system, and a solve that passes the cap
    fails alone (status "error") instead of taking the machine down.
    """
    t0 = time.perf_counter()
    problem = Problem(g, budget, 0, time_limit)
    try:
        if mem_gib:
            plan = call_isolated(solve, problem, name, address_space_bytes=int(mem_gib * 2**30))
        else:
            plan = solve(problem, name)
    except InfeasibleBudgetError as e:
        return {"status": "infeasible", "min_feasible": e.min_feasible_bytes,
                "solve_s": time.perf_counter() - t0}
    except (MemoryError, RematError) as e:  # over the cap, or the child died
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:200]}
    return {"status": plan.status, "cost": plan.cost, "peak": plan.predicted_peak_bytes,
            "lower_bound": plan.cost_lower_bound, "solve_s": time.perf_counter() - t0,
            "recomputations": len(plan.schedule) - g.number_of_nodes()}


def auto_min_budget(g, lb):
    """Smallest budget auto meets: ask for the lower bound; the error says what fits."""
    try:
        return solve(Problem(g, lb), "auto").predicted_peak_bytes
    except InfeasibleBudgetError as e:
        return e.min_feasible_bytes


def cmd_run(args):
    RESULTS.mkdir(parents=True, exist_ok=True)
    solvers = args.solvers or list(SOLVERS)
    for path in graph_files():
        if args.graphs and not any(s in path.name for s in args.graphs):
            continue
        g = load_graph(path)
        ref = reference_simulation(g)
        lb = single_op_lower_bound(g)
        out = RESULTS / (path.stem + ".json")
        if args.min_budget_only:  # refresh only the smallest-budget column
            res = json.loads(out.read_text())
            res["auto_min_budget"] = auto_min_budget(g, lb)
            res["recompute_bound"] = recompute_bound(g)
            print(f"{path.name[:28]:28s} auto min budget {res['auto_min_budget'] / lb:.3f} x lower bound",
                  flush=True)
            out.write_text(json.dumps(res, indent=1))
            continue
        res = {"graph": path.name, "nodes": g.number_of_nodes(), "ref_peak": ref.peak_bytes,
               "ref_cost": ref.cost, "lower_bound": lb,
               "once_bound": once_lower_bound(g, once=backward_once),
               "recompute_bound": recompute_bound(g), "rows": []}
        for f in FRACTIONS:
            budget = math.ceil(f * ref.peak_bytes)
            for name in solvers:
                tl = args.exact_time_limit if name == "exact" else None
                r = run_one(g, budget, name, tl)
                r.update(fraction=f, budget=budget, solver=name)
                res["rows"].append(r)
                print(f"{path.name[:28]:28s} {f} {name:24s} {r['status']:10s} "
                      f"{r.get('cost', float('nan')) / ref.cost:.4f} {r['solve_s']:.1f}s",
                      flush=True)
        # Smallest budget the default meets: ask for the lower bound itself; the
        # error (if any) carries the smallest budget auto found.
        if args.solvers and out.exists():  # keep the other solvers' rows
            old = json.loads(out.read_text())
            keep = [r for r in old["rows"] if r["solver"] not in solvers]
            res["rows"] = keep + res["rows"]
        res["auto_min_budget"] = auto_min_budget(g, lb)
        print(f"{path.name[:28]:28s} auto min budget {res['auto_min_budget'] / lb:.3f} x lower bound",
              flush=True)
        out.write_text(json.dumps(res, indent=1))


def cmd_report(args):
    known = best_known()
    files = sorted(RESULTS.glob("*.json"))
    if not files:
        print("no results: run `python benchmarks/solvers.py run` first")
        return
    data = [d for d in (json.loads(p.read_text()) for p in files) if "rows" in d]
    solvers = []
    for d in data:
        for r in d["rows"]:
            if r["solver"] not in solvers:
                solvers.append(r["solver"])
    # Registry order (auto first), whatever order partial reruns stored rows in.
    registry = list(SOLVERS)
    solvers.sort(key=lambda s: registry.index(s) if s in registry else len(registry))
    print("### Cost relative to checkpoint-all (every node once), by solver\n")
    print("Cell: cost / checkpoint-all cost (peak / budget, seconds); `inf` = infeasible "
          "(the solver's reported minimum budget / budget); `—` below the single-op lower "
          "bound for every solver.\n")
    print("| graph | m | " + " | ".join(solvers) + " |")
    print("|---|---|" + "---|" * len(solvers))
    for d in data:
        for f in FRACTIONS:
            rows = {r["solver"]: r for r in d["rows"] if r["fraction"] == f}
            if not rows:
                continue
            cells = []
            for s in solvers:
                r = rows.get(s)
                if r is None:
                    cells.append("")
                elif r["status"] == "infeasible":
                    cells.append(f"inf ({r['min_feasible'] / r['budget']:.2f}; {r['solve_s']:.1f}s)")
                else:
                    cells.append(f"{r['cost'] / d['ref_cost']:.4f} ({r['peak'] / r['budget']:.2f}, "
                                 f"{r['solve_s']:.1f}s){' *' if r['status'] == 'optimal' else ''}")
            print(f"| {d['graph'][:26]} | {f} | " + " | ".join(cells) + " |")
    print("\n`*`: status optimal (for `exact`: optimal within its model).\n")
    print("### The default against the best known plans and the baselines\n")
    print("extra = cost - checkpoint-all cost. best known: the graphs' README (Moccasin "
          "CP-SAT, 120-300 s) or this run's `exact`, whichever is lower.\n")
    print("| graph | m | budget ≥ lower bound | auto extra | best known extra | ratio | "
          "best baseline extra | auto s | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    baselines = [s for s in solvers if s.startswith("chen") or s == "checkpoint_all"]
    for d in data:
        for f in FRACTIONS:
            rows = {r["solver"]: r for r in d["rows"] if r["fraction"] == f}
            if "auto" not in rows:
                continue
            a = rows["auto"]
            budget = a["budget"]
            feasible_lb = budget >= d["lower_bound"]
            bk = known.get((d["graph"], f))
            cands = [bk - d["ref_cost"]] if bk is not None else []
            ex = rows.get("exact")
            if ex and ex["status"] != "infeasible":
                cands.append(ex["cost"] - d["ref_cost"])
            best = min(cands) if cands else None
            base = [rows[b]["cost"] - d["ref_cost"] for b in baselines
                    if b in rows and rows[b]["status"] != "infeasible"]
            if a["status"] == "infeasible":
                aex = f"infeasible (min {a['min_feasible'] / budget:.2f}× budget)"
                ratio = ""
            else:
                aex = f"{a['cost'] - d['ref_cost']:.6g}"
                aextra = a["cost"] - d["ref_cost"]
                if best is None:
                    ratio = "—"
                elif best > 0:
                    ratio = f"{aextra / best:.3f}"
                else:  # the best known plan recomputes nothing
                    ratio = "1.000" if aextra == 0 else "∞"
            print(f"| {d['graph'][:26]} | {f} | {'yes' if feasible_lb else 'no'} | {aex} | "
                  f"{'' if best is None else f'{best:.6g}'} | {ratio} | "
                  f"{'' if not base else f'{min(base):.6g}'} | {a['solve_s']:.1f} | {a['status']} |")
    print("\n### Smallest budget the default meets\n")
    print("single-op: the single-op bound (largest op's inputs + output). recompute bound: "
          "`tfremat.solvers.bounds.recompute_lower_bound` (depth "
          f"{BOUND_DEPTH}), also proven for every schedule, recomputation and reordering "
          "allowed; proven bound: the larger of the two. once-bound: the bound for "
          "schedules that run every backward op once (`once_lower_bound`; it equals the "
          "single-op bound on graphs without a backward phase).\n")
    print("| graph | nodes | single-op bound (bytes) | recompute bound / single-op | "
          "auto's minimum budget | minimum / single-op | minimum / proven bound | "
          "once-bound / single-op | minimum / once-bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in data:
        mb = d.get("auto_min_budget")
        ob = d.get("once_bound")
        rb = d.get("recompute_bound")
        g = None
        if (ob is None or rb is None) and (GRAPHS / d["graph"]).exists():
            g = load_graph(GRAPHS / d["graph"])
            ob = once_lower_bound(g, once=backward_once) if ob is None else ob
            rb = recompute_bound(g) if rb is None else rb
        if mb is None:
            continue
        lb = d["lower_bound"]
        proven = max(lb, rb or lb)
        rcol = f"{rb / lb:.3f}" if rb else ""
        extra = f" {ob / lb:.3f} | {mb / ob:.3f} |" if ob else " | |"
        print(f"| {d['graph'][:26]} | {d['nodes']} | {lb} | {rcol} | {mb} | {mb / lb:.3f} | "
              f"{mb / proven:.3f} |" + extra)


def cmd_curves(args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    files = [p for p in graph_files() if not args.graphs or any(s in p.name for s in args.graphs)]
    if not files:
        return
    solvers = args.solvers or list(SOLVERS)
    cols = 3
    rows_ = math.ceil(len(files) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.6 * rows_), squeeze=False)
    curves = {}
    for ax, path in zip(axes.flat, files):
        g = load_graph(path)
        ref = reference_simulation(g)
        lb = single_op_lower_bound(g)
        budgets = np.unique(np.linspace(lb, ref.peak_bytes, args.points).astype(np.int64))
        curves[path.name] = {}
        for name in solvers:
            xs, ys = [], []
            for b in budgets:
                tl = args.exact_time_limit if name == "exact" else args.time_limit
                r = run_one(g, int(b), name, tl, args.exact_mem_gib if name == "exact" else None)
                if r["status"] == "error":
                    print(f"{path.name[:28]} {name} at {int(b)}: {r['error']}", flush=True)
                if r["status"] not in ("infeasible", "error"):
                    xs.append(b / ref.peak_bytes)
                    ys.append(r["cost"] / ref.cost - 1)
            curves[path.name][name] = [xs, ys]
            style = {"auto": dict(lw=2.5, color="k", zorder=5),
                     "exact": dict(lw=1.5, ls="--", color="tab:red", zorder=4)}.get(name, dict(lw=1))
            if xs:
                ax.plot(xs, ys, marker=".", label=name, **style)
            print(f"{path.name[:28]} {name}: {len(xs)}/{len(budgets)} budgets feasible", flush=True)
        ax.axvline(lb / ref.peak_bytes, color="grey", ls=":", lw=1)
        ax.set_title(path.name.replace("_train.json", "").replace(".json", "")[:40], fontsize=9)
        ax.set_xlabel("budget / reference peak")
        ax.set_ylabel("extra cost / checkpoint-all cost")
        ax.set_yscale("symlog", linthresh=1e-3)
    for ax in list(axes.flat)[len(files):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=8)
    fig.tight_layout()
    out = ROOT / "docs" / args.out
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=90)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / (Path(args.out).stem + ".json")).write_text(json.dumps(curves))
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="solve every graph at every fraction with every solver")
    r.add_argument("--graphs", nargs="*", help="only graph files whose name contains one of these")
    r.add_argument("--solvers", nargs="*", help="only these solvers (default: all registered)")
    r.add_argument("--exact-time-limit", type=float, default=30.0)
    r.add_argument("--min-budget-only", action="store_true",
                   help="only recompute auto's smallest feasible budget in existing results")
    r.set_defaults(func=cmd_run)
    s = sub.add_parser("report", help="print the markdown tables from benchmarks/results")
    s.set_defaults(func=cmd_report)
    c = sub.add_parser("curves", help="overhead-vs-budget curves (PNG under docs/)")
    c.add_argument("--graphs", nargs="*")
    c.add_argument("--solvers", nargs="*")
    c.add_argument("--points", type=int, default=12)
    c.add_argument("--exact-time-limit", type=float, default=10.0)
    c.add_argument("--time-limit", type=float, default=None, help="for the other solvers")
    c.add_argument("--exact-mem-gib", type=float, default=6.0,
                   help="address-space cap of the child process each exact solve runs in "
                        "(0: solve in this process)")
    c.add_argument("--out", default="solver-curves.png")
    c.set_defaults(func=cmd_curves)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
