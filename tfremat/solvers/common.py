"""Helpers shared by solvers."""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from ..errors import InvalidScheduleError
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


def drop_recomputations(problem: Problem, schedule: Sequence[Hashable], rounds: int = 8) -> list:
    """``schedule`` with every recomputation removed that the budget does not need.

    Planners that evict under a working budget below the real one (eviction, the
    greedy baselines) leave slack: their plans' simulated peaks sit under the budget.
    This pass tries the recomputations most expensive first; removing one lets the
    previous instance of that value serve its readers, which keeps it live from its
    last read before the copy up to the copy's position (``bytes`` more there), and
    it is kept out when that would cross the budget. Copies no one reads are removed
    too. The estimate of the memory is conservative (in-place takeovers and the
    memory a removed copy's inputs free are ignored), so the pass runs again on its
    result, from a fresh simulation, up to ``rounds`` times while it removes
    something. Each result is simulated in full and kept only if it is valid and
    within the budget: it never costs more than ``schedule``.

    ``auto`` calls it with the plan's own simulated peak as the budget (see there).
    Measured on the 60 % budgets of the test models' traces, at that peak: CNN
    +26.2 % -> +23.4 % compute, Transformer +20.0 % -> +17.2 %, mixed-precision CNN
    +23.7 % -> +18.4 %, in 0.01-0.04 s.
    """
    best = list(schedule)
    for _ in range(rounds):
        nxt = _drop_pass(problem, best)
        if len(nxt) == len(best):
            break
        best = nxt
    return best


def serve_unread_firsts(graph, schedule: Sequence[Hashable]) -> list:
    """``schedule`` where each node whose first computation nobody reads before its
    next one has that next one removed: the first serves its readers instead.

    A plan that computes a value, leaves it unread and computes it again before its
    reader makes the reader's input a recomputed copy behind an ordering gate, and a
    fusion pattern that reads one tensor twice then sees two (oneDNN's Swish,
    ``Mul(x, Sigmoid(x))``, became ``Mul(x, Sigmoid(gate(x)))``): EfficientNetV2B0's
    forward Swish ran unfused, the first loss already differed, and 847 variables
    were up to 7.3e-2 apart after 3 steps. Removing the first computation instead
    would move the node's original later, and ``auto`` keeps first computations in
    the reference order (the executor follows reordered ones too loosely,
    docs/solvers.md). The first value is held longer, so the caller checks the
    budget.
    """
    result = list(schedule)
    latest: dict = {}
    read: set = set()
    first: dict = {}
    drop = set()
    for k, v in enumerate(result):
        for u in graph.predecessors(v):
            read.add(latest[u])
        if v in first and first[v] not in read and latest[v] == first[v]:
            drop.add(k)  # the first computation is unread: it serves instead
            continue
        first.setdefault(v, k)
        latest[v] = k
    return [v for k, v in enumerate(result) if k not in drop]


def drop_unread(graph, schedule: Sequence[Hashable]) -> list:
    """``schedule`` without the recomputations no op reads, repeatedly (a removed one
    may have been the only reader of another). Never costs more, and holds no tensor
    longer. First computations stay (see :func:`serve_unread_firsts` for unread
    ones)."""
    result = list(schedule)
    while True:
        latest: dict = {}
        used: set = set()
        for k, v in enumerate(result):
            for u in graph.predecessors(v):
                used.add(latest[u])
            latest[v] = k
        seen: set = set()
        dead = set()
        for k, v in enumerate(result):
            if v in seen and k not in used:
                dead.add(k)
            seen.add(v)
        if not dead:
            return result
        result = [v for k, v in enumerate(result) if k not in dead]


def _drop_pass(problem: Problem, sched: list) -> list:
    """One pass of :func:`drop_recomputations` (``sched`` itself when it fails)."""
    g, fixed, budget = problem.graph, problem.fixed_bytes, problem.budget_bytes
    n = len(sched)
    sim = simulate(g, sched, fixed)
    memory = np.asarray(sim.memory, dtype=np.int64).copy()
    latest: dict = {}
    prev = [-1] * n  # previous instance of the same node
    readers_of: list = [[] for _ in range(n)]  # positions reading each instance
    for j, v in enumerate(sched):
        for u in g.predecessors(v):
            readers_of[latest[u]].append(j)
        prev[j] = latest.get(v, -1)
        latest[v] = j
    last_use = [max(r, default=j) for j, r in enumerate(readers_of)]
    dropped = [False] * n

    def alive_before(j: int) -> int:
        i = prev[j]
        while dropped[i]:
            i = prev[i]
        return i

    copies = [j for j in range(n) if prev[j] >= 0]
    copies.sort(key=lambda j: (-g.nodes[sched[j]]["cost"], -j))
    for j in copies:
        i = alive_before(j)
        size = int(g.nodes[sched[j]]["bytes"])
        # Conservative by one position: an in-place reader may have ended instance
        # i one step before its last read.
        lo, hi = last_use[i], j
        if lo < hi and size and int(memory[lo:hi].max()) + size > budget:
            continue
        if lo < hi:
            memory[lo:hi] += size
        last_use[i] = max(last_use[i], last_use[j])
        dropped[j] = True
    # Computations nobody reads any more (their readers were dropped), repeatedly.
    result = drop_unread(g, [v for j, v in enumerate(sched) if not dropped[j]])
    try:
        final = simulate(g, result, fixed)
    except InvalidScheduleError:  # a bug here must not cost the user a plan
        return sched
    if final.peak_bytes > budget or final.cost > sim.cost:
        return sched
    return result
