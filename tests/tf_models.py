"""Small train steps shared by the TensorFlow tests (built fresh, seeded, per call)."""

from __future__ import annotations

import keras
import tensorflow as tf


def mlp(layers: int = 12, width: int = 256):
    inp = keras.Input((width,))
    h = inp
    for _ in range(layers):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def residual_cnn(channels: int = 16, blocks: int = 3, size: int = 32, groups: int = 1):
    inp = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(inp)
    for _ in range(blocks):
        r = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(h)
        # groups > 1: Keras runs grouped convolutions on CPU as XLA-compiled calls
        r = keras.layers.Conv2D(channels, 3, padding="same", groups=groups)(r)
        h = keras.layers.Activation("relu")(keras.layers.Add()([h, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


@tf.custom_gradient
def swish(x):
    """``x * sigmoid(x)`` whose gradient recomputes ``sigmoid(x)`` and ``x * sigmoid(x)``
    from ``x``, as hand-written gradients do: Grappler merges those with the forward's."""
    y = x * tf.sigmoid(x)

    def grad(dy):
        s = tf.sigmoid(x)
        return dy * (s + x * s * (1.0 - s))

    return y, grad


def swish_mlp(layers: int = 8, width: int = 256):
    inp = keras.Input((width,))
    h = inp
    for _ in range(layers):
        h = keras.layers.Lambda(swish)(keras.layers.Dense(width)(h))
    return keras.Model(inp, keras.layers.Dense(10)(h))


def grouped_cnn(channels: int = 16, blocks: int = 3, size: int = 32):
    return residual_cnn(channels, blocks, size, groups=4)


MODELS = {"mlp": mlp, "cnn": residual_cnn, "swish": swish_mlp, "grouped": grouped_cnn}
IMAGE_MODELS = ("cnn", "grouped")


def make_step(kind: str = "mlp", optimizer: str = "sgd", seed: int = 0, **kw):
    """Return ``(model, step)``: a fresh model and its plain ``tf.function`` train step."""
    keras.utils.set_random_seed(seed)
    model = MODELS[kind](**kw)
    opt = {
        "sgd": lambda: keras.optimizers.SGD(0.01),
        "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(1e-3),
    }[optimizer]()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, tf.function(gradient_step(model, opt, loss_fn))


def gradient_step(model, opt, loss_fn):
    """The plain Python train step ``(x, y) -> loss``: one GradientTape update."""

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def make_data(kind: str = "mlp", batch: int = 512, width: int = 256, size: int = 32, seed: int = 1):
    shape = (batch, size, size, 3) if kind in IMAGE_MODELS else (batch, width)
    x = tf.random.stateless_normal(shape, seed=(seed, 0))
    y = tf.random.stateless_uniform((batch,), seed=(seed, 1), minval=0, maxval=10, dtype=tf.int32)
    return x, y


def measure_peak(fn, *args):
    """Call ``fn`` once; return (result, allocator peak bytes during the call)."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    out = fn(*args)
    return out, tf.config.experimental.get_memory_info("CPU:0")["peak"]
