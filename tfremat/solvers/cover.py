"""Which forward values to keep, as a covering MILP (HiGHS), checked by the simulator.

The plans searched are checkpoint schedules (:func:`tfremat.schedule.checkpoint_schedule`):
the reference order, every forward value either kept to its last use or dropped after
its forward uses and recomputed just before its first use by a later phase. Greedy
rules and sweeps pick the dropped set one value at a time; this solves for it whole.

Model. One binary ``d_v`` per candidate (1 = dropped; the candidates are the
droppable forward values a later phase reads, then, as a second model, every
droppable forward value with bytes). With every candidate kept the memory at
reference position ``j`` is ``M_j``; dropping ``v`` alone changes it by ``s_vj`` and
the cost by ``c_v`` (both from the simulator, a recomputation's memory counted at the
op it precedes), so

    minimize   sum_v c_v d_v
    subject to sum_v s_vj d_v >= M_j - budget      for every position j.

What the sums miss are the interactions: a dropped value whose dropped inputs are
recomputed with it (earlier than their own first backward use), shared ancestors
recomputed once. So every solution is simulated; one that does not fit, or costs
more than the model said, is cut off (a no-good cut) and the MILP solved again, until
a solution fits at no more than the model's optimum (no cheaper solution of the model
is left) or time runs out. The best simulated plan found is returned: a heuristic,
not a proof, since the linear model may also reject sets that would fit.

Measured on the seven Checkmate training graphs at 0.9-0.6 of the reference peak
(docs/solvers.md): the first solution fits and is the model's optimum on every
budget but two, in 0.01-0.4 s; its cost equals the best known plan on every row
where one fits, and is below the 30 s CP-SAT run's on two (MobileNet at 0.6,
segnet at 0.7). VGG19 at 0.8, whose plans drop chains of values, finds no
fitting set before the deadline: the interactions are what the model leaves out.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import InfeasibleBudgetError
from ..plan import Plan, Problem
from ..schedule import checkpoint_schedule, saved_activations
from ..simulate import reference_simulation, simulate, single_op_lower_bound
from .baselines import linear_candidates
from .common import make_plan

__all__ = ["cover_schedule", "cover_solver"]

DEFAULT_TIME_LIMIT_S = 10.0
#: MILP rounds (one simulation each) before giving up on a model whose solutions
#: keep missing the budget.
MAX_ROUNDS = 200


def _memory_by_op(g, schedule, fixed: int, n: int) -> tuple[np.ndarray, float]:
    """Memory at each op's first computation, the recomputations just before it
    included (their maximum), and the schedule's cost."""
    sim = simulate(g, schedule, fixed)
    out = np.zeros(n, dtype=np.float64)
    seen: set = set()
    acc = 0
    for j, v in enumerate(schedule):
        acc = max(acc, int(sim.memory[j]))
        if v not in seen:
            out[len(seen)] = acc
            seen.add(v)
            acc = 0
    return out, sim.cost


def cover_schedule(problem: Problem, deadline: float) -> list | None:
    """The cheapest checkpoint schedule within the budget that the covering MILP finds
    before ``deadline`` (``time.perf_counter()`` seconds), or None.

    Two candidate sets, as their models see different plans: the values a later phase
    reads (the others are always dropped, recomputed where a kept value needs them),
    then, with what time is left, every droppable value with bytes. On a traced
    MLP, dropping a ``Relu`` alone saves nothing when its ``BiasAdd`` is kept (that
    is held for the recomputation instead), so only the first model fits there; on
    a traced Swish MLP only the second (docs/solvers.md). On layer-level graphs the
    two sets are the same.
    """
    g = problem.graph
    saved = saved_activations(g)
    if not saved:
        return None  # no forward value a later phase reads: dropping recomputes nothing
    every = linear_candidates(g)
    best = None
    sets = (saved, every) if len(every) > len(saved) else (saved,)
    for k, cands in enumerate(sets):
        # Half the time for the first of two sets; a single set gets all of it (on
        # layer-level graphs the sets are the same: a generated DenseNet training
        # graph at 0.6 of its peak found its plan, 11 % cheaper than eviction's, in
        # 1.5-2.5 s, and the halved second left it none within auto's 2 s).
        now = time.perf_counter()
        last = k == len(sets) - 1
        found = _cover(problem, cands, deadline if last else now + (deadline - now) / 2, best)
        if found is not None:
            best = found
    return None if best is None else best[1]


def _cover(problem: Problem, cands: list, deadline: float, best):
    """The covering MILP over dropping ``cands``: ``(cost, schedule)`` of the cheapest
    fitting plan found that is cheaper than ``best``, or None."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    g, fixed, budget = problem.graph, problem.fixed_bytes, problem.budget_bytes
    order = problem.order
    n, m = len(order), len(cands)
    all_kept = set(cands)
    t0 = time.perf_counter()
    base, base_cost = _memory_by_op(g, checkpoint_schedule(g, all_kept, order), fixed, n)
    if (time.perf_counter() - t0) * (m + 1) > deadline - time.perf_counter():
        return None  # the model's m simulations alone would not fit in the time left
    saving = np.empty((n, m))
    cost = np.empty(m)
    for i, v in enumerate(cands):
        if time.perf_counter() > deadline:
            return None
        mem, c = _memory_by_op(g, checkpoint_schedule(g, all_kept - {v}, order), fixed, n)
        saving[:, i] = base - mem
        cost[i] = c - base_cost
    need = base - budget
    # Positions already within the budget that no drop can push over it add nothing.
    rows = (need > 0) | (saving.min(axis=1) < 0)
    scale = max(1.0, float(np.abs(saving).max()), float(np.abs(need[rows]).max(initial=0)))
    constraints = [LinearConstraint(saving[rows] / scale, need[rows] / scale, np.inf)]
    # A free drop would make the model indifferent to it: a tiny cost keeps the
    # solutions minimal.
    objective = np.maximum(cost, 1e-9 * max(1.0, float(cost.max())))
    found = None
    cuts: list[np.ndarray] = []
    cut_rhs: list[float] = []
    for _ in range(MAX_ROUNDS):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        extra = [LinearConstraint(np.array(cuts), cut_rhs, np.inf)] if cuts else []
        res = milp(objective, constraints=constraints + extra, integrality=np.ones(m),
                   bounds=Bounds(0, 1), options={"time_limit": left, "presolve": False})
        if res.x is None:  # infeasible model, or no solution in time
            break
        drop = res.x > 0.5
        sched = checkpoint_schedule(g, all_kept - {cands[i] for i in np.flatnonzero(drop)}, order)
        sim = simulate(g, sched, fixed)
        if sim.peak_bytes <= budget and (best is None or sim.cost < best[0]):
            best = found = (sim.cost, sched)
        if best is not None and best[0] <= base_cost + res.fun + 1e-9 * max(1.0, abs(best[0])):
            break  # no solution of the model is cheaper than a plan already found
        # Cut this set off: at least one candidate changes side.
        cuts.append(np.where(drop, -1.0, 1.0))
        cut_rhs.append(1.0 - float(drop.sum()))
    return found


def cover_solver(problem: Problem) -> Plan:
    """Checkpoint selection by a covering MILP with simulated, lazily cut solutions.

    Parameters
    ----------
    problem : Problem
        ``time_limit_s`` bounds the search (default 10 s).

    Returns
    -------
    Plan
        Status ``"optimal"`` when the reference order fits, else ``"heuristic"``.

    Raises
    ------
    InfeasibleBudgetError
        When no checkpoint schedule the search finds fits; ``min_feasible_bytes`` is
        the reference peak (what keeping everything needs), never below the single-op
        lower bound.
    """
    t0 = time.perf_counter()
    g, fixed, budget = problem.graph, problem.fixed_bytes, problem.budget_bytes
    ref = reference_simulation(g, fixed)
    if ref.peak_bytes <= budget:
        return make_plan(problem, problem.order, "cover", "optimal", cost_lower_bound=ref.cost,
                         solve_s=time.perf_counter() - t0)
    sched = cover_schedule(problem, t0 + (problem.time_limit_s or DEFAULT_TIME_LIMIT_S))
    if sched is None:
        raise InfeasibleBudgetError(
            budget, max(ref.peak_bytes, single_op_lower_bound(g, fixed)), "covering MILP"
        )
    return make_plan(problem, sched, "cover", "heuristic", cost_lower_bound=ref.cost,
                     solve_s=time.perf_counter() - t0)
