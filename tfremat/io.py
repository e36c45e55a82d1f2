"""Read and write graph files (node-link JSON, as in ``shared/benchmarks/checkmate-graphs``).

The benchmark format names node attributes ``cost_ram`` (output bytes), ``cost_cpu``
(compute cost) and ``backward`` (bool, absent on random graphs); tfremat's own graphs
use ``bytes``, ``cost``, ``phase`` and ``recomputable``. :func:`load_graph` accepts
either spelling and returns a graph in tfremat's, so every solver and the simulator see
one vocabulary.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import networkx as nx

__all__ = ["from_node_link", "load_graph", "to_node_link"]


def from_node_link(data: Mapping[str, Any]) -> nx.DiGraph:
    """Build a tfremat graph from node-link data.

    Parameters
    ----------
    data : mapping
        Node-link JSON (``nodes``, ``links``, ``graph``) with either the benchmark
        attributes (``cost_ram``, ``cost_cpu``, ``backward``) or tfremat's (``bytes``,
        ``cost``, ``phase``, ``recomputable``).

    Returns
    -------
    networkx.DiGraph
        Node attributes ``bytes`` (int), ``cost``, ``phase``, ``recomputable``;
        graph attributes ``order`` (the file's reference order, or a topological
        sort when it has none) and ``name``.

    Raises
    ------
    ValueError
        If the graph has a cycle, a node lacks a size, or ``order`` is not a
        topological order of the graph's nodes.
    """
    data = dict(data)
    # networkx >= 3.4 wants the edge key named explicitly; "links" is the format's.
    g0 = nx.node_link_graph(data, directed=True, multigraph=False, edges="links")
    g = nx.DiGraph()
    for v, a in g0.nodes(data=True):
        if "bytes" in a:
            size = a["bytes"]
        elif "cost_ram" in a:
            size = a["cost_ram"]
        else:
            raise ValueError(f"node {v!r} has neither 'bytes' nor 'cost_ram'; add its output size")
        cost = a.get("cost", a.get("cost_cpu", 0))
        if "phase" in a:
            phase = a["phase"]
        else:
            phase = "backward" if a.get("backward", False) else "forward"
        attrs = dict(a)
        attrs.update(
            bytes=int(size),
            cost=cost,
            phase=phase,
            recomputable=bool(a.get("recomputable", True)),
        )
        g.add_node(v, **attrs)
    g.add_edges_from(g0.edges())
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("the graph has a cycle; a dataflow graph must be acyclic")
    order = g0.graph.get("order")
    if order is None:
        order = list(nx.lexicographical_topological_sort(g, key=str))
    else:
        order = list(order)
        pos = {v: i for i, v in enumerate(order)}
        if len(pos) != len(order) or set(pos) != set(g.nodes):
            raise ValueError("graph attribute 'order' must list every node exactly once")
        bad = [(u, v) for u, v in g.edges if pos[u] >= pos[v]]
        if bad:
            raise ValueError(f"graph attribute 'order' is not topological, e.g. edge {bad[0]!r}")
    g.graph.update({k: v for k, v in g0.graph.items() if k != "order"})
    g.graph["order"] = order
    return g


def load_graph(path: str | os.PathLike) -> nx.DiGraph:
    """Read a node-link JSON graph file (see :func:`from_node_link`).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not a valid graph (see :func:`from_node_link`).
    """
    with open(path) as f:
        data = json.load(f)
    g = from_node_link(data)
    g.graph.setdefault("name", os.path.basename(os.fspath(path)))
    return g


def to_node_link(graph: nx.DiGraph) -> dict:
    """Node-link data for ``graph`` (tfremat attribute names), JSON-serializable."""
    return nx.node_link_data(graph, edges="links")
