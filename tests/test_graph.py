"""build_graph on hand-made op records (TensorFlow-free)."""

from __future__ import annotations

import pytest

from tfremat.errors import InvalidScheduleError
from tfremat.graph import OpRecord, TensorInfo, build_graph
from tfremat.simulate import check_precedences, simulate

MIB = 2**20


def _t(nbytes, shape=None, dtype="float32"):
    return TensorInfo(shape if shape is not None else (nbytes // 4,), dtype, nbytes)


def _op(name, op_type, inputs=(), out=(), digest=""):
    return OpRecord(name, op_type, tuple(inputs), (), tuple(out), stateful=False, value_digest=digest)


def _records(second_value="zero"):
    shape = (256, 1024)  # 1 MiB of float32
    return [
        _op("x", "Placeholder", out=[_t(MIB, shape)]),
        _op("dims", "Const", out=[_t(8, (2,), "int32")], digest="dims"),
        _op("zero", "Const", out=[_t(4, ())], digest="0.0"),
        _op("one", "Const", out=[_t(4, ())], digest="1.0"),
        _op("z1", "Fill", ["dims:0", "zero:0"], [_t(MIB, shape)]),
        _op("z2", "Fill", ["dims:0", f"{second_value}:0"], [_t(MIB, shape)]),
        _op("zl", "ZerosLike", ["x:0"], [_t(MIB, shape)]),
        _op("a", "AddV2", ["x:0", "z1:0"], [_t(MIB, shape)]),
        _op("b", "AddV2", ["a:0", "z2:0"], [_t(MIB, shape)]),
        _op("c", "AddV2", ["b:0", "zl:0"], [_t(MIB, shape)]),
    ]


def test_splat_ops_are_fixed_constants_and_equal_ones_count_once():
    """Grappler folds Fill/ZerosLike into constants held for the function's life."""
    sg = build_graph(_records("zero"), ["x"])
    g = sg.graph
    for v in ("z1", "z2", "zl"):
        assert g.nodes[v]["bytes"] == 0, v
    # z1 and z2 are the same constant (merged by Grappler); zl is another one.
    assert sg.constant_bytes == 16 + 2 * MIB
    assert sg.fixed_bytes == sg.constant_bytes + MIB  # + the argument
    assert g.nodes["a"]["bytes"] == MIB  # ordinary ops keep their bytes


def test_splats_of_different_values_count_separately():
    sg = build_graph(_records("one"), ["x"])
    assert sg.constant_bytes == 16 + 3 * MIB


def test_fill_from_a_computed_value_is_not_folded():
    recs = _records("zero")
    recs[5] = _op("z2", "Fill", ["dims:0", "x:0"], [_t(MIB, (256, 1024))])  # value from an argument
    sg = build_graph(recs, ["x"])
    assert sg.graph.nodes["z2"]["bytes"] == MIB
    assert sg.constant_bytes == 16 + 2 * MIB


def test_variable_sizes_are_reported_per_variable():
    recs = [
        OpRecord("h", "VarHandleOp", (), (), (TensorInfo((), "resource", 0),), stateful=True),
        OpRecord("r", "ReadVariableOp", ("h:0",), (), (_t(MIB),), stateful=True),
        OpRecord("g", "VarHandleOp", (), (), (TensorInfo((), "resource", 0),), stateful=True),
        OpRecord("s", "ReadVariableOp", ("g:0",), (), (_t(4096),), stateful=True),
    ]
    sg = build_graph(recs)
    assert sorted(sg.variable_sizes) == [4096, MIB]
    assert sg.variable_bytes == MIB + 4096


def test_a_control_input_orders_but_keeps_no_tensor_alive():
    """TensorFlow's SquaredDifference gradient: ``2 * g * (x - y)`` with ``x - y``
    under a control dependency on ``g``. The runtime frees ``g`` after its last data
    consumer, so the product may take over its buffer; the control edge only orders."""
    shape = (256, 1024)  # 1 MiB of float32
    records = [
        _op("x", "Placeholder", out=[_t(MIB, shape)]),
        _op("y", "Placeholder", out=[_t(MIB, shape)]),
        _op("two", "Const", out=[_t(4, ())], digest="2.0"),
        _op("g", "Neg", ["x:0"], [_t(MIB, shape)]),
        _op("m", "Mul", ["two:0", "g:0"], [_t(MIB, shape)]),
        OpRecord("sub", "Sub", ("x:0", "y:0"), ("g",), (_t(MIB, shape),), stateful=False),
        _op("out", "Mul", ["m:0", "sub:0"], [_t(MIB, shape)]),
    ]
    g = build_graph(records, ["x", "y"]).graph
    assert not g.has_edge("g", "sub")
    assert ("g", "sub") in g.graph["order_edges"]
    order = g.graph["order"]
    assert order.index("g") < order.index("sub")
    # g dies into m (in place): at most two 1 MiB temporaries live at once (m, sub),
    # three if the control edge held g until sub ran.
    assert simulate(g, order).peak_bytes == 2 * MIB


def test_a_schedule_breaking_a_control_edge_is_rejected():
    shape = (256, 1024)
    records = [
        _op("x", "Placeholder", out=[_t(MIB, shape)]),
        _op("a", "Neg", ["x:0"], [_t(MIB, shape)]),
        OpRecord("b", "Neg", ("x:0",), ("a",), (_t(MIB, shape),), stateful=False),
    ]
    g = build_graph(records, ["x"]).graph
    check_precedences(g, ["x", "a", "b"])
    simulate(g, ["x", "b", "a"])  # memory-wise valid...
    with pytest.raises(InvalidScheduleError, match="must precede"):
        check_precedences(g, ["x", "b", "a"])  # ...but b must wait for a


def _attr_op(name, op_type, inputs, attrs="f32"):
    return OpRecord(name, op_type, tuple(inputs), (), (_t(MIB, (256, 1024)),), stateful=False, attr_digest=attrs)


@pytest.mark.parametrize("attrs, merged", [("f32", True), ("f16", False), ("", False)])
def test_a_repeated_computation_is_one_buffer_held_until_its_last_reader(attrs, merged):
    """Grappler's CSE computes ``s2 = Sigmoid(x)`` once with ``s1``: s2's reader holds
    s1's buffer, and nothing is computed at s2's place. Different attributes, or none
    known, are separate computations."""
    records = [
        _op("x", "Placeholder", out=[_t(MIB, (256, 1024))]),
        _attr_op("s1", "Sigmoid", ["x:0"]),
        _attr_op("h", "Mul", ["x:0", "s1:0"]),
        _attr_op("t", "MatMul", ["h:0", "h:0"]),
        _attr_op("s2", "Sigmoid", ["x:0"], attrs),
        _attr_op("out", "Mul", ["t:0", "s2:0"]),
    ]
    sg = build_graph(records, ["x"])
    g = sg.graph
    order = list(g.graph["order"])
    if merged:
        assert g.nodes["s2"]["twin_of"] == "s1" and g.nodes["s2"]["bytes"] == 0
        assert set(g.predecessors("s2")) == {"s1"}
    live_at_t = simulate(g, order, sg.fixed_bytes).memory[order.index("t")] - sg.fixed_bytes
    # h and t; and s1 when it waits for s2's reader
    assert live_at_t == (3 if merged else 2) * MIB
    if not merged:
        assert "twin_of" not in g.nodes["s2"] and g.nodes["s2"]["bytes"] == MIB
