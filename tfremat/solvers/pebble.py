"""Low-memory schedules with unlimited recomputation: a backward pebbling search.

For budgets below what reordering and eviction planning reach, on graphs whose every
node may be recomputed and reordered (no backward phase, e.g. the random layered
graphs), this planner searches the black-pebble game directly, backwards in time.

The game, backwards. Read a schedule from its end: let ``S`` be the set of values
that the rest of the schedule still reads (for the last op alone: that op). The op
``x`` that runs just before that rest is a member of ``S`` (its value is needed), and
while it runs the live values are ``S`` and ``x``'s inputs; the rest from ``x`` on
then needs ``S - {x} | preds(x)``. So a schedule that computes ``t`` from nothing is
a chain ``S_0 = {t}``, ``S_{k+1} = S_k - {x_k} | preds(x_k)`` with ``x_k`` in
``S_k``, ending at the empty set; the schedule is the ``x_k`` reversed, its peak is
``max_k bytes(S_k | preds(x_k))`` (the simulator's: a value is live at a position
iff a later op reads it, and then it is in ``S``) and its length is the chain's.
Every ancestor of ``t`` is computed: a member leaves ``S`` only when chosen, and a
chosen op's inputs enter it. Choosing, at every step, the member latest in a
topological order gives that order with no recomputation; choosing a member that a
member of ``S`` still reads recomputes it later. Chains always end (each step
replaces a member by members earlier in a topological order, so ``S`` decreases in
the well-founded multiset order) but may be exponentially long: the search caps them.

The search, under a cap: depth-first over chains whose every step fits the cap,
trying members in the order of a rule, memoizing states proven dead (every choice
fails; Zobrist hashes of ``S``), and giving up after ``max_moves`` steps tried or a
chain longer than ``max_len``. Rules (``cap - reserve`` is the rule's soft limit on
the state after a step):

- ``"late"``: members no other member reads (choosing them recomputes nothing),
  latest in the order first, while the state after the step stays under the soft
  limit; otherwise the member leaving the smallest state (a recomputation).
- ``"reserve"``: the latest member while under the soft limit, otherwise the member
  leaving the smallest state.

With ``seed``, the smallest-state choice weighs each state by a per-node log-normal
factor (randomized restarts). Graphs with several sinks get one chain per sink, each
from nothing, concatenated (the optimal peak is the largest sink's: every schedule's
prefix up to a sink's first computation is a schedule for that sink). Exhaustive
(no limits), the search is exact. Measured inside ``auto`` on the random layered
graphs (docs/solver-benchmarks.md): smallest budgets 1.25x the single-op bound on
n100 (a proven lower bound: optimal), 1.06x on n250, 4.0x on n500 and 8.4x on
n1000, where eviction planning reached 1.58x, 1.30x, 4.25x and 8.85x.
"""

from __future__ import annotations

import random
import time
from typing import Hashable, Sequence

import networkx as nx

from ..plan import Problem
from ..simulate import simulate, single_op_lower_bound

__all__ = ["PebbleSearch", "pebble_min_budget", "pebble_plan", "RULES", "CONFIGS", "LATE_CONFIGS"]

Node = Hashable

RULES = ("late", "reserve")


class PebbleSearch:
    """Backward pebbling search on one graph (every node recomputable).

    Parameters
    ----------
    graph : networkx.DiGraph
        Node attribute ``bytes``.
    order : sequence
        A topological order; the rules prefer members late in it.
    """

    def __init__(self, graph: nx.DiGraph, order: Sequence[Node]):
        self.graph = graph
        self.order = list(order)
        n = len(self.order)
        self.n = n
        idx = {v: i for i, v in enumerate(self.order)}
        self.size = [int(graph.nodes[v]["bytes"]) for v in self.order]
        self.preds = [[idx[u] for u in graph.predecessors(v)] for v in self.order]
        self.succs = [[idx[w] for w in graph.successors(v)] for v in self.order]
        rng = random.Random(0)
        self.zob = [rng.getrandbits(64) for _ in range(n)]
        self.sinks = [i for i in range(n) if not self.succs[i]]
        self.why: str | None = None  # why the last run gave up

    def run(self, cap: int, rule: str = "late", reserve: int = 0, max_len: int | None = None,
            max_moves: int | None = None, seed: int | None = None, sigma: float = 0.5,
            deadline: float | None = None) -> list[int] | None:
        """Forward schedule (positions in ``order``) whose peak is at most ``cap``, or None.

        Parameters
        ----------
        cap : int
            Live bytes allowed at every position (fixed bytes excluded).
        rule : str
            One of :data:`RULES`.
        reserve : int
            Bytes the rule keeps free before it starts recomputing.
        max_len : int
            Longest schedule accepted (default ``100 * n + 1000``).
        max_moves : int
            Steps tried, backtracked ones included, before giving up (default
            ``2 * max_len + 10000``).
        seed : int or None
            Randomizes the smallest-state choice (restarts); None: deterministic.
        deadline : float or None
            ``time.perf_counter()`` value after which the search gives up.
        """
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; choose one of {RULES}")
        n = self.n
        if max_len is None:
            max_len = 100 * n + 1000
        if max_moves is None:
            max_moves = 2 * max_len + 10000
        if seed is None:
            w = [1.0] * n
        else:
            r = random.Random(seed)
            w = [r.lognormvariate(0.0, sigma) for _ in range(n)]
        out: list[int] = []
        budget = [max_moves]
        self.why = None
        for t in self.sinks:
            chain = self._chain(t, cap, rule, cap - reserve, max_len - len(out), budget, w,
                                deadline)
            if chain is None:
                return None
            out.extend(reversed(chain))
        return out

    def _chain(self, t, cap, rule, limit, max_len, budget, w, deadline):
        size, preds, succs, zob = self.size, self.preds, self.succs, self.zob
        if size[t] + sum(size[p] for p in preds[t]) > cap:
            self.why = "an op alone exceeds the cap"
            return None
        S: set[int] = {t}
        add = {t: sum(size[p] for p in preds[t])}  # bytes of x's inputs not in S
        m = size[t]
        h = zob[t]
        dead: set[int] = set()
        late = rule == "late"

        def candidates() -> list[int]:
            # Members whose step fits the cap, the rule's first choice last.
            keyed = []
            for x in S:
                a = add[x]
                if m + a > cap:
                    continue
                nxt = m - size[x] + a
                if nxt <= limit and (not late or not any(z in S for z in succs[x])):
                    keyed.append(((0, -x), x))
                else:
                    keyed.append(((1, nxt * w[x], -x), x))
            keyed.sort(reverse=True)
            return [x for _, x in keyed]

        # path: (x chosen, its inputs that entered S, add[x] before); cands: the
        # choices left at each state on the path.
        path: list[tuple[int, list[int], int]] = []
        cands = [candidates()]
        while S:
            if budget[0] <= 0 or len(path) >= max_len:
                self.why = "step limit" if budget[0] <= 0 else "schedule length limit"
                return None
            if deadline is not None and budget[0] % 1024 == 0 and time.perf_counter() > deadline:
                self.why = "deadline"
                return None
            left = cands[-1]
            while left:
                x = left.pop()
                new = [p for p in preds[x] if p not in S]
                h2 = h ^ zob[x]
                for p in new:
                    h2 ^= zob[p]
                if h2 not in dead:
                    break
            else:
                # Every choice from this state fails: it is dead; undo the step
                # that led here.
                dead.add(h)
                cands.pop()
                if not path:
                    self.why = "no chain fits the cap"
                    return None
                x, new, ax = path.pop()
                for p in new:
                    S.discard(p)
                    m -= size[p]
                    h ^= zob[p]
                    del add[p]
                for p in new:
                    for z in succs[p]:
                        if z in S:
                            add[z] += size[p]
                S.add(x)
                m += size[x]
                h ^= zob[x]
                add[x] = ax
                for z in succs[x]:
                    if z in S:
                        add[z] -= size[x]
                continue
            budget[0] -= 1
            # x leaves S (its consumers in S now miss it); its missing inputs enter.
            ax = add.pop(x)
            S.discard(x)
            m -= size[x]
            h ^= zob[x]
            for z in succs[x]:
                if z in S:
                    add[z] += size[x]
            for p in new:
                S.add(p)
                m += size[p]
                h ^= zob[p]
            newset = set(new)
            for p in new:
                add[p] = sum(size[q] for q in preds[p] if q not in S)
            for p in new:
                for z in succs[p]:
                    if z in S and z not in newset:
                        add[z] -= size[p]
            path.append((x, new, ax))
            cands.append(candidates())
        return [x for x, _, _ in path]

    def nodes(self, positions: list[int]) -> list[Node]:
        order = self.order
        return [order[i] for i in positions]


#: (order, rule, reserve as a fraction of the single-op bound) tried by
#: :func:`pebble_min_budget`, best first as measured on the random layered graphs:
#: ``late`` on the reference order reached the lowest budgets on n500 and n1000,
#: ``reserve`` on n250 (1.05x vs 1.10x).
CONFIGS = (("ref", "late", 0.0), ("ref", "reserve", 0.1), ("low", "late", 0.1))
#: The configs that recompute little when the budget is not tight (``reserve``
#: recomputes from the first step over its soft limit: n1000 at 0.8 x the reference
#: peak, +3,300 % compute against +16 % for ``late``); :func:`pebble_plan` tries
#: them first.
LATE_CONFIGS = (("ref", "late", 0.0), ("low", "late", 0.1))


def pebble_plan(problem: Problem, orders: dict, deadline: float,
                configs=LATE_CONFIGS + (("ref", "reserve", 0.1),)):
    """The cheapest schedule within ``problem.budget_bytes`` that the configs find.

    ``orders`` maps the names used in ``configs`` ("ref", "low") to orders. Each
    config runs once at the budget, until ``deadline``. Returns the schedule (node
    list) or None.
    """
    g, fixed, budget = problem.graph, problem.fixed_bytes, problem.budget_bytes
    if budget < single_op_lower_bound(g, fixed):
        return None
    lb = single_op_lower_bound(g, 0)
    searches: dict = {}
    best = None
    for name, rule, frac in configs:
        if name not in orders or time.perf_counter() > deadline:
            continue
        ps = searches.get(name) or searches.setdefault(name, PebbleSearch(g, orders[name]))
        pos = ps.run(budget - fixed, rule, int(frac * lb), deadline=deadline)
        if pos is not None:
            sched = ps.nodes(pos)
            sim = simulate(g, sched, fixed)
            if sim.peak_bytes <= budget and (best is None or sim.cost < best[0]):
                best = (sim.cost, sched)
    return None if best is None else best[1]


def pebble_min_budget(problem: Problem, orders: dict, deadline: float, hi: int | None = None,
                      configs=CONFIGS):
    """Smallest budget at which a pebbling search finds a schedule, searched downwards.

    For each config in turn, from ``hi`` (default: the sum of all bytes) or the best
    peak so far: step the cap down by a gap that doubles after each success, and
    bisect between the last failure and the last success. The search is not monotone
    in the cap, so every simulated peak found counts. Starting from the top suits
    large graphs, whose smallest budgets lie near what eviction reaches; the doubling
    gap reaches the far lower minima of small graphs in a few steps.

    Returns
    -------
    (int, list) or (None, None)
        The lowest simulated peak found (fixed bytes included) and its schedule.
    """
    g, fixed = problem.graph, problem.fixed_bytes
    lb = single_op_lower_bound(g, fixed)
    best: tuple[int, list] | None = None
    searches: dict = {}
    for name, rule, frac in configs:
        if name not in orders or time.perf_counter() > deadline:
            continue
        ps = searches.get(name) or searches.setdefault(name, PebbleSearch(g, orders[name]))
        top = sum(ps.size) if hi is None else hi - fixed
        if best is not None:
            top = min(top, best[0] - fixed)
        lo = lb - fixed - 1  # below the single-op bound: fails
        gap = max(1, (top - lo) // 64)
        while top - lo > max(1, top // 500) and time.perf_counter() < deadline:
            mid = max(lo + 1, top - gap) if gap else (lo + top + 1) // 2
            pos = ps.run(mid, rule, int(frac * (lb - fixed)), deadline=deadline)
            if pos is None:
                lo = mid
                gap = 0  # bisect from now on
                continue
            sched = ps.nodes(pos)
            peak = simulate(g, sched, fixed).peak_bytes
            if best is None or peak < best[0]:
                best = (peak, sched)
            top = min(mid, peak - fixed) - 1
            if gap:
                gap *= 2
    if best is None:
        return None, None
    return best
