"""tf.function + example arguments -> TracedStep. The only module that reads a tf.Graph."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from ._tf import import_tf
from .errors import UnknownShapeError, UnsupportedGraphError
from .graph import OpRecord, TensorInfo

# Shape-arithmetic ops whose int outputs may have an unknown length: at most a few
# elements per rank, so they are counted as 0 bytes instead of refusing the graph.
_SHAPE_OPS = frozenset({"BroadcastGradientArgs", "Shape", "ShapeN", "Size", "Rank", "DynamicStitch"})


@dataclasses.dataclass
class TracedStep:
    """A traced step: TF objects needed to emit, plain records needed to plan."""

    concrete: Any  # tf ConcreteFunction
    graph_def: Any  # tf.compat.v1.GraphDef
    records: list[OpRecord]
    arg_placeholders: list[str]  # op names, in cf.inputs order
    arg_specs: list[Any]  # tf.TensorSpec per argument placeholder
    captures: list[tuple[Any, str]]  # (external tensor/handle, internal placeholder op name)
    output_names: list[str]  # tensor names of cf.outputs
    dtypes: dict[str, list[int]]  # op name -> DataType enum per output
    structured_outputs: Any
    python_function: Callable


def as_tf_function(fn):
    """Return ``fn`` if it is a ``tf.function``, else ``tf.function(fn)``."""
    tf = import_tf()
    if hasattr(fn, "get_concrete_function"):
        return fn
    return tf.function(fn)


def flat_tensor_args(python_function: Callable, args: tuple, kwargs: dict) -> list:
    """The tensor leaves of a call, in the order TensorFlow orders a concrete function's inputs."""
    tf = import_tf()
    import numpy as np

    try:
        bound = inspect.signature(python_function).bind(*args, **kwargs)
        args, kwargs = bound.args, bound.kwargs
    except (TypeError, ValueError):
        pass
    leaves = tf.nest.flatten((args, dict(kwargs)), expand_composites=True)
    return [x for x in leaves if isinstance(x, (tf.Tensor, tf.Variable, np.ndarray))]


def _tensor_info(t) -> TensorInfo:
    tf = import_tf()
    dtype = t.dtype
    if dtype in (tf.resource, tf.variant):
        return TensorInfo((), dtype.name, 0)
    shape = t.shape
    if shape.rank is None or any(d is None for d in shape.as_list()):
        if t.op.type in _SHAPE_OPS:
            return TensorInfo((), dtype.name, 0)
        raise UnknownShapeError(t.name, shape)
    dims = tuple(int(d) for d in shape.as_list())
    n = 1
    for d in dims:
        n *= d
    size = dtype.size if dtype != tf.string else 0
    return TensorInfo(dims, dtype.name, int(n * size))


def trace(fn, args: tuple, kwargs: dict | None = None) -> TracedStep:
    """Trace ``fn`` on example arguments into a :class:`TracedStep`.

    Raises
    ------
    UnknownShapeError
        When a tensor's size is not known at trace time.
    UnsupportedGraphError
        When the arguments include something tfremat cannot feed (e.g. a variable
        passed as an argument) or the outputs are not tensors.
    """
    tf = import_tf()
    kwargs = kwargs or {}
    tf_fn = as_tf_function(fn)
    cf = tf_fn.get_concrete_function(*args, **kwargs)
    graph = cf.graph
    captures = [(ext, internal.op.name) for ext, internal in graph.captures]
    capture_names = {name for _, name in captures}
    arg_inputs = [t for t in cf.inputs if t.op.name not in capture_names]
    if any(t.dtype == tf.resource for t in arg_inputs):
        raise UnsupportedGraphError(
            "a tf.Variable is passed as an argument of the step; capture it from the "
            "enclosing scope instead (use it inside the function without passing it)"
        )
    records = []
    for op in graph.get_operations():
        calls_function = any(
            op.node_def.attr[k].WhichOneof("value") == "func"
            or (op.node_def.attr[k].WhichOneof("value") == "list" and len(op.node_def.attr[k].list.func))
            for k in op.node_def.attr
        )
        records.append(
            OpRecord(
                name=op.name,
                op_type=op.type,
                inputs=tuple(t.name for t in op.inputs),
                control_inputs=tuple(c.name for c in op.control_inputs),
                outputs=tuple(_tensor_info(t) for t in op.outputs),
                stateful=bool(op.op_def.is_stateful) if op.op_def is not None else True,
                calls_function=calls_function,
                equation=op.get_attr("equation").decode() if op.type == "Einsum" else "",
            )
        )
    outputs = list(cf.outputs)
    structured = cf.structured_outputs
    flat_struct = tf.nest.flatten(structured, expand_composites=True)
    if any(not isinstance(x, tf.Tensor) for x in flat_struct if x is not None):
        raise UnsupportedGraphError(
            "the step returns something other than tensors (or nests of tensors); "
            "return tensors only"
        )
    return TracedStep(
        concrete=cf,
        graph_def=graph.as_graph_def(),
        records=records,
        arg_placeholders=[t.op.name for t in arg_inputs],
        arg_specs=[tf.TensorSpec(t.shape, t.dtype) for t in arg_inputs],
        captures=captures,
        output_names=[t.name for t in outputs],
        dtypes={op.name: [t.dtype.as_datatype_enum for t in op.outputs] for op in graph.get_operations()},
        structured_outputs=structured,
        python_function=getattr(tf_fn, "python_function", fn),
    )
