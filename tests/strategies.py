"""Hypothesis strategies for solver tests: graphs valid by construction (no filtering)."""

from __future__ import annotations

import math

import networkx as nx
from hypothesis import strategies as st

from tfremat.simulate import reference_simulation, single_op_lower_bound


@st.composite
def dags(draw, min_nodes: int = 1, max_nodes: int = 9, max_in: int = 3, nonrecomputable: bool = True):
    """A random DAG whose node ids 0..n-1 are a topological order (edges go up)."""
    n = draw(st.integers(min_nodes, max_nodes))
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(
            i,
            bytes=draw(st.integers(0, 64)),
            cost=draw(st.integers(0, 9)),
            phase="forward",
            recomputable=draw(st.booleans()) if nonrecomputable else True,
        )
    for j in range(1, n):
        for i in draw(st.sets(st.integers(0, j - 1), max_size=max_in)):
            g.add_edge(i, j)
    g.graph["order"] = list(range(n))
    return g


@st.composite
def training_graphs(draw, max_forward: int = 7, tf_like: bool | None = None):
    """A forward DAG, a loss, and a mirrored backward pass (phase="backward").

    Backward node ``b_i`` consumes the gradients of ``i``'s consumers and the forward
    values ``i`` read (as a real gradient op reads its op's inputs). With ``tf_like``
    backward ops and some forward ops (variable reads) are not recomputable, as in
    traced TensorFlow steps.
    """
    if tf_like is None:
        tf_like = draw(st.booleans())
    fwd = draw(dags(min_nodes=1, max_nodes=max_forward, nonrecomputable=False))
    n = fwd.number_of_nodes()
    g = nx.DiGraph()
    for i in range(n):
        a = dict(fwd.nodes[i])
        if tf_like:
            a["recomputable"] = draw(st.integers(0, 4)) > 0
        g.add_node(("f", i), **a)
    g.add_edges_from((("f", u), ("f", v)) for u, v in fwd.edges)
    g.add_node("loss", bytes=draw(st.integers(1, 8)), cost=1, phase="forward",
               recomputable=not tf_like)
    sinks = [i for i in range(n) if fwd.out_degree(i) == 0]
    g.add_edges_from((("f", i), "loss") for i in sinks)
    for i in reversed(range(n)):
        g.add_node(("b", i), bytes=draw(st.integers(0, 64)), cost=draw(st.integers(0, 9)),
                   phase="backward", recomputable=not tf_like)
        grads = [("b", s) for s in fwd.successors(i)] or ["loss"]
        for x in grads + [("f", p) for p in fwd.predecessors(i)]:
            g.add_edge(x, ("b", i))
        if draw(st.booleans()):  # e.g. ReluGrad reads the op's own output
            g.add_edge(("f", i), ("b", i))
    g.graph["order"] = [("f", i) for i in range(n)] + ["loss"] + [("b", i) for i in reversed(range(n))]
    return g


@st.composite
def problems(draw, graphs=None):
    """(graph, budget, fixed): budget from just below the lower bound to above the peak."""
    g = draw(graphs if graphs is not None else st.one_of(dags(), training_graphs()))
    fixed = draw(st.sampled_from([0, 0, 16]))
    ref = reference_simulation(g, fixed).peak_bytes
    lb = single_op_lower_bound(g, fixed)
    frac = draw(st.floats(0.0, 1.1))
    budget = int(math.floor(lb * 0.95 + frac * (ref - lb * 0.95)))
    return g, max(budget, 0), fixed
