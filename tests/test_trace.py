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
