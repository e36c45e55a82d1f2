"""The solver benchmark's memory-capped solves (benchmarks/solvers.py curves)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import networkx as nx


def _bench():
    path = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("solvers")


def _chain(n=5):
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(i, bytes=10, cost=1)
    g.add_edges_from((i, i + 1) for i in range(n - 1))
    g.graph["order"] = list(range(n))
    return g


def test_a_capped_solve_returns_the_plan_and_a_solve_over_the_cap_fails_alone():
    bench = _bench()
    ok = bench.run_one(_chain(), 100, "checkpoint_all", None, mem_gib=4.0)
    assert ok["status"] == "optimal", ok
    assert ok["cost"] == 5 and ok["peak"] == 20
    # A cap under what the interpreter needs to start: the child fails, the point
    # becomes an error row, and the caller goes on.
    bad = bench.run_one(_chain(), 100, "checkpoint_all", None, mem_gib=1 / 1024)
    assert bad["status"] == "error" and bad["error"]


def test_the_generated_held_out_graphs_are_valid_training_and_layered_graphs():
    """benchmarks/solver_sweep.py's graphs: DAGs in reference order, the training ones
    with one gradient per forward layer reading its layer's output, the layered ones
    with one source and one sink; the same graphs from the same seeds."""
    path = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)
    sweep = importlib.import_module("solver_sweep")
    from tfremat.simulate import check_precedences

    graphs = sweep.graphs()
    assert {k for k in graphs if k.startswith("train_")} and {k for k in graphs if k.startswith("layered_")}
    for name, g in graphs.items():
        assert nx.is_directed_acyclic_graph(g)
        check_precedences(g, g.graph["order"])
        phases = {a["phase"] for _, a in g.nodes(data=True)}
        if name.startswith("train_"):
            assert phases == {"forward", "backward"}
            fwd = [v for v, a in g.nodes(data=True) if a["phase"] == "forward"]
            bwd = [v for v, a in g.nodes(data=True) if a["phase"] == "backward"]
            assert len(bwd) == len(fwd) - 2  # every layer but the input, not the loss
            assert all(any(g.nodes[u]["phase"] == "forward" for u in g.predecessors(b)) for b in bwd)
        else:
            assert phases == {"forward"}
            assert sum(1 for v in g if g.in_degree(v) == 0) == 1
            assert sum(1 for v in g if g.out_degree(v) == 0) == 1
    again = sweep.graphs()
    assert all(nx.utils.graphs_equal(g, again[k]) for k, g in graphs.items())
