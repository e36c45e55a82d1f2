"""Problem and Plan: the solver contract's input and output (no TensorFlow)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Literal, Sequence

import networkx as nx

Node = Hashable
Status = Literal["optimal", "feasible", "heuristic", "unchanged"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a solver is asked.

    Parameters
    ----------
    graph : networkx.DiGraph
        Dataflow graph. Edge ``u -> v``: ``v`` consumes ``u``'s output. Node attributes:
        ``bytes`` (int, output size), ``cost`` (float >= 0, compute cost of one run),
        ``recomputable`` (bool; a node that is not must run exactly once) and,
        optionally, ``phase`` ("forward", "backward", "update", "input") and
        ``writers`` (nodes no recomputation of this one may follow: the writes of
        variables a recomputable loop reads; :func:`tfremat.solvers.solve` enforces
        it, solvers need not). Graph attribute ``order``: the reference topological order (the schedule
        with no recomputation).
    budget_bytes : int
        The peak the schedule must not exceed, fixed bytes included.
    fixed_bytes : int
        Bytes live for the whole step (variables, inputs), added at every position.
    time_limit_s : float or None
        Wall-clock limit for solvers that search; None means the solver's default.
    """

    graph: nx.DiGraph
    budget_bytes: int
    fixed_bytes: int = 0
    time_limit_s: float | None = None

    @property
    def order(self) -> list[Node]:
        order = self.graph.graph.get("order")
        if order is None:
            order = list(nx.lexicographical_topological_sort(self.graph, key=str))
        return list(order)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A solver's answer, checked by :func:`tfremat.simulate.simulate`.

    ``schedule`` lists node ids in execution order; a repeated id is a recomputation
    and every consumer binds to the most recent computation of each input.
    ``kept`` lists the forward values held for a later phase without recomputation
    (see :func:`kept_values`); ``fixed_bytes`` is the problem's fixed memory, included
    in every peak. ``tfremat.remat`` also fills ``allocator_peak_bytes``, the cautious
    allocator peak the budget is checked against, and ``allocator_expected_bytes``,
    the best guess of what the allocator reports (:mod:`tfremat.allocator`;
    :attr:`expected_peak_bytes`).
    """

    schedule: tuple[Node, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    cost: float
    baseline_cost: float
    solver: str
    status: Status
    cost_lower_bound: float | None = None
    solve_s: float = 0.0
    kept: tuple[Node, ...] = ()
    fixed_bytes: int = 0
    # What the allocator's statistics are predicted to report at most (its chunks, not
    # the requests: tfremat.allocator); None where the plan was not checked that way.
    allocator_peak_bytes: int | None = None
    # The allocator in use's model alone (allocator_peak_bytes takes the larger of two
    # where the statistics leave small requests out): the best guess of the peak the
    # statistics report, expected_peak_bytes. None where not checked that way.
    allocator_expected_bytes: int | None = None

    @property
    def recomputed(self) -> tuple[Node, ...]:
        """Nodes computed more than once, in order of first recomputation."""
        seen: set = set()
        out: list = []
        for v in self.schedule:
            if v in seen and v not in out:
                out.append(v)
            seen.add(v)
        return tuple(out)

    @property
    def expected_peak_bytes(self) -> int:
        """The peak the allocator's statistics are predicted to report for this plan.

        The model of the allocator in use (``allocator_expected_bytes``: its chunks,
        without the requests it leaves out of its statistics) where
        :func:`tfremat.remat` checked the plan that way, else the simulator's tensors
        (``predicted_peak_bytes``). This is the number to compare with
        ``tf.config.experimental.get_memory_info(device)['peak']``; the budget is
        checked against the more cautious ``allocator_peak_bytes``
        (docs/keras.md, session 33: how the three compare with measured peaks).
        """
        if self.allocator_expected_bytes is not None:
            return self.allocator_expected_bytes
        return self.predicted_peak_bytes

    @property
    def extra_cost(self) -> float:
        return self.cost - self.baseline_cost

    @property
    def extra_cost_fraction(self) -> float:
        return self.extra_cost / self.baseline_cost if self.baseline_cost else 0.0

Solver = Callable[[Problem], Plan]


def kept_values(graph: nx.DiGraph, schedule: Sequence[Node]) -> tuple[Node, ...]:
    """Forward values with bytes that a later phase consumes and that are never recomputed.

    Graphs without ``phase`` attributes have no such split: there, every node with
    bytes computed once and consumed at least once counts as kept.
    """
    counts: dict = {}
    for v in schedule:
        counts[v] = counts.get(v, 0) + 1
    out = []
    for v in graph.nodes:
        attrs = graph.nodes[v]
        if counts.get(v, 0) != 1 or attrs.get("bytes", 0) <= 0:
            continue
        phase = attrs.get("phase", "forward")
        if phase != "forward":
            continue
        succ = list(graph.successors(v))
        if not succ:
            continue
        if "phase" not in attrs or any(
            graph.nodes[s].get("phase", "forward") != "forward" for s in succ
        ):
            out.append(v)
    return tuple(out)
