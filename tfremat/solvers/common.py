"""Helpers shared by solvers."""

from __future__ import annotations

from typing import Hashable, Sequence

from ..plan import Plan, Problem, Status, kept_values
from ..simulate import reference_simulation, simulate


def make_plan(
    problem: Problem,
    schedule: Sequence[Hashable],
    solver: str,
    status: Status,
    cost_lower_bound: float | None = None,
    solve_s: float = 0.0,
) -> Plan:
    """Simulate ``schedule`` and wrap it in a Plan (the caller checks the budget)."""
    sim = simulate(problem.graph, schedule, problem.fixed_bytes)
    ref = reference_simulation(problem.graph, problem.fixed_bytes)
    return Plan(
        schedule=tuple(schedule),
        budget_bytes=int(problem.budget_bytes),
        predicted_peak_bytes=sim.peak_bytes,
        baseline_peak_bytes=ref.peak_bytes,
        cost=sim.cost,
        baseline_cost=ref.cost,
        solver=solver,
        status=status,
        cost_lower_bound=cost_lower_bound,
        solve_s=solve_s,
        kept=kept_values(problem.graph, schedule),
        fixed_bytes=int(problem.fixed_bytes),
    )
