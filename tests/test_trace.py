"""Tracing: sizes the planner sees for tensors whose static shape says nothing."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from tfremat.trace import trace  # noqa: E402

T, B, D = 16, 32, 64
STEP_BYTES = B * D * 4


def _while_records(fn, *args):
    return [r for r in trace(fn, args).records if r.op_type in ("While", "StatelessWhile")]


def test_gradient_accumulators_of_a_while_loop_are_counted():
    """while_v2 keeps one element per iteration for the gradient loop (TensorLists)."""
    w = tf.Variable(tf.ones((D, D)))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            def body(i, h):
                return i + 1, tf.tanh(tf.matmul(h, w) * x[i])

            _, h = tf.while_loop(lambda i, h: i < T, body, [0, tf.zeros((B, D))], maximum_iterations=T)
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, [x, w])

    records = _while_records(step, tf.random.normal((T, B, D)))
    forward = [r for r in records if "grad" not in r.name]
    assert len(forward) == 1
    held = sum(o.bytes for o in forward[0].outputs if o.dtype == "variant")
    # The gradient needs, per iteration, at least the state h and the element x[i]
    # (MatMul's and Mul's inputs): two (B, D) tensors per step. The variable read that
    # is also pushed aliases the variable and must not count (it would add T * D * D).
    assert 2 * T * STEP_BYTES <= held <= 5 * T * STEP_BYTES, held / (T * STEP_BYTES)
    backward = [r for r in records if "grad" in r.name]
    assert backward and all(
        o.bytes < T * STEP_BYTES for r in backward for o in r.outputs if o.dtype == "variant"
    ), "the gradient loop pops its lists: they end empty"


def test_keras_lstm_lists_are_counted():
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, D))
    model = keras.Model(inp, keras.layers.LSTM(D)(inp))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    records = _while_records(step, tf.random.normal((B, T, D)))
    forward = [r for r in records if "grad" not in r.name]
    held = sum(o.bytes for r in forward for o in r.outputs if o.dtype == "variant")
    # An LSTM step keeps its four gates, the cell state and the input element for the
    # gradient: several (B, D)-sized tensors per step, none of them the weights.
    assert 4 * T * STEP_BYTES <= held <= 12 * T * STEP_BYTES, held / (T * STEP_BYTES)


def test_seeded_random_kernels_are_found_in_the_step_and_the_functions_it_calls():
    from tfremat.trace import seeded_stream_ops

    gen = tf.random.Generator.from_seed(4)

    @tf.function
    def inner(t):
        return tf.random.uniform(tf.shape(t), seed=3) * t

    @tf.function
    def step(x):
        a = tf.nn.dropout(x, 0.5, seed=1)  # RandomUniform, seeded
        b = tf.random.stateless_uniform(tf.shape(x), seed=(1, 2))  # seed is an input
        c = gen.normal(tf.shape(x))  # state in a variable
        return a + b + c + inner(x)

    traced = trace(step, (tf.ones((4, 4)),))
    found = seeded_stream_ops(traced.graph_def)
    assert traced.seeded_streams == found
    types = {n.name: n.op for n in traced.graph_def.node}
    for f in traced.graph_def.library.function:
        types.update({f"{f.signature.name}/{n.name}": n.op for n in f.node_def})
    assert sorted(types[n] for n in found) == ["RandomUniform", "RandomUniform"], found


def test_a_conditional_holds_what_its_gradient_reads_from_the_forward_to_the_backward_pass():
    """cond_v2 wraps the intermediates a branch's gradient reads (here ``tanh(x)``, or
    ``relu(x)``) in an optional, one more output of the forward ``If``: it holds their
    bytes until the gradient ``If`` reads them."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.cond(tf.reduce_mean(x) > 0, lambda: tf.nn.relu(x), lambda: 2.0 * tf.tanh(x))
            loss = tf.reduce_sum(tf.square(y))
        return tape.gradient(loss, x)

    traced = trace(step, (tf.ones((64, 256)),))
    fwd = [r for r in traced.records if r.op_type in ("If", "StatelessIf") and not r.name.startswith("gradient")]
    assert len(fwd) == 1, [r.name for r in traced.records if "If" in r.op_type]
    (optional,) = [t for t in fwd[0].outputs if t.dtype == "variant"]
    assert optional.bytes == 64 * 256 * 4


# -- kernel scratch probes (tfremat.scratch) --------------------------------------------
def _conv_step_traced():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tf_models import make_data, make_step

    x, y = make_data("cnn", batch=8, size=16)
    _, step = make_step("cnn", "sgd", channels=8, blocks=2, size=16)
    return trace(step, (x, y))


def _needs_allocator_statistics() -> None:
    """Skip where the CPU allocator reports no statistics: nothing is probed there."""
    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        pytest.skip("this TensorFlow reports no CPU allocator statistics: nothing is probed")


def test_scratch_probes_cover_each_signature_once_and_a_failed_probe_fails_nothing(monkeypatch):
    import tfremat.scratch as sc

    traced = _conv_step_traced()
    seen = []

    def failing(tf_, node_def, spec, record, device, library=None, forward=None):
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                             for k, v in node_def.attr.items() if not k.startswith("_")))
        seen.append((record.op_type, tuple(s for s, _, _ in spec), attrs))
        raise RuntimeError("a kernel that cannot run alone")

    monkeypatch.setattr(sc, "_probe", failing)
    # every probe failed: no estimate, and no error for the planner
    assert sc.measure_scratch(traced, "CPU:0") == {}
    if not seen:
        pytest.skip("this TensorFlow reports no CPU allocator statistics: nothing is probed")
    assert "Conv2DBackpropFilter" in {t for t, _, _ in seen}
    assert len(seen) == len(set(seen)), "a signature was probed twice"
    candidates = [r for r in traced.records if r.op_type in sc.PROBED_OPS]
    assert len(seen) < len(candidates), "ops of one signature were not grouped"


def test_an_xla_compiled_call_is_probed_as_one_kernel():
    """A ``jit_compile=True`` function (Keras' grouped convolutions on CPU) runs as one
    kernel, so its temporaries are scratch: the gradient of a 256-group 7x7 convolution
    on a [16, 1, 1, 256] input takes about 32 MiB while it runs (the 768-group one in
    ConvNeXtTiny 220 MiB), none of it in any output."""
    import tfremat.scratch as sc

    _needs_allocator_statistics()
    k = tf.Variable(tf.ones((7, 7, 1, 256)))

    @tf.function(jit_compile=True)
    def grouped(x, kernel):
        return tf.nn.conv2d(x, kernel, 1, "SAME")  # 256 input channels, 1 per group

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(grouped(x, k))
        return tape.gradient(loss, k)

    traced = trace(step, (tf.ones((16, 1, 1, 256)),))
    calls = [r.name for r in traced.records if r.op_type in sc.CALL_OPS]
    assert len(calls) == 2, calls  # the forward call and its gradient's
    found = sc.measure_scratch(traced, "CPU:0")
    assert max(found.get(n, 0) for n in calls) >= 16 * 2**20, found


def test_an_einsum_that_transposes_its_inputs_is_probed():
    """Keras' MultiHeadAttention computes its scores with an ``Einsum`` whose kernel
    transposes both operands into temporaries first ("bqhd,bkhd->bhqk": 2 MiB each
    here), none of them an output. Measured on vit_tiny: 11.4 MiB expected for 12.5
    measured without the probe, 12.9 for 13.0 with it."""
    import tfremat.scratch as sc

    _needs_allocator_statistics()

    @tf.function
    def scores(q, k):
        return tf.einsum("bqhd,bkhd->bhqk", q, k)

    q = tf.ones((16, 256, 4, 32))
    traced = trace(scores, (q, q))
    einsums = [r.name for r in traced.records if r.op_type == "Einsum"]
    assert einsums, [r.op_type for r in traced.records]
    found = sc.measure_scratch(traced, "CPU:0")
    assert found.get(einsums[0], 0) >= 2 * 2**20, found


def test_a_float16_product_is_probed_for_the_temporaries_its_kernel_takes():
    """On CPUs without float16 arithmetic a half ``MatMul`` converts its operands and
    result to float32 temporaries: a random mixed_float16 attention model of
    ``benchmarks/keras_fuzz.py`` (fp16attn 0) held 1.5 MiB beside each 0.38 MiB
    output and ran 13.1-14.0 MiB on a 13.1 MiB budget for 11.0 MiB of chunks
    predicted. Whatever the kernel takes here (the op's peak less its output), the
    probe measures most of it."""
    import tfremat.scratch as sc

    _needs_allocator_statistics()

    @tf.function
    def product(a, b):
        return tf.matmul(a, b)

    a, b = tf.ones((3072, 256), tf.float16), tf.ones((256, 256), tf.float16)
    product(a, b)  # traced and run once: the measured call allocates only the kernel's
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    out = product(a, b)
    taken = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before - out.shape.num_elements() * 2
    del out
    traced = trace(product, (a, b))
    (matmul,) = [r.name for r in traced.records if r.op_type == "MatMul"]
    found = sc.measure_scratch(traced, "CPU:0")
    # (both are chunks of a pool whose layout the process's history sets: measured
    # 6.25 MiB probed for 7.3 taken after the rest of the suite, 8.25 for 8.25 alone)
    assert found.get(matmul, 0) >= taken / 2 - 256 * 1024, (found, taken)


def test_scratch_is_the_kernels_requests_where_they_account_for_its_chunks():
    """The allocator's peak counts chunks, each at most twice its request: measured,
    a float16 filter gradient requested a 23.6 MiB im2col buffer in a 32 MiB chunk,
    and a 2.25 MiB convolution output with no scratch held a 4 MiB chunk."""
    from tfremat.scratch import _scratch_from

    mib = 2**20
    assert _scratch_from(32 * mib, 9216, 24717312) == 24717312
    assert _scratch_from(4 * mib, 2.25 * mib, 0) == 0
    # requests that make up less than half of the chunks: the kernel allocated outside
    # its context too, and the chunks (less the outputs) are what is known
    assert _scratch_from(32 * mib, 1 * mib, 10 * mib) == 31 * mib
    assert _scratch_from(32 * mib, 1 * mib, None) == 31 * mib
    assert _scratch_from(1 * mib, 0.9 * mib, None) == 0  # under 256 KiB: noise


def test_a_float16_convolution_gradient_is_probed_for_the_bytes_it_requests():
    """Not for the chunk its im2col buffer lands in (the plan's pool model makes the
    chunks; counted twice, random mixed_float16 classifiers' smallest budgets were
    80 MiB for steps measured at 35). The profiler's allocation events say what the
    kernel requested."""
    import sys
    from pathlib import Path

    import tfremat.scratch as sc

    _needs_allocator_statistics()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        from peak_replay import profile_events
    except ImportError as e:  # the profiler's protobuf module moved
        pytest.skip(f"no profiler events: {e}")

    @tf.function
    def gradient(x, dy):
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=[3, 3, 16, 32], out_backprop=dy, strides=[1, 1, 1, 1], padding="SAME")

    x, dy = tf.zeros((64, 24, 24, 16), tf.float16), tf.zeros((64, 24, 24, 32), tf.float16)
    gradient(x, dy)
    requested = peak = 0
    for kind, st in profile_events(lambda: gradient(x, dy)):
        requested += st["requested_bytes"] if kind == "MemoryAllocation" else -(st.get("requested_bytes") or 0)
        peak = max(peak, requested)
    taken = peak - 3 * 3 * 16 * 32 * 2
    if taken < 2**20:
        pytest.skip("this CPU's float16 filter gradient takes no scratch (AVX-512 FP16: oneDNN's kernel)")
    traced = trace(gradient, (x, dy))
    (op,) = [r.name for r in traced.records if r.op_type == "Conv2DBackpropFilter"]
    found = sc.measure_scratch(traced, "CPU:0").get(op, 0)
    assert abs(found - taken) <= 256 * 1024, (found, taken)


def test_a_max_pool_gradient_is_probed_beside_its_forward_pool(monkeypatch):
    """Alone, ``MaxPoolGrad`` runs Eigen's kernel, which recomputes the arg-max into
    int64 temporaries (6 MiB here); in a step, oneDNN pairs it with its ``MaxPool``,
    whose workspace it reads (0.5 MiB on one CPU, 1.2 MiB on another: its size
    depends on the kernel oneDNN picks for the CPU). The probe runs the pair, and the
    forward's output is not counted as scratch."""
    import tfremat.scratch as sc
    from tfremat.api import _ONEDNN_SMALLEST_COUNTED, _smallest_counted

    _needs_allocator_statistics()

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.max_pool2d(x, 2, 2, "VALID")
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    traced = trace(step, (tf.ones((32, 32, 32, 64)),))
    (grad,) = [r.name for r in traced.records if r.op_type == "MaxPoolGrad"]
    paired = sc.measure_scratch(traced, "CPU:0").get(grad, 0)
    monkeypatch.setattr(sc, "_PAIRED_FORWARD", {})
    alone = sc.measure_scratch(traced, "CPU:0").get(grad, 0)
    assert alone >= 4 * 2**20, alone  # the arg-max alone: int64 of the 2 MiB output
    assert paired <= alone, (paired, alone)
    if _smallest_counted("CPU:0") == _ONEDNN_SMALLEST_COUNTED:  # oneDNN's allocator
        # Under half the int64 arg-max Eigen's kernel alone needs (4 MiB of it here).
        assert paired <= 2 * 2**20, paired


def test_no_scratch_probes_while_an_outer_function_traces():
    import tfremat.scratch as sc

    traced = _conv_step_traced()
    found = []

    @tf.function
    def outer():
        found.append(sc.measure_scratch(traced, "CPU:0"))
        return tf.constant(0)

    outer()
    assert found == [{}]


def test_dead_ops_are_dropped_as_the_runtime_drops_them():
    """The function runtime prunes ops nothing reads before Grappler sees the body
    (e.g. a gradient with respect to a constant divisor); counted, they changed the
    consumer counts Grappler's rewrites decide from (MobileNetV3Small). Stateful ops
    and the arguments stay even when nothing reads them."""
    v = tf.Variable(1.0)

    @tf.function
    def f(x, unused):
        dead = tf.square(x) * 3.0  # read by nothing
        v.assign_add(1.0)  # stateful, read by nothing: runs anyway
        return tf.sin(x)

    traced = trace(f, (tf.ones((4,)), tf.ones((4,))), {})
    names = {n.name for n in traced.graph_def.node}
    assert {r.name for r in traced.records} == names
    ops = {n.op for n in traced.graph_def.node}
    assert "Square" not in ops and "Mul" not in ops
    assert {"Sin", "AssignAddVariableOp"} <= ops
    assert set(traced.arg_placeholders) <= names and len(traced.arg_placeholders) == 2


def test_an_optimizers_identity_n_is_bypassed_as_grappler_does_and_the_step_is_unchanged():
    """Keras' optimizers pass every gradient through one IdentityN; Grappler removes
    it, so the trace reads the gradients directly and names them for the planner."""
    import numpy as np

    from tf_models import make_data, make_step
    from tfremat.emit import emit
    from tfremat.trace import flat_tensor_args

    tf.config.experimental.enable_op_determinism()
    x, y = make_data("mlp", batch=64, width=32)
    ref_model, ref_step = make_step("mlp", "adam", layers=3, width=32)
    ref = [float(ref_step(x, y)) for _ in range(3)]
    model, step = make_step("mlp", "adam", layers=3, width=32)
    assert any(op.type == "IdentityN" for op in step.get_concrete_function(x, y).graph.get_operations())
    traced = trace(step, (x, y))
    assert not any(r.op_type == "IdentityN" for r in traced.records)
    assert not any(n.op == "IdentityN" for n in traced.graph_def.node)
    # each gradient once (Keras passes them twice)
    assert len(traced.gradients) == len(model.trainable_variables)
    fn = emit(traced, traced.graph_def)
    flat = flat_tensor_args(traced.python_function, (x, y), {})
    assert [float(fn(*flat)) for _ in range(3)] == ref
    for a, b in zip(model.variables, ref_model.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_an_identity_n_a_reader_waits_on_is_kept():
    """Grappler keeps an IdentityN with a control output (bypassing it would add
    control edges), and so does the trace."""
    v = tf.Variable(tf.zeros((4, 4)))

    @tf.function
    def step(x):
        a, b = tf.identity_n([x * 2.0, x * 3.0])
        with tf.control_dependencies([a]):
            c = b + 1.0
        v.assign_add(a)
        v.assign_add(c)
        return x + 0.0

    traced = trace(step, (tf.ones((4, 4)),))
    assert [r.op_type for r in traced.records].count("IdentityN") == 1
    assert traced.gradients == ()


def test_an_identity_n_outside_the_optimizer_is_kept():
    """Only an IdentityN whose readers feed variable writes alone is bypassed: one in
    the forward pass (``tf.custom_gradient`` writes them) stays as it was traced."""
    v = tf.Variable(tf.zeros((4, 4)))

    @tf.function
    def step(x):
        a, b = tf.identity_n([x * 2.0, x * 3.0])
        v.assign_add(a)
        return a + b

    traced = trace(step, (tf.ones((4, 4)),))
    assert [r.op_type for r in traced.records].count("IdentityN") == 1

    @tf.function
    def update(x):
        a, b = tf.identity_n([x * 2.0, x * 3.0])
        v.assign_add(a)
        v.assign_add(b)
        return x + 0.0

    traced = trace(update, (tf.ones((4, 4)),))
    assert [r.op_type for r in traced.records].count("IdentityN") == 0
    assert len(traced.gradients) == 2


def test_the_outputs_of_an_xla_call_are_planned_apart():
    """Keras' grouped convolution on CPU is an XLA-compiled call whose outputs are the
    convolution (read by the next BiasAdd) and the tensors its gradient call reads:
    as one node, the convolution's bytes were held to the backward pass."""
    from tf_models import make_data, make_step
    from tfremat.graph import build_graph, with_call_outputs
    from tfremat.simulate import reference_simulation

    x, y = make_data("grouped", batch=8, size=16)
    _, step = make_step("grouped", "sgd", channels=8, blocks=2, size=16)
    traced = trace(step, (x, y))
    g = build_graph(traced.records, traced.arg_placeholders, traced.handle_bytes, traced.gradients).graph
    split = [v for v, a in g.nodes(data=True) if a.get("output_readers")]
    forward = [v for v in split if g.nodes[v]["phase"] == "forward"]
    assert len(forward) == 2, split  # one per grouped convolution
    conv = 8 * 16 * 16 * 8 * 4  # the convolution's output, float32
    for v in forward:
        readers = g.nodes[v]["output_readers"]
        assert sum(b for b, _ in readers) == g.nodes[v]["bytes"]
        assert any(b == conv and all(g.nodes[c]["phase"] == "forward" for c in cs) for b, cs in readers)
    h = with_call_outputs(g)
    assert reference_simulation(h).peak_bytes < reference_simulation(g).peak_bytes


def test_written_variables_are_those_given_to_anything_but_a_read():
    from tfremat.trace import written_variables

    read, assigned, applied, in_cond, gathered = (tf.Variable(tf.ones((4, 4))) for _ in range(5))

    @tf.function
    def step(x, flag):
        y = x @ read + tf.gather(gathered, [0, 1], axis=0)[0]
        assigned.assign_add(y)
        applied.assign_sub(0.1 * applied * y)  # read and written
        # a branch's body is not looked into: given the handle, it counts
        tf.cond(flag, lambda: in_cond.assign(y).read_value(), lambda: y)
        return tf.reduce_sum(y)

    traced = trace(step, (tf.ones((4, 4)), tf.constant(True)))
    got = {id(v) for v in written_variables(traced)}
    assert got == {id(assigned), id(applied), id(in_cond)}


def test_a_size_that_depends_on_the_data_is_taken_at_its_largest_input():
    """``tf.where`` and a gather through its indices have rows that depend on the
    data: each is sized at its largest input, the unknown dimension holding what the
    known ones leave, marked ``estimated`` and never recomputed. A tensor no input
    bounds (an argument of unknown size) still raises UnknownShapeError."""
    from tfremat import UnknownShapeError
    from tfremat.graph import build_graph

    @tf.function
    def f(x):
        idx = tf.where(x > 0.0)  # [None, 2] int64 of at most 8 * 4 elements
        vals = tf.gather_nd(x, idx)  # [None]
        return tf.reduce_sum(vals * 2.0)

    traced = trace(f, (tf.ones((8, 4)),), {})
    by_name = {r.name: r for r in traced.records}
    where = next(r for r in traced.records if r.op_type == "Where")
    gather = next(r for r in traced.records if r.op_type == "GatherNd")
    assert where.outputs[0].estimated and where.outputs[0].shape == (16, 2)
    assert where.outputs[0].bytes == 16 * 2 * 8
    assert gather.outputs[0].estimated and gather.outputs[0].shape == (32,)
    assert not by_name[where.inputs[0].split(":")[0]].outputs[0].estimated
    g = build_graph(traced.records, traced.arg_placeholders).graph
    assert not g.nodes[where.name]["recomputable"] and not g.nodes[gather.name]["recomputable"]
    assert g.nodes[gather.name]["output_shapes"] == (None,)

    @tf.function(input_signature=[tf.TensorSpec((None, 4))])
    def h(x):
        return tf.reduce_sum(x * 2.0)

    with pytest.raises(UnknownShapeError):
        trace(h, (tf.ones((8, 4)),), {})


def test_an_op_of_a_guessed_size_is_not_probed_for_scratch():
    """A probe runs the op alone on inputs of the recorded shapes: for a guessed
    (``estimated``) shape it would measure another kernel than the step runs."""
    from tfremat.scratch import _input_specs

    k = tf.ones((3, 3, 1, 2))

    @tf.function
    def f(x):
        rows = tf.gather_nd(x, tf.where(x > 0.0))  # [None]: a guessed size
        img = tf.reshape(rows, (1, -1, 4, 1))
        guessed = tf.nn.conv2d(img, k, 1, "SAME")
        static = tf.nn.conv2d(tf.reshape(x, (1, 8, 4, 1)), k, 1, "SAME")
        return tf.reduce_sum(guessed) + tf.reduce_sum(static)

    traced = trace(f, (tf.ones((8, 4)),), {})
    by_name = {r.name: r for r in traced.records}
    convs = [r for r in traced.records if r.op_type == "Conv2D"]
    assert sorted(r.outputs[0].estimated for r in convs) == [False, True]
    for r in convs:
        assert (_input_specs(r, by_name) is None) == r.outputs[0].estimated


def test_the_tanh_gelus_square_is_planned_beside_its_cube():
    """A traced tanh GELU step: its constants carry their values, the gradient's
    ``Pow(x, 3 - 1)`` is planned as the forward ``Pow(x, 3)``'s input (Grappler
    computes the two together, graph.build_graph), in the forward pass."""
    from tfremat.graph import build_graph

    w = tf.Variable(tf.ones((8, 8)))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.gelu(x @ w, approximate=True))
        return tape.gradient(loss, w)

    traced = trace(step, (tf.ones((4, 8)),), {})
    assert 3.0 in {r.scalar for r in traced.records if r.op_type == "Const"}
    g = build_graph(traced.records, traced.arg_placeholders).graph
    pows = {v: d for v, d in g.nodes(data=True) if d["op_type"] == "Pow"}
    assert len(pows) == 2, sorted(pows)
    (square,) = [v for v in pows if any(g.has_edge(v, u) for u in pows)]
    (cube,) = [v for v in pows if v != square]
    assert g.edges[square, cube]["kind"] == "liveness"
    assert pows[square]["phase"] == "forward"
    order = g.graph["order"]
    assert order.index(square) < order.index(cube)
