"""Train a Keras model with model.fit under a memory budget, with tfremat.

    python examples/keras_fit.py

One line turns rematerialization on: ``tfremat.keras.remat(model, budget_gib=...)``
on a compiled Keras 3 model (TensorFlow backend). ``fit`` and ``train_on_batch`` then
run a rewritten train step whose allocator peak stays under the budget and which
computes bitwise the same losses, metrics and weights as Keras' own step.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# This example prints the allocator's peak: TensorFlow's default CPU allocator reports
# it only with oneDNN on, which TF turns on by itself only on CPUs with AVX-512 VNNI/BF16
# or AMX (not on an AVX2-only AMD EPYC, for one).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfremat  # noqa: E402
import tfremat.keras  # noqa: E402

L = keras.layers


def build():
    inp = keras.Input((32, 32, 3))
    h = inp
    for i in range(6):  # residual blocks with BatchNorm and Dropout
        r = L.Conv2D(32, 3, padding="same")(h)
        r = L.BatchNormalization()(r)
        r = L.ReLU()(r)
        r = L.Dropout(0.2)(r)
        h = r if i == 0 else L.Add()([h, r])
    out = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    return keras.Model(inp, out)


def main():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, (256,)).astype("int32")

    model = build()
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    # Keras' own step peaks at about 0.18 GiB with batch 64; ask for 0.16 GiB.
    tfremat.keras.remat(model, budget_gib=0.16)
    print(tfremat.keras.explain(model, x[:64], y[:64]).split("\n  recompute")[0])

    model.fit(x, y, batch_size=64, epochs=1, verbose=2)

    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x[:64], y[:64])
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print(f"measured peak of one train step: {peak / 2**30:.3f} GiB (budget 0.160 GiB)")


if __name__ == "__main__":
    main()
