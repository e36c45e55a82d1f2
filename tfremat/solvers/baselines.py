"""Baseline solvers as Checkmate (Jain et al., MLSys 2020, section 6) defines them.

Each keeps a set of forward values for the backward pass and recomputes the rest
late (:func:`tfremat.schedule.checkpoint_schedule`); they differ only in which values
they keep:

- ``checkpoint_all``: keep everything (the reference order, no recomputation).
- ``chen_sqrtn``: Chen et al.'s sqrt(n): split the checkpoint candidates into
  ``sqrt(n)`` segments and keep each segment's last value.
- ``chen_greedy``: Chen et al.'s greedy: keep a candidate whenever the bytes since the
  last kept one exceed ``b``; ``b`` is swept and the cheapest plan within the budget
  wins (as in Checkmate's evaluation, which sweeps Chen's hyperparameter).

Candidates are, as in Checkmate, the forward graph's articulation points (values every
path from input to loss goes through; keeping one cuts the graph in two), or in the
``_linearized`` variants every forward value, treating the graph as a chain. A
baseline whose plan does not fit the budget raises
:class:`~tfremat.errors.InfeasibleBudgetError` carrying the lowest peak it reaches.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Hashable, Sequence

import networkx as nx
import numpy as np

from ..errors import InfeasibleBudgetError
from ..plan import Plan, Problem
from ..schedule import checkpoint_schedule, droppable, phase_of
from ..simulate import reference_simulation, simulate, single_op_lower_bound
from .common import make_plan

__all__ = [
    "articulation_candidates",
    "checkpoint_all",
    "chen_greedy",
    "chen_greedy_linearized",
    "chen_sqrtn",
    "chen_sqrtn_linearized",
    "linear_candidates",
]

Node = Hashable


def linear_candidates(graph: nx.DiGraph) -> list[Node]:
    """Every droppable forward value with bytes, in reference order (the chain view)."""
    return [v for v in droppable(graph) if graph.nodes[v]["bytes"] > 0]


def articulation_candidates(graph: nx.DiGraph) -> list[Node]:
    """Droppable forward values that are articulation points of the forward graph."""
    fwd = [v for v in graph.nodes if phase_of(graph, v) == "forward"]
    if not fwd:
        return []
    aps = set(nx.articulation_points(graph.subgraph(fwd).to_undirected(as_view=True)))
    return [v for v in linear_candidates(graph) if v in aps]


def _fits_or_raise(problem: Problem, schedule: Sequence[Node], name: str) -> Plan:
    plan = make_plan(problem, schedule, name, "heuristic")
    if plan.predicted_peak_bytes > problem.budget_bytes:
        raise InfeasibleBudgetError(
            problem.budget_bytes,
            max(plan.predicted_peak_bytes, single_op_lower_bound(problem.graph, problem.fixed_bytes)),
            f"{name} peaks at {plan.predicted_peak_bytes} bytes",
        )
    return plan


def checkpoint_all(problem: Problem) -> Plan:
    """The reference order: every value kept, nothing recomputed.

    Raises
    ------
    InfeasibleBudgetError
        When the reference peak exceeds the budget (``min_feasible_bytes`` is that peak).
    """
    t0 = time.perf_counter()
    plan = _fits_or_raise(problem, problem.order, "checkpoint_all")
    # Every node once is the least compute any schedule can use.
    return _with(plan, status="optimal", cost_lower_bound=plan.cost, t0=t0)


def _with(plan: Plan, t0: float, **kw) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, solve_s=time.perf_counter() - t0, **kw)


def _sqrtn(problem: Problem, cands: list[Node], name: str) -> Plan:
    t0 = time.perf_counter()
    g = problem.graph
    n = len(cands)
    if n == 0:
        return _with(_fits_or_raise(problem, problem.order, name), t0)
    seg = max(1, int(math.ceil(math.sqrt(n))))
    kept = {cands[i] for i in range(seg - 1, n, seg)}
    sched = checkpoint_schedule(g, kept, problem.order)
    return _with(_fits_or_raise(problem, sched, name), t0)


def chen_sqrtn(problem: Problem) -> Plan:
    """Chen et al.'s sqrt(n) over the forward graph's articulation points.

    Raises
    ------
    InfeasibleBudgetError
        When its (budget-independent) plan does not fit.
    """
    return _sqrtn(problem, articulation_candidates(problem.graph), "chen_sqrtn")


def chen_sqrtn_linearized(problem: Problem) -> Plan:
    """Chen et al.'s sqrt(n) treating every forward value as a candidate.

    Raises
    ------
    InfeasibleBudgetError
        When its (budget-independent) plan does not fit.
    """
    return _sqrtn(problem, linear_candidates(problem.graph), "chen_sqrtn_linearized")


def greedy_kept(graph: nx.DiGraph, candidates: Sequence[Node], threshold: float) -> set:
    """Keep a candidate each time the bytes since the last kept one exceed ``threshold``."""
    kept, acc = set(), 0
    for v in candidates:
        acc += graph.nodes[v]["bytes"]
        if acc > threshold:
            kept.add(v)
            acc = 0
    return kept


def greedy_sweep(
    problem: Problem, cands: list[Node], name: str, n_thresholds: int = 64
) -> tuple[Plan | None, int]:
    """Cheapest swept-greedy plan within budget (or None) and the lowest peak seen."""
    g = problem.graph
    sizes = sorted({g.nodes[v]["bytes"] for v in cands})
    total = sum(g.nodes[v]["bytes"] for v in cands)
    thresholds: list[float] = [math.inf, -1.0]  # keep none / keep every candidate
    if total > 0:
        thresholds += list(np.geomspace(max(sizes[0], 1), total, n_thresholds))
    seen: set = set()
    best: tuple | None = None
    lowest = None
    for b in thresholds:
        kept = frozenset(greedy_kept(g, cands, b))
        if kept in seen:
            continue
        seen.add(kept)
        sched = checkpoint_schedule(g, kept, problem.order)
        sim = simulate(g, sched, problem.fixed_bytes)
        lowest = sim.peak_bytes if lowest is None else min(lowest, sim.peak_bytes)
        if sim.peak_bytes <= problem.budget_bytes and (best is None or sim.cost < best[0]):
            best = (sim.cost, sched)
    if lowest is None:
        lowest = reference_simulation(g, problem.fixed_bytes).peak_bytes
    if best is None:
        return None, lowest
    return make_plan(problem, best[1], name, "heuristic"), lowest


def _greedy(problem: Problem, cands: list[Node], name: str) -> Plan:
    t0 = time.perf_counter()
    plan, lowest = greedy_sweep(problem, cands, name)
    if plan is None:
        raise InfeasibleBudgetError(
            problem.budget_bytes,
            max(lowest, single_op_lower_bound(problem.graph, problem.fixed_bytes)),
            f"{name}: no swept threshold fits",
        )
    return _with(plan, t0)


def chen_greedy(problem: Problem) -> Plan:
    """Chen et al.'s greedy over articulation points, threshold swept.

    Raises
    ------
    InfeasibleBudgetError
        When no threshold fits; ``min_feasible_bytes`` is the lowest peak seen.
    """
    return _greedy(problem, articulation_candidates(problem.graph), "chen_greedy")


def chen_greedy_linearized(problem: Problem) -> Plan:
    """Chen et al.'s greedy over every forward value, threshold swept.

    Raises
    ------
    InfeasibleBudgetError
        When no threshold fits; ``min_feasible_bytes`` is the lowest peak seen.
    """
    return _greedy(problem, linear_candidates(problem.graph), "chen_greedy_linearized")


BASELINES: dict[str, Callable[[Problem], Plan]] = {
    "checkpoint_all": checkpoint_all,
    "chen_sqrtn": chen_sqrtn,
    "chen_sqrtn_linearized": chen_sqrtn_linearized,
    "chen_greedy": chen_greedy,
    "chen_greedy_linearized": chen_greedy_linearized,
}
