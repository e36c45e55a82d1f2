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
