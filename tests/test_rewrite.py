"""rewrite.py's graph rules on small traced functions."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from tfremat.graph import build_graph  # noqa: E402
from tfremat.rewrite import _cse_twins  # noqa: E402
from tfremat.trace import trace  # noqa: E402


def test_cse_twins_are_ops_grappler_may_merge():
    """Same op, attributes and inputs (in either order for a commutative op, or
    through inputs that are twins themselves): twins. Different constants, a
    different op, or a stateful op: not."""
    v = tf.Variable(1.0)

    @tf.function
    def f(x, y):
        a = x + y
        b = x + y
        c = y + x  # commutative: the same sum
        d, e = tf.nn.relu(a), tf.nn.relu(b)  # twins through twin inputs
        g, h = x * 2.0, x * 3.0  # different constants
        r1, r2 = v.read_value(), v.read_value()  # stateful reads are never merged
        return d + e + c + g + h + r1 + r2

    x, y = tf.ones((4,)), tf.ones((4,))
    traced = trace(f, (x, y), {})
    sg = build_graph(traced.records, traced.arg_placeholders)
    twins = _cse_twins(traced.graph_def, sg.graph)
    ops = {n.name: n.op for n in traced.graph_def.node}
    adds = sorted(n for n, op in ops.items() if op == "AddV2" and n in twins)
    relus = sorted(n for n, op in ops.items() if op == "Relu")
    muls = [n for n, op in ops.items() if op == "Mul"]
    reads = [n for n, op in ops.items() if op == "ReadVariableOp"]
    assert len(adds) == 3, (adds, sorted(twins))
    assert set(relus) <= twins and len(relus) == 2
    assert not set(muls) & twins
    assert not set(reads) & twins
