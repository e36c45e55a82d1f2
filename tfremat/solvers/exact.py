"""Exact solver: a CP-SAT model of the whole schedule (OR-Tools, optional dependency).

The model follows Moccasin (Bartan et al., ICML 2023): each node ``v`` has up to
``C_v`` computations; computation ``c`` is an optional interval ``[s, e]`` of
schedule positions, from the position where it runs to its last use. It encodes the
README accounting exactly:

- at most one computation per position (no-overlap of unit intervals); gaps are
  harmless, since a gap's live set is a subset of the next position's;
- computation ``c`` of ``v`` needs, for each input ``u``, a computation of ``u``
  with ``s_u < s_v <= e_u``; a node's computations are ordered and disjoint
  (``e_c < s_{c+1}``), so the covering copy is the most recent one, the one the
  simulator binds to;
- a cumulative constraint over the intervals (demand: the node's bytes) caps the live
  bytes at every position by ``budget - fixed``: exactly the simulator's memory,
  since an interval may only be longer than the real lifetime, never shorter;
- minimize the summed cost of present computations.

Not recomputable nodes get one computation. "optimal" means optimal among schedules
with at most ``C_v`` computations per node (2 by default, more for nodes the
warm-start plan recomputes more often); ``cost_lower_bound`` is CP-SAT's proven
bound within that model. The model is warm-started (hinted) with the ``auto`` plan,
so with any time limit it returns a plan at least as good whenever auto has one.

Why CP-SAT and not Checkmate's MILP on HiGHS: Checkmate's formulation needs
O(n^2) binaries for each of its R and S matrices plus O(n * edges) FREE binaries
(for ResNet50, n = 353 and 751 edges: about 390,000 binaries) and fixes one
computation order; this interval model has at most C * n intervals and 4 booleans
per edge (about 3,700 for ResNet50) and places recomputations anywhere. The choice
rests on that size and on the reference results (also CP-SAT, Moccasin's model);
a head-to-head HiGHS run was not measured (docs/solvers.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Hashable, Sequence


from ..errors import InfeasibleBudgetError, SolverUnavailableError
from ..plan import Plan, Problem
from ..simulate import reference_simulation, simulate, single_op_lower_bound
from .common import make_plan
from .isolate import call_isolated, tensorflow_loaded

__all__ = ["exact_solver", "make_exact_solver"]

DEFAULT_TIME_LIMIT_S = 60.0
WARM_START_S = 9.0

Node = Hashable


def _import_cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SolverUnavailableError(
            "solver 'exact' needs OR-Tools: pip install 'tfremat[exact]' (or "
            "pip install ortools), or use solver='auto'"
        ) from e
    return cp_model


def _last_uses(graph, schedule: Sequence[Node]) -> list[int]:
    """Position of each computation's last use (its own position if unused)."""
    last_comp: dict = {}
    last = list(range(len(schedule)))
    for j, v in enumerate(schedule):
        for u in graph.predecessors(v):
            last[last_comp[u]] = j
        last_comp[v] = j
    return last


def make_exact_solver(
    max_computations: int = 2,
    workers: int | None = None,
    warm_start: Callable[[Problem], Plan] | None | str = "auto",
    name: str = "exact",
) -> Callable[[Problem], Plan]:
    """Build a CP-SAT solver.

    Parameters
    ----------
    max_computations : int
        Computations allowed per recomputable node (``C``).
    workers : int or None
        CP-SAT search workers; None uses every core.
    warm_start : callable, "auto" or None
        Solver whose plan hints the search (and widens ``C`` for nodes it recomputes
        more often); None for a cold start.
    name : str
        Solver name reported in plans.

    Returns
    -------
    callable
        ``solver(problem) -> Plan``.
    """

    def exact(problem: Problem) -> Plan:
        """CP-SAT over full schedules with at most C computations per node.

        Raises
        ------
        SolverUnavailableError
            When OR-Tools is not installed.
        InfeasibleBudgetError
            When no plan is found within the time limit (or none exists within the
            model); ``min_feasible_bytes`` comes from the warm-start solver or the
            single-op lower bound.
        """
        _import_cp_model()  # fail fast, before the warm start, when OR-Tools is missing
        t0 = time.perf_counter()
        limit = problem.time_limit_s or DEFAULT_TIME_LIMIT_S
        g, fixed, budget = problem.graph, problem.fixed_bytes, problem.budget_bytes
        ref = reference_simulation(g, fixed)
        lb_peak = single_op_lower_bound(g, fixed)
        if ref.peak_bytes <= budget:
            return make_plan(problem, problem.order, name, "optimal", cost_lower_bound=ref.cost,
                             solve_s=time.perf_counter() - t0)
        hint: Plan | None = None
        hint_error: InfeasibleBudgetError | None = None
        if warm_start is not None:
            from . import get_solver

            ws = get_solver(warm_start)
            try:
                # A third of the limit at most: the search itself needs the rest.
                hint = ws(dataclasses.replace(problem, time_limit_s=min(WARM_START_S, limit / 3)))
                if hint.predicted_peak_bytes > budget:
                    hint = None
            except InfeasibleBudgetError as e:
                hint_error = e
        if budget < lb_peak:
            raise InfeasibleBudgetError(budget, lb_peak, "below the single-op lower bound")

        return cpsat_plan(problem, hint, hint_error, max_computations, workers, name, t0,
                          limit, keep_order=False)

    exact.__name__ = name
    exact.__qualname__ = name
    return exact


def cpsat_plan(problem: Problem, hint: Plan | None, hint_error=None, max_computations: int = 2,
               workers: int | None = None, name: str = "exact", t0: float | None = None,
               limit: float | None = None, keep_order: bool = False) -> Plan:
    """Solve the CP-SAT model of ``problem``, hinted with ``hint``; best plan found.

    With ``keep_order`` the nodes' first computations follow the reference order
    (what the TensorFlow rewriter needs), so only recomputations are placed freely.

    Raises
    ------
    SolverUnavailableError
        When OR-Tools is not installed.
    InfeasibleBudgetError
        When the search finds no plan and there is no hint to fall back on.
    """
    t0 = time.perf_counter() if t0 is None else t0
    limit = problem.time_limit_s or DEFAULT_TIME_LIMIT_S if limit is None else limit
    if tensorflow_loaded():
        # CP-SAT segfaults in a process that imported TensorFlow first (isolate.py).
        left = max(0.1, limit - (time.perf_counter() - t0))
        return call_isolated(
            cpsat_plan, problem, hint, hint_error, max_computations, workers, name,
            None, left, keep_order, timeout=left + 120,
        )
    cp_model = _import_cp_model()
    g, fixed, budget = problem.graph, problem.fixed_bytes, problem.budget_bytes
    ref = reference_simulation(g, fixed)
    lb_peak = single_op_lower_bound(g, fixed)
    nodes = list(problem.order)
    counts = {v: 0 for v in nodes}
    if hint is not None:
        for v in hint.schedule:
            counts[v] += 1
    C = {
        v: (1 if not g.nodes[v].get("recomputable", True) else max(max_computations, counts[v]))
        for v in nodes
    }
    H = sum(C.values())
    sizes = [int(g.nodes[v]["bytes"]) for v in nodes]
    # Scale bytes by their gcd: same constraint, smaller coefficients for CP-SAT.
    gcd = 0
    for b in sizes + [budget - fixed]:
        gcd = math.gcd(gcd, int(b))
    gcd = max(gcd, 1)
    cap = (budget - fixed) // gcd
    costs = [g.nodes[v]["cost"] for v in nodes]
    # Integer objective: costs may be floats; scale so relative order survives.
    if all(float(c).is_integer() for c in costs):
        cscale = 1.0
    else:
        cscale = 1e6 / max(1e-12, max(abs(c) for c in costs))
    icost = [int(round(c * cscale)) for c in costs]

    m = cp_model.CpModel()
    pres, start, end = {}, {}, {}
    cum_iv, cum_dem, unit_iv = [], [], []
    for i, v in enumerate(nodes):
        for c in range(C[v]):
            p = m.NewConstant(1) if c == 0 else m.NewBoolVar(f"p{i}_{c}")
            s = m.NewIntVar(0, H - 1, f"s{i}_{c}")
            e = m.NewIntVar(0, H - 1, f"e{i}_{c}")
            m.Add(e >= s)
            length = m.NewIntVar(1, H, f"l{i}_{c}")
            iv = m.NewOptionalIntervalVar(s, length, e + 1, p, f"iv{i}_{c}")
            unit_iv.append(m.NewOptionalIntervalVar(s, 1, s + 1, p, f"u{i}_{c}"))
            if sizes[i] > 0:
                cum_iv.append(iv)
                cum_dem.append(sizes[i] // gcd if sizes[i] % gcd == 0 else sizes[i])
            pres[i, c], start[i, c], end[i, c] = p, s, e
            if c > 0:
                m.AddImplication(p, pres[i, c - 1])
                m.Add(start[i, c] > end[i, c - 1]).OnlyEnforceIf(p)
                # Absent copies sit after the last present one (symmetry).
                m.Add(start[i, c] >= start[i, c - 1])
    m.AddNoOverlap(unit_iv)
    m.AddCumulative(cum_iv, cum_dem, cap)
    idx = {v: i for i, v in enumerate(nodes)}
    for u, v in g.edges:
        iu, iv_ = idx[u], idx[v]
        for c in range(C[v]):
            options = []
            for cu in range(C[u]):
                b = m.NewBoolVar(f"b{iu}_{cu}_{iv_}_{c}")
                m.AddImplication(b, pres[iu, cu])
                m.Add(start[iu, cu] < start[iv_, c]).OnlyEnforceIf(b)
                m.Add(end[iu, cu] >= start[iv_, c]).OnlyEnforceIf(b)
                options.append(b)
            m.AddBoolOr(options).OnlyEnforceIf(pres[iv_, c])
        # The first computation of a consumer follows the producer's first one.
        m.Add(start[iu, 0] < start[iv_, 0])
    # Precedences without bytes (TensorFlow control edges, shape reads): first
    # computations only, as the rewrite needs (check_precedences).
    for u, v in g.graph.get("order_edges", ()):
        if u in idx and v in idx:
            m.Add(start[idx[u], 0] < start[idx[v], 0])
    if keep_order:
        for a_, b_ in zip(nodes, nodes[1:]):
            m.Add(start[idx[a_], 0] < start[idx[b_], 0])
    m.Minimize(sum(icost[i] * pres[i, c] for i, v in enumerate(nodes) for c in range(C[v])))

    if hint is not None:
        sched = list(hint.schedule)
        last = _last_uses(g, sched)
        seen: dict = {v: 0 for v in nodes}
        for j, v in enumerate(sched):
            i, c = idx[v], seen[v]
            seen[v] += 1
            if c > 0:
                m.AddHint(pres[i, c], 1)
            m.AddHint(start[i, c], j)
            m.AddHint(end[i, c], last[j])
        for v in nodes:
            i = idx[v]
            for c in range(seen[v], C[v]):
                m.AddHint(pres[i, c], 0)
                m.AddHint(start[i, c], H - 1)
                m.AddHint(end[i, c], H - 1)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, limit - (time.perf_counter() - t0))
    solver.parameters.num_search_workers = workers or max(1, os.cpu_count() or 1)
    st = solver.Solve(m)
    if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        comps = [
            (solver.Value(start[i, c]), v)
            for i, v in enumerate(nodes)
            for c in range(C[v])
            if solver.BooleanValue(pres[i, c])
        ]
        comps.sort(key=lambda x: x[0])
        sched = [v for _, v in comps]
        sim = simulate(g, sched, fixed)
        bound = solver.BestObjectiveBound() / cscale
        status = "optimal" if st == cp_model.OPTIMAL else "feasible"
        if sim.peak_bytes <= budget and (hint is None or sim.cost <= hint.cost):
            return make_plan(problem, sched, name, status,
                             cost_lower_bound=max(ref.cost, min(bound, sim.cost)),
                             solve_s=time.perf_counter() - t0)
    if hint is not None:  # the search found nothing better in time
        return make_plan(problem, hint.schedule, name, "feasible", cost_lower_bound=ref.cost,
                         solve_s=time.perf_counter() - t0)
    why = "proven infeasible within the model" if st == cp_model.INFEASIBLE else "no plan found in time"
    mf = hint_error.min_feasible_bytes if hint_error is not None else lb_peak
    raise InfeasibleBudgetError(budget, max(mf, budget + 1, lb_peak), why)


exact_solver = make_exact_solver()
