"""What TensorFlow's allocator reports for a schedule: its chunks, not the requests.

The simulator (``simulate.py``) counts the bytes each tensor asks for. TensorFlow's
allocators report something else: the CPU allocator with oneDNN (the x86 default)
serves requests of 256 KiB and more from a BFC pool ("best fit with coalescing",
``tensorflow/core/common_runtime/bfc_allocator.cc``), ``TF_CPU_ALLOCATOR_USE_BFC=true``
serves every request from one, and so do GPU allocators; each reports the sum of the
*chunks* in use, and a request can sit in a chunk up to twice its size. Measured on
the mixed-precision CNN test model at its smallest budget + 10 %: 42.0 MiB requested
at the peak, 56.0 MiB in chunks (8 MiB tensors in 12 and 14 MiB chunks left by
coalesced 4 and 2 MiB ones), 2 MiB over the budget.

This module replays a schedule's allocations and frees through a model of that pool
(no TensorFlow), so a plan can be checked against the number the allocator will
report. The model follows BFC's rules:

- requests round up to 256 bytes;
- a request takes the smallest free chunk that holds it (ties: the lowest address);
- the chunk is split only when it is at least twice the rounded request (or the
  remainder is 128 MiB or more): otherwise the whole chunk is in use;
- a freed chunk merges with free neighbours in its region;
- when no free chunk holds a request the pool grows by a region: 2 MiB at first, at
  least the request (doubling up to it), and each region that did not have to grow
  for its request doubles the size of the next (``allow_growth``).

What it cannot know: regions made before the step by other work in the process (model
building, earlier signatures) and the executor's own interleaving of ops the schedule
leaves unordered. It is a prediction of the same kind as the simulator's, checked
against measurements in ``tests/test_allocator.py`` and ``docs/design.md``.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Hashable, Iterable, Sequence

import networkx as nx

from .simulate import buffer_lifetimes

MIN_ALLOCATION = 256
# Ops whose bytes are mostly TensorList elements (a while loop's accumulators, one
# element per iteration): many requests of an element's size, not one of the total.
# They are counted at their size outside the pool (an LSTM's 8 KiB elements are
# under the oneDNN pool's 256 KiB; pooled one by one, they round by 256 bytes). Where
# the statistics leave such small elements out, ``StepGraph.counted`` has already
# given their lists no bytes.
LIST_OPS = frozenset({"While", "StatelessWhile", "TensorListFromTensor", "TensorListReserve"})
INITIAL_REGION = 2 << 20
MAX_INTERNAL_FRAGMENTATION = 128 << 20


class _Chunk:
    __slots__ = ("region", "offset", "size", "in_use", "prev", "next")

    def __init__(self, region: int, offset: int, size: int):
        self.region, self.offset, self.size = region, offset, size
        self.in_use = False
        self.prev: _Chunk | None = None
        self.next: _Chunk | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.region, self.offset)


class BFCPool:
    """A model of TensorFlow's BFC allocator with growth (``allow_growth``).

    ``allocate`` returns a handle for ``free``; ``in_use`` and ``peak`` are the
    allocator's statistics (bytes of chunks in use). Regions are ordered by creation
    (the tie-break among equal free chunks; real addresses are the OS's).
    """

    def __init__(self, initial_region: int = INITIAL_REGION):
        self.next_region_bytes = _round(initial_region)
        self.regions: list[int] = []
        self.in_use = 0
        self.peak = 0
        self._free: list[tuple[int, int, int]] = []  # sorted keys of free chunks
        self._by_key: dict[tuple[int, int, int], _Chunk] = {}

    def allocate(self, nbytes: int) -> _Chunk | None:
        """Serve a request of ``nbytes``; None for an empty one."""
        size = _round(nbytes)
        if size == 0:
            return None
        i = bisect.bisect_left(self._free, (size, -1, -1))
        if i == len(self._free):
            self._extend(size)
            i = bisect.bisect_left(self._free, (size, -1, -1))
        chunk = self._take(i)
        if chunk.size >= 2 * size or chunk.size - size >= MAX_INTERNAL_FRAGMENTATION:
            rest = _Chunk(chunk.region, chunk.offset + size, chunk.size - size)
            rest.prev, rest.next = chunk, chunk.next
            if chunk.next is not None:
                chunk.next.prev = rest
            chunk.next, chunk.size = rest, size
            self._insert(rest)
        chunk.in_use = True
        self.in_use += chunk.size
        self.peak = max(self.peak, self.in_use)
        return chunk

    def free(self, chunk: _Chunk | None) -> None:
        if chunk is None:
            return
        chunk.in_use = False
        self.in_use -= chunk.size
        if chunk.next is not None and not chunk.next.in_use:
            self._remove(chunk.next)
            self._absorb(chunk, chunk.next)
        if chunk.prev is not None and not chunk.prev.in_use:
            self._remove(chunk.prev)
            chunk = self._absorb(chunk.prev, chunk)
        self._insert(chunk)

    # -- internals -----------------------------------------------------------
    @staticmethod
    def _absorb(left: _Chunk, right: _Chunk) -> _Chunk:
        """Merge ``right`` into its left neighbour ``left`` (neither in the free list)."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        return left

    def _extend(self, size: int) -> None:
        grew = False
        while size > self.next_region_bytes:
            self.next_region_bytes *= 2
            grew = True
        region = _Chunk(len(self.regions), 0, self.next_region_bytes)
        self.regions.append(region.size)
        if not grew:
            self.next_region_bytes *= 2
        self._insert(region)

    def _insert(self, chunk: _Chunk) -> None:
        key = chunk.key()
        bisect.insort(self._free, key)
        self._by_key[key] = chunk

    def _remove(self, chunk: _Chunk) -> None:
        key = chunk.key()
        del self._free[bisect.bisect_left(self._free, key)]
        del self._by_key[key]

    def _take(self, i: int) -> _Chunk:
        key = self._free.pop(i)
        return self._by_key.pop(key)


def _round(nbytes: int) -> int:
    return -(-int(nbytes) // MIN_ALLOCATION) * MIN_ALLOCATION


@dataclasses.dataclass(frozen=True)
class AllocatorReport:
    """Result of :func:`allocator_peak`.

    Attributes
    ----------
    peak_bytes : int
        The highest allocator statistic over the steps, plus ``outside_bytes``.
    step_peaks : tuple of int
        Each step's own peak (``outside_bytes`` included).
    requested_peak_bytes : int
        The simulator's peak for the same schedule, for comparison.
    region_bytes : tuple of int
        The pool's regions after the last step.
    """

    peak_bytes: int
    step_peaks: tuple[int, ...]
    requested_peak_bytes: int
    region_bytes: tuple[int, ...]


def allocator_peak(
    graph: nx.DiGraph,
    schedule: Sequence[Hashable],
    resident: Iterable[int] = (),
    outside_bytes: int = 0,
    smallest_pooled: int = 0,
    steps: int = 2,
    count_unpooled: bool = True,
) -> AllocatorReport:
    """Replay ``schedule`` ``steps`` times through a :class:`BFCPool`.

    Parameters
    ----------
    graph, schedule
        As for :func:`tfremat.simulate.simulate` (node ``bytes``; ``inplace`` nodes
        take over an input's buffer at its last use, without a request).
    resident : iterable of int
        Sizes of buffers allocated before the first step and never freed (the
        step's variables and optimizer slots).
    outside_bytes : int
        Memory counted by the statistics but not served by the pool (added to
        every peak): constants, arguments, memory held outside the step.
    smallest_pooled : int
        Requests under this many bytes are served by another allocator (the x86
        default CPU allocator serves them apart, under 256 KiB); 0 pools every request.
    count_unpooled : bool
        Count those requests at their size (True) or leave them out, as the x86
        default CPU allocator's statistics do (False).
    steps : int
        Steps replayed back to back on one pool: the first grows the pool, the
        later ones run on its regions (every later step is the same as the second).

    Returns
    -------
    AllocatorReport
    """
    from .simulate import simulate

    resident = [int(b) for b in resident]
    requested = simulate(graph, schedule).peak_bytes + int(outside_bytes) + sum(resident)
    pooled = max(1, int(smallest_pooled))
    # The schedule's buffers, once for every step: which are pooled, which counted
    # apart (a loop's lists always, small requests if ``count_unpooled``), when each
    # is freed (an in-place output frees the buffer it took over instead).
    sizes, last_use, takes_over = buffer_lifetimes(graph, schedule)
    n = len(sizes)
    is_pooled = [False] * n
    counted = [count_unpooled] * n
    for j, nbytes in enumerate(sizes):
        src = takes_over.get(j)
        if src is not None:
            is_pooled[j], counted[j] = is_pooled[src], counted[src]
        elif graph.nodes[schedule[j]].get("op_type") in LIST_OPS:
            counted[j] = True
        else:
            is_pooled[j] = nbytes >= pooled
    handed_on = set(takes_over.values())
    frees_at: dict[int, list[int]] = {}
    for i, j in enumerate(last_use):
        if i not in handed_on:
            frees_at.setdefault(int(j), []).append(i)

    pool = BFCPool()
    unpooled = 0  # resident buffers counted apart
    for b in resident:
        if b >= pooled:
            pool.allocate(b)
        elif count_unpooled:
            unpooled += b
    peaks = []
    for _ in range(max(1, int(steps))):
        handles: list = [None] * n
        apart = 0  # live buffers counted apart
        peak = pool.in_use + unpooled
        for j, nbytes in enumerate(sizes):
            src = takes_over.get(j)
            if src is not None:
                handles[j] = handles[src]
            elif is_pooled[j]:
                handles[j] = pool.allocate(int(nbytes))
            elif counted[j]:
                apart += int(nbytes)
            peak = max(peak, pool.in_use + unpooled + apart)
            for i in frees_at.get(j, ()):
                if is_pooled[i]:
                    pool.free(handles[i])
                    handles[i] = None
                elif counted[i]:
                    apart -= int(sizes[i])
        peaks.append(peak + int(outside_bytes))
    return AllocatorReport(
        peak_bytes=max(peaks),
        step_peaks=tuple(peaks),
        requested_peak_bytes=requested,
        region_bytes=tuple(pool.regions),
    )


# Planning-graph nodes that are not TensorFlow ops and sit at a fixed place beside
# their op (graph.with_scratch, graph.with_call_outputs): never moved.
_PINNED_OPS = frozenset({"_Scratch", "_Outputs", "_Output"})


def nearby_orders(graph: nx.DiGraph, schedule: Sequence[Hashable], count: int, seed: int = 0) -> list[list]:
    """``count`` orders a little apart from ``schedule``: the orders an executor
    that does not follow the schedule exactly may take.

    Each is ``schedule`` after ``len(schedule)`` tries at swapping two neighbours
    chosen at random (``random.Random(seed)``: the same orders on every run) where
    neither reads the other. Every input stays bound to the same computation, so the
    tensors' peak barely moves; the pool's layout may move a lot. Measured on a
    random attention model of ``benchmarks/keras_fuzz.py`` (attn 5, a 12.45 MiB
    budget): 11.38 MiB of chunks for the schedule, up to 12.84 for eight such
    orders, 11.25-13.25 MiB measured on its calls (the profiler's order replayed
    through :class:`BFCPool` gives the measured peak: the pool's rules hold, the
    order is what the model cannot know).
    """
    import random

    rng = random.Random(seed)
    n = len(schedule)
    pinned = [graph.nodes[v].get("op_type") in _PINNED_OPS for v in schedule]
    out = []
    for _ in range(max(0, int(count))):
        s, pin = list(schedule), list(pinned)
        for _ in range(n if n > 1 else 0):
            j = rng.randrange(n - 1)
            a, b = s[j], s[j + 1]
            if pin[j] or pin[j + 1] or a == b or graph.has_edge(a, b) or graph.has_edge(b, a):
                continue
            s[j], s[j + 1] = b, a
        out.append(s)
    return out
