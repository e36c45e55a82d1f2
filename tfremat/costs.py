"""Bytes and compute-cost estimates for TensorFlow op types (no TensorFlow import).

Costs are FLOP estimates for the ops that dominate a train step (matrix products and
convolutions) and the number of output elements (memory traffic) for the rest, so a
plan's ``extra_cost_fraction`` approximates the extra step time.
"""

from __future__ import annotations

import math
from typing import Sequence

# Output shares the buffer of input 0 (TensorFlow forwards the buffer, no allocation).
ALIASING_OPS = frozenset(
    {
        "Identity",
        "IdentityN",
        "Reshape",
        "Squeeze",
        "ExpandDims",
        "StopGradient",
        "PreventGradient",
        "EnsureShape",
        "Bitcast",
        "ReadVariableOp",  # shares the variable's buffer, counted in fixed bytes
        "Snapshot",
        "CheckNumerics",
    }
)

# Ops a graph rewrite fuses with a sibling (an op reading the same tensor): oneDNN's
# layout pass fuses Conv2DBackpropFilter with the BiasAddGrad of the same gradient
# (outside Grappler: it happens with the meta-optimizer off too).
FUSED_WITH_SIBLING = frozenset({"BiasAddGrad", "Conv2DBackpropFilter"})

# Elementwise kernels that write their output into an input's buffer when that input
# has no other consumer (TensorFlow's forward_input_or_allocate_output).
INPLACE_OPS = frozenset(
    {
        "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Softplus",
        "Softsign", "Gelu", "BiasAdd", "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div",
        "DivNoNan", "Maximum", "Minimum", "Neg", "Abs", "Square", "Sqrt", "Rsqrt", "Exp",
        "Log", "Log1p", "Erf", "Cos", "Sin", "Pow", "SquaredDifference", "AddN",
        "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "TanhGrad",
        "SigmoidGrad", "SoftplusGrad", "RsqrtGrad", "SqrtGrad", "Reciprocal", "Floor",
        "Round", "Sign", "Softmax", "LogSoftmax",
    }
)

# Never recomputed whatever their OpDef says: inputs, variables, control flow, calls.
NEVER_RECOMPUTE = frozenset(
    {
        "Placeholder",
        "PlaceholderWithDefault",
        "Const",
        "HostConst",
        "VarHandleOp",
        "ReadVariableOp",
        "NoOp",
        "While",
        "StatelessWhile",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
        "PartitionedCall",
        "StatefulPartitionedCall",
        "Enter",
        "Exit",
        "Merge",
        "Switch",
        "NextIteration",
        "LoopCond",
        "_Arg",
        "_Retval",
        "Assert",
        "Print",
        "PrintV2",
    }
)

# Ops a while loop's body (and condition) may hold for the loop to be recomputed as
# one op: pure kernels, and reads of the variables the loop is given (the
# planning graph checks that no write of those variables can run before a copy).
# Anything else (a write, stateful RNG, a nested call or loop) keeps the loop opaque.
PURE_LOOP_OPS = frozenset(
    INPLACE_OPS
    | {
        "MatMul", "BatchMatMulV2", "BiasAdd", "Split", "SplitV", "Squeeze", "StridedSlice",
        "Identity", "Const", "NoOp", "Reshape", "ConcatV2", "Pack", "Unpack", "Slice",
        "Transpose", "Fill", "ZerosLike", "OnesLike", "Shape", "Cast", "Select", "SelectV2",
        "Less", "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual", "LogicalAnd",
        "LogicalOr", "LogicalNot", "ExpandDims", "Sum", "Mean", "Max", "Min", "Softmax",
        "Tile", "GatherV2", "Range", "Square", "Einsum", "ReadVariableOp",
        "TensorListGetItem", "TensorListSetItem", "TensorListPushBack", "TensorListPopBack",
        "TensorListLength", "TensorListElementShape", "TensorListReserve", "TensorListStack",
        "TensorListFromTensor", "EmptyTensorList",
    }
)


def loop_cost(trips: int, rows: int, weight_elements: int, moved_elements: int) -> float:
    """Estimated cost of one run of a recurrent loop (an RNN layer's ``while``).

    Each iteration multiplies ``rows`` vectors by every weight the loop reads (two
    FLOPs per weight per row: an LSTM cell's kernels), and the loop writes
    ``moved_elements`` elements in all (its outputs and the accumulators it keeps for
    the gradient), each charged ``ELEMENT_MOVE_COST`` as elementwise work is.
    """
    return float(max(2.0 * trips * rows * weight_elements, ELEMENT_MOVE_COST * moved_elements, 1.0))


MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "_FusedMatMul"})
CONV_OPS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "_FusedConv2D", "Conv"})


def num_elements(shape: Sequence[int]) -> int:
    return int(math.prod(shape)) if shape else 1


def einsum_flops(equation: str, in_shapes: Sequence[Sequence[int] | None]) -> float | None:
    """``2 * product of every index's size`` for a two-operand Einsum (None if unknown)."""
    lhs = equation.replace(" ", "").split("->")[0]
    terms = lhs.split(",")
    if "." in lhs or len(terms) != len(in_shapes) or any(s is None for s in in_shapes):
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, in_shapes):
        if len(term) != len(shape):
            return None
        for letter, dim in zip(term, shape):
            sizes[letter] = max(sizes.get(letter, 1), int(dim))
    return 2.0 * math.prod(sizes.values())


# Measured on this project's CI-class machine (2 cores, TF 2.21 with oneDNN): a 3x3
# convolution ran at ~68 GFLOP/s while an elementwise multiply over the same tensor
# took as long as ~88 FLOPs per output element (it reads one and writes one), and
# BatchNorm's moments ~210. Elementwise, reduction and copy ops are memory-bound, so
# counting their arithmetic made recomputing a BatchNorm chain look 1 % of the step
# when it cost a third of it. Each element read or written is charged this many FLOPs.
ELEMENT_MOVE_COST = 40.0


def op_cost(
    op_type: str,
    in_shapes: Sequence[Sequence[int] | None],
    out_shapes: Sequence[Sequence[int]],
    equation: str = "",
) -> float:
    """Estimated cost of one run of an op, in FLOP-like units (always >= 1).

    A roofline: the larger of the op's arithmetic and its memory traffic.
    Arithmetic: matrix products ``2 * out_elements * K``; Einsum ``2 *`` the product
    of every index's size; convolutions ``2 * out_elements * (kernel elements /
    output channels)`` (depthwise: kernel spatial size); everything else the number of
    output elements. Traffic: ``ELEMENT_MOVE_COST`` per input and output element.
    Ops that only alias a buffer (``ALIASING_OPS``) cost 1.
    """
    if op_type in ALIASING_OPS:
        return 1.0
    flops = _flops(op_type, in_shapes, out_shapes, equation)
    moved = sum(num_elements(s) for s in in_shapes if s is not None)
    moved += sum(num_elements(s) for s in out_shapes)
    return float(max(flops, ELEMENT_MOVE_COST * moved, 1.0))


def _flops(
    op_type: str,
    in_shapes: Sequence[Sequence[int] | None],
    out_shapes: Sequence[Sequence[int]],
    equation: str = "",
) -> float:
    """Arithmetic of one run: see :func:`op_cost`."""
    out = sum(num_elements(s) for s in out_shapes) if out_shapes else 1
    try:
        if op_type == "Einsum" and equation:
            flops = einsum_flops(equation, in_shapes)
            if flops is not None:
                return float(max(1.0, flops))
        if op_type in MATMUL_OPS and in_shapes and in_shapes[0] is not None:
            a = in_shapes[0]
            b = in_shapes[1] if len(in_shapes) > 1 and in_shapes[1] is not None else None
            # The contracted dim is the one of `a` not in the output; min() of a's last
            # two dims is wrong for transposes, so take it from b when known.
            k = min(a[-2:]) if len(a) >= 2 else 1
            if b is not None and len(b) >= 2 and out_shapes:
                n = out_shapes[0][-1]
                k = b[-2] if b[-1] == n else b[-1]
            return float(max(1, 2 * out * k))
        if op_type in CONV_OPS and len(in_shapes) > 1 and in_shapes[1] is not None:
            kernel = in_shapes[1]
            if op_type == "DepthwiseConv2dNative":
                per_out = num_elements(kernel[:-2])
            else:
                per_out = num_elements(kernel[:-1])
            return float(max(1, 2 * out * per_out))
        if op_type in ("Conv2DBackpropInput", "DepthwiseConv2dNativeBackpropInput") and len(in_shapes) > 2:
            # Same FLOPs as the forward conv: 2 * dy elements * kernel elements per output channel.
            kernel, dy = in_shapes[1], in_shapes[2]
            if kernel is not None and dy is not None:
                return float(max(1, 2 * num_elements(dy) * num_elements(kernel[:-1])))
        if op_type in ("Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter") and len(in_shapes) > 2:
            kernel, dy = out_shapes[0], in_shapes[2]
            if dy is not None:
                return float(max(1, 2 * num_elements(dy) * num_elements(kernel[:-1])))
    except (IndexError, TypeError):
        pass
    return float(max(1, out))
