"""Solvers: plain callables ``solver(problem) -> Plan`` behind a read-only registry.

A solver either returns a :class:`~tfremat.plan.Plan` whose schedule fits the budget or
raises :class:`~tfremat.errors.InfeasibleBudgetError`. Whatever it returns,
:func:`solve` re-checks it with the independent simulator before anyone uses it.
"""

from __future__ import annotations

import time
import types
from typing import Callable, Mapping, Union

from ..errors import InfeasibleBudgetError, InvalidScheduleError, RematError
from ..plan import Plan, Problem, Solver
from ..simulate import check_precedences, reread_after_write, simulate
from .auto import auto_solver
from .baselines import BASELINES
from .common import drop_unread, make_plan, serve_unread_firsts
from .cover import cover_solver
from .evict import evict_solver
from .exact import exact_solver
from .segments import segments_solver

__all__ = ["SOLVERS", "get_solver", "solve", "make_plan"]

SOLVERS: Mapping[str, Solver] = types.MappingProxyType(
    {
        "auto": auto_solver,
        **BASELINES,
        "segments": segments_solver,
        "cover": cover_solver,
        "evict": evict_solver,
        # OR-Tools is imported only when this runs (SolverUnavailableError if absent).
        "exact": exact_solver,
    }
)

SolverLike = Union[str, Callable[[Problem], Plan]]


def get_solver(solver: SolverLike) -> Solver:
    """Resolve a registry name or pass a callable through.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the known ones).
    TypeError
        For anything that is neither a string nor a callable.
    """
    if isinstance(solver, str):
        try:
            return SOLVERS[solver]
        except KeyError:
            raise ValueError(
                f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)} or pass a "
                "callable taking a tfremat.Problem and returning a tfremat.Plan"
            ) from None
    if callable(solver):
        return solver
    raise TypeError(f"solver must be a name or a callable, not {type(solver).__name__}")


def solve(problem: Problem, solver: SolverLike = "auto") -> Plan:
    """Run ``solver`` on ``problem`` and re-check its plan with the simulator.

    Raises
    ------
    InfeasibleBudgetError
        When the solver finds no plan within the budget.
    RematError
        When the solver returns something the simulator rejects (a solver bug).
    """
    fn = get_solver(solver)
    t0 = time.perf_counter()
    plan = fn(problem)
    elapsed = time.perf_counter() - t0
    if not isinstance(plan, Plan):
        raise RematError(f"solver {solver!r} returned {type(plan).__name__}, not a tfremat.Plan")
    try:
        sim = simulate(problem.graph, plan.schedule, problem.fixed_bytes)
        check_precedences(problem.graph, plan.schedule)
    except InvalidScheduleError as e:
        raise RematError(f"solver {plan.solver!r} returned an invalid schedule: {e}") from e
    if sim.peak_bytes > problem.budget_bytes:
        raise RematError(
            f"solver {plan.solver!r} returned a plan peaking at {sim.peak_bytes} bytes, over "
            f"the budget of {problem.budget_bytes} (a solver bug)"
        )
    if sim.peak_bytes != plan.predicted_peak_bytes or abs(sim.cost - plan.cost) > 1e-6 * max(1.0, abs(sim.cost)):
        raise RematError(f"solver {plan.solver!r} misreported its plan's peak or cost")
    import dataclasses

    # Any solver's unread computations: the rewrite would make their readers'
    # inputs gated copies (serve_unread_firsts). An unread first computation serves
    # its readers where the budget allows; unread copies go (drop_unread).
    served = serve_unread_firsts(problem.graph, plan.schedule)
    schedule = drop_unread(problem.graph, served)
    # (dropping unread copies alone holds nothing longer: only serving is checked)
    if len(served) < len(plan.schedule) and (
            simulate(problem.graph, schedule, problem.fixed_bytes).peak_bytes > problem.budget_bytes):
        schedule = drop_unread(problem.graph, plan.schedule)
    if len(schedule) < len(plan.schedule):
        plan = dataclasses.replace(
            make_plan(problem, schedule, plan.solver, plan.status, plan.cost_lower_bound, plan.solve_s),
            budget_bytes=plan.budget_bytes)
    bad = reread_after_write(problem.graph, plan.schedule)
    if bad:
        # A loop recomputed after a write of a variable it reads would read the new
        # value: plan again with those loops kept (each retry keeps one more).
        g = problem.graph.copy()
        for v in bad:
            g.nodes[v]["recomputable"] = False
        return solve(dataclasses.replace(problem, graph=g), solver)
    if not plan.solve_s:
        plan = dataclasses.replace(plan, solve_s=elapsed)
    return plan


_ = InfeasibleBudgetError  # re-exported through tfremat.errors
