"""Robustness sweep: Keras models the tests do not cover, through the tests' own check.

    python benchmarks/keras_sweep.py [NAME ...]
    python benchmarks/keras_sweep.py variants   # how a model is compiled and fed

For each model (default: all of ``EXTRA``), Keras' own 3 Adam steps run in one fresh
process and tfremat's in another (``tests/test_models.py``'s ``_check``: budget 60 % of
the measured baseline, or the solver's smallest budget + 10 % where 60 % is
infeasible, op determinism on), and one table row is printed: baseline, budget,
predicted peak (the simulator's tensors; the allocator model the budget is checked
against, ``Plan.allocator_peak_bytes``; ``Plan.expected_peak_bytes``, the model of
the allocator in use, which is what its statistics report), measured peak (MiB,
default CPU allocator), ops recomputed, and whether
every loss and variable is bitwise equal. The large keras.applications models take
minutes each on 2 cores. Results: docs/keras.md ("Other Keras models").
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_models as tm  # noqa: E402

# name -> (batch, input shape)
EXTRA = {
    "conv1d_attention": (32, (128, 16)),
    "embed_bilstm": (64, (40,)),
    "autoencoder": (32, (32, 32, 3)),
    "sepconv_groupnorm": (32, (32, 32, 3)),
    "unet": (8, (64, 64, 3)),
    "xception": (16, (71, 71, 3)),
    "nasnetmobile": (16, (32, 32, 3)),
    "convnexttiny": (16, (32, 32, 3)),
    "gru_conv1d": (48, (64, 16)),
    "conv3d_bn": (8, (16, 32, 32, 3)),
    "causal_decoder": (32, (64,)),
    "vit_tiny": (32, (32, 32, 3)),
    "efficientnetv2b0": (16, (32, 32, 3)),
    "resnet50v2": (16, (32, 32, 3)),
    # session 11
    "inceptionv3": (8, (75, 75, 3)),
    "mobilenet": (32, (32, 32, 3)),
    "noisy_cnn": (32, (32, 32, 3)),
    "masked_lstm": (32, (48,)),
    # session 22
    "mobilenetv3large": (32, (32, 32, 3)),
    "resnext_tiny": (32, (32, 32, 3)),  # grouped convolutions
    "tabular_mlp": (256, (64,)),
    # session 29: random augmentation layers, shared weights, token mixing, attention
    "augment_cnn": (32, (32, 32, 3)),
    "siamese": (32, (32, 32, 6)),
    "mlp_mixer": (32, (32, 32, 3)),
    "seq_attention": (32, (64, 16)),
    "film_glu": (32, (128, 16)),
    "einsum_rms": (32, (64, 32)),
    "convlstm": (8, (6, 16, 16, 3)),
    "attention2d": (16, (16, 16, 3)),
    "swiglu_prenorm": (32, (64, 32)),
    "preact_fp16": (32, (32, 32, 3)),  # "fp16": the check sets the mixed_float16 policy
    "sepconv1d": (32, (128, 8)),
    "bigru_mha": (16, (32, 16)),
    "cross_attention": (32, (48, 32)),
    "upsample_fp16": (16, (16, 16, 8)),
    # session 30: tanh-GELU decoder, squeeze-and-excitation, Mish, a text CNN, Conformer
    "gpt_tanh_gelu": (32, (64, 16)),
    "se_resnet": (32, (32, 32, 3)),
    "mish_cnn": (32, (32, 32, 3)),
    "textcnn": (64, (80,)),
    "conformer": (16, (64, 32)),
    # session 31: grouped-query attention with RMSNorm, SELU with alpha dropout, unit
    # normalization with PReLU, transposed 1-D convolutions
    "gqa_rmsnorm": (32, (64, 32)),
    "selu_alpha": (1024, (256,)),
    "unitnorm_prelu": (32, (32, 32, 3)),
    "conv1d_transpose": (128, (256, 16)),
    # session 34: control flow, stateful randomness and gradients of one's own
    "cond_gate": (32, (32, 32, 3)),
    "stateful_dropout": (32, (32, 32, 3)),
    "scan_rnn": (32, (64, 32)),
    "topk_gather": (32, (64, 32)),
    "pixel_shuffle": (16, (32, 32, 3)),
    "ste_quant": (32, (32, 32, 3)),
    "recompute_grad_block": (32, (32, 32, 3)),
}


def _builders():
    import keras
    import tensorflow as tf

    L = keras.layers
    out = _test_builders()

    def prenorm_blocks(h, blocks, norm, attention, feed_forward):
        """Pre-norm residual blocks: ``h + attention(norm(h))``, then
        ``h + feed_forward(norm(h))``; ``norm`` makes a new normalization layer."""
        for _ in range(blocks):
            n = norm()(h)
            h = L.Add()([h, attention(n)])
            n = norm()(h)
            h = L.Add()([h, feed_forward(n)])
        return h

    def conv1d_attention():
        inp = keras.Input(EXTRA["conv1d_attention"][1])
        h = inp
        for c in (64, 64, 128):
            h = L.BatchNormalization()(L.Conv1D(c, 5, padding="same", activation="elu")(h))
        h = L.Attention()([h, h])
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def embed_bilstm():
        inp = keras.Input(EXTRA["embed_bilstm"][1])  # float, as the check feeds: made token ids
        ids = L.Lambda(lambda t: keras.ops.cast(keras.ops.abs(t) * 1000, "int32"))(inp)
        h = L.Embedding(5000, 64)(ids)
        h = L.Bidirectional(L.LSTM(32, return_sequences=True))(h)
        h = L.GlobalMaxPooling1D()(L.Dense(128, activation="relu")(h))
        return keras.Model(inp, L.Dense(10)(L.Dropout(0.3)(h)))

    def autoencoder():
        inp = keras.Input(EXTRA["autoencoder"][1])
        h = inp
        for c in (32, 64):
            h = L.Conv2D(c, 3, strides=2, padding="same", activation="relu")(h)
        for c in (64, 32):
            h = L.Conv2DTranspose(c, 3, strides=2, padding="same", activation="relu")(h)
        h = L.MaxPooling2D()(L.UpSampling2D()(L.Conv2D(3, 3, padding="same")(h)))
        return keras.Model(inp, L.Dense(10)(L.Flatten()(L.AveragePooling2D(4)(h))))

    def sepconv_groupnorm():
        inp = keras.Input(EXTRA["sepconv_groupnorm"][1])
        h = L.Conv2D(32, 3, padding="same")(inp)
        for _ in range(4):
            r = L.GroupNormalization(8)(L.SeparableConv2D(32, 3, padding="same")(h))
            h = L.Add()([h, L.SpatialDropout2D(0.1)(L.Activation("swish")(r))])
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def unet():
        inp = keras.Input(EXTRA["unet"][1])
        skips, h = [], inp
        for c in (16, 32, 64):
            h = L.Conv2D(c, 3, padding="same", activation="relu")(h)
            skips.append(h)
            h = L.MaxPooling2D()(h)
        h = L.Conv2D(128, 3, padding="same", activation="relu")(h)
        for c, s in zip((64, 32, 16), reversed(skips)):
            h = L.Concatenate()([L.Conv2DTranspose(c, 2, strides=2)(h), s])
            h = L.Conv2D(c, 3, padding="same", activation="relu")(h)
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def gru_conv1d():
        inp = keras.Input(EXTRA["gru_conv1d"][1])
        h = L.Conv1D(64, 3, padding="same", activation="relu")(inp)
        h = L.GRU(64, return_sequences=True)(h)
        h = L.GRU(32)(L.LayerNormalization()(h))
        return keras.Model(inp, L.Dense(10)(h))

    def conv3d_bn():
        inp = keras.Input(EXTRA["conv3d_bn"][1])
        h = inp
        for c in (16, 32):
            h = L.ReLU()(L.BatchNormalization()(L.Conv3D(c, 3, padding="same")(h)))
            h = L.MaxPooling3D()(h)
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling3D()(h)))

    def causal_decoder(d=64, blocks=2):
        seq = EXTRA["causal_decoder"][1][0]
        inp = keras.Input((seq,))  # float, as the check feeds: made token ids
        ids = L.Lambda(lambda t: keras.ops.cast(keras.ops.abs(t) * 100, "int32") % 1000)(inp)
        h = L.Embedding(1000, d)(ids)
        for _ in range(blocks):
            a = L.MultiHeadAttention(4, d // 4, dropout=0.1)(h, h, use_causal_mask=True)
            h = L.LayerNormalization()(L.Add()([h, a]))
            f = L.Dense(d)(L.Dropout(0.1)(L.Dense(4 * d, activation="gelu")(h)))
            h = L.LayerNormalization()(L.Add()([h, f]))
        return keras.Model(inp, L.Dense(10)(h[:, -1]))

    def vit_tiny(d=64, blocks=2):
        inp = keras.Input(EXTRA["vit_tiny"][1])
        h = L.Reshape((64, d))(L.Conv2D(d, 4, strides=4)(inp))
        for _ in range(blocks):
            n = L.LayerNormalization()(h)
            h = L.Add()([h, L.MultiHeadAttention(4, d // 4)(n, n)])
            n = L.LayerNormalization()(h)
            h = L.Add()([h, L.Dense(d)(L.Dense(2 * d, activation="gelu")(n))])
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def noisy_cnn():
        # random-noise layers (stateless RNG seeded from a variable), learned and fixed
        # activations, resampling and cropping
        inp = keras.Input(EXTRA["noisy_cnn"][1])
        h = L.GaussianNoise(0.1)(inp)
        h = L.PReLU(shared_axes=[1, 2])(L.Conv2D(32, 3, padding="same")(h))
        h = L.SpatialDropout2D(0.2)(L.Activation("mish")(L.Conv2D(32, 3, padding="same")(h)))
        h = L.MaxPooling2D()(h)
        h = L.GaussianDropout(0.2)(L.LeakyReLU(0.1)(L.Conv2D(64, 3, padding="same")(h)))
        h = L.Cropping2D(2)(L.UpSampling2D(interpolation="bilinear")(h))
        h = L.Activation("hard_silu")(L.LayerNormalization()(L.Conv2D(32, 3, padding="same")(h)))
        h = L.Activation("selu")(L.DepthwiseConv2D(3, padding="same")(h))
        return keras.Model(inp, L.Dense(10)(L.AlphaDropout(0.1)(L.GlobalAveragePooling2D()(h))))

    def masked_lstm():
        inp = keras.Input(EXTRA["masked_lstm"][1])  # float, as the check feeds: token ids, 0 masked
        ids = L.Lambda(lambda t: keras.ops.cast(keras.ops.maximum(t, 0.0) * 300, "int32") % 500)(inp)
        h = L.Embedding(500, 64, mask_zero=True)(ids)
        h = L.LSTM(64, return_sequences=True)(h)
        h = L.Dense(128, activation="tanh")(h)
        return keras.Model(inp, L.Dense(10)(L.LSTM(32)(h)))

    def resnext_tiny():
        # ResNeXt-style bottlenecks: a grouped 3x3 convolution between 1x1 ones
        inp = keras.Input(EXTRA["resnext_tiny"][1])
        h = L.Conv2D(64, 3, padding="same")(inp)
        for _ in range(3):
            r = L.ReLU()(L.BatchNormalization()(L.Conv2D(64, 1)(h)))
            r = L.ReLU()(L.BatchNormalization()(L.Conv2D(64, 3, padding="same", groups=8)(r)))
            h = L.ReLU()(L.Add()([h, L.BatchNormalization()(L.Conv2D(64, 1)(r))]))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def tabular_mlp():
        # a wide-and-deep tabular model: an embedded categorical column beside
        # BatchNorm'd dense layers, concatenated
        inp = keras.Input(EXTRA["tabular_mlp"][1])
        ids = L.Lambda(lambda t: keras.ops.cast(keras.ops.abs(t[:, :1]) * 100, "int32") % 200)(inp)
        wide = L.Flatten()(L.Embedding(200, 16)(ids))
        h = inp
        for width in (512, 512, 256):
            h = L.Dropout(0.1)(L.Activation("relu")(L.BatchNormalization()(L.Dense(width)(h))))
        return keras.Model(inp, L.Dense(10)(L.Concatenate()([h, wide])))

    def augment_cnn():
        # Keras' random augmentation layers (stateless RNG from a SeedGenerator, an
        # image transform with no gradient) in front of BatchNorm conv blocks
        inp = keras.Input(EXTRA["augment_cnn"][1])
        h = L.RandomFlip("horizontal")(inp)
        h = L.RandomRotation(0.1)(h)
        h = L.RandomZoom(0.1)(h)
        h = L.RandomContrast(0.2)(h)
        for c in (32, 64):
            h = L.ReLU()(L.BatchNormalization()(L.Conv2D(c, 3, padding="same")(h)))
            h = L.ReLU()(L.BatchNormalization()(L.Conv2D(c, 3, padding="same")(h)))
            h = L.MaxPooling2D()(h)
        return keras.Model(inp, L.Dense(10)(L.Dropout(0.2)(L.GlobalAveragePooling2D()(h))))

    def siamese():
        # one tower applied to two halves of the input: every weight's gradient is a
        # sum over two uses
        inp = keras.Input(EXTRA["siamese"][1])
        tower = keras.Sequential([
            L.Conv2D(32, 3, padding="same", activation="relu"),
            L.Conv2D(32, 3, padding="same", activation="relu"), L.MaxPooling2D(),
            L.Conv2D(64, 3, padding="same", activation="relu"), L.GlobalAveragePooling2D(),
        ])
        a = tower(L.Lambda(lambda t: t[..., :3])(inp))
        b = tower(L.Lambda(lambda t: t[..., 3:])(inp))
        d = L.Concatenate()([L.Lambda(keras.ops.abs)(L.Subtract()([a, b])), L.Multiply()([a, b])])
        return keras.Model(inp, L.Dense(10)(L.Dense(64, activation="relu")(d)))

    def mlp_mixer(d=64, tokens=64, blocks=2):
        # MLP-Mixer: token mixing through transposes, GELU MLPs, LayerNorm residuals
        inp = keras.Input(EXTRA["mlp_mixer"][1])
        h = L.Reshape((tokens, d))(L.Conv2D(d, 4, strides=4)(inp))
        for _ in range(blocks):
            t = L.Permute((2, 1))(L.LayerNormalization()(h))
            t = L.Dense(tokens)(L.Dense(2 * tokens, activation="gelu")(t))
            h = L.Add()([h, L.Permute((2, 1))(t)])
            c = L.Dense(d)(L.Dense(4 * d, activation="gelu")(L.LayerNormalization()(h)))
            h = L.Add()([h, c])
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(L.LayerNormalization()(h))))

    def seq_attention():
        # dot-product and additive attention between two 1-D conv encodings,
        # resampled with a transposed convolution
        inp = keras.Input(EXTRA["seq_attention"][1])
        q = L.Conv1D(64, 3, padding="same", activation="tanh")(inp)
        v = L.Conv1D(64, 5, padding="same", activation="softplus")(inp)
        h = L.Attention(use_scale=True)([q, v])
        h = L.AdditiveAttention()([h, q])
        h = L.Conv1DTranspose(32, 3, strides=2, padding="same")(L.MaxPooling1D()(h))
        h = L.Softmax()(L.UpSampling1D()(L.Conv1D(32, 3, padding="same")(h)))
        return keras.Model(inp, L.Dense(10)(L.Flatten()(L.AveragePooling1D(4)(h))))

    def film_glu():
        # dilated causal convolutions with gated linear units, modulated (FiLM) by a
        # scale and shift computed from a pooled summary: broadcast products
        inp = keras.Input(EXTRA["film_glu"][1])
        h = L.Conv1D(64, 1)(inp)
        for rate in (1, 2, 4):
            a = L.Conv1D(64, 3, padding="causal", dilation_rate=rate)(h)
            b = L.Conv1D(64, 3, padding="causal", dilation_rate=rate, activation="sigmoid")(h)
            g = L.Multiply()([a, b])
            ctx = L.GlobalAveragePooling1D(keepdims=True)(g)
            scale, shift = L.Dense(64)(ctx), L.Dense(64)(ctx)
            h = L.Add()([h, L.Add()([L.Multiply()([g, scale]), shift])])
        return keras.Model(inp, L.Dense(10)(L.GlobalMaxPooling1D()(h)))

    def einsum_rms(d=32, blocks=2):
        # einsum projections (EinsumDense), RMS-scaled LayerNorm, a layer-scale
        # residual and a squared-ReLU MLP
        inp = keras.Input(EXTRA["einsum_rms"][1])
        h = inp
        for _ in range(blocks):
            n = L.LayerNormalization(rms_scaling=True)(h)
            u = L.EinsumDense("btd,df->btf", output_shape=(EXTRA["einsum_rms"][1][0], 4 * d), bias_axes="f")(n)
            u = L.Lambda(lambda t: keras.ops.square(keras.ops.relu(t)))(u)
            u = L.EinsumDense("btf,fd->btd", output_shape=(EXTRA["einsum_rms"][1][0], d))(u)
            h = L.Add()([h, L.Lambda(lambda t: 0.1 * t)(u)])
        return keras.Model(inp, L.Dense(10)(L.Flatten()(L.MaxPooling1D(4)(h))))

    def convlstm():
        # a convolutional LSTM (a while loop of convolutions) after per-frame convs
        inp = keras.Input(EXTRA["convlstm"][1])
        h = L.TimeDistributed(L.Conv2D(16, 3, padding="same", activation="relu"))(inp)
        h = L.ConvLSTM2D(16, 3, padding="same", return_sequences=False)(h)
        h = L.BatchNormalization()(L.Conv2D(32, 3, padding="same", activation="relu")(h))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def attention2d():
        # attention over both image axes, merged with max and average branches
        inp = keras.Input(EXTRA["attention2d"][1])
        h = L.Conv2D(32, 3, padding="same", activation="relu")(inp)
        a = L.MultiHeadAttention(2, 16, attention_axes=(1, 2))(h, h)
        m = L.Maximum()([h, a])
        v = L.Average()([h, L.Conv2D(32, 1)(a)])
        h = L.Concatenate()([m, v, L.Minimum()([m, v])])
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def swiglu_prenorm(d=32, blocks=2):
        # pre-norm blocks with a SwiGLU feed-forward (silu(x W) * (x V)) and attention
        inp = keras.Input(EXTRA["swiglu_prenorm"][1])

        def swiglu(n):
            gate = L.Dense(2 * d, activation="silu")(n)
            return L.Dense(d)(L.Multiply()([gate, L.Dense(2 * d)(n)]))

        h = prenorm_blocks(inp, blocks, L.LayerNormalization, lambda n: L.MultiHeadAttention(2, d // 2)(n, n), swiglu)
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def preact_fp16():
        # pre-activation residual blocks (BatchNorm, ReLU, conv) under mixed_float16
        inp = keras.Input(EXTRA["preact_fp16"][1])
        h = L.Conv2D(32, 3, padding="same")(inp)
        for c in (32, 64):
            r = L.Conv2D(c, 3, padding="same")(L.ReLU()(L.BatchNormalization()(h)))
            r = L.Conv2D(c, 3, padding="same")(L.Dropout(0.1)(L.ReLU()(L.BatchNormalization()(r))))
            h = L.Add()([L.Conv2D(c, 1)(h) if c != h.shape[-1] else h, r])
        h = L.GlobalAveragePooling2D()(L.ReLU()(L.BatchNormalization()(h)))
        return keras.Model(inp, L.Activation("linear", dtype="float32")(L.Dense(10)(h)))

    def sepconv1d():
        # separable 1-D convolutions, spatial dropout, strided pooling
        inp = keras.Input(EXTRA["sepconv1d"][1])
        h = inp
        for c in (32, 64, 64):
            h = L.SeparableConv1D(c, 5, padding="same", activation="relu")(h)
            h = L.SpatialDropout1D(0.1)(L.BatchNormalization()(h))
            h = L.MaxPooling1D(2)(h)
        return keras.Model(inp, L.Dense(10)(L.GlobalMaxPooling1D()(h)))

    def bigru_mha():
        # a bidirectional GRU under self-attention
        inp = keras.Input(EXTRA["bigru_mha"][1])
        h = L.Bidirectional(L.GRU(32, return_sequences=True))(inp)
        h = L.LayerNormalization()(L.Add()([h, L.MultiHeadAttention(2, 16)(h, h)]))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def cross_attention(d=32):
        # two streams (the input's two halves): one queries the other
        inp = keras.Input(EXTRA["cross_attention"][1])
        a = L.Dense(d, activation="gelu")(L.Lambda(lambda t: t[:, :24])(inp))
        b = L.Dense(d, activation="tanh")(L.Lambda(lambda t: t[:, 24:])(inp))
        h = L.LayerNormalization()(L.Add()([a, L.MultiHeadAttention(4, d // 4, dropout=0.1)(a, b)]))
        h = L.Concatenate(axis=1)([h, b])
        return keras.Model(inp, L.Dense(10)(L.Flatten()(h)))

    def upsample_fp16():
        # transposed convolutions and nearest upsampling under mixed_float16
        inp = keras.Input(EXTRA["upsample_fp16"][1])
        h = L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(inp)
        h = L.BatchNormalization()(h)
        h = L.Conv2D(32, 3, padding="same", activation="relu")(L.UpSampling2D()(h))
        h = L.Conv2D(16, 3, strides=2, padding="same", activation="elu")(h)
        h = L.GlobalAveragePooling2D()(h)
        return keras.Model(inp, L.Activation("linear", dtype="float32")(L.Dense(10)(h)))

    def gpt_tanh_gelu(d=32, blocks=2):
        # causal self-attention with attention dropout, tanh-approximated GELU
        inp = keras.Input(EXTRA["gpt_tanh_gelu"][1])
        h = L.Dense(d)(inp)

        def attention(n):
            return L.MultiHeadAttention(2, d // 2, dropout=0.1)(n, n, use_causal_mask=True)

        def gelu_mlp(n):
            u = L.Dense(2 * d, activation=lambda t: keras.activations.gelu(t, approximate=True))(n)
            return L.Dropout(0.1)(L.Dense(d)(u))

        h = prenorm_blocks(h, blocks, L.LayerNormalization, attention, gelu_mlp)
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def gqa_rmsnorm(d=32, blocks=2):
        # pre-RMSNorm blocks with grouped-query attention (4 query heads, 2 key/value
        # heads) and a squared-ReLU feed-forward written as a power
        inp = keras.Input(EXTRA["gqa_rmsnorm"][1])

        def squared_relu_mlp(n):
            u = L.Lambda(lambda t: keras.ops.power(keras.ops.relu(t), 2.0))(L.Dense(2 * d)(n))
            return L.Dense(d)(u)

        h = prenorm_blocks(inp, blocks, L.RMSNormalization,
                           lambda n: L.GroupQueryAttention(d // 4, 4, 2)(n, n), squared_relu_mlp)
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def selu_alpha():
        # a self-normalizing MLP: SELU, lecun_normal, AlphaDropout
        inp = keras.Input(EXTRA["selu_alpha"][1])
        h = inp
        for w in (256, 256, 128):
            h = L.AlphaDropout(0.1)(L.Dense(w, activation="selu", kernel_initializer="lecun_normal")(h))
        return keras.Model(inp, L.Dense(10)(h))

    def unitnorm_prelu():
        # PReLU and LeakyReLU convolutions, an L2-normalized embedding (UnitNormalization)
        inp = keras.Input(EXTRA["unitnorm_prelu"][1])
        h = L.PReLU(shared_axes=[1, 2])(L.Conv2D(32, 3, padding="same")(inp))
        h = L.LeakyReLU(0.1)(L.Conv2D(32, 3, padding="same")(h))
        h = L.MaxPooling2D()(L.BatchNormalization()(h))
        h = L.PReLU()(L.Conv2D(64, 3, padding="same")(h))
        e = L.UnitNormalization()(L.Dense(32)(L.GlobalAveragePooling2D()(h)))
        return keras.Model(inp, L.Dense(10)(e))

    def conv1d_transpose():
        # a 1-D encoder-decoder: strided and transposed convolutions, padding and
        # cropping, spatial dropout
        inp = keras.Input(EXTRA["conv1d_transpose"][1])
        h = L.ZeroPadding1D(2)(inp)
        h = L.Conv1D(32, 5, strides=2, activation="relu")(h)
        h = L.SpatialDropout1D(0.1)(L.Conv1D(64, 3, strides=2, padding="same", activation="relu")(h))
        h = L.Conv1DTranspose(32, 3, strides=2, padding="same", activation="relu")(h)
        h = L.Cropping1D((1, 1))(L.UpSampling1D(2)(h))
        return keras.Model(inp, L.Dense(10)(L.GlobalMaxPooling1D()(h)))

    def se_resnet():
        # residual blocks with GroupNorm, GELU and squeeze-and-excitation gates
        inp = keras.Input(EXTRA["se_resnet"][1])
        h = L.Conv2D(32, 3, padding="same")(inp)
        for _ in range(2):
            r = L.Activation("gelu")(L.GroupNormalization(8)(L.Conv2D(32, 3, padding="same")(h)))
            r = L.GroupNormalization(8)(L.Conv2D(32, 3, padding="same")(r))
            s = L.Dense(32, activation="sigmoid")(L.Dense(8, activation="relu")(L.GlobalAveragePooling2D()(r)))
            h = L.Activation("gelu")(L.Add()([h, L.Multiply()([r, L.Reshape((1, 1, 32))(s)])]))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def mish_cnn():
        # Mish (x * tanh(softplus(x))) and hard-sigmoid activations, BatchNorm, pooling
        inp = keras.Input(EXTRA["mish_cnn"][1])
        mish = L.Lambda(lambda t: t * keras.ops.tanh(keras.ops.softplus(t)))
        h = L.BatchNormalization()(mish(L.Conv2D(32, 3, padding="same")(inp)))
        h = L.MaxPooling2D()(mish(L.Conv2D(32, 3, padding="same")(h)))
        h = L.Conv2D(64, 3, padding="same", activation="hard_sigmoid")(h)
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def textcnn():
        # token ids from the input, an embedding, parallel n-gram convolutions
        inp = keras.Input(EXTRA["textcnn"][1])
        ids = L.Lambda(lambda t: keras.ops.cast(keras.ops.abs(t) * 300.0, "int32") % 1000)(inp)
        e = L.Embedding(1000, 32)(ids)
        pools = [L.GlobalMaxPooling1D()(L.Conv1D(32, k, activation="relu")(e)) for k in (3, 4, 5)]
        return keras.Model(inp, L.Dense(10)(L.Dropout(0.2)(L.Concatenate()(pools))))

    def conformer(d=32):
        # a Conformer block: half-step Swish feed-forwards, attention, GLU + depthwise conv
        inp = keras.Input(EXTRA["conformer"][1])

        def ff(h):
            u = L.Dense(d)(L.Dense(2 * d, activation="swish")(L.LayerNormalization()(h)))
            return L.Add()([h, L.Lambda(lambda t: 0.5 * t)(u)])

        h = ff(inp)
        n = L.LayerNormalization()(h)
        h = L.Add()([h, L.MultiHeadAttention(2, d // 2)(n, n)])
        u = L.Dense(2 * d)(L.LayerNormalization()(h))
        u = L.Lambda(lambda t: t[..., :d] * keras.ops.sigmoid(t[..., d:]))(u)  # GLU
        u = L.Activation("swish")(L.BatchNormalization()(L.DepthwiseConv1D(7, padding="same")(u)))
        h = L.LayerNormalization()(ff(L.Add()([h, L.Dense(d)(u)])))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def conv_stem(inp, c=32):
        return L.BatchNormalization()(L.Conv2D(c, 3, padding="same", activation="relu")(inp))

    def layered_cnn(name, layer, activation="relu"):
        """A small CNN with ``layer()`` after its stem and after its second conv."""
        inp = keras.Input(EXTRA[name][1])
        h = layer()(conv_stem(inp))
        h = layer()(L.Conv2D(32, 3, padding="same", activation=activation)(h))
        h = L.MaxPooling2D()(L.Conv2D(64, 3, padding="same", activation="relu")(h))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def cond_gate():
        # a branch on a tensor's value (tf.cond: StatelessIf) in the forward pass
        class Gate(L.Layer):
            def call(self, t):
                return tf.cond(tf.reduce_mean(t) > 0.0, lambda: tf.nn.relu(t), lambda: 2.0 * tf.tanh(t))

        return layered_cnn("cond_gate", Gate, activation=None)

    def stateful_dropout():
        # tf.nn.dropout with no op seed (the global one seeds it): a stateful RandomUniform whose draws continue
        # from step to step (never recomputed; the stream must not restart)
        class TfDropout(L.Layer):
            def call(self, t, training=None):
                return tf.nn.dropout(t, 0.3) if training else t

        return layered_cnn("stateful_dropout", TfDropout)

    def scan_rnn():
        # a recurrence written with tf.scan (a while loop over TensorArrays)
        class Leaky(L.Layer):
            def call(self, t):
                tm_ = tf.transpose(t, [1, 0, 2])
                return tf.transpose(tf.scan(lambda a, x: 0.9 * a + tf.tanh(x), tm_), [1, 0, 2])

        inp = keras.Input(EXTRA["scan_rnn"][1])
        h = Leaky()(L.Dense(128, activation="relu")(inp))
        h = Leaky()(L.Dense(128)(h))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(h)))

    def topk_gather():
        # integer ops in the forward pass: top-k positions by score, gathered per example
        class TopK(L.Layer):
            def call(self, t):
                _, idx = tf.math.top_k(tf.reduce_sum(t, -1), k=16)
                return tf.gather(t, idx, batch_dims=1)

        inp = keras.Input(EXTRA["topk_gather"][1])
        h = L.Dense(256, activation="gelu")(inp)
        h = TopK()(L.Dense(128, activation="relu")(h))
        return keras.Model(inp, L.Dense(10)(L.Flatten()(h)))

    def pixel_shuffle():
        # sub-pixel upsampling (depth_to_space), bilinear resizing, space_to_depth
        inp = keras.Input(EXTRA["pixel_shuffle"][1])
        h = L.Conv2D(64, 3, padding="same", activation="relu")(inp)
        h = L.Lambda(lambda t: tf.nn.depth_to_space(t, 2))(h)
        h = L.Conv2D(32, 3, padding="same", activation="relu")(h)
        h = L.Lambda(lambda t: tf.image.resize(t, (48, 48), "bilinear"))(h)
        h = L.Lambda(lambda t: tf.nn.space_to_depth(t, 4))(L.Conv2D(16, 3, padding="same")(h))
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def ste_quant():
        # fake quantization with a straight-through gradient (tf.custom_gradient)
        @tf.custom_gradient
        def ste_round(t):
            return tf.round(t * 4.0) / 4.0, lambda dy: dy

        class Quant(L.Layer):
            def call(self, t):
                return ste_round(t)

        return layered_cnn("ste_quant", Quant)

    def recompute_grad_block():
        # residual blocks the user already wrapped in tf.recompute_grad
        class Block(L.Layer):
            def build(self, shape):
                self.c1 = L.Conv2D(32, 3, padding="same", activation="relu")
                self.c2 = L.Conv2D(32, 3, padding="same")
                self.c1.build(shape)
                self.c2.build(shape[:-1] + (32,))

            def call(self, t):
                return tf.nn.relu(t + tf.recompute_grad(lambda u: self.c2(self.c1(u)))(t))

        inp = keras.Input(EXTRA["recompute_grad_block"][1])
        h = conv_stem(inp)
        for _ in range(3):
            h = Block()(h)
        return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))

    def app(cls, name):
        return lambda: getattr(keras.applications, cls)(weights=None, input_shape=EXTRA[name][1], classes=10)

    out.update(conv1d_attention=conv1d_attention, embed_bilstm=embed_bilstm, autoencoder=autoencoder,
               sepconv_groupnorm=sepconv_groupnorm, unet=unet, xception=app("Xception", "xception"),
               nasnetmobile=app("NASNetMobile", "nasnetmobile"), convnexttiny=app("ConvNeXtTiny", "convnexttiny"),
               gru_conv1d=gru_conv1d, conv3d_bn=conv3d_bn, causal_decoder=causal_decoder, vit_tiny=vit_tiny,
               efficientnetv2b0=app("EfficientNetV2B0", "efficientnetv2b0"), resnet50v2=app("ResNet50V2", "resnet50v2"),
               inceptionv3=app("InceptionV3", "inceptionv3"), mobilenet=app("MobileNet", "mobilenet"),
               noisy_cnn=noisy_cnn, masked_lstm=masked_lstm,
               mobilenetv3large=app("MobileNetV3Large", "mobilenetv3large"),
               resnext_tiny=resnext_tiny, tabular_mlp=tabular_mlp, augment_cnn=augment_cnn,
               siamese=siamese, mlp_mixer=mlp_mixer, seq_attention=seq_attention, film_glu=film_glu,
               einsum_rms=einsum_rms, convlstm=convlstm, attention2d=attention2d,
               swiglu_prenorm=swiglu_prenorm, preact_fp16=preact_fp16, sepconv1d=sepconv1d,
               bigru_mha=bigru_mha, cross_attention=cross_attention, upsample_fp16=upsample_fp16,
               gpt_tanh_gelu=gpt_tanh_gelu, se_resnet=se_resnet, mish_cnn=mish_cnn, textcnn=textcnn,
               conformer=conformer, gqa_rmsnorm=gqa_rmsnorm, selu_alpha=selu_alpha,
               unitnorm_prelu=unitnorm_prelu, conv1d_transpose=conv1d_transpose,
               cond_gate=cond_gate, stateful_dropout=stateful_dropout, scan_rnn=scan_rnn,
               topk_gather=topk_gather, pixel_shuffle=pixel_shuffle, ste_quant=ste_quant,
               recompute_grad_block=recompute_grad_block)
    return out


# Session 14: how the model is compiled and fed, on one small BatchNorm + dropout CNN
# (4 residual conv blocks, batch 32). name -> model.compile overrides (a function of keras).
VARIANT_SHAPE = (32, (32, 32, 3))
VARIANTS = {
    "opt_adamw": lambda k: dict(optimizer=k.optimizers.AdamW(1e-3, weight_decay=0.01)),
    "opt_rmsprop_centered": lambda k: dict(optimizer=k.optimizers.RMSprop(1e-3, momentum=0.9, centered=True)),
    "opt_nadam": lambda k: dict(optimizer=k.optimizers.Nadam(1e-3)),
    "opt_adamax": lambda k: dict(optimizer=k.optimizers.Adamax(1e-3)),
    "opt_adagrad": lambda k: dict(optimizer=k.optimizers.Adagrad(0.01)),
    "opt_adadelta": lambda k: dict(optimizer=k.optimizers.Adadelta(1.0)),
    "opt_lion": lambda k: dict(optimizer=k.optimizers.Lion(1e-4)),
    "opt_adafactor": lambda k: dict(optimizer=k.optimizers.Adafactor(1e-3)),
    "opt_ftrl": lambda k: dict(optimizer=k.optimizers.Ftrl(0.01)),
    "opt_sgd_nesterov": lambda k: dict(optimizer=k.optimizers.SGD(0.01, momentum=0.9, nesterov=True)),
    "opt_clipnorm": lambda k: dict(optimizer=k.optimizers.Adam(1e-3, clipnorm=1.0)),
    "opt_clipvalue": lambda k: dict(optimizer=k.optimizers.Adam(1e-3, clipvalue=0.01)),
    "opt_global_clipnorm": lambda k: dict(optimizer=k.optimizers.Adam(1e-3, global_clipnorm=1.0)),
    "opt_ema": lambda k: dict(optimizer=k.optimizers.Adam(1e-3, use_ema=True, ema_overwrite_frequency=2)),
    "opt_grad_accum": lambda k: dict(optimizer=k.optimizers.Adam(1e-3, gradient_accumulation_steps=2)),
    "opt_loss_scale_factor": lambda k: dict(optimizer=k.optimizers.Adam(1e-3, loss_scale_factor=64.0)),
    "sample_weight": lambda k: {},
    "regularized": lambda k: {},
    "multi_output": lambda k: dict(
        loss=[k.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        loss_weights=[1.0, 0.5], metrics=[["accuracy"], ["mae"]]),
    "binary_auc": lambda k: dict(
        loss=k.losses.BinaryCrossentropy(from_logits=True),
        metrics=[k.metrics.AUC(from_logits=True), k.metrics.BinaryAccuracy(threshold=0.0)]),
    # session 31: a focal loss (a power of the probabilities, clipped logs)
    "focal_loss": lambda k: dict(
        loss=k.losses.BinaryFocalCrossentropy(from_logits=True, gamma=2.0, apply_class_balancing=True),
        metrics=[k.metrics.BinaryAccuracy(threshold=0.0)]),
    "custom_train_step": lambda k: {},
    "bf16": lambda k: {},
}


def _variant_builders():
    import keras
    import tensorflow as tf

    L = keras.layers

    def cnn_body(inp, regularize=False):
        reg = dict(kernel_regularizer=keras.regularizers.L2(1e-4)) if regularize else {}
        h = inp
        for i in range(4):
            r = L.Dropout(0.2)(L.ReLU()(L.BatchNormalization()(L.Conv2D(32, 3, padding="same", **reg)(h))))
            h = r if i == 0 else L.Add()([h, r])
        return L.GlobalAveragePooling2D()(h)

    class CustomStep(keras.Model):
        # A train_step of one's own: clipped gradients, a loss from compute_loss.
        def train_step(self, data):
            x, y = data[0], data[1]
            with tf.GradientTape() as tape:
                pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=pred)
            grads = tape.gradient(loss, self.trainable_variables)
            grads = [tf.clip_by_norm(g, 1.0) for g in grads]
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    def build(name):
        if name == "bf16":
            keras.mixed_precision.set_global_policy("mixed_bfloat16")
        inp = keras.Input(VARIANT_SHAPE[1])
        h = cnn_body(inp, regularize=name == "regularized")
        if name == "multi_output":
            return keras.Model(inp, [L.Dense(10)(h), L.Dense(1)(h)])
        if name in ("binary_auc", "focal_loss"):
            return keras.Model(inp, L.Dense(1, dtype="float32")(h))
        if name == "regularized":
            return keras.Model(inp, L.Dense(10, activity_regularizer=keras.regularizers.L1(1e-5))(h))
        if name == "custom_train_step":
            return CustomStep(inputs=inp, outputs=L.Dense(10)(h))
        return keras.Model(inp, L.Dense(10, dtype="float32")(h))

    return {name: functools.partial(build, name) for name in VARIANTS}


def _compile_kwargs(name):
    import keras

    kwargs = _test_compile_kwargs(name)
    if name in VARIANTS:
        kwargs.update(VARIANTS[name](keras))
    return kwargs


def _data(name, batch, shape):
    import numpy as np
    import tensorflow as tf

    x, y, extra = _test_data(name, batch, shape)
    rng = np.random.default_rng(1)
    if name == "sample_weight":
        extra = dict(sample_weight=tf.constant(rng.uniform(0.1, 2.0, (batch,)).astype("float32")))
    elif name == "multi_output":
        y = (y, tf.constant(rng.standard_normal((batch, 1)).astype("float32")))
    elif name in ("binary_auc", "focal_loss"):
        y = tf.constant(rng.integers(0, 2, (batch, 1)).astype("float32"))
    return x, y, extra


_test_builders, _test_compile_kwargs, _test_data = tm._builders, tm._compile_kwargs, tm._data
tm.MODELS.update(EXTRA)
tm.MODELS.update({name: VARIANT_SHAPE for name in VARIANTS})
tm._builders = lambda: {**_builders(), **_variant_builders()}
tm._compile_kwargs, tm._data = _compile_kwargs, _data


def _run(name: str, fraction: float, role: str, state: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name, str(fraction), role, state],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), cwd=ROOT,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def main(names) -> None:
    mib = 2**20
    print("| model | batch | baseline | budget | tensors | checked | expected | measured | ops recomputed | bitwise equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            state = os.path.join(tmp, name)
            ref = _run(name, tm.FRACTION, "reference", state)
            if "error" in ref:
                print(f"| {name} | reference failed: {ref['error']} |")
                continue
            with open(state + ".json", "w") as f:
                json.dump(ref, f)
            r = _run(name, tm.FRACTION, "remat", state)
            if "error" in r:
                print(f"| {name} | tfremat failed: {r['error']} |")
                continue
            kind = "min+10 %" if r.get("infeasible_at_fraction") else "60 %"
            equal = r["logs_equal"] and r["n_unequal"] == 0
            expected, checked = ("—" if r.get(k) is None else f"{r[k] / mib:.1f}" for k in ("expected", "chunks"))
            print(f"| {name} | {r['batch']} | {max(ref['peaks']) / mib:.1f} | {r['budget'] / mib:.1f} ({kind}) "
                  f"| {r['predicted'] / mib:.1f} | {checked} | {expected} | {max(r['peaks']) / mib:.1f} | {r['recomputed']} "
                  f"| {'yes' if equal else 'no (max %.1e)' % r['max_abs_diff']} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        name, fraction, role, state = sys.argv[2:6]
        print(json.dumps(tm._check(name, float(fraction), role, state)))
    else:
        args = sys.argv[1:]
        main(list(VARIANTS) if args == ["variants"] else args or list(EXTRA))
