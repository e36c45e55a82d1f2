"""build_graph on hand-made op records (TensorFlow-free)."""

from __future__ import annotations

import dataclasses

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


def test_counted_leaves_out_small_variables_beyond_one_largest_tensor():
    """Variables (weights, optimizer slots) under 256 KiB are allocations the default
    CPU allocator's statistics leave out: DenseNet121's many small kernels and their
    Adam slots were 38 MiB of fixed memory the plan counted and no measurement saw.
    Up to the step's largest tensor of them stays counted as room for what the model
    misses; big variables always count."""
    kib = 1024

    def var(name, nbytes):
        return [OpRecord(f"{name}_h", "VarHandleOp", (), (), (TensorInfo((), "resource", 0),), stateful=True),
                OpRecord(f"{name}_r", "ReadVariableOp", (f"{name}_h:0",), (), (_t(nbytes),), stateful=True)]

    recs = [_op("x", "Placeholder", out=[_t(MIB)])]
    for i in range(20):  # 20 small variables, 2.5 MiB in all
        recs += var(f"w{i}", 128 * kib)
    recs += var("big", 2 * MIB)
    recs += [_op("a", "Relu", ["x:0"], [_t(MIB)])]  # the largest tensor: 1 MiB
    sg = build_graph(recs, ["x"])
    assert sg.fixed_bytes == MIB + 20 * 128 * kib + 2 * MIB
    c = sg.counted(256 * kib)
    assert c.fixed_bytes == MIB + MIB + 2 * MIB  # 1.5 MiB of the small ones left out
    assert c.variable_bytes == sg.variable_bytes - 20 * 128 * kib + MIB
    # the ones left out are no resident buffers; the kept small ones still are
    assert sorted(c.variable_sizes) == [128 * kib] * 8 + [2 * MIB]
    assert sg.counted(0) is sg
    # fewer small bytes than the largest tensor: all of them stay counted
    few = build_graph(recs[:1 + 2 * 4] + recs[-3:], ["x"])
    assert few.counted(256 * kib).fixed_bytes == few.fixed_bytes


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


def test_each_output_of_an_identity_n_holds_its_own_input():
    """Output k of an ``IdentityN`` is its input k: a reader of output 1 holds input
    1's buffer, not input 0's (a custom gradient's ``IdentityN`` passes its forward
    values on; the planning graph followed input 0 for every output, holding a 1 MiB
    tensor past its last reader and freeing the one still read)."""
    shape = (256, 1024)  # 1 MiB of float32
    records = [
        _op("x", "Placeholder", out=[_t(MIB, shape)]),
        _op("a", "Neg", ["x:0"], [_t(MIB, shape)]),
        _op("b", "Exp", ["x:0"], [_t(2 * MIB)]),
        _op("n", "IdentityN", ["a:0", "b:0"], [_t(MIB, shape), _t(2 * MIB)]),
        _op("use_a", "Sum", ["n:0"], [_t(4, ())]),
        _op("big", "Sqrt", ["x:0"], [_t(MIB, shape)]),
        _op("use_b", "AddV2", ["n:1", "big:0"], [_t(MIB, shape)]),
    ]
    g = build_graph(records, ["x"]).graph
    assert g.has_edge("b", "use_b") and g.edges["b", "use_b"]["kind"] == "liveness"
    assert not g.has_edge("a", "use_b")
    assert g.has_edge("a", "use_a") and not g.has_edge("b", "use_a")
    # while `big` runs: b (2 MiB, read later through n:1) and big; a is dead
    sim = simulate(g, ["x", "a", "b", "n", "use_a", "big", "use_b"])
    assert sim.memory[5] == 3 * MIB, list(sim.memory)


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


def _two_layer_update_records():
    """Backward of two layers, then an optimizer's updates in program order (after
    the whole backward pass, as Keras writes them): ``lr * g`` and an assign each."""
    res = TensorInfo((), "resource", 0)
    return [
        _op("x", "Placeholder", out=[_t(MIB)]),
        OpRecord("v1", "Placeholder", (), (), (res,), stateful=False),
        OpRecord("v2", "Placeholder", (), (), (res,), stateful=False),
        OpRecord("lr_read", "ReadVariableOp", ("v1:0",), (), (_t(4, ()),), stateful=True),
        _op("d2", "MatMul", ["x:0"], [_t(MIB)]),  # the upstream gradient
        _op("g2", "MatMul", ["d2:0"], [_t(MIB)]),  # layer 2's weight gradient
        _op("d1", "MatMul", ["d2:0"], [_t(MIB)]),
        _op("g1", "MatMul", ["d1:0"], [_t(MIB)]),  # layer 1's weight gradient
        _op("u1", "Mul", ["g1:0", "lr_read:0"], [_t(MIB)]),
        OpRecord("w1", "AssignSubVariableOp", ("v1:0", "u1:0"), (), (), stateful=True),
        _op("u2", "Mul", ["g2:0", "lr_read:0"], [_t(MIB)]),
        OpRecord("w2", "AssignSubVariableOp", ("v2:0", "u2:0"), (), (), stateful=True),
    ]


def test_an_optimizers_update_runs_as_soon_as_its_gradient_exists():
    """The executor applies each gradient when it is computed (Grappler drops the
    optimizer's IdentityN, trace._bypass_identity_n): the plan's order does too, so
    layer 2's gradient is not held through layer 1's backward."""
    records = _two_layer_update_records()
    plain = build_graph(records, ["x"]).graph
    applied = build_graph(records, ["x"], gradients=["g2", "g1"]).graph
    order = applied.graph["order"]
    assert order.index("u2") == order.index("g2") + 1 and order.index("w2") == order.index("u2") + 1
    assert order.index("u2") < order.index("d1")  # before the rest of the backward pass
    assert plain.graph["order"].index("u2") > plain.graph["order"].index("g1")  # program order
    # while d1 and g1 run, g2 is still held in program order, not once applied
    assert simulate(plain, plain.graph["order"]).peak_bytes == 3 * MIB
    assert simulate(applied, order).peak_bytes == 2 * MIB


def test_an_update_holding_more_than_its_gradient_keeps_its_program_position():
    """Only updates that hold no more than the gradient they free go first (SGD's
    ``lr * g``). One with a temporary of the gradient's size on top (Adam's moments)
    keeps program order: sorted first, Adam's interleaved temporaries fragmented the
    modelled pool of the Keras test CNN until budgets that had plans were infeasible."""
    records = _two_layer_update_records()
    # layer 2's update as Adam-like: a moment-sized temporary before lr * g
    i = next(k for k, r in enumerate(records) if r.name == "u2")
    records[i:i + 1] = [
        _op("m2", "Mul", ["g2:0", "lr_read:0"], [_t(MIB)]),
        _op("u2", "Mul", ["m2:0", "g2:0"], [_t(MIB)]),
    ]
    g = build_graph(records, ["x"], gradients=["g2", "g1"]).graph
    order = g.graph["order"]
    assert order.index("u2") > order.index("g1")  # program position: after the backward
    assert order.index("u1") == order.index("g1") + 1  # SGD-like: right after its gradient
    # the order with every update first stays beside it, for budgets this one misses
    (other,) = g.graph["other_orders"]
    assert other.index("u2") < other.index("g1") and set(other) == set(order)


def test_counted_leaves_out_tensor_lists_of_small_elements():
    """What an allocator that leaves requests under 256 KiB out of its statistics sees
    (TensorFlow's default x86 CPU allocator): a TensorList's small elements, each an
    allocation of its own, weigh nothing; a list of big elements, a small activation
    and the fixed memory count as before."""
    kib = 1024
    recs = [
        _op("x", "Placeholder", out=[_t(MIB)]),
        _op("w", "Const", out=[_t(128 * kib)], digest="w"),
        _op("a", "Relu", ["x:0"], [_t(MIB)]),
        _op("s", "Mean", ["a:0"], [_t(16 * kib)]),
        # 64 elements of 8 KiB, and 4 of 256 KiB
        _op("acc", "While", ["a:0"], [TensorInfo((), "variant", 512 * kib, 64),
                                      TensorInfo((), "variant", MIB, 4)]),
        _op("b", "Mul", ["s:0", "acc:0", "w:0"], [_t(MIB)]),
    ]
    sg = build_graph(recs, ["x"])
    assert sg.counted(0) is sg
    c = sg.counted(256 * kib)
    assert c.graph.nodes["acc"]["bytes"] == MIB == c.graph.nodes["acc"]["largest_tensor"]
    assert sg.graph.nodes["acc"]["bytes"] == MIB + 512 * kib  # the original is unchanged
    assert c.graph.nodes["s"]["bytes"] == 16 * kib  # a single small activation still counts
    assert c.graph.nodes["a"]["bytes"] == MIB
    assert c.fixed_bytes == sg.fixed_bytes == MIB + 128 * kib


def test_an_inplace_op_beside_another_reader_of_its_input_is_not_counted_in_that_buffer():
    """Two products of one tensor (an additive-attention gradient's ``Tile``), neither an
    ancestor of the other: the executor runs them side by side, so neither takes the
    tensor's buffer over. Run as traced (``free``) each is counted in a buffer of its
    own; the rewrite's ordering (the default accounting) still lets the second take it
    over. A reader that is an ancestor of the op blocks nothing."""
    shape = (256, 1024)  # 1 MiB of float32
    records = [
        _op("x", "Placeholder", out=[_t(MIB, shape)]),
        _op("s", "Placeholder", out=[_t(MIB, shape)]),
        _op("axes", "Const", out=[_t(8, (2,), "int32")], digest="axes"),
        _op("t", "Neg", ["x:0"], [_t(MIB, shape)]),
        _op("a", "Sum", ["t:0", "axes:0"], [_t(4, ())]),  # reads t, an ancestor of m2
        _op("m1", "Mul", ["t:0", "s:0"], [_t(MIB, shape)]),
        _op("m2", "Mul", ["t:0", "a:0"], [_t(MIB, shape)]),
        _op("out", "AddV2", ["m1:0", "m2:0"], [_t(MIB, shape)]),
    ]
    g = build_graph(records, ["x", "s"]).graph
    assert g.nodes["m1"]["inplace_blockers"] == {"t": ("a", "m2")}
    assert g.nodes["m2"]["inplace_blockers"] == {"t": ("m1",)}
    order = ["x", "s", "axes", "t", "a", "m1", "m2", "out"]
    # ordered: m2 takes t over (t and m1 live, then m1 and m2)
    assert simulate(g, order).peak_bytes == 2 * MIB + 4
    # free: m2 may run beside m1, so t, m1 and m2 are live at once
    assert simulate(g, order, free=True).peak_bytes == 3 * MIB + 4
    # a recomputed copy of t for m2 leaves the original to m1 alone: m1 takes it over
    rec = ["x", "s", "axes", "t", "a", "m1", "t", "m2", "out"]
    assert simulate(g, rec, free=True).peak_bytes == simulate(g, rec).peak_bytes == 2 * MIB + 4


def _softmax_gradient_records(fwd="fwd/softmax", grad="gradient_tape/sub", divide=False):
    """``(grad * fwd) * c`` (a softmax gradient times an attention scale): the forward
    value is ready long before ``grad``, which depends on the loss."""
    shape = (256, 1024)  # 1 MiB of float32
    root = (_op("gradient_tape/scale", "RealDiv", ["gradient_tape/mul:0", "c:0"], [_t(MIB, shape)]) if divide
            else _op("gradient_tape/scale", "Mul", ["gradient_tape/mul:0", "c:0"], [_t(MIB, shape)]))
    return [
        _op("x", "Placeholder", out=[_t(MIB, shape)]),
        _op("c", "Const", out=[_t(4, ())], digest="c"),
        _op(fwd, "Exp", ["x:0"], [_t(MIB, shape)]),
        _op("loss", "Sum", [f"{fwd}:0"], [_t(4, ())]),
        _op("ones", "OnesLike", ["loss:0"], [_t(4, ())]),
        _op(grad, "Sub", [f"{fwd}:0", "ones:0"], [_t(MIB, shape)]),
        _op("gradient_tape/mul", "Mul", [f"{grad}:0", f"{fwd}:0"], [_t(MIB, shape)]),
        root,
        _op("out", "Neg", ["gradient_tape/scale:0"], [_t(MIB, shape)]),
    ]


@pytest.mark.parametrize("divide", [False, True])
def test_grappler_regrouping_of_a_product_with_a_constant_is_recorded(divide):
    """Grappler pairs the scalar with the operand whose name sorts first (the forward
    value here), so the inner product reads forward values only: as traced it runs as
    soon as the forward value exists. ``regrouped`` gives the graph those edges; the
    free-running order then computes it before ``grad`` and holds it."""
    from tfremat.graph import regrouped
    from tfremat.simulate import free_running_order

    g = build_graph(_softmax_gradient_records(divide=divide), ["x"]).graph
    pair, dropped, root, sizes, constants = g.graph["regrouped"]["gradient_tape/mul"]
    assert set(pair) == {"c", "fwd/softmax"} and dropped == "gradient_tape/sub"
    assert root == "gradient_tape/scale" and constants == {"c"} and sizes["c"] == 1
    h = regrouped(g)
    assert not h.has_edge("gradient_tape/sub", "gradient_tape/mul")
    assert h.has_edge("gradient_tape/sub", "gradient_tape/scale") and h.has_edge("c", "gradient_tape/mul")
    assert g.has_edge("gradient_tape/sub", "gradient_tape/mul")  # the planning graph keeps its edges
    order = [v for v in g.graph["order"] if v in g]
    as_traced = free_running_order(h, order)
    assert as_traced.index("gradient_tape/mul") < as_traced.index("gradient_tape/sub")
    assert free_running_order(g, order).index("gradient_tape/mul") > order.index("gradient_tape/sub")


def test_no_regrouping_is_recorded_where_grappler_keeps_the_pairing():
    """The backward operand's name sorts first: Grappler pairs the scalar with it, which
    changes nothing the executor sees; nor is a chain whose inner op has two readers
    rebuilt."""
    g = build_graph(_softmax_gradient_records(fwd="z/softmax"), ["x"]).graph
    pair, dropped, *_ = g.graph["regrouped"]["gradient_tape/mul"]
    assert set(pair) == {"c", "gradient_tape/sub"} and dropped == "z/softmax"  # grad waits as before
    records = _softmax_gradient_records()
    records.append(_op("other", "Neg", ["gradient_tape/mul:0"], [_t(MIB, (256, 1024))]))
    assert build_graph(records, ["x"]).graph.graph["regrouped"] == {}


def _tiled_ones(multiples_bytes=MIB):
    """The gradient of ``reduce_sum(h * h)`` starts from ``Tile(Reshape(ones), m)``."""
    shape = (multiples_bytes // 4 // 1024, 1024)
    return [
        _op("x", "Placeholder", out=[_t(multiples_bytes, shape)]),
        _op("ones", "Const", out=[_t(4, ())], digest="1.0"),
        _op("shape", "Const", out=[_t(8, (2,), "int32")], digest="shape"),
        _op("m", "Const", out=[_t(8, (2,), "int32")], digest="m"),
        _op("r", "Reshape", ["ones:0", "shape:0"], [_t(4, (1, 1))]),
        _op("tile", "Tile", ["r:0", "m:0"], [_t(multiples_bytes, shape)]),
        _op("grad", "Mul", ["tile:0", "x:0"], [_t(multiples_bytes, shape)]),
    ]


def test_ops_computed_from_constants_are_constants_held_from_the_first_call():
    """Grappler folds the chain; its last op is a Const the executor holds (measured:
    a 0.5 MiB Tile of ones allocated at the start of every call, never freed)."""
    sg = build_graph(_tiled_ones(), ["x"])
    g = sg.graph
    assert g.nodes["tile"]["bytes"] == 0 and g.nodes["tile"]["folded"]
    assert g.nodes["r"]["bytes"] == 0  # read only by a folded op: gone
    assert sg.folded_sizes == (MIB,)  # the Reshape's 4 bytes are not held
    assert sg.constant_bytes == 4 + 8 + 8 + MIB
    assert sg.argument_sizes == (MIB,)
    assert g.nodes["grad"]["bytes"] == MIB


def test_a_constant_result_over_grapplers_size_limit_is_not_folded():
    from tfremat.graph import MAX_FOLDED_BYTES

    big = 2 * MAX_FOLDED_BYTES
    sg = build_graph(_tiled_ones(big), ["x"])
    assert sg.graph.nodes["tile"]["bytes"] == big
    assert sg.folded_sizes == ()  # (the Reshape is a view: no bytes of its own)


def test_softmax_writes_into_its_input():
    """TensorFlow's Softmax kernel forwards its input's buffer when nothing else reads
    it (measured on the attention model of test_tf_memory: an attention's scores and
    its softmax were one 2 MiB allocation)."""
    shape = (256, 1024)
    recs = [
        _op("x", "Placeholder", out=[_t(MIB, shape)]),
        _op("s", "Mul", ["x:0", "x:0"], [_t(MIB, shape)]),
        _op("p", "Softmax", ["s:0"], [_t(MIB, shape)]),
        _op("y", "Neg", ["p:0"], [_t(MIB, shape)]),
        _op("z", "AddV2", ["p:0", "y:0"], [_t(MIB, shape)]),
    ]
    g = build_graph(recs, ["x"]).graph
    assert g.nodes["p"]["inplace"]
    # s's buffer becomes p's: p and y at once, then z into y's
    assert simulate(g, ["x", "s", "p", "y", "z"]).peak_bytes == 2 * MIB


def test_a_square_grappler_merges_into_a_cube_is_planned_in_the_forward_pass():
    """``x ** 3`` runs as ``x * x**2`` (ConvertPow), and CSE merges that ``x**2`` with
    the gradient's ``Pow(x, 3 - 1)``: the square exists from the forward pass on and
    is held until the gradient reads it (the tanh GELU: keras_fuzz mlp 16 measured
    15.5 MiB for 11.0 expected before). The graph plans it as the cube's input,
    right before the cube; a power by 4 has no such twin."""
    shape = (256, 1024)  # 1 MiB of float32

    def records(exponent):
        return [
            _op("x", "Placeholder", out=[_t(MIB, shape)]),
            _op("e", "Const", out=[_t(4, ())]),
            _op("cube", "Pow", ["x:0", "e:0"], [_t(MIB, shape)]),
            _op("y", "Tanh", ["cube:0"], [_t(MIB, shape)]),
            _op("loss", "Sum", ["y:0"], [_t(4, ())]),
            _op("three", "Const", out=[_t(4, ())]),
            _op("one", "Const", out=[_t(4, ())]),
            _op("em1", "Sub", ["three:0", "one:0"], [_t(4, ())]),
            _op("sq", "Pow", ["x:0", "em1:0"], [_t(MIB, shape)]),
            _op("g", "Mul", ["sq:0", "y:0"], [_t(MIB, shape)]),
        ]

    def scalars(rs, cube):
        values = {"e": cube, "three": cube, "one": 1.0}
        return [dataclasses.replace(r, scalar=values.get(r.name)) for r in rs]

    g = build_graph(scalars(records(3.0), 3.0), ["x"]).graph
    order = g.graph["order"]
    assert g.has_edge("sq", "cube")
    assert order.index("sq") < order.index("cube") < order.index("y")
    assert g.nodes["sq"]["phase"] == "forward"
    # the square is held beside the forward pass's activation (x is an argument)
    assert simulate(g, order).memory[order.index("y")] == 2 * MIB
    g4 = build_graph(scalars(records(4.0), 4.0), ["x"]).graph
    order4 = g4.graph["order"]
    assert not g4.has_edge("sq", "cube")
    assert order4.index("sq") > order4.index("y")
    assert simulate(g4, order4).memory[order4.index("y")] == MIB


@pytest.mark.parametrize("x, kept", [("Dense/BiasAdd", False), ("conv1d/Squeeze", True), ("einsum_7/Einsum", True)])
def test_a_cube_whose_bits_depend_on_the_square_grappler_keeps_is_not_copied(x, kept):
    """Grappler pushes the constant of ``c * x**3`` down to the factor of ``x * s``
    whose name sorts first; ``s`` is the gradient's square in the plain step and the
    cube's own square where a plan recomputes the gradient's. Where ``x``'s name
    sorts between the two (``tf.nn.gelu(approximate=True)`` of a conv1d or an einsum,
    steps_fuzz 10: 29 of 37 values apart), the square, the cube and ``c * cube`` are
    kept; elsewhere (a Dense layer's bias add) they may be recomputed."""
    shape = (256, 1024)
    recs = [
        _op(x, "Placeholder", out=[_t(MIB, shape)]),
        _op("Gelu/Pow/y", "Const", out=[_t(4, ())]),
        _op("Gelu/Pow", "Pow", [f"{x}:0", "Gelu/Pow/y:0"], [_t(MIB, shape)]),
        _op("Gelu/Cast/x", "Const", out=[_t(4, ())]),
        _op("Gelu/mul_1", "Mul", ["Gelu/Cast/x:0", "Gelu/Pow:0"], [_t(MIB, shape)]),
        _op("Gelu/Tanh", "Tanh", ["Gelu/mul_1:0"], [_t(MIB, shape)]),
        _op("loss", "Sum", ["Gelu/Tanh:0"], [_t(4, ())]),
        _op("gradient_tape/Gelu/Pow/sub/y", "Const", out=[_t(4, ())]),
        _op("gradient_tape/Gelu/Pow/sub", "Sub", ["Gelu/Pow/y:0", "gradient_tape/Gelu/Pow/sub/y:0"], [_t(4, ())]),
        _op("gradient_tape/Gelu/Pow/Pow", "Pow", [f"{x}:0", "gradient_tape/Gelu/Pow/sub:0"], [_t(MIB, shape)]),
        _op("g", "Mul", ["gradient_tape/Gelu/Pow/Pow:0", "Gelu/Tanh:0"], [_t(MIB, shape)]),
    ]
    values = {"Gelu/Pow/y": 3.0, "gradient_tape/Gelu/Pow/sub/y": 1.0, "Gelu/Cast/x": 0.044715}
    recs = [dataclasses.replace(r, scalar=values.get(r.name)) for r in recs]
    g = build_graph(recs, [x]).graph
    for v in ("gradient_tape/Gelu/Pow/Pow", "Gelu/Pow", "Gelu/mul_1"):
        assert g.nodes[v]["recomputable"] is not kept, v
    assert g.nodes["Gelu/Tanh"]["recomputable"]
