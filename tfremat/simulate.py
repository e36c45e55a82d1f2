"""The independent checker: peak memory and cost of a schedule (no TensorFlow).

Accounting (the one Checkmate and Moccasin use, see the README of
``shared/benchmarks/checkmate-graphs``): a schedule is a sequence of node ids, a
repeated id being a recomputation. When node ``v`` runs at position ``j`` each input
binds to that input's most recent computation before ``j``. Memory at ``j`` is the
size of every earlier computation that still has a consumer bound to it at a position
``>= j``, plus the size of ``v``'s output, plus the fixed bytes. The peak is the
maximum over ``j``; the cost is the sum of node costs over the sequence.

One optional refinement for TensorFlow graphs: a node with ``inplace=True`` (an
elementwise kernel that forwards an input buffer) reuses the buffer of an input of
the same size whose last use it is, so that input is not counted at its position;
with ``free=True`` (an executor left to its own order) and an ``inplace_blockers``
attribute (input -> readers that may run beside it, ``tfremat.graph``), only where
none of those reads the same computation.
Graphs without the attribute (the benchmark files) get the plain accounting.
"""

from __future__ import annotations

import dataclasses
import graphlib
from typing import Hashable, Iterable, Mapping, Sequence

import networkx as nx
import numpy as np

from .errors import InvalidScheduleError

Node = Hashable


@dataclasses.dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`.

    Attributes
    ----------
    peak_bytes : int
        Maximum of ``memory``.
    cost : float
        Sum of node costs over the schedule.
    memory : numpy.ndarray
        Bytes live at each position (fixed bytes included), int64.
    peak_position : int
        First position where the peak is reached.
    """

    peak_bytes: int
    cost: float
    memory: np.ndarray
    peak_position: int


def simulate(graph: nx.DiGraph, schedule: Sequence[Node], fixed_bytes: int = 0, free: bool = False) -> Simulation:
    """Check ``schedule`` against ``graph`` and return its peak memory and cost.

    Parameters
    ----------
    graph : networkx.DiGraph
        Node attributes ``bytes`` (int), ``cost`` (number), optional ``recomputable``
        (default True).
    schedule : sequence of node ids
        Execution order; repeated ids are recomputations.
    fixed_bytes : int
        Added at every position.
    free : bool
        The executor runs without the rewrite's ordering edges (the step as
        traced): an ``inplace`` op is not counted in an input's buffer that a
        reader in its ``inplace_blockers`` also reads (:func:`buffer_lifetimes`).

    Returns
    -------
    Simulation

    Raises
    ------
    InvalidScheduleError
        If a node is unknown, runs before one of its inputs was computed, is never
        computed, or a non-recomputable node runs more than once.
    """
    n = len(schedule)
    if n == 0:
        if graph.number_of_nodes():
            raise InvalidScheduleError("empty schedule for a non-empty graph")
        return Simulation(int(fixed_bytes), 0.0, np.zeros(0, np.int64), 0)
    sizes, last_use, _ = buffer_lifetimes(graph, schedule, free=free)
    cost = schedule_cost(graph, schedule)
    diff = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, np.arange(n), sizes)
    np.add.at(diff, last_use + 1, -sizes)
    memory = np.cumsum(diff[:n]) + int(fixed_bytes)
    pos = int(np.argmax(memory))
    return Simulation(int(memory[pos]), float(cost), memory, pos)


def buffer_lifetimes(graph: nx.DiGraph, schedule: Sequence[Node], free: bool = False):
    """The buffers of ``schedule``: who allocates what, and until when.

    Returns ``(sizes, last_use, takes_over)``: position ``j`` allocates ``sizes[j]``
    bytes, live through position ``last_use[j]``; ``takes_over`` maps a position
    whose ``inplace`` node forwards an input's buffer (same size, at that input's
    last use) to the position that allocated it (that input's ``last_use`` is then
    one position earlier: the output holds the buffer from there on).

    With ``free`` the step runs without ordering edges, so a takeover also needs
    that no reader the node's ``inplace_blockers`` names for that input (one that is
    not its ancestor, so it may run beside it or after it) reads the same
    computation: TensorFlow forwards a buffer only when nothing else holds it. The
    rewrite's strict ordering makes each anchored big op wait for the readers of big
    tensors scheduled before it, so plans it emits keep the plain rule.

    Raises
    ------
    InvalidScheduleError
        As :func:`simulate`.
    """
    n = len(schedule)
    nodes = graph.nodes
    last_comp: dict = {}
    last_use = np.arange(n, dtype=np.int64)
    sizes = np.empty(n, dtype=np.int64)
    inplace: list[tuple[int, list[tuple[int, Node]]]] = []
    # The readers of each computation of an input some inplace op may be kept from
    # taking over (node attribute ``inplace_blockers``, ``tfremat.graph``).
    watched = {u for _, b in graph.nodes(data="inplace_blockers") if b for u in b} if free else ()
    readers: dict[int, set] = {}
    for j, v in enumerate(schedule):
        if v not in nodes:
            raise InvalidScheduleError(f"schedule position {j}: unknown node {v!r}")
        attrs = nodes[v]
        if v in last_comp and not attrs.get("recomputable", True):
            raise InvalidScheduleError(
                f"schedule position {j}: node {v!r} is not recomputable but runs twice"
            )
        bound = []
        for u in graph.predecessors(v):
            i = last_comp.get(u)
            if i is None:
                raise InvalidScheduleError(
                    f"schedule position {j}: node {v!r} runs before its input {u!r}"
                )
            if last_use[i] < j:
                last_use[i] = j
            bound.append((i, u))
            if u in watched:
                readers.setdefault(i, set()).add(v)
        last_comp[v] = j
        sizes[j] = attrs["bytes"]
        if attrs.get("inplace") and attrs["bytes"] > 0:
            inplace.append((j, bound))
    takes_over: dict[int, int] = {}
    for j, bound in inplace:
        blockers = (nodes[schedule[j]].get("inplace_blockers") or {}) if free else {}
        for i, u in bound:
            if last_use[i] == j and sizes[i] == sizes[j] and not readers.get(i, set()).intersection(
                    blockers.get(u, ())):
                last_use[i] = j - 1  # the output takes over this buffer
                takes_over[j] = i
                break
    if len(last_comp) != graph.number_of_nodes():
        missing = [v for v in graph.nodes if v not in last_comp][:5]
        raise InvalidScheduleError(f"nodes never computed, e.g. {missing!r}")
    return sizes, last_use, takes_over


def check_precedences(graph: nx.DiGraph, schedule: Sequence[Node]) -> None:
    """Check the graph's precedences without bytes (graph attribute ``order_edges``:
    TensorFlow control edges, ``Shape`` ops after their input): for each ``(u, v)``
    the first computation of ``u`` comes before the first computation of ``v``.

    :func:`simulate` leaves them out (they hold no memory); a rewrite of a schedule
    that breaks one would close a cycle with the control edge itself.

    Raises
    ------
    InvalidScheduleError
        For the first precedence the schedule breaks.
    """
    edges = graph.graph.get("order_edges", ())
    if not edges:
        return
    first: dict = {}
    for j, v in enumerate(schedule):
        first.setdefault(v, j)
    for u, v in edges:
        if u in first and v in first and first[u] > first[v]:
            raise InvalidScheduleError(
                f"node {v!r} first runs at position {first[v]}, before {u!r} (position "
                f"{first[u]}), which must precede it (a control edge or a shape read)"
            )


def reread_after_write(graph: nx.DiGraph, schedule: Sequence[Node]) -> set:
    """Nodes ``schedule`` recomputes after one of their ``writers`` ran.

    A pure loop (``graph.build_graph``) reads variables; a copy of it after a write
    of one of them would read the new value. Solvers do not see this constraint:
    :func:`tfremat.solvers.solve` plans again with such nodes kept.
    """
    done: set = set()
    bad: set = set()
    nodes = graph.nodes
    for v in schedule:
        if v in done and any(w in done for w in nodes[v].get("writers", ())):
            bad.add(v)
        done.add(v)
    return bad


def reference_simulation(graph: nx.DiGraph, fixed_bytes: int = 0) -> Simulation:
    """Simulate the reference order (graph attribute ``order``, else a topological sort)."""
    order = graph.graph.get("order")
    if order is None:
        order = list(nx.topological_sort(graph))
    return simulate(graph, order, fixed_bytes)


def single_op_lower_bound(graph: nx.DiGraph, fixed_bytes: int = 0) -> int:
    """A proven lower bound on any schedule's peak: the largest op's inputs + output + fixed.

    An ``inplace`` op may take over the buffer of one input of its own size (at that
    input's last use), so for it one such input is not counted.
    """
    best = 0
    for v in graph.nodes:
        own = int(graph.nodes[v]["bytes"])
        ins = [int(graph.nodes[u]["bytes"]) for u in graph.predecessors(v)]
        need = own + sum(ins)
        if graph.nodes[v].get("inplace") and own > 0 and own in ins:
            need -= own
        best = max(best, need)
    return int(best + fixed_bytes)


def schedule_cost(graph: nx.DiGraph, schedule: Iterable[Node]) -> float:
    return float(sum(graph.nodes[v]["cost"] for v in schedule))


def free_running_order(graph: nx.DiGraph, schedule: Sequence[Node]) -> list:
    """The order an executor without ordering edges takes for ``schedule``'s ops.

    TensorFlow's executor runs every op as soon as its inputs are ready, whatever
    the program order: an optimizer's ``momentum * m`` reads variables only and runs
    at the start of the step, holding its output through the forward and backward
    passes (an SGD-momentum MLP: 5 MiB more than the program order, measured). This
    orders each op by its depth (longest chain of data and control predecessors),
    ties in ``schedule`` order: every op as early as its inputs allow, the way a
    free executor with enough threads would take them. ``schedule`` must compute
    each node once.

    Raises
    ------
    InvalidScheduleError
        If ``schedule`` repeats a node.
    """
    pos = {}
    for j, v in enumerate(schedule):
        if v in pos:
            raise InvalidScheduleError(f"node {v!r} is computed twice; free_running_order takes plain orders")
        pos[v] = j
    preds = _waits_for(graph, pos)
    depth: dict = {}
    # graphlib, not schedule order: a graph with the edges Grappler's regrouping
    # gives (tfremat.graph.regrouped) may read a constant the schedule runs later.
    for v in graphlib.TopologicalSorter(preds).static_order():
        depth[v] = 1 + max((depth[u] for u in preds[v]), default=-1)
    return sorted(pos, key=lambda v: (depth[v], pos[v]))


def _waits_for(graph: nx.DiGraph, nodes) -> dict:
    """Node of ``nodes`` -> the set of nodes of ``nodes`` it waits for: its data
    predecessors and its ``order_edges`` sources."""
    preds: dict = {v: {u for u in graph.predecessors(v) if u in nodes} for v in nodes}
    for u, v in graph.graph.get("order_edges", ()):
        if u in preds and v in preds:
            preds[v].add(u)
    return preds


def scratch_peak(
    graph: nx.DiGraph,
    order: Sequence[Node],
    fixed_bytes: int = 0,
    scratch: Mapping[Node, int] | None = None,
    free: bool = False,
) -> int:
    """Peak memory of ``order`` (as :func:`simulate`) with each op's kernel
    ``scratch`` (op -> bytes) held while it runs, and beside it the largest scratch
    of an op that may run at the same time: one that is neither its ancestor nor
    its descendant through data edges and the graph's ``order_edges``.

    The executor's timing decides whether two such kernels overlap, and no cost
    model predicts it: float16 convolution gradients (Eigen kernels, 32 MiB of
    scratch each at ``keras_sweep.py upsample_fp16``'s size) ran side by side on
    one call in three, 69.4 MiB against 49.3, where :func:`parallel_peak` with
    the modelled costs ran them one after the other. So any pair that may overlap
    is counted. ``order`` must compute each node once.

    Raises
    ------
    InvalidScheduleError
        As :func:`simulate`, or if ``order`` repeats a node.
    """
    if len(set(order)) != len(order):
        raise InvalidScheduleError("scratch_peak takes plain orders: a node is computed twice")
    memory = simulate(graph, order, fixed_bytes, free=free).memory
    held = {v: int(b) for v, b in (scratch or {}).items() if b and v in graph}
    if not held:
        return int(memory.max(initial=int(fixed_bytes)))
    ranked = sorted(held, key=held.get, reverse=True)
    bit = {v: 1 << i for i, v in enumerate(ranked)}
    preds = _waits_for(graph, set(graph))
    ancestors: dict = {}  # node -> bit mask of the scratch ops it depends on
    for v in graphlib.TopologicalSorter(preds).static_order():
        mask = 0
        for u in preds[v]:
            mask |= ancestors[u] | bit.get(u, 0)
        ancestors[v] = mask
    beside: dict = {}  # scratch op -> the largest scratch that may run beside it
    for v in ranked:
        w = next((w for w in ranked if w != v and not (ancestors[v] & bit[w]) and not (ancestors[w] & bit[v])), None)
        beside[v] = held[w] if w is not None else 0
    return max(int(m) + held.get(v, 0) + beside.get(v, 0) for m, v in zip(memory, order))


def parallel_peak(
    graph: nx.DiGraph,
    order: Sequence[Node],
    fixed_bytes: int = 0,
    workers: int = 2,
    scratch: Mapping[Node, int] | None = None,
) -> int:
    """Peak memory of ``order``'s ops run the way TensorFlow's executor runs a step
    without ordering edges: ``workers`` threads, each op started as soon as its inputs
    (and ``order_edges`` predecessors) are done and a thread is free, ready ops in
    ``order``'s order, each lasting its ``cost``.

    An op's output is allocated when it starts; a buffer is freed when its last
    reader finishes; an ``inplace`` op takes over an input of its size only when it
    is that input's last unfinished reader. One order cannot show two big ops running
    side by side, each holding what it reads: this can. Measured on a 2-D attention
    model run as traced (``benchmarks/keras_sweep.py attention2d``): 37.0 MiB where
    the free-running order (:func:`free_running_order`) gives 28.2. ``order`` must
    compute each node once.

    ``scratch`` (op -> bytes) is kernel scratch space, held from an op's start to
    its end: two big kernels side by side hold both. Measured on a mixed_float16
    upsampling CNN (``keras_sweep.py upsample_fp16``) run as traced: 49.3 MiB on
    two calls and 69.4 on a third, where two float16 convolution gradients ran
    together; the single order with each op's scratch simulates to 47.9.

    Raises
    ------
    InvalidScheduleError
        If ``order`` repeats a node or leaves one out.
    """
    import heapq

    pos: dict = {}
    for j, v in enumerate(order):
        if v in pos:
            raise InvalidScheduleError(f"node {v!r} is computed twice; parallel_peak takes plain orders")
        pos[v] = j
    if len(pos) != graph.number_of_nodes():
        raise InvalidScheduleError("parallel_peak needs every node of the graph once")
    nodes = graph.nodes
    extra = {v: int(b) for v, b in (scratch or {}).items() if v in pos and b}
    after: dict = {v: set(graph.successors(v)) for v in pos}
    for u, v in graph.graph.get("order_edges", ()):
        if u in pos and v in pos:
            after[u].add(v)
    pending = {v: 0 for v in pos}
    for u in pos:
        for c in after[u]:
            pending[c] += 1
    readers = {v: graph.out_degree(v) for v in pos}  # unfinished data readers
    held: dict = {}  # node -> bytes its output holds now
    mem = peak = int(fixed_bytes)
    ready = [(pos[v], v) for v in pos if pending[v] == 0]
    heapq.heapify(ready)
    running: list = []
    t = 0.0
    while ready or running:
        while ready and len(running) < max(1, workers):
            _, v = heapq.heappop(ready)
            size = int(nodes[v]["bytes"])
            took = None
            if nodes[v].get("inplace") and size > 0:
                took = next((u for u in graph.predecessors(v) if readers[u] == 1 and held.get(u) == size), None)
            if took is not None:
                held[took] = 0  # the buffer is v's from now on
            else:
                mem += size
                peak = max(peak, mem)
            held[v] = size
            mem += extra.get(v, 0)
            peak = max(peak, mem)
            heapq.heappush(running, (t + float(nodes[v].get("cost", 0.0)), pos[v], v))
        t, _, v = heapq.heappop(running)
        mem -= extra.get(v, 0)
        for u in graph.predecessors(v):
            readers[u] -= 1
            if readers[u] == 0:
                mem -= held.pop(u, 0)
        if readers[v] == 0:
            mem -= held.pop(v, 0)
        for c in after[v]:
            pending[c] -= 1
            if pending[c] == 0:
                heapq.heappush(ready, (pos[c], c))
    return int(peak)
