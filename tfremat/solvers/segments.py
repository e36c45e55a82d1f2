"""Budget-driven segment checkpointing (Chen et al.'s greedy, swept and refined).

Chen's greedy keeps a forward value each time the bytes accumulated since the last
kept one exceed a threshold ``b``. Instead of Chen's fixed ``b = sqrt(total)``, this
sweeps ``b`` over a geometric range, keeps the cheapest schedule that fits the budget,
then greedily keeps more values (most expensive to recompute first) while the
schedule still fits. Works on any graph with ``phase`` attributes, op-level graphs of
thousands of nodes included; every candidate is scored by the simulator itself.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..errors import InfeasibleBudgetError
from ..plan import Plan, Problem
from ..schedule import checkpoint_schedule, saved_activations
from ..simulate import reference_simulation, simulate, single_op_lower_bound
from .baselines import greedy_kept
from .common import make_plan

DEFAULT_TIME_LIMIT_S = 10.0


def segments_solver(problem: Problem) -> Plan:
    """Cheapest swept Chen-greedy schedule within the budget, then greedily refined.

    Raises
    ------
    InfeasibleBudgetError
        When no swept threshold fits; ``min_feasible_bytes`` is the lowest peak seen.
    """
    t0 = time.perf_counter()
    limit = problem.time_limit_s or DEFAULT_TIME_LIMIT_S
    g, budget, fixed = problem.graph, problem.budget_bytes, problem.fixed_bytes
    order = problem.order
    ref = reference_simulation(g, fixed)
    if ref.peak_bytes <= budget:
        return make_plan(problem, order, "segments", "optimal", cost_lower_bound=ref.cost)

    cands = saved_activations(g)
    total = sum(g.nodes[v]["bytes"] for v in cands)
    smallest = min((g.nodes[v]["bytes"] for v in cands), default=1)
    thresholds = [math.inf, -1.0]  # keep none / keep all candidates
    if total > 0:
        thresholds += list(np.geomspace(max(smallest, 1), total, 48))

    def evaluate(kept):
        sched = checkpoint_schedule(g, kept, order)
        return sched, simulate(g, sched, fixed)

    best = None  # (cost, peak, kept, schedule)
    lowest_peak = ref.peak_bytes
    for b in thresholds:
        kept = set(cands) if b < 0 else greedy_kept(g, cands, b)
        sched, sim = evaluate(kept)
        lowest_peak = min(lowest_peak, sim.peak_bytes)
        if sim.peak_bytes <= budget and (best is None or sim.cost < best[0]):
            best = (sim.cost, sim.peak_bytes, kept, sched)
    if best is None:
        raise InfeasibleBudgetError(
            budget,
            max(lowest_peak, single_op_lower_bound(g, fixed)),
            "segment checkpointing",
        )

    # Refinement: keeping a value is never more compute; try the ones whose loss
    # would cost the most to recompute first, while the schedule still fits.
    cost, _, kept, sched = best
    rest = sorted((v for v in cands if v not in kept), key=lambda v: -g.nodes[v]["cost"])
    for v in rest:
        if time.perf_counter() - t0 > limit:
            break
        trial = kept | {v}
        s2, sim2 = evaluate(trial)
        if sim2.peak_bytes <= budget and sim2.cost <= cost:
            cost, kept, sched = sim2.cost, trial, s2
    return make_plan(problem, sched, "segments", "heuristic", solve_s=time.perf_counter() - t0)
