"""Kernel scratch space, measured: bytes an op allocates while it runs and frees before it ends.

TensorFlow side, between trace and graph: the planning graph counts outputs, but some
kernels also take large temporaries from the same allocator for the length of one
call. Measured (TF 2.21, CPU, ``mixed_float16`` CNN on an AVX2 machine, where oneDNN
has no fp16 kernels and the Eigen ones run): every ``Conv2DBackpropFilter`` allocated a
26.4 MiB im2col buffer (``[47, 1024, 288]`` half), whatever the batch; a plan whose
simulated peak was 49.1 MiB ran at 58.8-60.0 MiB when its peak fell on one of them,
over a 61.5 MiB budget on some runs. With oneDNN's float32 kernels the same ops use
no counted scratch. Which kernel runs depends on the build, the CPU, the dtype and
the environment, so the bytes are measured, not modelled: each distinct signature
(op type, attributes, input shapes and dtypes) of the op types below, and of calls
compiled with XLA, runs once, alone, in a ``tf.function`` on the step's device, and
its scratch is the allocator's peak during the call less what was live before and
the op's outputs. That peak counts the allocator's chunks, up to twice the bytes
requested; where a second run's step statistics account for what the kernel
requested, the scratch is those requests (the plan's pool model makes the chunks).

The measurement resets the allocator's peak statistic (``reset_memory_stats``) of that
device, once per probe, while a new input signature is planned. Without allocator
statistics (TensorFlow's default CPU allocator with oneDNN off), or when planning runs
inside another function's tracing, nothing is measured and no scratch is modelled.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

from .graph import CALL_OPS, OpRecord, output_index, producer

# Op types whose kernels are known to take scratch from the allocator on some builds:
# the convolution family (Eigen's im2col buffers, cuDNN workspaces), fused batch norm
# and pooling gradients, and ``Einsum`` (its kernel transposes operands into
# temporaries: Keras' attention scores, 2 MiB per operand at [16, 256, 4, 32]; vit_tiny's
# step measured 12.5 MiB for an 11.4 MiB expected peak without this probe, 13.0 for
# 12.9 with it).
PROBED_OPS = frozenset({
    "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput",
    "Conv3D", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput",
    "FusedBatchNormV3", "FusedBatchNormGradV3", "MaxPoolGrad", "AvgPoolGrad",
    "Einsum",
    # float16 products on CPUs without native float16 arithmetic convert their operands
    # and result to float32 temporaries: a random mixed_float16 attention model of
    # ``benchmarks/keras_fuzz.py`` (fp16attn 0) held 1.5 MiB beside each 0.38 MiB
    # [64, 48, 64] half ``MatMul`` output and measured 13.1-14.0 MiB on a 13.1 MiB
    # budget, 11.0 MiB of chunks predicted.
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
})
# Calls of a function compiled with XLA (``tf.function(jit_compile=True)``, e.g. Keras'
# grouped convolutions on CPU) run as one kernel: the temporaries of the whole function
# are that kernel's scratch. Measured (TF 2.21, CPU): the gradient of a depthwise
# (768-group) 7x7 convolution on a [16, 1, 1, 768] input took 256 MiB while it ran;
# ConvNeXtTiny's step measured 607 MiB for a 472 MiB prediction without it.
_XLA_ATTR = "_XlaMustCompile"


def _probed(op_type: str, node_def) -> bool:
    if op_type in PROBED_OPS:
        return True
    return op_type in CALL_OPS and _XLA_ATTR in node_def.attr and node_def.attr[_XLA_ATTR].b

# Smaller differences are noise: TensorFlow's default CPU allocator does not count
# allocations under 256 KiB.
_MIN_SCRATCH = 256 * 1024
# After this many probes of one (op type, dtype) measure no scratch, the rest of that
# kind is taken to use none either (oneDNN's float32 kernels: probing every signature
# of a large model would cost seconds for nothing).
_ZERO_STREAK = 2
# Probing stops after this long; signatures not probed take the largest scratch
# measured for their kind (an upper bound in practice: the Eigen buffers are sized
# to a fixed working set, not to the batch).
_TIME_LIMIT_S = 20.0


# Op type -> the position of its int32 "sizes" input (the shape of its own output).
_SIZES_INPUT = {
    "Conv2DBackpropFilter": 1, "Conv2DBackpropInput": 0,
    "Conv3DBackpropFilterV2": 1, "Conv3DBackpropInputV2": 0,
    "DepthwiseConv2dNativeBackpropFilter": 1, "DepthwiseConv2dNativeBackpropInput": 0,
    "AvgPoolGrad": 0,
}


# Gradient op type -> (input its forward op made, forward op type): probed with that
# forward op in the same graph, run from the gradient's own first input. oneDNN pairs
# them (the forward leaves a workspace the gradient reads); alone, the gradient runs
# Eigen's kernel, which recomputes the arg-max into int64 temporaries. Measured
# (TF 2.21, oneDNN, [32, 32, 32, 64] -> [32, 16, 16, 64]): 6.0 MiB of scratch alone,
# 0.5 MiB paired (the workspace); the sweep's seeded-dropout CNN was predicted at
# 36.7 MiB with the 10 MiB of its MaxPoolGrad probed alone, and measured 26.5.
# Without oneDNN both measure Eigen's 6.0 MiB.
_PAIRED_FORWARD = {"MaxPoolGrad": (1, "MaxPool")}


def measure_scratch(traced, device: str, time_limit_s: float = _TIME_LIMIT_S) -> dict[str, int]:
    """Scratch bytes per op name of ``traced`` (a :class:`tfremat.trace.TracedStep`).

    Ops without measurable scratch are absent. Returns ``{}`` when the device's
    allocator reports no statistics.
    """
    from ._tf import import_tf

    tf = import_tf()
    if not tf.executing_eagerly():
        return {}  # planned while an outer function traces: the probes would join its graph
    try:
        tf.config.experimental.reset_memory_stats(device)
        tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError, tf.errors.OpError):
        return {}
    nodes = {n.name: n for n in traced.graph_def.node}
    by_name = {r.name: r for r in traced.records}
    # signature (op type, attributes, input specs, paired forward op) -> names of the
    # ops that share it
    groups: dict[tuple, list[str]] = {}
    for r in traced.records:
        if r.name not in nodes or not r.outputs or not _probed(r.op_type, nodes[r.name]):
            continue
        spec = _input_specs(r, by_name)
        if spec is None:
            continue
        forward = _paired_forward(r, by_name)  # part of the signature: the pair is what runs
        node = nodes[r.name]
        attrs = tuple(sorted(
            (k, v.SerializeToString(deterministic=True)) for k, v in node.attr.items() if not k.startswith("_")
        ))
        groups.setdefault((r.op_type, attrs, spec, forward and forward.name), []).append(r.name)
    out: dict[str, int] = {}
    zeros: dict[tuple, int] = {}  # (op type, dtype) -> probes that measured no scratch
    largest: dict[tuple, int] = {}  # (op type, dtype) -> largest scratch measured
    start = time.perf_counter()
    for (_, _, spec, forward_name), names in groups.items():
        r = by_name[names[0]]
        # one kind per op type and dtype; a call's kind is its signature (its function
        # may be anything)
        kind = (r.op_type, r.outputs[0].dtype) + ((spec,) if r.op_type in CALL_OPS else ())
        if kind not in largest and zeros.get(kind, 0) >= _ZERO_STREAK:
            continue
        if time.perf_counter() - start > time_limit_s:
            bytes_ = largest.get(kind, 0)
        else:
            try:
                forward = (nodes[forward_name], by_name[forward_name]) if forward_name in nodes else None
                bytes_ = _probe(tf, nodes[r.name], spec, r, device, traced.graph_def.library, forward=forward)
            except Exception:  # noqa: BLE001 - a measurement, never a reason to fail planning
                continue  # an op that cannot run alone keeps no scratch estimate
            if bytes_ > 0:
                largest[kind] = max(largest.get(kind, 0), bytes_)
            else:
                zeros[kind] = zeros.get(kind, 0) + 1
        if bytes_ > 0:
            for n in names:
                out[n] = bytes_
    return out


def _paired_forward(r: OpRecord, by_name: Mapping[str, OpRecord]) -> OpRecord | None:
    """The forward op ``r`` is probed with (``_PAIRED_FORWARD``), if it reads one."""
    if r.op_type not in _PAIRED_FORWARD:
        return None
    index, op_type = _PAIRED_FORWARD[r.op_type]
    if len(r.inputs) <= index or output_index(r.inputs[index]) != 0:
        return None
    src = by_name.get(producer(r.inputs[index]))
    if src is None or src.op_type != op_type or not src.inputs or src.inputs[0] != r.inputs[0]:
        return None
    return src


def _input_specs(r: OpRecord, by_name: Mapping[str, OpRecord]) -> tuple | None:
    """(shape, dtype name, constant value or None) per input; None if unknown, or
    if a size is a guess (``TensorInfo.estimated``: a probe of it would measure
    another kernel than the step runs)."""
    if any(o.estimated for o in r.outputs):
        return None
    spec = []
    for i, t in enumerate(r.inputs):
        src = by_name.get(producer(t))
        idx = output_index(t)
        if src is None or idx >= len(src.outputs):
            return None
        info = src.outputs[idx]
        if info.dtype in ("resource", "variant", "string") or info.estimated:
            return None
        value = None
        if info.dtype in ("int32", "int64"):
            if _SIZES_INPUT.get(r.op_type) != i:
                return None
            value = tuple(r.outputs[0].shape)
        spec.append((tuple(info.shape), info.dtype, value))
    return tuple(spec)


def _add_copy(gd, node_def, name: str, inputs: Sequence[str], keep: Sequence[str] = ()) -> None:
    """Add to ``gd`` a copy of ``node_def`` named ``name`` reading ``inputs``, on no
    device, without internal (``_``) attributes other than ``keep``."""
    n = gd.node.add()
    n.CopyFrom(node_def)
    n.name = name
    del n.input[:]
    n.input.extend(inputs)
    n.device = ""
    for k in [k for k in n.attr if k.startswith("_") and k not in keep]:
        del n.attr[k]


def _probe(tf, node_def, spec: Sequence, record: OpRecord, device: str, library=None,
           forward=None) -> int:
    """Run the op alone on zeros of its input shapes; its scratch bytes (0 if none).

    ``forward``: ``(node_def, record)`` of the op that makes the input
    ``_PAIRED_FORWARD`` names, run in the probe from the op's first input; its
    output is not scratch."""
    gd = tf.compat.v1.GraphDef()
    if record.op_type in CALL_OPS and library is not None:
        gd.library.CopyFrom(library)
    paired = _PAIRED_FORWARD[record.op_type][0] if forward is not None else None
    fed = []
    for i, (shape, dtype, value) in enumerate(spec):
        if i == paired:
            _add_copy(gd, forward[0], f"in{i}", ["in0"])
            continue
        n = gd.node.add()
        n.name = f"in{i}"
        n.attr["dtype"].type = tf.as_dtype(dtype).as_datatype_enum
        if value is not None:
            n.op = "Const"
            n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=tf.as_dtype(dtype)))
        else:
            n.op = "Placeholder"
            n.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
            fed.append((n.name, shape, dtype))
    _add_copy(gd, node_def, "probe", [f"in{i}" for i in range(len(spec))], keep=(_XLA_ATTR,))
    n_out = len(record.outputs)

    @tf.function(input_signature=[tf.TensorSpec(s, tf.as_dtype(d)) for _, s, d in fed])
    def run(*args):
        return tf.graph_util.import_graph_def(
            gd,
            input_map={f"{name}:0": a for (name, _, _), a in zip(fed, args)},
            return_elements=[f"probe:{k}" for k in range(n_out)],
        )

    with tf.device(device):
        args = [tf.zeros(s, tf.as_dtype(d)) for _, s, d in fed]
        outs = run(*args)  # instantiation (Grappler, kernel creation) is not measured
        del outs
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
        outs = run(*args)
        peak = tf.config.experimental.get_memory_info(device)["peak"]
        out_bytes = sum(int(o.shape.num_elements() or 0) * o.dtype.size for o in outs)
        del outs, args
    if paired is not None:
        out_bytes += forward[1].outputs[0].bytes
    chunks = peak - before
    requested = None
    if chunks - out_bytes >= _MIN_SCRATCH and record.op_type not in CALL_OPS:
        requested = _requested_scratch(tf, gd, fed, device)
    return _scratch_from(chunks, out_bytes, requested)


def _scratch_from(chunks: int, outputs: int, requested: int | None) -> int:
    """Scratch bytes from a probe's measures: ``chunks``, the allocator's peak less
    what was live before; ``outputs``, the bytes of what the probe returned;
    ``requested``, the op's own requests beyond its outputs (None: unknown).

    The allocator's statistics count chunks, and a chunk holds at most twice its
    request (BFC splits a free chunk only at twice the request or more): the
    requests behind ``chunks`` are more than half of it. Where the op's tracked
    requests and outputs make up that half, they are all it took; otherwise it also
    allocated outside its context (Eigen's device buffers), and the chunks less the
    outputs are the measurement (an upper bound)."""
    if requested is not None and 2 * (requested + outputs) + _MIN_SCRATCH >= chunks:
        scratch = requested
    else:
        scratch = chunks - outputs
    return int(scratch) if scratch >= _MIN_SCRATCH else 0


def _requested_scratch(tf, gd, fed, device: str) -> int | None:
    """Bytes the probe op requested beyond its outputs at its peak, from TensorFlow's
    step statistics; None where they say nothing of it.

    The allocator's ``peak`` counts *chunks*: measured (TF 2.21, CPU, no AVX-512),
    a float16 ``Conv2DBackpropFilter`` requested a 23.6 MiB im2col buffer and held
    a 32 MiB chunk for it; the plan's pool model then placed a "32 MiB request" and
    gave it a 64 MiB chunk (random mixed_float16 classifiers' smallest budgets at
    80 MiB, measured 35). A session run with a full trace tracks each kernel's
    requests through its context (``NodeExecStats.memory``, public
    ``tf.compat.v1`` API)."""
    import numpy as np

    try:
        g = tf.Graph()
        with g.as_default(), tf.device(device):
            tf.graph_util.import_graph_def(gd, name="")
        feeds = {f"{name}:0": np.zeros(shape, tf.as_dtype(dtype).as_numpy_dtype) for name, shape, dtype in fed}
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        with tf.compat.v1.Session(graph=g) as session:
            session.run("probe", feeds)  # kernel creation is not measured
            metadata = tf.compat.v1.RunMetadata()
            session.run("probe", feeds, options=options, run_metadata=metadata)
    except Exception:  # noqa: BLE001 - the chunk measurement stands
        return None
    stats = [n for d in metadata.step_stats.dev_stats for n in d.node_stats if n.node_name == "probe"]
    if len(stats) != 1 or not stats[0].memory:
        return None
    peak = sum(m.peak_bytes for m in stats[0].memory)
    outputs = sum(o.tensor_description.allocation_description.requested_bytes for o in stats[0].output)
    return max(0, peak - outputs)
