"""Proven lower bounds on the peak of a schedule, beyond the single-op bound.

:func:`once_lower_bound` strengthens the single-op bound (largest op's inputs + output
+ fixed bytes) for schedules in which a given set of nodes runs exactly once: the
non-recomputable nodes of a traced TensorFlow step (always), or the backward ops of
a training graph (the plans tfremat's rewriter can emit, and every plan that never
recomputes a gradient).

Argument. Let ``O`` be the nodes that run exactly once and ``v`` any node; look at
the position ``j`` of ``v``'s first computation. Its inputs' bound computations and
its own output are live at ``j`` (the single-op bound). Let ``u`` in ``O`` be an
ancestor of ``v`` with a consumer ``w`` that is a descendant of ``v``. Every
computation of ``v`` follows a computation of each ancestor, so ``u``'s only
computation comes before ``j``; every computation of ``w`` follows some computation
of ``v``, so it comes after ``j``, and it binds to ``u``'s only computation. Hence
``u`` is live at ``j`` too. Distinct nodes are distinct computations, so the peak is
at least ``fixed + bytes(preds(v) | {v} | U(v))`` with ``U(v)`` those ``u`` (less one
input of ``v``'s size outside ``U(v)`` when ``v`` is ``inplace``: it may take over that
buffer); the bound is the maximum over ``v``. It does not depend on the order: reordering cannot go
below it.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence

import networkx as nx

from ..plan import Problem
from ..simulate import single_op_lower_bound

__all__ = ["once_lower_bound", "backward_once", "fixed_order_lower_bound", "recompute_lower_bound"]

Node = Hashable



def _once_set(graph, once) -> set:
    """The nodes that run exactly once: given, computed from the graph, or by default
    the non-recomputable ones."""
    if once is None:
        return {v for v, a in graph.nodes(data=True) if not a.get("recomputable", True)}
    if callable(once):
        return set(once(graph))
    return set(once)

def backward_once(graph: nx.DiGraph) -> set:
    """Nodes that are not forward values: backward and update ops, and every node
    that is not recomputable."""
    return {
        v for v, a in graph.nodes(data=True)
        if a.get("phase", "forward") != "forward" or not a.get("recomputable", True)
    }


def once_lower_bound(graph: nx.DiGraph, fixed_bytes: int = 0,
                     once: Iterable[Node] | Callable[[nx.DiGraph], Iterable[Node]] | None = None,
                     ) -> int:
    """Lower bound on the peak of any schedule in which the nodes ``once`` run once.

    Parameters
    ----------
    graph : networkx.DiGraph
        Node attribute ``bytes``.
    fixed_bytes : int
        Added to the bound.
    once : iterable of nodes, or a callable graph -> nodes, optional
        Nodes assumed to run exactly once. Default: the non-recomputable nodes
        (then the bound holds for every valid schedule).

    Returns
    -------
    int
        At least :func:`tfremat.simulate.single_op_lower_bound`.
    """
    once = _once_set(graph, once)
    best = single_op_lower_bound(graph, fixed_bytes)
    if not once:
        return best
    size = {v: int(a["bytes"]) for v, a in graph.nodes(data=True)}
    # For each u in O with bytes: the nodes v strictly between u and one of its
    # consumers (u an ancestor of v, the consumer a descendant of v).
    extra: dict[Node, set] = {}
    for u in once:
        if size[u] <= 0:
            continue
        desc_u = nx.descendants(graph, u)
        between: set = set()
        for w in graph.successors(u):
            between |= desc_u & nx.ancestors(graph, w)
        for v in between:
            extra.setdefault(v, set()).add(u)
    for v, us in extra.items():
        live = set(graph.predecessors(v)) | {v} | us
        if graph.nodes[v].get("inplace") and size[v] > 0:
            # v may take over the buffer of an input of its size read for the last
            # time (simulate.py); not one of ``us``, which are read later.
            reusable = [p for p in graph.predecessors(v) if size[p] == size[v] and p not in us]
            if reusable:
                live.discard(reusable[0])
        best = max(best, int(fixed_bytes) + sum(size[x] for x in live))
    return int(best)


def fixed_order_lower_bound(graph: nx.DiGraph, fixed_bytes: int = 0,
                            once: Iterable[Node] | Callable[[nx.DiGraph], Iterable[Node]] | None = None,
                            order: Sequence[Node] | None = None) -> int:
    """Lower bound on the peak of schedules that keep the reference order of first
    occurrences (or ``order``, a topological order) and run the nodes ``once`` once:
    the plans tfremat's TensorFlow rewriter emits (``once`` defaults to the
    non-recomputable nodes).

    Argument: at ``v``'s first computation, every ``u`` in ``once`` placed before
    ``v`` in the reference order has run (its only computation), and each consumer
    of ``u`` placed after ``v`` has not yet run its first computation, which will
    read that one; so ``u`` is live, besides ``v``'s inputs and output (less one
    input of ``v``'s size that is not such a ``u``, when ``v`` is ``inplace``).
    Linear time: one sweep over the reference order.
    """
    once = _once_set(graph, once)
    order = Problem(graph, 0).order if order is None else list(order)
    pos = {v: i for i, v in enumerate(order)}
    n = len(order)
    size = [int(graph.nodes[v]["bytes"]) for v in order]
    last = [max((pos[w] for w in graph.successors(v)), default=i) for i, v in enumerate(order)]
    held = [v in once for v in order]
    # cover[j]: bytes of values in ``once`` strictly between their position and
    # their last consumer's.
    diff = [0] * (n + 1)
    for i in range(n):
        if held[i] and size[i] > 0 and last[i] > i + 1:
            diff[i + 1] += size[i]
            diff[last[i]] -= size[i]
    best = single_op_lower_bound(graph, fixed_bytes)
    cover = 0
    for j, v in enumerate(order):
        cover += diff[j]
        ins = [pos[u] for u in graph.predecessors(v)]
        free = [i for i in ins if not (held[i] and last[i] > j)]  # not in cover
        need = cover + size[j] + sum(size[i] for i in free)
        if graph.nodes[v].get("inplace") and size[j] > 0 and any(size[i] == size[j] for i in free):
            need -= size[j]
        best = max(best, int(fixed_bytes) + need)
    return int(best)


def recompute_lower_bound(graph: nx.DiGraph, fixed_bytes: int = 0, depth: int = 6,
                          max_steps: int = 200_000) -> int:
    """Lower bound on the peak of every schedule, recomputation and reordering allowed.

    The "last computed member" argument, unrolled ``depth`` times. Call a node set
    ``S`` *held at* position ``j`` when every member has a computation at or before
    ``j`` that is live at ``j``. Then the peak is at least ``bytes(S)`` (distinct
    nodes are distinct computations), and, looking at the member ``x`` whose
    computation is latest (at ``i <= j``): every other member's computation comes
    before ``i`` and is read at or after ``j >= i``, so it is live at ``i``; ``x``'s
    inputs are bound at ``i`` to computations before ``i``, live there too. So at
    ``i`` the live values cover ``S | preds(x)`` (peak at least its bytes), and
    ``S - {x} | preds(x)`` is held at ``i``. Which member is latest is unknown, so

        F_0(S) = bytes(S)
        F_d(S) = max(bytes(S), min over x in S of
                     max(bytes(S | preds(x)), F_{d-1}(S - {x} | preds(x))))

    is a lower bound on the peak whenever ``S`` is held somewhere (induction on
    ``d``). Every node ``v`` is computed at least once, and at that position ``{v}``
    is held: the peak is at least ``fixed + max_v F_d({v})``; ``F_1({v})`` is the
    single-op bound.

    Computation: any value at most ``F_d`` is still a lower bound, so the search may
    stop early and be memoized freely. It keeps the best bound so far ``beta`` and
    skips what cannot beat it: a member whose step alone exceeds ``beta`` counts
    with that step only; once one member's branch is at most ``beta`` the state
    returns ``bytes(S)``; after ``max_steps`` states every state returns ``bytes(S)``.
    Deterministic. Graphs with an ``inplace`` node (an op that may reuse an input's
    buffer) get the single-op bound: the argument counts every input.

    Measured on the random layered graphs (docs/solvers.md): at the default depth
    6, n100 1.251x the single-op bound (optimal: ``auto`` meets it) and n1000 1.056x
    (0.1 s); at depth 20 n1000 1.115x (6 s); n250 and n500 1.000x at any depth tried.
    """
    base = single_op_lower_bound(graph, 0)
    if any(a.get("inplace") for _, a in graph.nodes(data=True)):
        return int(base + fixed_bytes)
    nodes = list(graph.nodes)
    idx = {v: i for i, v in enumerate(nodes)}
    size = [int(graph.nodes[v]["bytes"]) for v in nodes]
    preds = [[idx[u] for u in graph.predecessors(v)] for v in nodes]
    memo: dict = {}
    beta = base
    steps = [max_steps]

    def bound(S: frozenset, m: int, d: int) -> int:
        # A value <= F_d(S), exceeding beta only when F_d(S) does.
        if d == 0 or m > beta:
            return m
        key = (S, d)
        got = memo.get(key)
        if got is not None:
            return got
        if steps[0] <= 0:
            return m
        steps[0] -= 1
        kids = []
        for x in S:
            new = [p for p in preds[x] if p not in S]
            kids.append((m + sum(size[p] for p in new), x, new))
        kids.sort(key=lambda k: k[0])
        low = None
        for step, x, new in kids:
            if step > beta:
                c = step  # <= the true branch value; it already beats beta
            else:
                c = max(step, bound(S.difference((x,)).union(new), step - size[x], d - 1))
                if c <= beta:
                    memo[key] = m
                    return m  # the min cannot beat beta: bytes(S) is a safe value
            low = c if low is None else min(low, c)
        out = m if low is None else max(m, low)
        memo[key] = out
        return out

    starts = sorted(range(len(nodes)),
                    key=lambda v: -(size[v] + sum(size[p] for p in preds[v])))
    for d in range(1, depth + 1):
        for v in starts:
            beta = max(beta, bound(frozenset((v,)), size[v], d))
            if steps[0] <= 0:
                break
    return int(beta + fixed_bytes)
