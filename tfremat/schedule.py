"""Build schedules from a set of kept activations (checkpointing), no TensorFlow.

Most solvers decide *which forward outputs to keep* for the backward pass; this turns
that decision into an explicit schedule the simulator can check and the rewriter can
emit: the reference order, where every dropped forward value that a later phase needs
is recomputed (with the dropped values it depends on, back to kept ones) just before
its first use in that phase. A recomputed copy then serves every later use, as in
Chen et al.'s segment checkpointing.
"""

from __future__ import annotations

from typing import Collection, Hashable, Sequence

import networkx as nx

Node = Hashable


def phase_of(graph: nx.DiGraph, v: Node) -> str:
    return graph.nodes[v].get("phase", "forward")


def droppable(graph: nx.DiGraph) -> list[Node]:
    """Forward nodes that may be recomputed, in reference order."""
    order = graph.graph.get("order") or list(nx.topological_sort(graph))
    return [
        v
        for v in order
        if phase_of(graph, v) == "forward" and graph.nodes[v].get("recomputable", True)
    ]


def saved_activations(graph: nx.DiGraph) -> list[Node]:
    """Droppable nodes with bytes whose output a later phase consumes, in reference order."""
    out = []
    for v in droppable(graph):
        if graph.nodes[v]["bytes"] <= 0:
            continue
        if any(phase_of(graph, s) != "forward" for s in graph.successors(v)):
            out.append(v)
    return out


def checkpoint_schedule(
    graph: nx.DiGraph,
    kept: Collection[Node],
    order: Sequence[Node] | None = None,
) -> list[Node]:
    """The schedule that keeps ``kept`` and recomputes every other droppable value late.

    Parameters
    ----------
    graph : networkx.DiGraph
        With node attributes ``phase`` and ``recomputable``.
    kept : collection of nodes
        Forward values held from the forward pass to their last use. Every other
        droppable node is freed after its last forward use and recomputed before its
        first use by a later phase.
    order : sequence, optional
        Reference order; defaults to the graph's ``order`` attribute.

    Returns
    -------
    list
        Node ids in execution order (repeats are recomputations).
    """
    if order is None:
        order = graph.graph.get("order") or list(nx.topological_sort(graph))
    kept = set(kept)
    dropped = {v for v in droppable(graph) if v not in kept}
    preds = graph.pred
    nodes = graph.nodes
    schedule: list[Node] = []
    current: set = set()  # dropped nodes with a recomputed copy already in the schedule

    def ensure(root: Node) -> None:
        # Iterative post-order DFS: copy `root` and the dropped values it needs.
        stack = [(root, False)]
        while stack:
            u, expanded = stack.pop()
            if u in current:
                continue
            if expanded:
                current.add(u)
                schedule.append(u)
                continue
            stack.append((u, True))
            for w in preds[u]:
                if w in dropped and w not in current:
                    stack.append((w, False))

    for v in order:
        pv = nodes[v].get("phase", "forward")
        for u in preds[v]:
            if u in dropped and u not in current and nodes[u].get("phase", "forward") != pv:
                ensure(u)
        schedule.append(v)
    return schedule
