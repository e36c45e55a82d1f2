"""While loops: an RNN's forward loop recomputed whole, any other loop kept opaque."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tfremat  # noqa: E402
import tfremat.keras  # noqa: E402
from tfremat.graph import build_graph  # noqa: E402
from tfremat.trace import trace  # noqa: E402

T, B, D = 16, 32, 64


def _loops(step, *args):
    """(records, planning graph) of the forward while loops of ``step``."""
    traced = trace(step, args)
    g = build_graph(traced.records, traced.arg_placeholders).graph
    loops = [r for r in traced.records if r.op_type in ("While", "StatelessWhile") and "grad" not in r.name]
    return loops, g


def _loop_step(body_extra=None, write_before_use=False):
    w = tf.Variable(tf.random.stateless_normal((D, D), (1, 2)) * 0.1)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            def body(i, h):
                h = tf.tanh(tf.matmul(h, w) + x[i])
                if body_extra is not None:
                    h = body_extra(h)
                return i + 1, h

            _, h = tf.while_loop(lambda i, h: i < T, body, [0, tf.zeros((B, D))], maximum_iterations=T)
            if write_before_use:
                w.assign_add(tf.ones((D, D)))  # runs between the loop and its gradient's use
            loss = tf.reduce_sum(h * h)
        g = tape.gradient(loss, w)
        w.assign_sub(0.01 * g)
        return loss

    return step, w


def test_a_loop_of_pure_kernels_and_variable_reads_is_recomputable():
    step, _ = _loop_step()
    (loop,), g = _loops(step, tf.random.normal((T, B, D)))
    assert loop.pure_loop and g.nodes[loop.name]["recomputable"]
    # every weight multiplied once per row per iteration: at least 2 * T * B * D * D
    assert g.nodes[loop.name]["cost"] >= 2 * T * B * D * D


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(lambda h: h + tf.random.uniform(tf.shape(h)), id="stateful_rng"),
        pytest.param(lambda h: tf.cond(tf.reduce_sum(h) > 0, lambda: h, lambda: -h), id="nested_branch"),
    ],
)
def test_a_loop_with_a_stateful_or_nested_op_stays_opaque(extra):
    step, _ = _loop_step(body_extra=extra)
    (loop,), g = _loops(step, tf.random.normal((T, B, D)))
    assert not loop.pure_loop and not g.nodes[loop.name]["recomputable"]


def test_no_copy_of_a_loop_runs_after_a_write_of_a_variable_it_reads():
    """A copy of the loop reads its variable again: after a write of it, it would read
    the new value. The planning graph names the writers; a plan recomputing the loop
    after one is planned again with the loop kept, and the rewrite makes each writer
    wait for every copy."""
    from tfremat.plan import Problem
    from tfremat.rewrite import rewrite_graph_def
    from tfremat.simulate import reread_after_write
    from tfremat.solvers import solve

    step, _ = _loop_step(write_before_use=True)
    traced = trace(step, (tf.random.normal((T, B, D)),))
    g = build_graph(traced.records, traced.arg_placeholders).graph
    (loop,) = [r.name for r in traced.records if r.op_type == "While" and "grad" not in r.name]
    writers = g.nodes[loop]["writers"]
    assert len(writers) == 2  # the assign_add in the forward pass and the update
    order = list(g.graph["order"])
    late = order + [loop]  # a copy after both writes
    assert reread_after_write(g, late) == {loop}
    assert not reread_after_write(g, order)

    def recompute_at_the_end(problem):
        from tfremat.solvers.common import make_plan

        sched = list(problem.graph.graph["order"])
        if problem.graph.nodes[loop]["recomputable"]:
            sched.append(loop)
        return make_plan(problem, sched, "test", "heuristic")

    plan = solve(Problem(g, 2**40), recompute_at_the_end)
    assert loop not in plan.recomputed

    # a copy before the writes: each writer waits for it in the rewritten step
    at = min(order.index(w) for w in writers)
    gd, _ = rewrite_graph_def(traced.graph_def, order[:at] + [loop] + order[at:], g, traced.dtypes)
    nodes = {n.name: n for n in gd.node}
    (copy,) = [n for n, d in nodes.items() if n.startswith(loop + "/_remat") and d.op == "While"]
    for w in writers:
        assert "^" + copy in nodes[w].input


def _rnn_model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, 16))
    h = keras.layers.Dense(D, activation="relu")(inp)
    h = keras.layers.LSTM(D, return_sequences=True)(h)
    h = keras.layers.Dense(D, activation="relu")(h)
    h = keras.layers.GRU(16)(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("held_mib", [0, 256])
def test_an_rnn_step_recomputes_its_loops_exactly_and_under_budget(held_mib):
    """The smallest budget the solver accepts, plus 1 MiB: the plan recomputes the
    LSTM's forward loop (its accumulators are most of the step's activations), the
    three steps match Keras' own bitwise, and each measured peak is under the budget."""
    tf.config.experimental.enable_op_determinism()
    held = tf.ones((held_mib, 2**18)) + 0.0  # memory the rest of the process holds
    rng = np.random.default_rng(0)
    # 1024 rows: each accumulator element (1024 x 64 floats) is 256 KiB, which the
    # default CPU allocator's statistics count (smaller ones it leaves out, and so
    # does the plan: the loops would hold nothing worth recomputing)
    rows = 1024
    x = tf.constant(rng.standard_normal((rows, T, 16)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, (rows,)).astype("int32"))

    ref = _rnn_model()
    ref_losses = [float(ref.train_on_batch(x, y)) for _ in range(3)]

    model = tfremat.keras.remat(_rnn_model(), budget_gib=1e-6)
    with pytest.raises(tfremat.InfeasibleBudgetError) as e:
        tfremat.keras.get_plan(model, x, y)
    # (not + 10 %: the budget counts what the rest of the process holds, and 10 % of
    # that left room for a plan keeping the loops when the whole suite ran first)
    budget = e.value.min_feasible_bytes + 2**20
    model = tfremat.keras.remat(model, budget_gib=budget / 2**30)
    plan = tfremat.keras.get_plan(model, x, y)
    graph = tfremat.keras._step_for(model)._entry((tfremat.keras._batch(model, x, y),), {}).step_graph.graph
    loops = [v for v in plan.recomputed if graph.nodes[v]["op_type"] in ("While", "StatelessWhile")]
    assert loops, "the plan recomputes no loop: the test would prove nothing"

    losses, peaks = [], []
    for _ in range(3):
        tf.config.experimental.reset_memory_stats("CPU:0")
        losses.append(float(model.train_on_batch(x, y)))
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    assert losses == ref_losses
    for a, b in zip(model.variables, ref.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert max(peaks) <= budget, (max(peaks) / 2**20, budget / 2**20)
    del held


def test_an_lstm_s_accumulators_are_sized_as_lists_of_per_step_elements():
    """Each accumulator of the forward loop holds one element per time step, each an
    allocation of its own (what an allocator leaving small requests out of its
    statistics sees: ``StepGraph.counted``)."""
    keras.utils.set_random_seed(0)
    layer = keras.layers.LSTM(D, return_sequences=True)
    x = tf.random.stateless_normal((B, T, 16), (1, 2))
    layer(x)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, layer.trainable_variables)

    traced = trace(step, (x,))
    loops = [r for r in traced.records if r.op_type in ("While", "StatelessWhile") and "grad" not in r.name]
    lists = [t for r in loops for t in r.outputs if t.dtype == "variant" and t.bytes]
    assert lists, "no accumulator sized: the test would prove nothing"
    for t in lists:
        assert t.pieces == T and t.bytes % T == 0 and t.piece_bytes * T == t.bytes
    unstacked = [t for r in traced.records if r.op_type == "TensorListFromTensor" for t in r.outputs]
    assert unstacked and all(t.pieces == T for t in unstacked)
    sg = build_graph(traced.records, traced.arg_placeholders)
    small = sg.counted(256 * 1024).graph  # B x D floats per element: 8 KiB
    for r in loops:
        assert small.nodes[r.name]["bytes"] < sg.graph.nodes[r.name]["bytes"]
