"""tf.function + example arguments -> TracedStep. The only module that reads a tf.Graph."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from typing import Any, Callable

from ._tf import import_tf
from .costs import PURE_LOOP_OPS, loop_cost
from .errors import UnknownShapeError, UnsupportedGraphError
from .graph import BRANCH_OPS, OpRecord, TensorInfo, is_variable_write, producer

# Shape-arithmetic ops whose int outputs may have an unknown length: at most a few
# elements per rank, so they are counted as 0 bytes instead of refusing the graph.
_SHAPE_OPS = frozenset({"BroadcastGradientArgs", "Shape", "ShapeN", "Size", "Rank", "DynamicStitch"})
# Outputs whose shape TensorFlow's shape function leaves unknown although the CPU
# kernel's is empty: a fused batch norm's ``reserve_space_3`` (shape [] or [0] on CPU,
# with or without oneDNN; measured, docs/design.md) is counted as 0 bytes.
_EMPTY_OUTPUTS = frozenset({("FusedBatchNormV3", 5), ("_FusedBatchNormEx", 5)})


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
    # captured resource placeholder op name -> bytes of the variable behind it
    handle_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # ops whose outputs went through an optimizer's IdentityN (bypassed): gradients
    gradients: tuple[str, ...] = ()
    # seeded random ops whose kernels hold their stream (seeded_stream_ops)
    seeded_streams: tuple[str, ...] = ()


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


def _tensor_info(t, bound: int = 0) -> TensorInfo:
    """Shape, dtype and bytes of ``t``.

    A dimension unknown at trace time raises :class:`UnknownShapeError`, unless
    ``bound`` (elements) is given: the size of a tensor whose rows depend on the
    data but whose inputs are all static (``tf.where``, ``tf.unique``, the sparse
    division Keras' RMSprop does on an embedding's ``IndexedSlices`` gradient, in a
    ``tf.cond`` whose branches return different row counts) is taken as that many
    elements (its largest input, see :func:`_input_bound`), the unknown dimension
    holding what the known ones leave. Such ops stay where they are (never
    recomputed); the per-call measurement corrects a guess that is low.
    """
    tf = import_tf()
    dtype = t.dtype
    if dtype in (tf.resource, tf.variant):
        return TensorInfo((), dtype.name, 0)
    shape = t.shape
    size = dtype.size if dtype != tf.string else 0
    if shape.rank is None or any(d is None for d in shape.as_list()):
        if t.op.type in _SHAPE_OPS:
            return TensorInfo((), dtype.name, 0)
        if (t.op.type, t.value_index) in _EMPTY_OUTPUTS:
            return TensorInfo((0,), dtype.name, 0)
        if not bound or shape.rank is None:
            raise UnknownShapeError(t.name, shape)
        known = math.prod(int(d) for d in shape.as_list() if d is not None)
        first = [d is None for d in shape.as_list()].index(True)
        dims = tuple(max(1, bound // max(1, known)) if k == first else (1 if d is None else int(d))
                     for k, d in enumerate(shape.as_list()))
        return TensorInfo(dims, dtype.name, int(math.prod(dims) * size), estimated=True)
    dims = tuple(int(d) for d in shape.as_list())
    return TensorInfo(dims, dtype.name, int(math.prod(dims) * size))


def _input_bound(op, elements: dict) -> int:
    """The most elements of any input of ``op`` (``elements``: tensor name ->
    elements, of the ops traced so far); 0 where an input is unknown, so that a
    tensor whose size cannot be bounded still raises :class:`UnknownShapeError`."""
    sizes = [elements.get(t.name) for t in op.inputs if t.dtype.name not in ("resource", "variant")]
    if not sizes or any(n is None for n in sizes):
        return 0
    return max(sizes)


_WHILE_OPS = frozenset({"While", "StatelessWhile"})
_NEW_LIST_OPS = frozenset({"EmptyTensorList", "TensorListReserve"})
_PASS_THROUGH = frozenset({"Identity", "StopGradient"})


def _source(t):
    while t.op.type in _PASS_THROUGH and t.op.inputs:
        t = t.op.inputs[0]
    return t


def _trip_count(op) -> int | None:
    """Iterations of a while loop, when the graph says so statically.

    Keras' RNNs (and ``tf.while_loop`` over a sequence) unstack the sequence into a
    TensorList (``TensorListFromTensor``) that the loop reads one element per step,
    and ``while_v2`` passes ``maximum_iterations`` as the loop's second input.
    """
    tf = import_tf()
    counts = []
    for t in op.inputs:
        src = _source(t)
        if src.op.type == "TensorListFromTensor":
            shape = src.op.inputs[0].shape
            if shape.rank and shape[0] is not None:
                counts.append(int(shape[0]))
    if counts:
        return max(counts)
    if len(op.inputs) > 1:
        v = tf.get_static_value(op.inputs[1])
        if v is not None and int(v) > 0:
            return int(v)
    return None


# Ops inside a loop body whose output shares a buffer that lives anyway: pushing it
# onto an accumulator holds no new memory (ReadVariableOp aliases the variable). An
# element read from the input sequence's list (TensorListGetItem) does count: the
# accumulator keeps it alive until the gradient loop, after the list itself is gone.
_ALIASING_IN_BODY = frozenset({"ReadVariableOp", "Const", "Identity"})


def _pushes_fresh_tensor(body, index: int) -> bool:
    """Whether the loop body pushes a newly computed tensor onto loop variable ``index``.

    ``body`` is the loop body's FunctionDef (None when unavailable: then assume it
    does, the conservative answer).
    """
    if body is None or index >= len(body.signature.input_arg):
        return True
    arg = body.signature.input_arg[index].name
    nodes = {n.name: n for n in body.node_def}
    pushed = [n.input[1] for n in body.node_def if n.op == "TensorListPushBack" and n.input and n.input[0] == arg]
    if not pushed:
        return True
    ret = body.ret
    out_args = [a.name for a in body.signature.output_arg]
    invariant = {body.signature.input_arg[i].name for i, o in enumerate(out_args) if ret.get(o) == body.signature.input_arg[i].name}
    for t in pushed:
        name = t.split(":")[0]
        while name in nodes and nodes[name].op == "Identity" and nodes[name].input:
            name = nodes[name].input[0].split(":")[0]
        if name in nodes:
            if nodes[name].op not in _ALIASING_IN_BODY:
                return True
        elif name not in invariant:
            return True  # a loop-carried state: a new tensor every iteration
    return False


def _list_bytes(op, index: int, functions: dict) -> tuple[int, int]:
    """Bytes a while loop's TensorList output ``index`` holds when the loop ends, and
    its number of elements (each a separate allocation).

    ``while_v2`` saves, for the gradient loop, every intermediate it needs in an
    accumulator: an ``EmptyTensorList`` passed into the loop, one element pushed per
    iteration, and returned as a loop output that lives until the gradient loop pops
    it (an LSTM's gates and states: most of its activations). An accumulator of a
    tensor that aliases one the step holds anyway (a variable read) holds no new
    memory. A list created with ``TensorListReserve`` holds ``num_elements``
    elements. Lists whose size the graph does not give statically count as 0 bytes (a
    documented limit).
    """
    tf = import_tf()
    if index >= len(op.inputs):
        return 0, 1
    src = _source(op.inputs[index])
    if src.op.type not in _NEW_LIST_OPS:
        return 0, 1
    shape = tf.get_static_value(src.op.inputs[0])
    if shape is None:
        return 0, 1
    dims = [int(d) for d in shape.reshape(-1).tolist()]
    if shape.ndim == 0 or any(d < 0 for d in dims):
        return 0, 1  # unknown element shape (-1 or a -1 dimension)
    if src.op.type == "TensorListReserve":
        v = tf.get_static_value(src.op.inputs[1])
        n = int(v) if v is not None and int(v) >= 0 else None
    else:
        try:
            body = functions.get(op.get_attr("body").name)
        except (ValueError, AttributeError):
            body = None
        if not _pushes_fresh_tensor(body, index):
            return 0, 1
        n = _trip_count(op)
    if not n:
        return 0, 1
    return int(math.prod(dims) * tf.as_dtype(src.op.get_attr("element_dtype")).size * n), int(n)


def _loop_cost(op, functions: dict, outputs, variables: dict) -> tuple[float, bool]:
    """``(estimated cost, pure)`` of a while loop with a static trip count, else ``(0, False)``.

    The cost is ``costs.loop_cost``'s: every weight the loop reads, multiplied once per
    row per iteration, or the elements it writes, whichever is more. The loop is
    *pure* when its body and condition hold only ``costs.PURE_LOOP_OPS``: pure
    kernels and reads of the variables it is given, so a second run from the same
    inputs computes the same outputs, provided no write of those variables comes
    between (``graph.build_graph`` checks that). An RNN layer's forward loop is
    pure: recomputing it drops its accumulators (most of the layer's activations)
    between the forward and the backward pass.
    """
    tf = import_tf()
    if op.type not in _WHILE_OPS:
        return 0.0, False
    trips = _trip_count(op)
    if not trips:
        return 0.0, False
    pure = True
    for attr in ("body", "cond"):
        try:
            fdef = functions.get(op.get_attr(attr).name)
        except (ValueError, AttributeError):
            fdef = None
        if fdef is None or any(
            n.op not in PURE_LOOP_OPS
            or any(v.WhichOneof("value") == "func" or (v.WhichOneof("value") == "list" and len(v.list.func))
                   for v in n.attr.values())
            for n in fdef.node_def
        ):
            pure = False
    # rows: the batch of a step's element (an RNN's input list holds (batch, features)
    # elements) or of a loop-carried state (its hidden state)
    rows, weights = 1, 0
    for t in op.inputs:
        src = _source(t)
        if src.op.type == "TensorListFromTensor":
            shape = src.op.inputs[0].shape
            if shape.rank and shape.rank >= 2 and shape[1] is not None:
                rows = max(rows, int(shape[1]))
        elif t.dtype == tf.resource:
            if t.op.name in variables:
                weights += variables[t.op.name][0]
            else:  # the variable's shape from a read of it outside the loop
                shapes = [c.outputs[0].shape for c in t.consumers() if c.type == "ReadVariableOp"]
                if shapes and shapes[0].is_fully_defined():
                    weights += int(shapes[0].num_elements())
        elif t.dtype.is_floating and t.shape.rank and t.shape.rank >= 2 and t.shape[0] is not None:
            rows = max(rows, int(t.shape[0]))
    moved = sum(info.bytes for info in outputs) // 4
    return loop_cost(trips, rows, weights, moved), pure


def _branch_functions(op, functions: dict) -> list:
    """The FunctionDefs of a conditional's branches (those in the library)."""
    names = []
    for attr in ("then_branch", "else_branch", "branches"):
        if attr not in op.node_def.attr:
            continue
        a = op.node_def.attr[attr]
        names += [a.func.name] if a.WhichOneof("value") == "func" else [f.name for f in a.list.func]
    return [functions[n] for n in names if n in functions]


def _optional_bytes(op, index: int, functions: dict) -> int:
    """Bytes a conditional's ``variant`` output ``index`` holds.

    ``cond_v2`` wraps the intermediates a branch's gradient needs in an optional
    (``OptionalFromValue``), one more output of the forward ``If`` that lives until
    the gradient ``If`` unwraps it (``OptionalGetValue``, whose ``output_shapes``
    attribute gives the shapes). The largest over the gradient's branches; 0 where
    no reader says (unknown shapes too). Measured on a CNN with two ``tf.cond``
    gates (``benchmarks/keras_sweep.py cond_gate``): 4 MiB per gate held from the
    forward to the backward pass, which the plan had counted as nothing.
    """
    t = op.outputs[index]
    best = 0
    for c in t.consumers():
        if c.type not in BRANCH_OPS:
            continue
        for j, u in enumerate(c.inputs):
            if j == 0 or u.name != t.name:
                continue  # input 0 is the predicate (the branch index)
            for fdef in _branch_functions(c, functions):
                if j - 1 >= len(fdef.signature.input_arg):
                    continue
                arg = fdef.signature.input_arg[j - 1].name
                best = max([best] + [_unwrapped_bytes(n) for n in fdef.node_def
                                     if n.op == "OptionalGetValue" and n.input and n.input[0] == arg])
    return int(best)


def _unwrapped_bytes(node) -> int:
    """Bytes an ``OptionalGetValue`` node returns, from its static ``output_shapes``
    (0 if any is unknown)."""
    tf = import_tf()
    total = 0
    for shape, dt in zip(node.attr["output_shapes"].list.shape, node.attr["output_types"].list.type):
        dims = [d.size for d in shape.dim]
        if shape.unknown_rank or any(d < 0 for d in dims):
            return 0
        total += math.prod(dims) * tf.as_dtype(dt).size
    return total


def _output_infos(op, functions: dict, bound: int = 0) -> tuple[TensorInfo, ...]:
    tf = import_tf()
    infos = []
    for i, t in enumerate(op.outputs):
        info = _tensor_info(t, bound)
        if t.dtype == tf.variant:
            if op.type in _WHILE_OPS:
                info = TensorInfo((), info.dtype, *_list_bytes(op, i, functions))
            elif op.type in BRANCH_OPS:
                info = TensorInfo((), info.dtype, _optional_bytes(op, i, functions))
            elif op.type == "TensorListFromTensor":
                # A copy of the tensor, one element per row (the kernel allocates
                # each row apart).
                src = _tensor_info(op.inputs[0])
                info = TensorInfo((), info.dtype, src.bytes, max(1, src.shape[0]) if src.shape else 1)
        infos.append(info)
    return tuple(infos)


def _attr_digest(op) -> str:
    """A digest of every attribute: ops that also share type and inputs compute the same."""
    h = hashlib.sha1()
    for k in sorted(op.node_def.attr):
        h.update(k.encode())
        h.update(op.node_def.attr[k].SerializeToString(deterministic=True))
    return h.hexdigest()


def _value_digest(op) -> str:
    if op.type not in ("Const", "HostConst"):
        return ""
    return hashlib.sha1(op.node_def.attr["value"].SerializeToString(deterministic=True)).hexdigest()


def _scalar_value(op) -> float | None:
    """The number a ``Const`` of one element holds (None otherwise)."""
    if op.type not in ("Const", "HostConst"):
        return None
    proto = op.node_def.attr["value"].tensor
    if math.prod(d.size for d in proto.tensor_shape.dim) != 1:
        return None
    try:
        value = import_tf().make_ndarray(proto)
        return float(value.reshape(-1)[0])
    except (TypeError, ValueError):  # strings, resources
        return None


def _live_ops(graph, outputs, keep=()) -> set:
    """Names of the ops the runtime runs: the outputs, the control outputs, every
    stateful op, what they read (data or control, transitively), and ``keep``.

    The function runtime prunes the rest before Grappler sees the body, so a step's
    dead ops (e.g. the gradient of a division with respect to a constant divisor) are
    dropped here too: counted as consumers, they made the rewrite order an input
    through a gate, or give a copy an unused fan-out consumer, where the runtime sees a
    single consumer; Grappler's arithmetic rewrites decide from those counts (found on
    MobileNetV3Small: the hard-swish gradient ``(g * x) / 6`` was reassociated in the
    original and not in the rewritten step, 1.7e-4 after 3 steps).
    """
    stack = [t.op for t in outputs] + list(graph.control_outputs)
    stack += [op for op in graph.get_operations() if op.op_def is None or op.op_def.is_stateful]
    stack += [graph.get_operation_by_name(name) for name in keep]
    seen = {op.name for op in stack}
    while stack:
        op = stack.pop()
        for dep in [t.op for t in op.inputs] + list(op.control_inputs):
            if dep.name not in seen:
                seen.add(dep.name)
                stack.append(dep)
    return seen


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
    outputs = list(cf.outputs)
    live = _live_ops(graph, outputs, keep=[t.op.name for t in cf.inputs])
    graph_def = graph.as_graph_def()
    kept = [n for n in graph_def.node if n.name in live]
    if len(kept) < len(graph_def.node):
        del graph_def.node[:]
        graph_def.node.extend(kept)
    functions = {f.signature.name: f for f in graph_def.library.function}
    variables = _variable_elements(cf, captures)
    records = []
    elements: dict = {}  # tensor name -> elements (estimated ones included)
    for op in graph.get_operations():
        if op.name not in live:
            continue
        calls_function = any(
            op.node_def.attr[k].WhichOneof("value") == "func"
            or (op.node_def.attr[k].WhichOneof("value") == "list" and len(op.node_def.attr[k].list.func))
            for k in op.node_def.attr
        )
        infos = _output_infos(op, functions, _input_bound(op, elements))
        for t, info in zip(op.outputs, infos):
            elements[t.name] = math.prod(info.shape) if info.shape else (1 if info.bytes else 0)
        cost, pure = _loop_cost(op, functions, infos, variables)
        records.append(
            OpRecord(
                name=op.name,
                op_type=op.type,
                inputs=tuple(t.name for t in op.inputs),
                control_inputs=tuple(c.name for c in op.control_inputs),
                outputs=infos,
                stateful=bool(op.op_def.is_stateful) if op.op_def is not None else True,
                calls_function=calls_function,
                equation=op.get_attr("equation").decode() if op.type == "Einsum" else "",
                value_digest=_value_digest(op),
                scalar=_scalar_value(op),
                attr_digest=_attr_digest(op),
                loop_cost=cost,
                pure_loop=pure,
            )
        )
    records, gradients = _bypass_identity_n(records, graph_def, [t.name for t in outputs])
    structured = cf.structured_outputs
    flat_struct = tf.nest.flatten(structured, expand_composites=True)
    if any(not isinstance(x, tf.Tensor) for x in flat_struct if x is not None):
        raise UnsupportedGraphError(
            "the step returns something other than tensors (or nests of tensors); "
            "return tensors only"
        )
    return TracedStep(
        concrete=cf,
        graph_def=graph_def,
        records=records,
        arg_placeholders=[t.op.name for t in arg_inputs],
        arg_specs=[tf.TensorSpec(t.shape, t.dtype) for t in arg_inputs],
        captures=captures,
        output_names=[t.name for t in outputs],
        dtypes={op.name: [t.dtype.as_datatype_enum for t in op.outputs] for op in graph.get_operations()},
        structured_outputs=structured,
        python_function=getattr(tf_fn, "python_function", fn),
        handle_bytes=_handle_bytes(variables),
        gradients=gradients,
        seeded_streams=seeded_stream_ops(graph_def),
    )


def seeded_stream_ops(graph_def) -> tuple[str, ...]:
    """Seeded random ops whose kernel holds its own stream, in the step or a function
    it calls (``"function/op"``).

    ``tf.random.uniform``, ``tf.nn.dropout`` without a generator, ``tf.random.shuffle``
    and the like run stateful kernels (``RandomUniform``, ``RandomShuffle``, ...) that
    draw the next numbers of a Philox stream seeded by their ``seed``/``seed2``
    attributes; the stream lives in the kernel, so a new function made from the same
    graph starts it again (measured: a re-emitted ``tf.nn.dropout`` repeats the first
    call's mask). Such ops are told apart by those two attributes (stateless random
    ops take their seed as an input; ``tf.random.Generator`` keeps its state in a
    variable). Both zero means a fresh random seed per kernel: nothing to reproduce.
    """

    def seeded(node) -> bool:
        a = node.attr
        return "seed" in a and "seed2" in a and bool(a["seed"].i or a["seed2"].i)

    found = [n.name for n in graph_def.node if seeded(n)]
    for f in graph_def.library.function:
        found.extend(f"{f.signature.name}/{n.name}" for n in f.node_def if seeded(n))
    return tuple(found)


# Producers an identity is not bypassed after (Grappler's SafeToRemoveIdentity).
_KEEP_IDENTITY_AFTER = frozenset({"VarHandleOp", "VariableV2", "Variable", "_Recv", "Switch"})


def _bypass_identity_n(records: list, graph_def, output_names) -> tuple[list, tuple[str, ...]]:
    """Read each multi-input ``IdentityN``'s inputs directly, as Grappler will, and drop it.

    Keras' optimizers pass every gradient through one ``IdentityN`` before their
    updates. Grappler's dependency optimizer reroutes its readers to its inputs and
    deletes it (when no reader waits on it through a control edge, no reader reads it
    twice, it has no control inputs and it is not an output: the conditions of its
    ``SafeToRemoveIdentity`` and ``BypassingNodeIsBeneficial`` on one device), so the
    executor applies each gradient as soon as it exists. Left in the planning graph,
    the ``IdentityN`` joined all gradients: every one was held until the last was
    computed, and the plan's order put every update after the backward pass
    (profiler replay of the ``make demo`` MLP: one 256 KiB weight gradient live at
    the peak, seven in the plan). Doing the bypass here, in the GraphDef the rewrite
    starts from and in the records it is planned from, keeps the two the same; the
    steps it was measured on compute bit for bit what the original does (an MLP with
    SGD, momentum and Adam, a residual CNN with Adam and momentum, the Transformer
    test model with Adam and Nesterov momentum: 3 steps, op determinism).

    Returns the new records and the producers of the bypassed inputs (the
    gradients); ``graph_def`` is changed in place.
    """
    by_name = {r.name: r for r in records}
    nodes = {n.name: n for n in graph_def.node}
    outputs = {producer(t) for t in output_names}
    readers: dict = {}
    for r in records:
        for t in r.inputs:
            readers.setdefault(producer(t), []).append(r)
    waited_on = {c for r in records for c in r.control_inputs}
    # The optimizer's: every reader of it feeds variable writes only. A custom
    # gradient's IdentityN in the forward pass is left to Grappler (dropped here too,
    # the swish test MLP's plans recomputed more: +15 % compute instead of +8 %).
    feeds = {r.name for r in records if is_variable_write(r.op_type)}
    for r in reversed(records):  # program order is a topological order
        rs = readers.get(r.name, [])
        if r.name not in feeds and rs and all(c.name in feeds for c in rs):
            feeds.add(r.name)
    bypass = {}
    for r in records:
        if r.op_type != "IdentityN" or len(r.inputs) < 2 or r.control_inputs:
            continue
        if r.name in outputs or r.name in waited_on or r.name not in nodes or r.name not in feeds:
            continue
        first = by_name.get(producer(r.inputs[0]))
        if first is None or first.op_type in _KEEP_IDENTITY_AFTER:
            continue
        rs = readers.get(r.name, [])
        refs = sum(1 for c in rs for t in c.inputs if producer(t) == r.name)
        if refs > len({c.name for c in rs}) or any(c.op_type in ("Merge", "_Retval") for c in rs):
            continue
        device = nodes[r.name].device
        near = [producer(t) for t in r.inputs] + [c.name for c in rs]
        if any(n in nodes and nodes[n].device != device for n in near):
            continue
        bypass[r.name] = r
    if not bypass:
        return records, ()

    def forward(t: str) -> str:
        op, _, idx = t.partition(":")
        r = bypass.get(op)
        return r.inputs[int(idx or 0)] if r is not None else t

    for n in graph_def.node:
        for k, t in enumerate(n.input):
            if not t.startswith("^") and t.partition(":")[0] in bypass:
                src = forward(t)  # a GraphDef names output 0 by the op alone
                n.input[k] = src[:-2] if src.endswith(":0") else src
    kept = [n for n in graph_def.node if n.name not in bypass]
    del graph_def.node[:]
    graph_def.node.extend(kept)
    gradients = tuple(dict.fromkeys(producer(t) for r in bypass.values() for t in r.inputs))
    records = [
        dataclasses.replace(r, inputs=tuple(forward(t) for t in r.inputs))
        for r in records
        if r.name not in bypass
    ]
    return records, gradients


def _variable_elements(cf, captures) -> dict[str, tuple[int, int]]:
    """``(elements, bytes per element)`` of each captured variable, by its placeholder
    in the step's graph.

    From the variables themselves (``ConcreteFunction.variables``), matched to the
    captures by handle: a variable the step uses only inside a called function (a
    ``tf.cond`` branch or a loop body) has no read in the step's own graph to size it by.
    """
    out = {}
    for name, v in _captured_variables(cf, captures).items():
        try:
            out[name] = (int(v.shape.num_elements()), v.dtype.size)
        except (AttributeError, TypeError):  # unknown shape: sized by its reads
            continue
    return out


def _captured_variables(cf, captures) -> dict:
    """Each captured variable (``ConcreteFunction.variables``) by its placeholder in
    the step's graph, matched by handle."""
    by_handle = {id(v.handle): v for v in cf.variables if hasattr(v, "handle")}
    return {name: by_handle[id(ext)] for ext, name in captures if id(ext) in by_handle}


def written_variables(traced: TracedStep) -> list:
    """The captured variables the step may write.

    A variable whose handle reaches any op other than a read
    (:data:`tfremat.graph.VARIABLE_READS`) or a loop that only reads
    (``OpRecord.pure_loop``) counts: an assignment, an optimizer's apply, and a
    function call or loop given the handle, whose body is not looked into.
    """
    from .graph import VARIABLE_READS, producer

    consumers: dict[str, list] = {}
    for r in traced.records:
        for t in r.inputs:
            consumers.setdefault(producer(t), []).append(r)
    return [
        v for name, v in _captured_variables(traced.concrete, traced.captures).items()
        if any(not (r.op_type in VARIABLE_READS or r.pure_loop) for r in consumers.get(name, ()))
    ]


def _handle_bytes(variables: dict) -> dict[str, int]:
    """Bytes of each captured variable, by its placeholder (see _variable_elements)."""
    return {name: n * size for name, (n, size) in variables.items()}
