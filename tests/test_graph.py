"""build_graph on hand-made op records (TensorFlow-free)."""

from __future__ import annotations

from tfremat.graph import OpRecord, TensorInfo, build_graph

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
