"""Traced ops -> networkx dataflow graph with bytes, cost, phase, recomputability.

No TensorFlow here: :mod:`tfremat.trace` turns a concrete function into
:class:`OpRecord` s, and this module builds the planning graph from them.

Phases are found by structure and memory, never by op names:

* ``input``: placeholders (arguments, captured variable handles) and constants;
* ``update``: ops that write a variable (assign, ``ResourceApply*``, ...) and every
  op downstream of one;
* ``forward``: the loss and everything it is computed from. The loss is found by
  reachability, not by name: among the scalar floating-point ops whose value is used
  only by scalar ops or variable writes (a gradient never needs the loss value
  itself, only what it was computed from; Keras feeds it to a metric), the one with
  the most ancestors;
* ``backward``: every other op (the gradient computation, metrics).

When no op qualifies as the loss, the split falls back to the peak of the
un-rematerialized schedule in program order. A misplaced op can cost savings, never
correctness: recomputing a stateless op yields the same value wherever it sits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable, Mapping, Sequence

import networkx as nx

from .costs import ALIASING_OPS, FUSED_WITH_SIBLING, INPLACE_OPS, NEVER_RECOMPUTE, op_cost
from .simulate import simulate

# Ops that read only their input's shape.
SHAPE_ONLY_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Ops the rewrite may leave without an ordering control input (node attribute "asap"):
# Add/Mul-family ops Grappler's arithmetic optimizer merges, gradient AddNs, and the
# fused siblings (see rewrite.py).
ASAP_OPS = frozenset({"Add", "AddV2", "AddN", "Sub", "Mul", "Neg"}) | FUSED_WITH_SIBLING

# Ops with a variant (TensorList) output that are pure and may be recomputed: an RNN
# layer's input sequence unstacked into a list, which its loop reads step by step.
RECOMPUTABLE_LIST_OPS = frozenset({"TensorListFromTensor"})
WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter", "ResourceStridedSliceAssign")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor's shape, dtype and bytes; ``pieces``: how many separate allocations
    hold the bytes (a TensorList's elements, each allocated on its own: an LSTM's
    accumulators are one 8 KiB element per step), which decides whether an allocator
    that leaves small requests out of its statistics counts them
    (:meth:`StepGraph.counted`)."""

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    pieces: int = 1
    # A size that depends on the data (``tf.where``, ``tf.unique``, a conditional
    # whose branches return different row counts): ``shape`` is an upper guess
    # (:func:`tfremat.trace._tensor_info`), not the static shape.
    estimated: bool = False

    @property
    def piece_bytes(self) -> int:
        return self.bytes // max(1, self.pieces)


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op of a traced step, as plain data.

    ``inputs`` are tensor names ``"op:index"``; ``control_inputs`` op names.
    ``stateful`` comes from the OpDef; ``calls_function`` marks ops with a function
    attribute (calls, control flow), which are never recomputed.
    """

    name: str
    op_type: str
    inputs: tuple[str, ...]
    control_inputs: tuple[str, ...]
    outputs: tuple[TensorInfo, ...]
    stateful: bool
    calls_function: bool = False
    equation: str = ""  # Einsum's equation, for its FLOP estimate
    value_digest: str = ""  # Const ops: a digest of the value (equal constants merge)
    attr_digest: str = ""  # a digest of every attribute ("": unknown, never merged)
    # a while loop's estimated cost (0: unknown), and whether it may be recomputed
    # whole (trace._loop_cost; the planning graph also checks the variables it reads)
    loop_cost: float = 0.0
    pure_loop: bool = False
    scalar: float | None = None  # Const ops holding one number: its value


_STATIC_OPS = frozenset({"Placeholder", "Const", "HostConst", "VarHandleOp", "ReadVariableOp"})


def _updates_of(g: nx.DiGraph, gradients, writes: set, bounded: bool = True) -> set:
    """The optimizer's updates of ``gradients`` that the order runs as soon as each exists.

    An update of one gradient is ready as soon as that gradient is, and the executor
    runs it then, freeing the gradient; in program order it comes after the whole
    backward pass, holding every gradient to the end. Sorted first among ready ops,
    the plan's order is the executor's. This is done for updates that hold no more
    than the gradient they free (SGD's ``lr * g``): Adam's moments, sorted first,
    interleaved temporaries of the gradient's size with the backward pass, and the
    pool model (``tfremat.allocator``) put the Keras test CNN's plans at 52.7 MiB of
    chunks for 43.8 MiB of tensors (44.8 MiB in program order): budgets that had
    plans became infeasible. Those keep their program position. So do the small ops
    the chosen updates read (variable reads, the learning rate's casts: under 1/64
    of the largest output, so the rewrite leaves them unordered), whose late program
    position would hold the update back. Bigger ops that read only variables and
    constants (SGD's ``momentum * m``) keep their program position: ready at the
    start of the step, they would hold their output through it (that order is the
    executor's own, which plans that recompute nothing are checked against,
    ``api._emit_plan``). ``gradients``: the ops whose outputs Keras' optimizers
    passed through an ``IdentityN`` (``trace._bypass_identity_n``). Measured on the
    ``make demo`` MLP (SGD): tensors, pool model and measured peak within 0.3 MiB at
    targets of 50-75 MiB, where the pool model in program order was 25 MiB over.
    """
    topo = list(nx.topological_sort(g))
    feeds: set = set(writes)  # every consumer (data or liveness) is in the set
    for v in reversed(topo):
        succ = [c for c in g.successors(v) if g.edges[v, c]["kind"] != "control"]
        if v not in feeds and succ and all(c in feeds for c in succ):
            feeds.add(v)
    updates = set()
    for v in gradients:
        if v not in g or g.nodes[v].get("op_type") in _STATIC_OPS:
            continue
        chain = nx.descendants(g, v) & feeds
        # held beside the gradient: SGD's lr * g only, Adam's moments more
        if not bounded or sum(g.nodes[u]["bytes"] for u in chain if u not in writes) <= g.nodes[v]["bytes"]:
            updates |= chain
    if not updates:
        return updates
    # the small values computed from variables and constants alone that they read
    static: set = set()
    for v in topo:
        preds = [u for u in g.predecessors(v) if g.edges[u, v]["kind"] != "control"]
        if g.nodes[v].get("op_type") in _STATIC_OPS or (preds and all(u in static for u in preds)):
            static.add(v)
    small = max((g.nodes[v]["bytes"] for v in g.nodes), default=0) // 64
    candidates = {v for v in feeds & static if g.nodes[v]["bytes"] < small}
    read: set = set()
    for v in reversed(topo):
        if v not in candidates:
            continue
        if any(c in updates or c in read for c in g.successors(v) if g.edges[v, c]["kind"] != "control"):
            read.add(v)
    return updates | read


def producer(tensor_name: str) -> str:
    return tensor_name.rsplit(":", 1)[0] if ":" in tensor_name else tensor_name


def output_index(tensor_name: str) -> int:
    """Which output of its producer ``"op:index"`` names (0 for a bare op name)."""
    return int(tensor_name.rsplit(":", 1)[1]) if ":" in tensor_name else 0


def is_variable_write(op_type: str) -> bool:
    return op_type.startswith(WRITE_PREFIXES)


# Ops given a variable's handle that only read it (not writers: _loop_writers,
# tfremat.trace.written_variables).
VARIABLE_READS = frozenset({"ReadVariableOp", "VariableShape", "ResourceGather", "ResourceGatherNd"})


def _loop_writers(g: nx.DiGraph, records, by_name: dict) -> None:
    """Record, on each recomputable pure loop (``OpRecord.pure_loop``), the ops that
    may write a variable it reads (``writers``).

    A copy of the loop reads the variables again, so it must run before any of them:
    :func:`tfremat.solvers.solve` plans again, with the loop kept, a schedule that has
    a copy after one (``simulate.reread_after_write``), and the rewrite makes each of
    them wait for every copy. Any op given one of
    the loop's handles counts, except reads and other pure loops.
    """
    for r in records:
        if not r.pure_loop or not g.nodes[r.name]["recomputable"]:
            continue
        writers = set()
        for t in r.inputs:
            rec = by_name.get(producer(t))
            info = rec.outputs[output_index(t)] if rec and output_index(t) < len(rec.outputs) else None
            if info is None or info.dtype != "resource":
                continue
            for w in g.successors(rec.name):
                wr = by_name.get(w)
                if w != r.name and wr is not None and not (wr.op_type in VARIABLE_READS or wr.pure_loop):
                    writers.add(w)
        if writers:
            g.nodes[r.name]["writers"] = tuple(sorted(writers))


# Function calls (their bodies opaque to the plan; tfremat.scratch probes XLA ones).
CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# Conditionals: their branches are functions too, and the forward one's outputs include
# the optional holding what its gradient reads (trace._optional_bytes).
BRANCH_OPS = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})


def _call_output_readers(g: nx.DiGraph, records) -> None:
    """Record, on each function call whose outputs have different readers, each
    output's bytes and readers (``output_readers``, for :func:`with_call_outputs`).

    Calls whose outputs an aliasing op reads are left as they are: the liveness edges
    of those aliases' readers start at the call, not at one output."""
    readers: dict = {}
    for r in records:
        if r.op_type in SHAPE_ONLY_OPS:
            continue
        for t in r.inputs:
            readers.setdefault(producer(t), {}).setdefault(output_index(t), set()).add(r.name)
    for r in records:
        if r.op_type not in CALL_OPS or len(r.outputs) < 2 or r.name not in g:
            continue
        if any(k != "data" for _, _, k in g.out_edges(r.name, data="kind")):
            continue
        per = readers.get(r.name, {})
        sets = [frozenset(per.get(k, ())) for k in range(len(r.outputs))]
        if len(set(sets)) < 2 or any(not g.has_edge(r.name, c) or g.nodes[c].get("alias")
                                     for s in sets for c in s):
            continue
        g.nodes[r.name]["output_readers"] = tuple(
            (int(t.bytes), tuple(sorted(s))) for t, s in zip(r.outputs, sets))


def find_loss(g: nx.DiGraph, by_name: dict, update: set) -> str | None:
    """The op computing the loss, found by structure (see the module docstring).

    A candidate is a scalar floating-point op outside the update phase whose value is
    used, and only by scalar ops outside the update phase (the gradient never
    consumes the loss value: the tape seeds it with ones). Its value may feed variable
    writes: Keras feeds the loss to its loss-tracker metric. A gradient-pass scalar
    either feeds non-scalar gradient math or nothing at all (an unused gradient).
    """

    def data_succ(v):
        return [s for s in g.successors(v) if g.edges[v, s].get("kind") == "data"]

    def feeds_only_scalars(v) -> bool:
        stack, seen = data_succ(v), set()
        if not stack:
            return False
        while stack:
            s = stack.pop()
            if s in seen or s in update:
                continue
            seen.add(s)
            if any(math.prod(t.shape) > 1 for t in by_name[s].outputs):
                return False
            stack.extend(data_succ(s))
        return True

    best, best_n = None, 0
    for v, rec in by_name.items():
        if v in update or g.nodes[v]["phase"] != "forward":
            continue
        if len(rec.outputs) != 1 or rec.outputs[0].shape != () or not rec.outputs[0].dtype.startswith(
            ("float", "half", "bfloat")
        ):
            continue
        if not feeds_only_scalars(v):
            continue
        n = len(nx.ancestors(g, v))
        if n > best_n:
            best, best_n = v, n
    return best


# Ops whose output is one value repeated over a static shape. Grappler's constant
# folding turns them into Const nodes whatever their size (a splat constant is stored
# compressed, so the size limit on folded constants does not apply), and the executor
# then holds each such constant for as long as the function lives: fixed memory, not
# a temporary. Measured on EfficientNetB0 (32x32, batch 64): the gradient's
# activation-sized ``Fill`` zeros added 19 MiB that stayed allocated from the first
# call on, and the plan that counted them as temporaries ran 19 MiB over it.
SPLAT_OPS = frozenset({"Fill", "ZerosLike", "OnesLike"})


def _constant_derived(records: Sequence[OpRecord]) -> dict[str, bool]:
    """Op name -> whether it computes from constants and static shapes only (what
    Grappler folds). One pass in creation order (a topological order), so deep graphs
    need no recursion."""
    derived: dict[str, bool] = {}
    for r in records:
        if r.op_type in ("Const", "HostConst") or r.op_type in SHAPE_ONLY_OPS:
            derived[r.name] = True
        elif r.stateful or r.calls_function or r.op_type == "Placeholder" or not r.inputs:
            derived[r.name] = False
        else:
            derived[r.name] = all(derived.get(producer(t), False) for t in r.inputs)
    return derived


# Grappler's constant folding keeps a folded result only up to this size (its
# ``kMaxConstantSize``); splats are stored compressed and fold at any size.
MAX_FOLDED_BYTES = 10 << 20


def _fold_constants(records, by_name, g) -> list[int]:
    """Zero the bytes of ops Grappler folds; return the sizes of the constants the
    folded step holds.

    Splat ops from constants and static shapes fold at any size, and Grappler's
    common-subexpression pass merges equal ones (same op kind, shape, dtype and
    value count once). Every other op computed from constants only folds where its
    output is at most ``MAX_FOLDED_BYTES``: the folded chain's last op becomes a
    ``Const`` the executor holds from the first call on, and the ops before it
    (read only by folded ops) are gone. Measured on an attention step whose loss is
    ``reduce_sum(h * h)``: the gradient's 0.5 MiB ``Tile`` of ones ran as a constant
    allocated at the start of every call, first in the allocator's pool, where the
    plan counted a temporary in the backward pass.
    """
    derived = _constant_derived(records)
    readers: dict[str, list[str]] = {}
    for r in records:
        for t in r.inputs:
            readers.setdefault(producer(t), []).append(r.name)

    seen: set = set()
    held: list[int] = []
    for r in records:
        if r.op_type not in SPLAT_OPS or len(r.outputs) != 1:
            continue
        out = r.outputs[0]
        if r.op_type == "Fill":
            if len(r.inputs) != 2 or not all(derived.get(producer(t), False) for t in r.inputs):
                continue
            value = by_name.get(producer(r.inputs[1]))
            value_key = value.value_digest if value is not None and value.value_digest else r.name
            key: tuple = ("Fill", out.shape, out.dtype, value_key)
        else:
            key = (r.op_type, out.shape, out.dtype)
        g.nodes[r.name]["bytes"] = g.nodes[r.name]["largest_tensor"] = 0
        g.nodes[r.name]["folded"] = True
        if key not in seen:
            seen.add(key)
            held.append(out.bytes)

    def folds(r) -> bool:
        return (derived.get(r.name, False) and r.op_type not in ("Const", "HostConst")
                and r.op_type not in SHAPE_ONLY_OPS and all(t.bytes <= MAX_FOLDED_BYTES for t in r.outputs))

    folding = {r.name for r in records if folds(r)}
    for r in records:
        if r.name not in folding or r.name not in g or g.nodes[r.name].get("folded") or g.nodes[r.name]["bytes"] <= 0:
            continue
        d = g.nodes[r.name]
        if not all(c in folding for c in readers.get(r.name, ("",))):
            held.append(int(d["bytes"]))  # a constant from here on (a step output too)
        d["bytes"] = d["largest_tensor"] = 0
        d["folded"] = True
    return held


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """The planning graph and the fixed memory of a traced step."""

    graph: nx.DiGraph
    fixed_bytes: int
    variable_bytes: int
    argument_bytes: int
    constant_bytes: int
    variable_sizes: tuple[int, ...] = ()  # bytes of each variable the step reads or writes
    # bytes of each constant Grappler folds (held from the first call on) and of each
    # argument: buffers made before the step, in the allocator's pool where pooled
    folded_sizes: tuple[int, ...] = ()
    argument_sizes: tuple[int, ...] = ()
    # op name -> kernel scratch bytes (measured, ``tfremat.scratch``): live while the op runs
    scratch: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def counted(self, smallest: int) -> "StepGraph":
        """The step as an allocator that leaves requests under ``smallest`` bytes out
        of its statistics sees it, where that is safe (0: ``self``).

        TensorFlow's default x86 CPU allocator (oneDNN's) serves requests under
        256 KiB apart, and its statistics, which ``get_memory_info`` reports and
        budgets are measured by, leave them out. Here a ``TensorList`` whose elements
        are that small weighs nothing: each element is an allocation of its own (node
        ``output_sizes``): an LSTM's accumulators, one 8 KiB element per step, and the
        per-row copies ``TensorListFromTensor`` makes of its input. They made the
        LSTM+GRU test model's plan predict 21.4 MiB for 16.5 measured.

        Small variables (weights, optimizer slots) are left out beyond one largest
        tensor's bytes of them (sessions 26-27): DenseNet121 at 32x32 has 572 of its
        606 weights under 256 KiB, 38 MiB with Adam's slots that the plan counted and
        no measurement saw, so 60 % of its baseline had no plan (its smallest budget
        + 10 % was 116.8 MiB); now 76.8 MiB (60 %), 67.8-68.8 predicted, 68.2-72.5
        measured, bitwise. All of them left out, the Transformer test model (1.2 MiB
        of them) measured its first call at 60 % of the baseline at 22.5-24.5 MiB for
        a 23.1 MiB budget, 21.5-23.0 counted (the profiler: six 2 MiB GELU tensors
        live at once where the plan has four, an order the rewrite leaves free for
        Grappler, docs/keras.md): the part kept is that room.

        Everything else still counts at its size, measured: small activations left
        out, the MobileNetV2 test model's smallest budget + 10 % (57.4 MiB) had 52.0
        MiB of chunks predicted and measured 56.2-63.7 (6 MiB requests in 8-10 MiB
        chunks the pool model did not foresee). Counted, they leave room for what the model misses. GPUs'
        allocators and ``TF_CPU_ALLOCATOR_USE_BFC=true`` count every request
        (``smallest`` 0).
        """
        if smallest <= 0:
            return self
        # The step's small variables (and their optimizer slots) are allocations of
        # their own too, before the step: DenseNet121 at 32x32 has 572 of its 606
        # weights under 256 KiB, 12.6 of 26.9 MiB, and with Adam's two slots 38 MiB
        # that the plan counted and the statistics never see.
        small = sum(b for b in self.variable_sizes if b < smallest)
        g = self.graph.copy()
        for v, d in g.nodes(data=True):
            sizes = d.get("output_sizes")
            if not sizes or d["bytes"] <= 0 or all(piece == b for b, piece in sizes):
                continue
            kept = [b for b, piece in sizes if piece >= smallest or piece == b]
            d["bytes"] = int(sum(kept))
            d["largest_tensor"] = int(max(kept, default=0))
            readers = d.get("output_readers")
            if readers:
                d["output_readers"] = tuple(
                    (int(b) if piece >= smallest or piece == b else 0, cs)
                    for (b, cs), (_, piece) in zip(readers, sizes))
        # Up to one largest tensor of them stays counted, as room for what the plan's
        # model misses (the Transformer test model's first call, see above). The
        # smallest go first; the ones kept stay resident buffers of the allocator
        # model too (api._allocator_estimate), so where none is left out nothing
        # changes (dropping them all from the resident buffers moved their bytes
        # into its unpooled rest and raised the grouped-convolution test model's
        # smallest budget by 2.4 MiB, over 80 % of its baseline).
        largest = max((d.get("largest_tensor", d["bytes"]) for _, d in g.nodes(data=True)), default=0)
        room = max(0, small - int(largest))
        sizes = list(self.variable_sizes)
        left_out = 0
        for i in sorted(range(len(sizes)), key=sizes.__getitem__):
            if sizes[i] >= smallest or left_out + sizes[i] > room:
                break
            left_out += sizes[i]
            sizes[i] = None
        return dataclasses.replace(
            self, graph=g, fixed_bytes=self.fixed_bytes - left_out, variable_bytes=self.variable_bytes - left_out,
            variable_sizes=tuple(b for b in sizes if b is not None))

    @functools.cached_property
    def planning_graph(self) -> nx.DiGraph:
        """``graph`` with each op's kernel scratch as an input node (:func:`with_scratch`)
        and the outputs of calls as nodes of their own (:func:`with_call_outputs`)."""
        return with_scratch(with_call_outputs(self.graph), self.scratch)


def scratch_node(op: str) -> str:
    return f"{op}/_tfremat_scratch"


def with_scratch(graph: nx.DiGraph, scratch: Mapping[str, int]) -> nx.DiGraph:
    """A copy of ``graph`` where each op with scratch space has it as an extra input.

    The scratch of op ``v`` becomes a node :func:`scratch_node` (``v``) of that many
    bytes, no cost and no inputs, read by ``v`` only and placed just before it in the
    order: in the simulator's accounting its bytes are live exactly while ``v`` runs,
    which is when the kernel holds them. Every solver plans with it as with any other
    node (a recomputed ``v`` recomputes it, for free); a schedule is turned back into
    one of ``graph`` by dropping these nodes (they are not TensorFlow ops). Returns
    ``graph`` itself when there is no scratch.
    """
    scratch = {v: int(b) for v, b in scratch.items() if b > 0 and v in graph}
    if not scratch:
        return graph
    g = graph.copy()
    order = []
    for v in graph.graph.get("order") or list(nx.topological_sort(graph)):
        if v in scratch:
            a = graph.nodes[v]
            s = scratch_node(v)
            g.add_node(
                s, op_type="_Scratch", bytes=scratch[v], largest_tensor=scratch[v], cost=0.0,
                recomputable=a.get("recomputable", True), stateful=False,
                phase=a.get("phase", "forward"), alias=False, inplace=False, scratch_of=v,
            )
            g.add_edge(s, v, kind="scratch")
            order.append(s)
        order.append(v)
    g.graph["order"] = order
    return g


def output_node(op: str, k: int) -> str:
    return f"{op}/_tfremat_output{k}"


def _inplace_blockers(g: nx.DiGraph, extra_edges=()) -> None:
    """Mark, for each ``inplace`` op, the readers that can keep it from taking over an
    input's buffer when the executor runs the step in its own order (node attribute
    ``inplace_blockers``: input -> readers, in place).

    TensorFlow's ``forward_input_or_allocate_output`` reuses an input's buffer only
    when nothing else holds it when the kernel starts: each reader that has not run
    yet holds a reference. A reader that is not an ancestor of the op (through data,
    control or shape edges: ``g``'s edges, control ones included, and
    ``extra_edges``) may run beside it or after it, whatever the plan's order says:
    both are ready once the input exists, and the executor runs every ready op.
    :func:`tfremat.simulate.simulate` with ``free=True`` (the step run without the
    rewrite's ordering edges) counts the takeover only where none of these readers
    reads the same computation of the input. Measured on an additive-attention model
    (``benchmarks/keras_sweep.py seq_attention``, nothing recomputed, the step run
    as traced): the gradient's two products of one 32 MiB ``Tile``, each
    ``inplace``, ran side by side and neither took it over: 131 MiB measured where
    the plan, counting the second product in the ``Tile``'s buffer, predicted 99.9.
    """
    h = nx.DiGraph(g.edges)
    h.add_nodes_from(g.nodes)
    h.add_edges_from(extra_edges)
    bit = {}
    anc: dict = {}
    for i, v in enumerate(nx.topological_sort(h)):
        bit[v] = 1 << i
        a = 0
        for p in h.predecessors(v):
            a |= anc[p] | bit[p]
        anc[v] = a
    for v, attrs in g.nodes(data=True):
        if not attrs.get("inplace"):
            continue
        blockers = {}
        for u in g.predecessors(v):
            if g.edges[u, v]["kind"] == "control":
                continue
            others = tuple(w for w in g.successors(u)
                           if w != v and g.edges[u, w]["kind"] != "control" and not anc[v] & bit[w])
            if others:
                blockers[u] = others
        attrs["inplace_blockers"] = blockers


# Ops whose chains Grappler's arithmetic optimizer regroups (MinimizeBroadcasts).
_REGROUPED_OPS = frozenset({"Mul", "Add", "AddV2"})


def _regrouped_pairs(records: Sequence[OpRecord], by_name: dict) -> dict:
    """Products (and sums) Grappler computes from other operands than the trace's.

    Grappler's arithmetic optimizer rebuilds a chain ``(x * y) * c`` of one op
    (``Mul``, ``Add``, ``AddV2``; a ``RealDiv`` by a constant is a ``Mul`` by its
    reciprocal by then) whose inner op has no other reader and no control edge,
    when its leaves have more than one shape: leaves sorted by element count,
    then by tensor name, the first two paired in the inner op. So a gradient's
    ``(grad * fwd) * 0.5`` becomes ``grad * (0.5 * fwd)``, and the inner op, which now
    reads forward values only, runs in the forward pass and holds its output until
    the backward pass reads it. Measured (TF 2.21, CPU): the scalar pairs with the
    operand whose name sorts first, whichever input it was, and an ``Identity`` with
    a control input in front of that operand keeps the pairing and moves the control
    input onto the inner op. Found on a SwiGLU model with pre-norm attention
    (``benchmarks/keras_sweep.py swiglu_prenorm``): each attention's softmax
    gradient ``(g * softmax) * scale`` became ``g * (softmax * scale)``, 1 MiB per
    block held from the forward pass on; a plan predicted at 7.1 MiB measured 9.0-9.5.
    GELU's and hard-swish's gradients have the same shape of chain.

    Returns ``inner op -> (the two leaves it reads after the rewrite, the input it no
    longer reads, the chain's root, each leaf's element count, the leaves computed
    from constants only)`` for the chains of two ops where the pairing changes.
    Longer chains are left out (their regrouping is not modelled).
    """
    data_readers: dict = {}
    controlled: set = set()
    for r in records:
        for t in r.inputs:
            data_readers.setdefault(producer(t), []).append(r.name)
        if r.control_inputs:
            controlled.add(r.name)
            controlled.update(r.control_inputs)

    def elements(t: str) -> int | None:
        src = by_name.get(producer(t))
        idx = output_index(t)
        if src is None or idx >= len(src.outputs) or src.outputs[idx].shape is None:
            return None
        return math.prod(src.outputs[idx].shape)

    constant = _constant_derived(records)

    def kind(r) -> str:
        # Constant folding turns a division by a constant into a product by its
        # reciprocal before the arithmetic optimizer runs.
        if r.op_type == "RealDiv" and len(r.inputs) == 2 and constant.get(producer(r.inputs[1])):
            return "Mul"
        return r.op_type

    def absorbable(name: str, op_type: str) -> bool:
        r = by_name.get(name)
        return (r is not None and kind(r) == op_type and len(r.inputs) == 2
                and name not in controlled and len(data_readers.get(name, ())) == 1)

    pairs = {}
    for r in records:
        op = kind(r)
        if op not in _REGROUPED_OPS or len(r.inputs) != 2:
            continue
        readers = data_readers.get(r.name, ())
        if len(readers) == 1 and r.name not in controlled and kind(by_name[readers[0]]) == op:
            continue  # r is inside a longer chain
        inner = [k for k in (0, 1) if absorbable(producer(r.inputs[k]), op)]
        if r.op_type == "RealDiv" and inner != [0]:
            continue
        if len(inner) != 1:
            continue
        child = by_name[producer(r.inputs[inner[0]])]
        if any(absorbable(producer(t), op) for t in child.inputs):
            continue
        # as the GraphDef spells them (Grappler sorts these strings): no ":0"
        leaves = [t[:-2] if t.endswith(":0") else t for t in (r.inputs[1 - inner[0]], *child.inputs)]
        sizes = [elements(t) for t in leaves]
        if None in sizes or len(set(sizes)) == 1 or len(set(leaves)) < 3:
            continue
        first, second, _ = sorted(range(3), key=lambda i: (sizes[i], leaves[i]))
        pair = (leaves[first], leaves[second])
        if set(pair) == set(leaves[1:]):
            continue
        (dropped,) = [t for t in leaves[1:] if t not in pair]
        fixed = frozenset(t for t in leaves if constant.get(producer(t)))
        pairs[child.name] = (pair, dropped, r.name, dict(zip(leaves, sizes)), fixed)
    return pairs


def regrouped(graph: nx.DiGraph) -> nx.DiGraph:
    """``graph`` with the dependencies Grappler's regrouping gives the step as traced.

    For each inner op of ``graph.graph["regrouped"]`` (:func:`_regrouped_pairs`): it
    reads the two leaves it is paired with, not the operand it lost, which the chain's
    root reads instead. The step the rewrite emits with ordering edges keeps the
    traced dependencies (``tfremat.rewrite`` gates the paired operand on the lost
    one); a step run as traced does not, and its free-running order
    (:func:`tfremat.simulate.free_running_order`) is taken on this graph.
    """
    pairs = graph.graph.get("regrouped") or {}
    if not pairs:
        return graph
    h = graph.copy()
    for child, (pair, dropped, root, _, _) in pairs.items():
        lost = producer(dropped)
        if child not in h or root not in h or lost not in h:
            continue
        keep = {producer(t) for t in pair}
        if lost not in keep and h.has_edge(lost, child) and h.edges[lost, child].get("kind") == "data":
            h.remove_edge(lost, child)
        if not h.has_edge(lost, root):
            h.add_edge(lost, root, kind="data")
        for u in keep:
            if u in h and not h.has_edge(u, child):
                h.add_edge(u, child, kind="data")
    return h


def with_call_outputs(graph: nx.DiGraph) -> nx.DiGraph:
    """A copy of ``graph`` where each op with ``output_readers`` (a function call whose
    outputs have different readers) has its outputs as nodes of their own.

    Node-level accounting holds every output of an op until the op's last reader: an
    XLA-compiled grouped convolution (Keras on CPU) outputs the convolution, read by
    the next ``BiasAdd``, beside the tensors its gradient call reads, so the
    convolution's bytes were held to the backward pass (a ResNeXt-style test model:
    three 8 MiB outputs, its smallest budget 0.64x its baseline). Here output ``k``
    becomes :func:`output_node` (``op``, ``k``): its bytes, no cost, computed once
    (not recomputable: a copy of a reader reads the first computation, which
    TensorFlow then keeps), right after the op, read by that output's readers. The op
    itself holds no bytes; an input node of the outputs' total bytes, read by the op
    only and placed just before it (as kernel scratch is, :func:`with_scratch`), keeps
    them counted while the op runs. Only ops that are never recomputed get this (a
    copy of the op would need copies of its outputs). A schedule is turned back into
    one of ``graph`` by dropping the nodes that are not in it. Returns ``graph``
    itself when no op has ``output_readers``.
    """
    calls = {v: a["output_readers"] for v, a in graph.nodes(data=True)
             if a.get("output_readers") and not a.get("recomputable", True)}
    if not calls:
        return graph
    g = graph.copy()
    order = []
    for v in graph.graph.get("order") or list(nx.topological_sort(graph)):
        if v not in calls:
            order.append(v)
            continue
        a = graph.nodes[v]
        common = dict(cost=0.0, recomputable=False, stateful=False, phase=a.get("phase", "forward"),
                      alias=False, inplace=False, output_of=v)
        readers = calls[v]
        total = sum(int(b) for b, _ in readers)
        held = f"{v}/_tfremat_outputs"
        g.add_node(held, op_type="_Outputs", bytes=total, largest_tensor=total, **common)
        g.add_edge(held, v, kind="scratch")
        g.nodes[v]["bytes"] = 0
        order += [held, v]
        for k, (b, cs) in enumerate(readers):
            o = output_node(v, k)
            g.add_node(o, op_type="_Output", bytes=int(b), largest_tensor=int(b), **common)
            g.add_edge(v, o, kind="data")
            for c in cs:
                if g.has_edge(v, c):
                    g.remove_edge(v, c)
                g.add_edge(o, c, kind="data")
                blockers = g.nodes[c].get("inplace_blockers")
                if blockers and v in blockers:  # readers that may hold this output too
                    g.nodes[c]["inplace_blockers"] = {**blockers, o: blockers[v]}
            order.append(o)
    g.graph["order"] = order
    return g


# Inputs in any order compute the same (Grappler's dedup sorts them).
_COMMUTATIVE = frozenset({"Add", "AddV2", "AddN", "Mul", "Maximum", "Minimum"})
_NEVER_MERGED = frozenset({"Placeholder", "_Arg", "Const", "HostConst"})


def _cse_twins(records: Sequence[OpRecord], g: nx.DiGraph) -> dict:
    """Later twin -> first twin, for the ops Grappler's common-subexpression
    elimination merges: same type, attributes and (canonical) data and control
    inputs, neither stateful nor calling a function.

    A gradient often repeats a forward computation from the forward's own inputs (a
    custom gradient's ``sigmoid(x)``, ``x * sigmoid(x)``); the executor runs the
    merged op as soon as its inputs are ready, in the forward pass, and its output
    stays live until the gradient reads it. Measured on an 8-layer MLP with a custom
    swish gradient: eight such tensors (8 MiB) live through the forward pass that a
    graph without twins placed in the backward (predicted 23 MiB, measured 29-30).
    """
    rep: dict = {}
    first: dict = {}
    twins: dict = {}
    for r in records:
        d = g.nodes[r.name]
        if not r.attr_digest or r.op_type in _NEVER_MERGED or not d["recomputable"] or d["stateful"]:
            continue
        data = [(rep.get(producer(t), producer(t)), output_index(t)) for t in r.inputs]
        if r.op_type in _COMMUTATIVE:
            data = sorted(data)
        ctrl = tuple(sorted(rep.get(c, c) for c in r.control_inputs))
        key = (r.op_type, tuple(data), ctrl, r.attr_digest)
        u = first.setdefault(key, r.name)
        if u != r.name:
            rep[r.name] = u
            twins[r.name] = u
    return twins


_FOLDED_ARITHMETIC = frozenset({"Identity", "Cast", "Neg", "Sub", "Add", "AddV2", "Mul", "RealDiv", "Div"})


def _scalar(t: str, by_name: Mapping[str, OpRecord], depth: int = 0) -> float | None:
    """The value of tensor ``t`` where it is a number computed from constants only
    (a ``Const``, or a sum, difference, product, quotient, negation or cast of such):
    what Grappler's constant folding makes of it. None otherwise."""
    r = by_name.get(producer(t))
    if r is None or depth > 4:
        return None
    if r.scalar is not None:
        return r.scalar
    if r.op_type not in _FOLDED_ARITHMETIC:
        return None
    args = [_scalar(i, by_name, depth + 1) for i in r.inputs]
    if not args or any(a is None for a in args):
        return None
    if r.op_type in ("Identity", "Cast") and len(args) == 1:
        return args[0]
    if r.op_type == "Neg" and len(args) == 1:
        return -args[0]
    if len(args) == 2:
        a, b = args
        if r.op_type == "Sub":
            return a - b
        if r.op_type in ("Add", "AddV2"):
            return a + b
        if r.op_type == "Mul":
            return a * b
        if r.op_type in ("RealDiv", "Div") and b:
            return a / b
    return None


def _convert_pow_pairs(records: Sequence[OpRecord], by_name: Mapping[str, OpRecord], twin_of: Mapping) -> dict:
    """``Pow(x, 2)`` -> the ``Pow(x, 3)`` of the same ``x`` that Grappler computes it
    with (see build_graph), for constant exponents."""
    cubes: dict = {}
    squares: dict = {}
    for r in records:
        if r.op_type != "Pow" or len(r.inputs) != 2 or r.name in twin_of:
            continue
        e = _scalar(r.inputs[1], by_name)
        if e == 3.0:
            cubes.setdefault(r.inputs[0], r.name)
        elif e == 2.0:
            squares.setdefault(r.inputs[0], r.name)
    return {q: cubes[x] for x, q in squares.items() if x in cubes}


def _pow_pair_mis_sorts(square: str, cube: str, by_name: Mapping[str, OpRecord]) -> bool:
    """Whether recomputing the square/cube pair of ``c * x**3`` would change its bits.

    Grappler computes the cube as ``x * s`` (ConvertPow), ``s`` the square its
    common-subexpression pass keeps, and then pushes ``c`` down to the factor whose
    node name sorts first: ``(c * x) * s`` or ``(c * s) * x``, two roundings. In the
    plain step ``s`` is the gradient's own square (it has a reader in the backward
    pass); where the plan recomputes that square, the forward's cube keeps
    ConvertPow's new square instead, named after the cube
    (``<scope>/ArithmeticOptimizer/ConvertPow__inner_<name>``). Measured on random
    hand-written steps (``benchmarks/steps_fuzz.py`` 10: ``tf.nn.gelu(approximate=True)``
    of a ``conv1d`` and of an ``einsum``, 29 of 37 values apart); where ``x``'s name
    sorts between the two squares' names, the pair and the cube's product with ``c``
    are kept, not copied."""
    src = producer(by_name[square].inputs[0])
    scope, _, base = cube.rpartition("/")
    inner = f"{scope}/ArithmeticOptimizer/ConvertPow__inner_{base}" if scope else f"ArithmeticOptimizer/ConvertPow__inner_{base}"
    return (src < square) != (src < inner)


def build_graph(
    records: Sequence[OpRecord],
    argument_ops: Iterable[str] = (),
    handle_bytes: Mapping[str, int] | None = None,
    gradients: Iterable[str] = (),
) -> StepGraph:
    """Build the planning graph of a step from its ops in program (creation) order.

    Parameters
    ----------
    records : sequence of OpRecord
        Every op of the step's graph, in creation order (a topological order).
    argument_ops : iterable of str
        Placeholders that are function arguments (their bytes are fixed: the caller
        holds them for the whole step).
    handle_bytes : mapping of str to int, optional
        Bytes of the variable behind each captured resource placeholder. Without it a
        variable is sized by the reads and assigns of the step's own graph, which miss
        one used only inside a called function (the optimizer slots a
        ``LossScaleOptimizer`` updates inside its ``tf.cond``).
    gradients : iterable of str
        Ops whose outputs an optimizer applies (``TracedStep.gradients``): their
        updates run as soon as each is computed (:func:`_updates_of`), every
        update (Adam's too) where that order has the lower floor.
    """
    argument_ops = set(argument_ops)
    by_name = {r.name: r for r in records}
    g = nx.DiGraph()
    order = [r.name for r in records]
    variable_sizes: dict[str, int] = {}
    argument_bytes = constant_bytes = 0
    argument_sizes: list[int] = []

    for r in records:
        out_bytes = sum(t.bytes for t in r.outputs)
        alias = r.op_type in ALIASING_OPS
        if r.op_type in ("Const", "HostConst"):
            constant_bytes += out_bytes  # allocated once, before the step runs
            out_bytes = 0
        elif r.op_type == "Placeholder":
            if r.name in argument_ops:
                argument_bytes += out_bytes
                argument_sizes.append(out_bytes)
            out_bytes = 0
        elif alias:
            out_bytes = 0
        in_shapes = []
        for t in r.inputs:
            src = by_name.get(producer(t))
            idx = output_index(t)
            in_shapes.append(src.outputs[idx].shape if src and idx < len(src.outputs) else None)
        recomputable = not (
            r.stateful
            or r.calls_function
            or r.op_type in NEVER_RECOMPUTE
            or any(t.dtype in ("resource", "variant") for t in r.outputs)
            or any(t.estimated for t in r.outputs)  # a guessed size is not worth a copy
        )
        cost = op_cost(r.op_type, in_shapes, [t.shape for t in r.outputs], r.equation)
        cost = max(cost, r.loop_cost)
        if r.pure_loop:
            recomputable = True  # its variables' writers: _loop_writers
        elif r.op_type in RECOMPUTABLE_LIST_OPS:
            recomputable = True
        g.add_node(
            r.name,
            op_type=r.op_type,
            bytes=int(out_bytes),
            # the largest single output: a while loop's bytes are many accumulators
            largest_tensor=int(max((t.bytes for t in r.outputs), default=0)) if out_bytes else 0,
            # each output's bytes and the size of each allocation it is made of
            output_sizes=tuple((int(t.bytes), int(t.piece_bytes)) for t in r.outputs),
            # each output's static shape (the rewrite: which reshapes Grappler drops)
            output_shapes=tuple(tuple(t.shape) if t.shape is not None and not t.estimated else None
                                for t in r.outputs),
            cost=cost,
            recomputable=recomputable,
            stateful=bool(r.stateful or r.calls_function),
            phase="forward",
            alias=alias,
            inplace=r.op_type in INPLACE_OPS,
        )
        # Variable sizes: what reads return and what assigns write, per handle.
        if r.op_type == "ReadVariableOp" and r.outputs and r.inputs:
            h = producer(r.inputs[0])
            variable_sizes[h] = max(variable_sizes.get(h, 0), r.outputs[0].bytes)

    # Precedences of the TensorFlow graph that hold no bytes: a Shape op reads its
    # input's shape only, but it still runs after it (an order that put it first
    # would close a cycle with the rewrite's ordering edges).
    order_edges = []
    for r in records:
        for t in r.inputs:
            if r.op_type in SHAPE_ONLY_OPS:
                # Shapes are static (trace.py refuses unknown ones), so Grappler folds
                # these into constants: they neither need nor keep their input.
                if producer(t) in by_name:
                    order_edges.append((producer(t), r.name))
                continue
            g.add_edge(producer(t), r.name, kind="data")
        for c in r.control_inputs:
            if not g.has_edge(c, r.name):
                g.add_edge(c, r.name, kind="control")  # for the phases; removed below
        if is_variable_write(r.op_type) and len(r.inputs) > 1 and r.op_type.startswith("Assign"):
            h = producer(r.inputs[0])
            src = by_name.get(producer(r.inputs[1]))
            if src is not None:
                idx = output_index(r.inputs[1])
                if idx < len(src.outputs):
                    variable_sizes[h] = max(variable_sizes.get(h, 0), src.outputs[idx].bytes)

    for h, b in (handle_bytes or {}).items():
        if h in by_name:  # a handle the runtime keeps (dead ops are not in records)
            variable_sizes[h] = max(variable_sizes.get(h, 0), int(b))

    folded_sizes = _fold_constants(records, by_name, g)
    constant_bytes += sum(folded_sizes)

    # Grappler's common-subexpression elimination computes an op once for all its
    # twins: each later twin is an alias of the first (no bytes, no cost, its readers
    # hold the first one's buffer), and the rewrite binds its readers to the first.
    twin_of = _cse_twins(records, g)
    for v, u in twin_of.items():
        for p in [p for p in g.predecessors(v) if g.edges[p, v]["kind"] == "data"]:
            g.remove_edge(p, v)
        g.add_edge(u, v, kind="data")
        g.nodes[v].update(bytes=0, largest_tensor=0, cost=0.0, alias=True, twin_of=u)

    # An aliasing op's consumers keep its source buffer alive: add liveness edges
    # from the buffer's owner (the first non-aliasing producer) to those consumers.
    # Output k of an ``IdentityN`` is its input k (a custom gradient's passes the
    # forward values on), so the owner is followed per output read.
    def owner(name: str, index: int = 0) -> str:
        seen = set()
        while g.nodes[name]["alias"] and (name, index) not in seen:
            seen.add((name, index))
            if name in twin_of:
                name = twin_of[name]
                continue
            rec = by_name[name]
            if rec.op_type != "IdentityN":
                index = 0
            if index >= len(rec.inputs):
                break
            name, index = producer(rec.inputs[index]), output_index(rec.inputs[index])
        return name

    for c in records:
        for t in dict.fromkeys(c.inputs):
            src = producer(t)
            if src not in g or src == c.name or not g.nodes[src]["alias"] or not g.has_edge(src, c.name):
                continue
            if g.edges[src, c.name]["kind"] == "control":
                continue
            root = owner(src, output_index(t))
            if root not in (src, c.name) and not g.has_edge(root, c.name):
                g.add_edge(root, c.name, kind="liveness")

    # Grappler computes x**3 as x * x**2 (the arithmetic optimizer's ConvertPow) and
    # its common-subexpression pass merges that x**2 with a Pow(x, 2) of the same x:
    # the tanh GELU's gradient of x**3. The merged power runs in the forward pass and
    # lives until the gradient reads it; the trace's order had it in the backward
    # pass (a random residual MLP, keras_fuzz mlp 16: three 1 MiB powers the plan
    # did not count, 15.5 MiB measured for 11.0 expected). Planned as the cube's
    # input, right before it.
    # (each square with what it waits for: x, and the constants its exponent is
    # computed from, traced in the gradient; none where a control input already
    # orders the square after the cube, as an edge would close a cycle)
    squared_by = {}
    for q, p3 in _convert_pow_pairs(records, by_name, twin_of).items():
        before = nx.ancestors(g, q) | {q}
        if p3 not in before:
            g.add_edge(q, p3, kind="liveness")
            squared_by[p3] = before
        if _pow_pair_mis_sorts(q, p3, by_name):
            for v in (q, p3, *(c for c in g.successors(p3) if by_name[c].op_type == "Mul")):
                g.nodes[v]["recomputable"] = False

    # Program order, except where control edges added after creation (automatic
    # control dependencies) demand otherwise.
    # Variable writes run as soon as they are ready (the executor runs ready ops, and
    # that frees each gradient early), so they sort first among ready ops.
    position = {name: i for i, name in enumerate(order)}
    for p3, before in squared_by.items():
        for a in before:
            if position[a] > position[p3]:
                position[a] = position[p3] - 0.5
    writes = {r.name for r in records if is_variable_write(r.op_type)}
    with_order_edges = nx.DiGraph(g.edges)
    with_order_edges.add_nodes_from(g.nodes)
    with_order_edges.add_edges_from(order_edges)

    def updates_first(first: set) -> list:
        return list(nx.lexicographical_topological_sort(
            with_order_edges, key=lambda v: (0 if v in first else 1, position[v])))

    order = updates_first(writes | _updates_of(g, gradients, writes))
    every_update = updates_first(writes | _updates_of(g, gradients, writes, bounded=False))

    # Phases.
    for r in records:
        if r.op_type in ("Placeholder", "Const", "HostConst", "VarHandleOp"):
            g.nodes[r.name]["phase"] = "input"
    update = set()
    for r in records:
        if is_variable_write(r.op_type):
            update.add(r.name)
            update |= nx.descendants(g, r.name)
    for v in update:
        g.nodes[v]["phase"] = "update"
    loss = find_loss(g, by_name, update)
    if loss is not None:
        forward = nx.ancestors(g, loss) | {loss}
        for v in g.nodes:
            if g.nodes[v]["phase"] == "forward" and v not in forward:
                g.nodes[v]["phase"] = "backward"
    else:
        cut = simulate(g, order).peak_position
        for i, v in enumerate(order):
            if g.nodes[v]["phase"] == "forward" and i > cut:
                g.nodes[v]["phase"] = "backward"
    g.graph["loss"] = loss
    for v in g.nodes:
        if g.nodes[v]["phase"] != "forward":
            g.nodes[v]["recomputable"] = False
    # Ops a rewrite fuses with a sibling share a ``sibling_group`` (the tensor they
    # both read): an order that parts them invites a cycle once they are one node.
    readers: dict = {}
    for r in records:
        if r.op_type in FUSED_WITH_SIBLING:
            for t in dict.fromkeys(r.inputs):
                readers.setdefault(t, []).append(r.name)
    for t, names in readers.items():
        if len(names) > 1:
            for name in names:
                g.nodes[name]["sibling_group"] = t
    # Ops the rewrite gives no ordering control input (it would change Grappler's float
    # rewrites or a oneDNN fusion, see rewrite.py): they run when their inputs are
    # ready, and an order of first computations must put them there.
    for r in records:
        if r.op_type in ASAP_OPS:
            g.nodes[r.name]["asap"] = True
    # A control input orders, it holds no tensor: the runtime frees a value after its
    # last *data* consumer, so an op waiting on it through a control edge neither
    # keeps it alive nor stops the next op from taking over its buffer. As an edge of
    # the planning graph it did both: TensorFlow's SquaredDifference gradient,
    # ``2 * g * (x - y)`` with the subtraction under a control dependency on ``g``,
    # kept each BatchNorm's activation-sized ``g`` live one op too long (a small
    # BatchNorm CNN at batch 32: predicted 44.7 MiB at its smallest budget + 10 %,
    # measured 38.4). Control edges become precedences without bytes.
    _loop_writers(g, records, by_name)
    # A gradient loop reads its forward loop's accumulators and does about twice its
    # work (two products for each product of the forward cell); its own inputs say
    # little (its weights arrive as accumulated reads). A loop fed a loop's final
    # state directly (an encoder-decoder) is over-estimated the same way.
    for r in records:
        if r.op_type in ("While", "StatelessWhile"):
            forward = [g.nodes[p]["cost"] for p in g.predecessors(r.name)
                       if p in by_name and by_name[p].op_type in ("While", "StatelessWhile")]
            if forward:
                g.nodes[r.name]["cost"] = max(g.nodes[r.name]["cost"], 2.0 * max(forward))
    _inplace_blockers(g, order_edges)
    g.graph["regrouped"] = _regrouped_pairs(records, by_name)
    control = [(u, v) for u, v, k in g.edges(data="kind") if k == "control"]
    g.remove_edges_from(control)
    _call_output_readers(g, records)
    # Every update first, Adam's and momentum's too, where that lowers the floor of
    # the plans the rewrite can emit (``fixed_order_lower_bound``, over the ops that
    # run once): in program order they wait for the whole backward pass and hold
    # every weight gradient until then (VGG16 at batch 48: about 150 MiB of its
    # 811 MiB floor; 659 MiB with every update first). Only a lower floor wins:
    # Adam's temporaries interleaved with the backward pass can cost more than the
    # gradients they free (the Keras test CNN, see ``_updates_of``).
    # The floor is not the whole story: an LSTM test model's every-update order has
    # the lower floor (12.25 MiB of tensors, 13.25 MiB in the other) but the higher
    # smallest budget (31.2 MiB, 26.7 MiB in the other). So the other order stays
    # in the graph (``other_orders``), for ``tfremat.remat`` to plan on where the
    # first has no plan under the budget.
    other_orders = []
    if every_update != order:
        from .solvers.bounds import fixed_order_lower_bound

        if fixed_order_lower_bound(g, order=every_update) < fixed_order_lower_bound(g, order=order):
            order, every_update = every_update, order
        other_orders.append(every_update)
    g.graph["order"] = order
    g.graph["other_orders"] = other_orders
    g.graph["order_edges"] = [(u, v) for u, v in order_edges + control if not g.has_edge(u, v)]
    variable_bytes = sum(variable_sizes.values())
    return StepGraph(
        graph=g,
        fixed_bytes=int(variable_bytes + argument_bytes + constant_bytes),
        variable_bytes=int(variable_bytes),
        argument_bytes=int(argument_bytes),
        constant_bytes=int(constant_bytes),
        variable_sizes=tuple(int(b) for b in variable_sizes.values()),
        folded_sizes=tuple(int(b) for b in folded_sizes),
        argument_sizes=tuple(int(b) for b in argument_sizes),
    )
