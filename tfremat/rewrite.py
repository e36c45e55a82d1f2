"""GraphDef + schedule -> rewritten GraphDef (copies, rewired inputs, ordering edges).

Works on the GraphDef protobuf only (no TensorFlow import). For each position of the
schedule, the first occurrence of an op is the original node and any later one is a
copy named ``<op>/_remat<k>``; every data input binds to the most recent computation
of its producer, exactly as the simulator binds it.

Ordering (measured, see docs/design.md): a copy that may run as soon as its inputs
exist runs during the forward pass and saves nothing, and Grappler merges copies that
equal their original back into it. So every data input a copy takes from an original
tensor goes through a *gate*: ``Identity(tensor)`` with control inputs on the
backward ops that must run first. The gate (not the copy) carries the control input
so Grappler's remapper still fuses MatMul+BiasAdd+Relu in the copy, and the distinct
control input keeps common-subgraph elimination from merging the copy back.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Hashable, Mapping, Sequence

import networkx as nx
import numpy as np

from .costs import ALIASING_OPS, FUSED_WITH_SIBLING
from .errors import InvalidScheduleError, RematError
from .simulate import simulate

COPY_SEP = "/_remat"
MAX_BARRIER_EDGES = 64

# FUSED_WITH_SIBLING (costs.py): oneDNN fuses Conv2DBackpropFilter with the
# BiasAddGrad of the same gradient, but not when either has a control input. Found by
# the Keras Hypothesis test: the strict-ordering edge Conv2DBackpropInput ->
# Conv2DBackpropFilter blocked the fusion and the conv bias differed by ~3e-8 after 2
# Adam steps. These ops get no ordering control inputs; like small ops, the next big
# allocation waits for them (a control fanout does not block the fusion).


@dataclasses.dataclass(frozen=True)
class RewriteInfo:
    copies: int
    gates: int
    rewired_inputs: int
    floating: int = 0  # big allocations left free of the serial order (``limit_bytes``)


# A BiasAdd recomputed twice from one copy of its convolution gave the copy two
# consumers, so the remapper did not fuse the pair, and the unfused pair computes
# another bfloat16 result than the fused kernel of the original step: the mixed_bfloat16
# CNN of benchmarks/keras_sweep.py variants at 31.2 MiB (102 ops recomputed) differed
# by 2.1e-3 after 3 steps (bisected to the ordering gates of BiasAdd targets, the
# gate sat on the two-consumer convolution copy). Such a BiasAdd gets its
# contraction recomputed right before it (_with_fused_producers).
_CONTRACTIONS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul"})
_FUSED_AFTER_CONTRACTION = frozenset({"BiasAdd"})
# A contraction's bias add as the remapper fuses it (Keras adds a Dense bias with Add).
_BIAS_ADDS = _FUSED_AFTER_CONTRACTION | {"Add", "AddV2"}
# Activations the remapper fuses after a contraction and its bias add.
_FUSED_ACTIVATIONS = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid", "Gelu"})
# Ops a fused_cone may rebuild: cheap, elementwise, the size of their output.
_ELEMENTWISE = frozenset({
    "Mul", "AddV2", "Add", "Sub", "Neg", "Sigmoid", "Tanh", "Exp", "Erf", "Erfc", "Relu",
    "Relu6", "Square", "RealDiv", "Maximum", "Minimum", "Cast", "Softplus", "Rsqrt", "Sqrt",
})


def _data_edges(graph_def) -> tuple[dict, dict]:
    """Op -> the ops its data inputs come from (in order), and op -> the set of ops
    that read it as data (control inputs left out)."""
    data_in: dict = {}
    consumers: dict = {}
    for n in graph_def.node:
        ins = [_split(i)[0] for i in n.input if not i.startswith("^")]
        data_in[n.name] = ins
        for p in ins:
            consumers.setdefault(p, set()).add(n.name)
    return data_in, consumers


def _with_fused_producers(schedule: Sequence[Hashable], graph_def, graph: nx.DiGraph,
                          edges: tuple[dict, dict] | None = None) -> list:
    """``schedule`` with the fused cone of each recomputed ``v`` rebuilt right before
    it when ``v``'s copy would read an original of the cone, or a copy made from
    older inputs than the ones ``v`` reads: the elementwise producers only ``v``
    consumes whose other inputs ``v`` reads itself (``x * sigmoid(x)``: the Sigmoid).

    A copy of ``v`` reading the original ``u`` gives ``u`` a second consumer, and
    Grappler fuses a pair only when the producer has one (oneDNN's Swish is
    ``Mul(x, Sigmoid(x))``): the original pair then ran unfused, unlike in the
    original step. Found by bisecting EfficientNetB0 (1.1e-3 after 3 Adam steps):
    recomputing ``block7a_activation/mul_1`` alone broke bitwise equality,
    recomputing it with its ``Sigmoid`` did not. A copy of ``u`` made from an older
    ``x`` than ``v``'s copy reads (``Mul(x', Sigmoid(x))``) is no Swish pattern either.
    Keras' Swish is ``x * sigmoid(beta * x)``: the whole single-consumer elementwise
    cone (``beta * x``, ``Sigmoid``) is rebuilt, see ``fused_cone``; the failing plan
    had rebuilt block6a's cone from the original ``x`` and the product from a copy of
    ``x``, and is bitwise equal with this rule (2 ops added). Where the cone reads an
    input of ``v`` and an original op ran since the cone's latest copy, the cone is
    rebuilt too: the two copies would wait behind different ordering gates on that
    input (EfficientNetB0 at 60 %, session 27: 6 of 8 plans differed, up to 6.4e-4
    after 3 Adam steps; 9 of 9 bitwise after). The added copies live only
    between their run and ``v``'s, inside the time the plan kept the originals for
    ``v``'s copy, and read inputs ``v`` reads anyway (or constants, or values
    never recomputed); while a cone of two or more is rebuilt, one more elementwise
    tensor of the cone's size can be live than the plan counted.
    """
    data_in, consumers = edges if edges is not None else _data_edges(graph_def)
    by_name = {n.name: n for n in graph_def.node}

    def recomputable(w) -> bool:
        return w in graph and graph.nodes[w].get("recomputable", False)

    def fused_cone(v):
        """v's producers that only v consumes, transitively, through elementwise ops
        (at most 3 deep), whose other inputs v reads itself, are constants, or are
        never recomputed; in topological order. ``x * sigmoid(x)`` gives [sigmoid];
        Keras' ``x * sigmoid(beta * x)`` gives [beta * x, sigmoid]; a chain through a
        convolution gives nothing."""
        post: list = []

        def member(w) -> bool:
            return recomputable(w) and by_name[w].op in _ELEMENTWISE and len(consumers.get(w, ())) == 1

        def visit(u, depth) -> bool:
            for w in dict.fromkeys(data_in.get(u, ())):
                if member(w) and depth < 3:
                    if not visit(w, depth + 1):
                        return False
                    if w not in post:
                        post.append(w)
                elif not (w in data_in[v] or by_name[w].op in _CONSTS or not recomputable(w)):
                    return False
            return True

        def extended_add(u) -> bool:
            """An Add-family ``u`` rebuilt alone, reading the computations its latest
            one read: those of its inputs not allowed above stay live until ``v``
            instead of ``u``'s latest computation, so they may hold no more bytes
            than it. AddOpsRewrite folds an Add tree (LayerNorm's ``x*s + (b -
            m*s)``) into one ``AddN`` only when each inner Add has one consumer; two
            copies of the root reading one copy of the inner Add left it unfolded,
            and the sum was rounded in another order (the Transformer test model at
            14.6 MiB: 99 variables up to 7.3e-7 apart after 3 Adam steps)."""
            if by_name[u].op not in _ADD_FAMILY:
                return False
            held = 0
            for w in dict.fromkeys(data_in.get(u, ())):
                if w in data_in[v] or by_name[w].op in _CONSTS or not recomputable(w):
                    continue
                nbytes = int(graph.nodes[w].get("bytes", 0)) if w in graph else 0
                if nbytes and by_name[w].op not in _ELEMENTWISE:
                    return False  # a second reader of a convolution would unfuse it
                held += nbytes
            return held <= int(graph.nodes[u].get("bytes", 0))

        out: list = []
        for u in dict.fromkeys(data_in.get(v, ())):
            if member(u) and consumers.get(u) == {v}:
                post.clear()
                if visit(u, 1):
                    out += [w for w in post if w not in out] + [u]
                elif extended_add(u) and u not in out:
                    out.append(u)
        return out

    last: dict = {}  # node -> position of its latest computation in ``out``
    first_run: dict = {}  # node -> position of its original computation

    def shape(w):
        shapes = graph.nodes[w].get("output_shapes") if w in graph else None
        return shapes[0] if shapes else None

    def contraction(v):
        """The convolution or matrix product the remapper fuses ``v`` (a bias add) with,
        when ``v`` is its only consumer. A bias add is a ``BiasAdd`` or an
        ``Add``/``AddV2`` of a vector as long as the product's last dimension (what
        the remapper takes for one: ``x @ w + b`` in a hand-written step; Keras writes
        ``BiasAdd``). A copy of ``tanh(x @ w + b)`` alone read the original ``AddV2``,
        which then ran unfused (steps_fuzz 79: 21 of 28 values apart after 3 steps)."""
        op, ins = by_name[v].op, data_in.get(v)
        if op not in _BIAS_ADDS or not ins or (op != "BiasAdd" and len(ins) != 2):
            return None
        for k, u in enumerate(ins[:1] if op == "BiasAdd" else ins):
            if not (recomputable(u) and by_name[u].op in _CONTRACTIONS and consumers.get(u) == {v}):
                continue
            if op == "BiasAdd":
                return u
            out, bias = shape(u), shape(ins[1 - k])
            if out and bias is not None and len(bias) == 1 and bias[0] == out[-1]:
                return u
        return None

    def fused_group(v) -> list:
        """The ops the remapper fuses ``v`` with, in order: a BiasAdd's contraction;
        an activation's bias add and contraction (``_FusedConv2D`` with ``BiasAdd,
        Elu``), where each is the next one's only input of its kind and has no
        other consumer. A copy of the activation alone reads the original bias add,
        runs the standalone kernel, and computes other bits than the fused one:
        found by a random U-Net of ``benchmarks/keras_fuzz.py`` (unet 3, ELU): a
        plan recomputing one ``Elu`` from its kept ``BiasAdd`` moved 3 variables
        after one step (``executed_diff.py``: ``Elu`` where the original ran
        ``_MklNativeFusedConv2D``)."""
        c = contraction(v)
        if c is not None:
            return [c]
        summed = residual(v)
        if summed:
            return summed
        if by_name[v].op not in _FUSED_ACTIVATIONS or not data_in.get(v):
            return []
        # (a BiasAdd only: an Add is fused as a bias only where its other operand is
        # one, and ``Relu(conv + 1.0)`` is no fusion pattern)
        b = data_in[v][0]
        if not recomputable(b) or consumers.get(b) != {v}:
            return []
        c = contraction(b)
        if c is not None:
            return [c, b]
        summed = residual(b)
        return summed + [b] if summed else []

    def residual(v) -> list:
        """[contraction, BiasAdd] when ``v`` is a sum the remapper fuses into them
        (``_MklNativeFusedMatMul`` with ``BiasAdd, Add``: a residual ``h + Dense(f)``,
        found by a random residual MLP, keras_fuzz mlp 6), the BiasAdd read by ``v``
        alone; else []."""
        if by_name[v].op not in ("Add", "AddV2"):
            return []
        for b in dict.fromkeys(data_in.get(v, ())):
            if recomputable(b) and consumers.get(b) == {v}:
                c = contraction(b)
                if c is not None:
                    return [c, b]
        return []

    out: list = []
    firsts = [0]  # firsts[i]: original computations in out[:i]
    for v in schedule:
        if v in last:
            cone = fused_cone(v)
            group = fused_group(v)
            cone = group + [u for u in cone if u not in group]
            # (``last[u] < last[v]``: u's latest computation is read by an earlier one of
            # v already, and a second reader would break the pair's fusion; an original
            # computation since u's latest one, where the cone reads an input of v:
            # the rewrite orders each copy behind the ops before it, so u's copy and
            # v's would wait behind different gates on the input they share, two
            # tensors for the fusion pattern, as in EfficientNetB0's re-planned
            # squeeze-excite swishes, session 27; a convolution before a BiasAdd
            # shares none, and is not recomputed twice for it)
            shares = any(x in data_in[v] for u in cone for x in data_in.get(u, ()))
            rebuild = any(last[u] == first_run[u] or last[u] < last[v]
                          or (shares and firsts[-1] > firsts[last[u] + 1])
                          or any(last.get(x, -1) > last[u] for x in data_in[u])
                          for u in cone)
        else:
            # The original v after a recomputation of an input its cone read: v
            # would read the new computation, its cone the older one, ``Mul(x',
            # Sigmoid(x))``, no Swish pattern. Found by a random classifier of
            # ``benchmarks/keras_fuzz.py`` (conv 5): a plan freed a BatchNorm output
            # in the forward pass and recomputed it for its Swish's product; the
            # forward pass ran ``Mul`` where Keras' ran ``_MklSwish``, and the first
            # loss already differed.
            cone = [u for u in fused_cone(v) if u in last]
            rebuild = any(last.get(x, -1) > last[u] for u in cone for x in data_in[u])
        if rebuild:
            for u in cone:
                last[u] = len(out)
                out.append(u)
                firsts.append(firsts[-1])
        first = v not in last
        if first:
            first_run[v] = len(out)
        last[v] = len(out)
        out.append(v)
        firsts.append(firsts[-1] + first)
    return out


# One-input aliasing ops with no state: a copy of one anywhere is the same tensor.
# (Not the multi-input IdentityN, not a variable read; Bitcast and CheckNumerics are
# left out too: never seen between a forward value and a backward reader.)
_PLAIN_ALIASES = ALIASING_OPS - {"IdentityN", "ReadVariableOp", "Bitcast", "CheckNumerics"}


def _with_fresh_aliases(schedule: Sequence[Hashable], graph: nx.DiGraph, data_in: dict) -> list:
    """``schedule`` with each alias (a ``Reshape``, an ``Identity``: no buffer of its
    own) recomputed right before an op that reads it, when the buffer's owner has been
    recomputed since the alias last ran.

    The planning graph gives an alias no bytes and binds its readers' liveness to the
    owner's *latest* computation, as if the reader held that copy. A reader of the
    original alias holds the original buffer instead. Measured on the Transformer test
    model at its smallest budget + 10 %: each backward weight-gradient ``MatMul`` read
    the forward ``Tensordot/Reshape`` of its Dense input while the plan recomputed the
    input, so five forward activations (4 MiB) stayed live through the backward pass
    that the plan counted as freed. Aliases cost next to nothing and take no bytes, so
    the simulated peak is unchanged and now true.
    """
    def alias(w) -> bool:
        d = graph.nodes[w] if w in graph else None
        # (a CSE twin is an alias of its first twin, not of its input: rewrite binds it)
        if not (d and d.get("alias") and data_in.get(w) and not d.get("twin_of")):
            return False
        # A backward op is never recomputed, but a one-input alias in the backward
        # pass that reads a forward value (tf.recompute_grad's gradient captures its
        # block's input through an ``Identity``) holds the original buffer just the
        # same; a fresh copy of it computes nothing and is exact.
        return bool(d.get("recomputable") or (d.get("op_type") in _PLAIN_ALIASES and not d.get("stateful")))

    last: dict = {}
    out: list = []
    for v in schedule:
        for u in dict.fromkeys(data_in.get(v, ())):
            chain = []
            w = u
            while alias(w) and w not in chain and len(chain) < 16:
                chain.append(w)
                w = data_in[w][0]
            stale = False
            for a in reversed(chain):  # from the one reading the owner up to u
                # (any input: an IdentityN passes each of them on)
                stale = stale or any(last.get(i, -1) > last.get(a, -1) for i in data_in[a])
                if stale and a in last:
                    last[a] = len(out)
                    out.append(a)
        last[v] = len(out)
        out.append(v)
    return out


def _room(
    graph: nx.DiGraph, schedule: Sequence[Hashable], limit: int, fixed: int, scratch: Mapping[str, int]
) -> np.ndarray:
    """Bytes between ``limit`` and the schedule's simulated memory (``fixed`` bytes and
    each op's kernel ``scratch`` included) at each position, int64, never negative;
    zeros where the schedule does not simulate (nothing floats)."""
    try:
        mem = simulate(graph, schedule, fixed).memory
    except InvalidScheduleError:
        return np.zeros(len(schedule), np.int64)
    mem = mem + np.array([scratch.get(v, 0) for v in schedule], np.int64)
    return np.maximum(limit - mem, 0)


def _split(tensor: str) -> tuple[str, str]:
    if ":" in tensor:
        op, idx = tensor.rsplit(":", 1)
        return op, ":" + idx
    return tensor, ""


def rewrite_graph_def(
    graph_def,
    schedule: Sequence[Hashable],
    graph: nx.DiGraph,
    dtypes: Mapping[str, Sequence[int]],
    strict: bool = True,
    limit_bytes: int | None = None,
    fixed_bytes: int = 0,
    scratch: Mapping[str, int] | None = None,
):
    """Return ``(new_graph_def, RewriteInfo)`` realizing ``schedule`` on ``graph_def``.

    Parameters
    ----------
    graph_def : tensorflow GraphDef
        The traced step's graph (left unmodified; a copy is returned).
    schedule : sequence of op names
        A schedule the simulator accepted for ``graph`` (repeats are recomputations).
    graph : networkx.DiGraph
        The planning graph (for phases when choosing the ordering edges).
    dtypes : mapping
        Op name -> the DataType enum of each of its outputs (for the gates).
    strict : bool
        Also order the original ops as the schedule does, where it matters for
        memory: every op whose output is at least 1/64 of the largest tensor (a big
        allocation) waits, through control edges, for the big allocations before it
        and for every smaller op scheduled since that reads a big tensor (its run
        frees that tensor), unless it may float (``limit_bytes``). Chaining *every*
        op instead put control edges between ops Grappler later fuses or rewrites,
        which closed cycles. Measured (2 cores): without it the allocator peak of an
        8-layer MLP varied by +-40 MiB from call to call around the prediction, and
        a residual CNN's by one activation; with it, peaks were identical on every
        call and within 2 MiB of the prediction (docs/design.md).
    limit_bytes : int, optional
        With ``strict``: the memory (in the simulator's accounting, ``fixed_bytes``
        and ``scratch`` included) the executor's freedom may use. A big allocation
        *floats* (waits for its data only) when, at every schedule position from the
        earliest it may run to its own, the schedule's memory plus the outputs of
        the ops already floating there leaves room for its output under this limit;
        the next *anchored* big allocation waits for it. So every order the executor
        may choose stays within the limit in the model, and where the schedule runs
        well below it the two cores overlap big ops again. ``None`` (or 0): nothing
        floats, every big allocation is serial. The serial chain left one of 2 cores
        idle: the Transformer test model with nothing recomputed ran 1.18-1.65x the
        traced step's time serial, 1.02x with inter-op parallelism 1 on both sides.
        A floating op that is the only data input of a later op is not waited for
        by the next anchor once that consumer ran (its control fanout would block
        the fusion of the two: ``x * sigmoid(x)`` into oneDNN's Swish; EfficientNetB0
        lost bitwise equality through such a wait).
    fixed_bytes : int
        Bytes held throughout (``limit_bytes``'s accounting).
    scratch : mapping, optional
        Op name -> kernel scratch bytes live while the op runs (``limit_bytes``'s
        accounting).

    Raises
    ------
    RematError
        If the schedule names an op absent from the GraphDef.
    """
    data_in, data_consumers = _data_edges(graph_def)
    schedule = _with_fused_producers(schedule, graph_def, graph, (data_in, data_consumers))
    schedule = _with_fresh_aliases(schedule, graph, data_in)
    largest = max((graph.nodes[v]["bytes"] for v in graph.nodes), default=0)
    new = type(graph_def)()
    new.CopyFrom(graph_def)
    nodes = {n.name: n for n in new.node}
    originals = {n.name: n for n in graph_def.node}
    missing = [v for v in schedule if v not in originals]
    if missing:
        raise RematError(f"schedule names ops not in the graph: {missing[:3]}")
    taken = set(nodes)

    count: dict = {}
    latest: dict = {}
    pos_of_original: dict = {}
    position: dict = {}  # node of the new graph (original or copy) -> schedule position
    is_copy = []
    for v in schedule:
        k = count.get(v, 0)
        count[v] = k + 1
        is_copy.append(k > 0)
    count.clear()

    def phase(v):
        return graph.nodes[v].get("phase", "forward") if v in graph else "input"

    def chain_triggers_for(j: int) -> list[str]:
        """Control inputs for the gates of a chain of copies starting at position j.

        The chain must wait for the backward op that runs before it. Preferred: the
        latest-computed backward input of the op that needs the chain; else the op
        the schedule ran just before it. A trigger is skipped when one of its
        siblings (an op sharing an input with it) consumes a value this chain
        recomputes: Grappler fuses some siblings (oneDNN's Conv2DBackpropFilter +
        BiasAddGrad), and the fused node would close a cycle through the gate.
        """
        n = len(schedule)
        end = j
        while end < n and is_copy[end]:
            end += 1
        chain_ops = set(schedule[j:end])
        # A later CSE twin is no trigger (here or in the barrier below): the rewrite
        # bound its readers to the first twin's latest computation, and the twin
        # itself, kept by a control edge, runs as soon as its own inputs exist. Found
        # by a random two-output Keras model with sample weights: the metrics'
        # forward pass, recomputed after the optimizer's update, waited on
        # ``Cast(sample_weight)``, a twin of the loss's cast, and ran during the
        # first forward pass (4.5 MiB for 3.2 predicted).
        candidates: list[str] = []
        if end < n:
            consumer = schedule[end]
            preds = [
                u
                for u in graph.predecessors(consumer)
                if u in pos_of_original and phase(u) in ("backward", "update") and u not in twin
            ]
            candidates += sorted(preds, key=lambda u: -pos_of_original[u])
        for i in range(j - 1, max(-1, j - 200), -1):
            if not is_copy[i] and phase(schedule[i]) != "input" and schedule[i] not in twin:
                candidates.append(schedule[i])

        def risky(t: str) -> bool:
            for inp in originals[t].input:
                if inp.startswith("^"):
                    continue
                for sib in data_consumers.get(_split(inp)[0], ()):
                    if sib == t or sib in pos_of_original:
                        continue  # already scheduled: cannot depend on this chain
                    if any(
                        _split(i)[0] in chain_ops for i in originals[sib].input if not i.startswith("^")
                    ):
                        return True
            return False

        # A trigger the executor may run early orders nothing: an L2 regularizer's
        # gradient reads only variables and the loss's seed, runs at the start of the
        # backward pass whatever its place in the schedule, and released a copy with
        # it (a regularized CNN: 42.0 MiB measured for a 29.9 MiB prediction). Prefer
        # triggers that cannot run before the latest anchored big op.
        # Where every candidate may run that early, the latest anchored op itself
        # triggers: the optimizer's updates of the gradients made early in the
        # backward pass, and Keras' step counter update, fill the 200 positions
        # before a chain recomputing a random classifier's metrics' forward pass
        # after the update; triggered by the counter update, it ran 1,100 positions
        # early, beside the backward pass (``keras_fuzz.py conv 8``: 15.1 MiB
        # measured for 12.4 expected).
        floor = position.get(anchor[0], 0) if anchor else 0

        def runs_early(t: str) -> bool:
            return early.get(latest.get(t, t), floor) < floor

        candidates.sort(key=runs_early)
        if anchor and anchor[0] in originals and candidates and runs_early(candidates[0]):
            candidates.insert(0, anchor[0])
        triggers: list[str] = []
        for t in candidates:
            if not risky(t) and not fused_later(t):
                triggers.append(t)
                break
        # Barrier: also wait for every op the schedule ran since the previous chain
        # (its sinks suffice). Without it the executor postponed small ops that hold
        # big inputs (weight gradients holding an activation and its gradient), and
        # the measured peak varied by one activation from call to call.
        window = [
            schedule[i]
            for i in range(prev_chain_end, j)
            if not is_copy[i] and phase(schedule[i]) != "input" and schedule[i] not in twin
        ]
        in_window = set(window)
        for u in window:
            if len(triggers) >= MAX_BARRIER_EDGES:
                break
            if u in triggers or any(w in in_window for w in graph.successors(u)):
                continue
            if not risky(u) and not fused_later(u):
                triggers.append(u)
        return triggers

    def single_consumer(u: str) -> bool:
        return len(data_consumers.get(_copy_base(u) or u, ())) == 1

    def consumed_by_now(u: str) -> bool:
        return all(c in pos_of_original for c in data_consumers.get(_copy_base(u) or u, ()))

    # Each op oneDNN may fuse with a sibling (costs.FUSED_WITH_SIBLING), with the
    # siblings it may be fused with, and (lazily) its descendants.
    fusable: dict = {}
    for name, n in originals.items():
        if n.op in FUSED_WITH_SIBLING:
            sibs = {
                sib
                for inp in n.input
                if not inp.startswith("^")
                for sib in data_consumers.get(_split(inp)[0], ())
                if sib != name and originals[sib].op in FUSED_WITH_SIBLING
            }
            if sibs:
                fusable[name] = sibs
    below: dict = {}
    step_graph = nx.DiGraph()  # the GraphDef's data and control edges, once needed

    def fused_later(u: str) -> bool:
        """Whether ``u`` is, or depends on, an op that may be fused with a sibling the
        schedule has not run yet.

        The fused node runs when the sibling does, so an op waiting on ``u`` may be an
        ancestor of the fused node: a cycle (measured: a recomputed residual input of
        a convolution waited on that convolution's BiasAddGrad, which oneDNN then
        fused with the Conv2DBackpropFilter that reads the recomputed input). The
        same holds for what the fusable op feeds: with each gradient applied when it
        exists (``graph._updates_of``), a chain of copies waited on a bias's
        ``AssignSubVariableOp``, fed by the BiasAddGrad that oneDNN fused with the
        Conv2DBackpropFilter reading the chain (the residual CNN test model at 60 %).
        """
        for f, sibs in fusable.items():
            if f not in pos_of_original or all(s in pos_of_original for s in sibs):
                continue
            if u == f or u in descendants(f):
                return True
        return False

    def descendants(f: str) -> set:
        """``f``'s descendants in the traced step, through control edges too (Adam
        reads m after its assign)."""
        if f not in below:
            if not step_graph:
                step_graph.add_nodes_from(originals)
                step_graph.add_edges_from(
                    (_split(i.lstrip("^"))[0], name) for name, n in originals.items() for i in n.input
                )
            below[f] = nx.descendants(step_graph, f) if f in step_graph else set()
        return below[f]

    def fusion_cycle(u: str, v: str) -> bool:
        """Whether ``v`` waiting on ``u`` closes a cycle once oneDNN fuses either
        with a sibling (the fused node takes both ops' inputs and outputs)."""
        u, v = _copy_base(u) or u, _copy_base(v) or v
        us, vs = {u} | fusable.get(u, set()), {v} | fusable.get(v, set())
        return any(a in descendants(b) for a in us for b in vs)

    gates: dict = {}
    signatures: dict = {}  # v -> the inputs each computation of v read so far
    made: dict = {}  # copies made so far, by name

    def nodes_by_name(name: str):
        return made.get(name) or nodes[name]

    def swish_inputs(v) -> set:
        """The ``x`` of a Swish ``x * sigmoid(v)`` that ``v`` (Keras' ``beta * x``)
        feeds: gated for ``v``'s copy, the Swish's product would read ``x`` itself
        and the Sigmoid the gate, no Swish pattern (a random classifier, keras_fuzz
        conv 2 at a 10.1 MiB budget: 61 variables apart after 3 steps)."""
        xs = set()
        for sig in data_consumers.get(v, ()):
            if originals[sig].op != "Sigmoid":
                continue
            for m in data_consumers.get(sig, ()):
                if originals[m].op == "Mul":
                    xs |= {p for p in data_in.get(m, ()) if p != sig}
        return xs & set(data_in.get(v, ()))

    def fused_head(node):
        """The contraction ``node`` follows in a remapper fusion, where ``node`` is its
        bias add (read by nothing else: the copy was just made) or that bias add's
        activation; else None. The remapper does not fuse a bias add that waits on a
        control input: ``tanh(x @ w + b)`` recomputed with its product ran as
        ``MatMul``, ``AddV2`` and ``Tanh`` where the plain step ran one
        ``_MklNativeFusedMatMul`` (steps_fuzz 79, 21 of 28 values apart after 3
        steps), as the copy of ``AddV2`` was ordered behind gradient products."""
        def data(n):
            return [_split(i)[0] for i in n.input if not i.startswith("^")]

        if node.op in _FUSED_ACTIVATIONS and data(node):
            b = made.get(data(node)[0]) or nodes.get(data(node)[0])
            return fused_head(b) if b is not None and b.op in _BIAS_ADDS else None
        if node.op not in _BIAS_ADDS:
            return None
        for i in data(node):
            p = made.get(i) or nodes.get(i)
            if p is not None and p.op in _CONTRACTIONS:
                return p.name
        return None

    def signature(src) -> tuple:
        """The computations ``src``'s data inputs bind to now."""
        out = []
        for inp in src.input:
            if not inp.startswith("^"):
                op, idx = _split(inp)
                op = twin.get(op, op)
                out.append(latest.get(op, op) + idx)
        return tuple(out)

    def gate_on(tensor: str, op: str, idx: str, device: str, source: str) -> str:
        """The gate of the current chain in front of ``tensor`` (output ``idx`` of
        ``op``; it may run from where ``source`` may), made on first use."""
        key = (tensor, tuple(chain_triggers))
        gate = gates.get(key)
        if gate is None:
            gate = _fresh(f"{op}{COPY_SEP}_gate{len(gates)}", taken)
            _add_identity(new, gate, tensor, dtypes[op][int(idx[1:]) if idx else 0], device, chain_triggers)
            gates[key] = gate
            early[gate] = max([early.get(t, 0) for t in chain_triggers] + [early.get(source, 0)])
        return gate

    def gated_input(inp: str) -> bool:
        """A copy's data input ``inp`` is an original tensor, so it goes through a gate."""
        if inp.startswith("^"):
            return False
        op = _split(inp)[0]
        op = twin.get(op, op)
        return bool(chain_triggers) and latest.get(op, op) == op and not constant(op)

    def constant(op: str) -> bool:
        """``op`` is a constant in the step Grappler runs: a ``Const``, or an op it
        folds into one (graph.py, ``folded``). A gate or a copy reading one would be
        folded into a constant of its own, held from the first call on: a random
        attention model's causal mask (0.56 MiB, ``benchmarks/keras_fuzz.py`` attn 4)
        was held four times where the plan counted it once per block."""
        return originals[op].op in _CONSTS or op in folded

    n_copies = n_rewired = 0
    chain_triggers: list[str] = []
    prev_chain_end = 0
    # Strict ordering. An *anchored* big allocation waits for the previous anchored
    # one, for every floating one since, and for every small op since that reads a
    # big tensor (its run frees that tensor): when it runs, everything of size the
    # schedule ran before it has run, so memory is what the simulator counted there.
    # A *floating* big allocation waits for its data only; it is allowed where the
    # room under ``limit_bytes`` (less what earlier floating ops reserved) holds its
    # output at every position from the earliest it may run to its own.
    anchor: list[str] = []  # the latest anchored big op (none before the first)
    floating: list[str] = []  # floating big ops since the latest anchor
    freeing: list[str] = []  # small ops reading a big tensor since the latest anchor's waits
    carry: list[str] = []
    early: dict = {}  # node of the new graph -> earliest schedule position it may have run at
    # Strict ordering chains only ops whose output matters for the peak: chaining
    # every op put control edges between ops Grappler later fuses (oneDNN's
    # Conv2DBackpropFilter + BiasAddGrad), and the fused node closed a cycle.
    min_bytes = max(1, largest // 64)

    def ordered_alloc(name: str) -> bool:
        """Whether strict ordering chains ``name`` as a big allocation."""
        return name in graph and graph.nodes[name]["bytes"] >= min_bytes and originals[name].op not in FUSED_WITH_SIBLING

    sc = scratch or {}
    last_scratch = ""  # the latest op with scratch of at least min_bytes
    # The latest such op not ordered as a big allocation, until an anchor whose own
    # control fanout Grappler keeps waits for it: every anchor till then does (below).
    pending_scratch = ""
    room = _room(graph, schedule, limit_bytes, fixed_bytes, sc) if strict and limit_bytes else None
    n_floating = 0
    waits_on_copies: dict = {}
    # Twins Grappler's CSE would merge (graph.py): readers of a later twin read the
    # first one's latest computation, as the planning graph counted them; the later
    # twin is left without readers, and the runtime prunes it.
    twin = {v: d["twin_of"] for v, d in graph.nodes(data=True) if d.get("twin_of")}
    folded = {v for v, d in graph.nodes(data=True) if d.get("folded")}  # constants once Grappler ran
    for j, v in enumerate(schedule):
        k = count.get(v, 0)
        count[v] = k + 1
        src = originals[v]
        if v in twin:
            if k == 0:
                pos_of_original[v] = j
            latest[v] = latest.get(twin[v], twin[v])
            continue
        if k == 0:
            node = nodes[v]
            pos_of_original[v] = j
        else:
            if not is_copy[j - 1] if j else True:
                chain_triggers = chain_triggers_for(j)
                prev_chain_end = j
            node = new.node.add()
            node.CopyFrom(src)
            name = _fresh(f"{v}{COPY_SEP}{k}", taken)
            node.name = name
            made[name] = node
            n_copies += 1
            if v in graph:
                # a loop reading variables: their writers wait for every copy of it
                for w in graph.nodes[v].get("writers", ()):
                    waits_on_copies.setdefault(w, []).append(name)
        del node.input[:]
        # A copy whose inputs all are the computations an earlier one of v read (no
        # input recomputed since) is the same op to Grappler's common-subexpression
        # elimination, unless a gate sets it apart: CSE merged it with the earlier
        # one, which then lived until the last one's readers, and the merged op's
        # extra consumers kept the arithmetic optimizer from folding the Add tree it
        # starts (Xception at its smallest budget + 10 %: a BatchNorm's x*s and
        # x*s + b recomputed 3 times from one convolution copy, then summed with the
        # residual in another order; 547 variables up to 1.9e-3 after 3 steps). Only
        # a sum or product is set apart, by a gate of its chain on its first input
        # computed by an op no arithmetic rewrite folds into it (not elementwise) and
        # read by none of its other inputs' producers: a gate on the ``x`` of
        # ``Mul(x, Sigmoid(x))`` broke oneDNN's Swish pattern (EfficientNetV2B0:
        # 1.1e-2 after 3 steps). Where no input is such, an elementwise one that is
        # no activation's partner in a fusion pattern takes the gate: the exact
        # GELU's ``(x * 0.5) * erfc(-x / sqrt 2)``, recomputed twice from one pair of
        # factor copies, was merged and held 2 MiB across a MaxPool gradient (a
        # random U-Net, keras_fuzz unet 0: 18.25 MiB measured for 16.0 expected).
        sig = signature(src)
        twin_copy = (k > 0 and chain_triggers and src.op in _ADD_FAMILY | _MUL_FAMILY
                     and sig in signatures.get(v, ())
                     and not any(gated_input(inp) for inp in src.input))
        if twin_copy:
            data = [_split(i) for i in src.input if not i.startswith("^")]
            bound_in = [latest.get(twin.get(o, o), twin.get(o, o)) for o, _ in data]
            read_by_others = {
                t for b in bound_in for t in (_split(i)[0] for i in nodes_by_name(b).input if not i.startswith("^"))
            }
            candidates = [
                (b, originals[twin.get(o, o)].op) for b, (o, _) in zip(bound_in, data)
                if b != twin.get(o, o) and not constant(twin.get(o, o)) and b not in read_by_others
                and twin.get(o, o) not in swish_inputs(v)
            ]
            twin_gate_at = next((b for b, op in candidates if op not in _ELEMENTWISE), None)
            if twin_gate_at is None:
                twin_gate_at = next((b for b, op in candidates if op not in _ACTIVATION_PARTNERS), None)
            twin_copy = twin_gate_at is not None
        for inp in src.input:
            if inp.startswith("^"):
                # A copy waits on the latest computation of what its original waited
                # on, as it reads the latest of its data inputs: that op keeps its
                # control fanout, without which Grappler folds it into a product
                # (the moments gradient's ``sub`` waits on ``truediv_1 = Tile / n``;
                # a copy of ``2 * truediv_1 * sub`` whose copy of ``truediv_1`` had no
                # control fanout ran as ``(2/n * sub) * Tile``: steps_fuzz 82)
                c = inp[1:]
                c = twin.get(c, c)
                node.input.append("^" + (latest.get(c, c) if k > 0 else inp[1:]))
                continue
            op, idx = _split(inp)
            op = twin.get(op, op)
            bound = latest.get(op, op)
            if twin_copy and bound == twin_gate_at:
                twin_copy = False  # one gate sets it apart
                node.input.append(gate_on(bound + idx, op, idx, src.device, bound))
                n_rewired += 1
                continue
            if k > 0 and gated_input(inp):
                # (a constant is not gated: the gate would hide it from constant
                # folding and the arithmetic optimizer's constant rewrites)
                node.input.append(gate_on(inp, op, idx, src.device, op))
                continue
            if bound != op:
                n_rewired += 1
            node.input.append(bound + idx)
        signatures.setdefault(v, set()).add(sig)
        latest[v] = node.name
        position[node.name] = j
        # Copies are ordered too: a gate releases a whole recomputation chain at once,
        # and independent branches of it (two BatchNorm blocks' statistics) ran
        # interleaved, holding one activation more each (docs/design.md).
        if room is not None:  # where it may run from: only floating needs it
            # A control input of the traced step from an op Grappler rewrites orders
            # nothing at run time: the rewrite takes the op's place and not its
            # control fanout. Measured on the Transformer test model at 60 %: the GELU
            # gradient's ``Square(x / sqrt 2)`` waits in the trace for a product of
            # the incoming gradient, which the arithmetic optimizer reassociated; the
            # Square, counted as floating from that product on, ran in the forward
            # pass and held 2 MiB through the next block's backward pass (24.0 MiB
            # measured on a first call for 20.2 predicted).
            start = max(
                (
                    early.get(_split(i.lstrip("^"))[0], 0)
                    for i in node.input
                    if not (i.startswith("^") and i in src.input and originals[i[1:]].op in _REWRITTEN_SOURCES)
                ),
                default=0,
            )
            early[node.name] = start
        if strict and sc.get(v, 0) >= min_bytes:
            # A kernel with big scratch that is not ordered as a big allocation (a
            # small output, or fused with a sibling) waits on the previous kernel with
            # big scratch: the simulator counts each one's scratch at its own
            # position only. Measured on a mixed_float16 residual CNN at its smallest
            # budget + 10 % (Eigen float16 filter gradients, 16-32 MiB of scratch
            # each, a few KiB of output): 62.8 and 65.8 MiB on a 64.2 MiB budget for
            # 52.7 predicted. Kernels ordered as big allocations keep only those
            # edges: each one more is a control input Grappler's rewrites must keep.
            if not ordered_alloc(v) and last_scratch and not fusion_cycle(last_scratch, node.name):
                node.input.append("^" + last_scratch)
            last_scratch = node.name
            if not ordered_alloc(v):
                pending_scratch = node.name
        if strict and phase(v) != "input":
            data_srcs = {_split(i)[0] for i in node.input if not i.startswith("^")}
            own = graph.nodes[v]["bytes"]
            if ordered_alloc(v):
                if room is not None:
                    # An early run brings forward the kernel's scratch with its output,
                    # and that of every consumer left unordered (small, or fused with a
                    # sibling): it may start as soon as this op is done. Measured on a
                    # BFC CNN with Eigen kernels: two 32 MiB Conv2DBackpropFilter
                    # scratches overlapped, 81.1 MiB for a 73.3 MiB prediction.
                    need = own + sc.get(v, 0) + sum(
                        sc.get(c, 0)
                        for c in data_consumers.get(v, ())
                        if c in graph and not ordered_alloc(c)
                    )
                    if start >= j or int(room[start:j].min()) >= need:
                        room[start:j] -= need
                        floating.append(node.name)
                        n_floating += 1
                        continue
                # An anchor: waits for the previous anchor, the floating big ops and
                # the freeing small ops since (a floating op that is the only input
                # of a later op is left to it: its control fanout would block a
                # fusion, see single_consumer).
                waits = list(carry) + anchor + freeing
                # ... and the latest kernel with big scratch (not a big allocation),
                # which the simulator counts at its own position only: its scratch
                # must be gone before this op allocates. Every anchor waits for it
                # until one whose control fanout Grappler keeps does: an edge from an
                # elementwise or identity op is re-seated or dropped
                # (_anchor_ordering_edges), so a chain of them does not carry the
                # wait. Found by a random mixed_float16 U-Net (sample weights, Eigen
                # float16 convolution gradients, 32 MiB of scratch each): one conv's
                # filter gradient ran beside the next conv's input gradient, past a
                # GELU gradient's products, on every other call: 69.7 MiB measured
                # for a 43.3 MiB prediction and a 47.9 MiB budget.
                if pending_scratch and not fusion_cycle(pending_scratch, node.name):
                    if pending_scratch not in waits:
                        waits.append(pending_scratch)
                    if src.op not in _FANOUT_RESEATED:
                        pending_scratch = ""
                waits += [u for u in floating if not (single_consumer(u) and consumed_by_now(u))]
                if src.op != "AddN" or room is None:
                    early[node.name] = j
                # (an AddN waits for nothing, below: it may run as early as its
                # inputs, and so may a big op reading it: the same U-Net's next input
                # gradient, counted from the AddN's position on, floated beside the
                # filter gradient before it)
                if src.op == "AddN":
                    # A gradient AddN gets no ordering edge (_anchor_ordering_edges):
                    # the next big allocation waits for what it would have, or the
                    # serial chain breaks there. Measured on the mixed-precision CNN
                    # (its residual gradients are AddNs): 86-98 MiB for a 66.9 MiB
                    # prediction with the chain broken, 68-70 MiB carried over.
                    carry = [u for u in waits if u not in data_srcs]
                else:
                    # (a member of a contraction's fusion after the contraction: its
                    # waits go to the contraction where they ran before it; one that
                    # ran since is dropped, as the fusion is worth more than the order)
                    head = fused_head(node) if k > 0 else None
                    for u in waits:
                        if u in data_srcs or fused_later(u):
                            continue
                        if head is None:
                            node.input.append("^" + u)
                        elif position.get(u, j) < position.get(head, j) and u != head:
                            nodes_by_name(head).input.append("^" + u)
                    carry = []
                anchor, floating, freeing = [node.name], [], []
            elif any(
                graph.nodes[producer_of].get("bytes", 0) >= min_bytes
                for producer_of in (_split(i)[0] for i in src.input if not i.startswith("^"))
                if producer_of in graph
            ):
                freeing.append(node.name)
    reps = _cse_representatives(graph_def, graph)
    _anchor_ordering_edges(new, graph_def, set(gates.values()), dtypes, position, _cse_twins(graph_def, graph, reps),
                           merged=set(twin), folded=folded)
    _restore_fanout(new, graph_def, dtypes, twin)
    _split_sums(new, graph_def, {v: d.get("output_shapes") for v, d in graph.nodes(data=True)}, reps)
    _keep_control_twins_apart(new, graph_def)
    _keep_regrouped_pairs_ordered(new, graph_def, graph)
    for w, copies in waits_on_copies.items():
        nodes[w].input.extend("^" + c for c in copies)
    _break_ordering_cycles(new, graph_def)
    return new, RewriteInfo(copies=n_copies, gates=len(gates), rewired_inputs=n_rewired, floating=n_floating)


_ALIAS_SOURCES = frozenset({"Identity", "IdentityN", "StopGradient", "PreventGradient", "Snapshot"})
_STABLE_PRODUCERS = frozenset({"ReadVariableOp", "Placeholder", "_Arg", "VarHandleOp"})
# The step's inputs: fed to the emitted function, never imported, so no control edge
# may start from one.
_STEP_INPUTS = _STABLE_PRODUCERS - {"ReadVariableOp"}
_CONSTS = frozenset({"Const", "HostConst"})
# Elementwise ops Grappler may rewrite together with a neighbour: a search for a
# substitute source walks through them.
_REWRITTEN_SOURCES = frozenset(
    {
        "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan",
        "Neg", "Square", "Sqrt", "Rsqrt", "Reciprocal", "Exp", "Log", "Pow", "Erf",
        "Cast", "Maximum", "Minimum", "SquaredDifference", "Tanh", "Sigmoid",
        "Transpose", "Reshape", "Tile", "BroadcastTo", "Select", "SelectV2", "BiasAdd",
        "Relu", "Relu6", "Elu", "LeakyRelu", "Softplus",
    }
)
# Ops whose outgoing ordering edges _anchor_ordering_edges may re-seat or drop (the
# Add/Mul families are among the rewritten sources): a wait carried through one of
# them may be lost, so the strict rewrite does not count on it.
_FANOUT_RESEATED = _REWRITTEN_SOURCES | _ALIAS_SOURCES
# The arithmetic optimizer merges chains of these (AddOpsRewrite: Add trees into AddN;
# MinimizeBroadcasts: reassociated Mul chains; a factor hoisted out of a sum) only
# when no member has or drives a control dependency.
_ADD_FAMILY = frozenset({"Add", "AddV2", "AddN"})
# Elementwise ops that a remapper pattern fuses with the product reading them
# (Swish: Mul(x, Sigmoid(x)); Mish: Mul(x, Tanh(Softplus(x)))): never gated in
# front of that product.
_ACTIVATION_PARTNERS = frozenset({"Sigmoid", "Tanh", "Softplus", "Relu", "Relu6", "Elu", "Exp"})
# Copies of these ops get no (re-seated) ordering control inputs; see _anchor_ordering_edges.
_UNORDERED_COPY_OPS = frozenset({"Mul"})
# A division joins the products: Grappler turns ``x / c`` into ``x * (1/c)`` and then
# reassociates it with the product feeding it (constant push-down). Found on
# MobileNetV3Small: an ordering edge on the hard-swish gradient's ``(g * x) / 6`` made
# it ``x * (g/6)`` instead of the original's ``(x/6) * g`` (1.7e-4 after 3 steps).
#
# A power joins them too: the arithmetic optimizer's ConvertPow turns ``Pow(x, 3)``
# into ``x * Square(x)``, which then reassociates with a constant factor like any
# product (``c * x**3`` -> ``(c*x) * x**2``, pairing by operand names). Found on a
# tanh-GELU (``benchmarks/keras_sweep.py gpt_tanh_gelu``): an ordering gate in front
# of the forward ``Pow``'s input renamed that operand, the constant paired with the
# square instead, and 31 variables differed (2.4e-6) after 3 steps.
_MUL_FAMILY = frozenset({"Mul", "RealDiv", "Div", "Pow"})


FANOUT_SINK = "tfremat_fanout_sink"


def _restore_fanout(new, graph_def, dtypes, twin=None) -> None:
    """Give every op (original or copy) at least as many consumers as the original op had.

    Measured on a Keras Transformer: once the backward GELU read a recomputed copy of
    ``Gelu/mul = 0.5 * x``, the original kept a single consumer, so the arithmetic
    optimizer absorbed it into the next product and reassociated ``(0.5*x)*erfc`` as
    ``x*(0.5*erfc)`` in the forward pass; the copy, also with one consumer, was
    reassociated into the gradient. Grappler decides such merges from consumer counts,
    so each missing consumer is replaced by an unused ``Identity`` (marked
    ``_grappler_do_not_remove``); all of them feed the control inputs of one ``NoOp``
    that emit.py makes the outputs wait for, so the runtime does not prune them.
    """
    twin = twin or {}

    def count(gd, merge=False) -> dict:
        out: dict = {}
        for n in gd.node:
            if merge and n.name in twin:
                continue  # merged away: its readers read the first twin
            for i in {i for i in n.input if not i.startswith("^")}:
                p, idx = _split(i)
                if merge:  # the counts Grappler sees once CSE merged the twins
                    p = twin.get(p, p)
                key = (p, int(idx[1:]) if idx else 0)
                out[key] = out.get(key, 0) + 1
        return out

    ref: dict = {}
    for (p, k), c in count(graph_def, merge=True).items():
        ref.setdefault(p, []).append((k, c))
    cur = count(new)
    ops = {n.name: n for n in graph_def.node}
    dummies = []
    for n in list(new.node):
        # Originals and their copies only: a gate or an ordering anchor in front of a
        # copy (``<op>/_remat1/_remat_order``) reads the copy's input, whose dtype may
        # differ (found on the mixed-precision CNN: a float dummy on a half Cast input).
        base = n.name if n.name in ops else _copy_base(n.name)
        if base is None or base not in ops or ops[base].op in _CONSTS or base in twin:
            continue  # a gate, anchor or fan-out node of this rewrite, a constant, a twin
        for k, want in ref.get(base, ()):
            have = cur.get((n.name, k), 0)
            types = dtypes.get(base) or []
            if k >= len(types):
                continue
            for j in range(want - have):
                d = _add_identity(
                    new, f"{n.name}{COPY_SEP}_fanout{k}_{j}", n.name if k == 0 else f"{n.name}:{k}",
                    types[k], n.device, preserved=True,
                )
                dummies.append(d.name)
    if dummies:
        _fanout_sink(new).input.extend("^" + d for d in dummies)


def _fanout_sink(new):
    """The preserved ``NoOp`` the emitted function's outputs wait for (added once)."""
    sink = next((x for x in new.node if x.name == FANOUT_SINK), None)
    if sink is None:
        sink = new.node.add()
        sink.name = FANOUT_SINK
        sink.op = "NoOp"
        _preserved(sink)
    return sink


# DataType enum values (tensorflow/core/framework/types.proto) of the float types
# whose AddN kernel sums in the order _split_sums reproduces.
_FLOAT_DTYPES = frozenset({1, 2, 14, 19})  # float, double, bfloat16, half


def _split_sums(new, graph_def, shapes: Mapping[str, Sequence] | None = None,
                reps: Mapping[str, str] | None = None) -> None:
    """Rewrite a float ``AddN`` of more than two inputs as a tree of two-input
    ``AddN`` ops that sums in the original step's order (in place).

    Grappler's memory optimizer (``SchedulingPass``) turns an ``AddN`` of three or
    more inputs into a ``TemporaryVariable`` that each input is ``AssignAdd``-ed into
    as it arrives, when its static memory estimate says the inputs are live at its
    peak. The sum is then taken in arrival order, and which ``AddN`` it picks moves
    with every recomputed op. Found on EfficientNetB0 at a 108 MiB budget (a debug
    subset of a plan, its ordering edges dropped): one more recomputed ``Rsqrt``
    made it rewrite a three-term BatchNorm gradient sum in ``block7a``, and 734
    variables differed after 3 steps (2.8e-3); one op fewer, it rewrote nothing and
    the step was bitwise. The pass leaves two-input ``AddN`` ops alone.

    The order: Grappler sorts the inputs of a commutative op by name
    (``CanonicalizeNode``), so the original step sums in the order of its input
    names; the tree takes them in that order, by their names in the original step
    (a recomputed input is renamed here). Without the sort, EfficientNetB0 with
    nothing recomputed differed by 3.1e-3 after 3 steps. The names are those left
    after the arithmetic optimizer drops reshapes to the same shape (``shapes``: op
    name -> its outputs' static shapes), as it does before it sorts again: a
    TimeDistributed convolution's bias gradient sums ``Reshape_6`` .. ``Reshape_11``,
    which Grappler sums as the ``BiasAddGrad`` ops behind them (frame 0 to 5), not
    in the reshapes' own name order (10, 11, 6, ...): 1.8e-7 after 3 steps
    (``benchmarks/keras_sweep.py convlstm``). They are also the names left after
    common-subexpression elimination (``reps``: :func:`_cse_representatives`), which
    runs before the sort: a GAN step's generator and discriminator cross-entropies on
    the same fake logits compute equal gradient terms, and Grappler keeps the first
    of each, so the discriminator's four-term sum ``AddN_2`` sums the generator's
    ``binary_crossentropy/.../Neg``, ``Select``, ``Select_3`` and then its own
    ``binary_crossentropy_2/.../mul/Mul``, and ``AddN_1`` the generator's ``mul/Mul``
    first: by the traced names, 34 of 46 values differed after 3 steps
    (``benchmarks/steps_sweep.py gan``). The kernel (``AddNOp``)
    adds the first ``k`` inputs left to right (``k`` = n mod 8, or 8 or 9 where that
    is 0 or 1), then each following group of eight, summed left to right, onto the
    running sum; the tree does the same (tests/test_rewrite.py checks it bitwise).

    Every inner sum drives a control edge into a preserved ``NoOp`` of its own (all
    waited for by the fan-out sink): the arithmetic optimizer does not fold an op
    that drives a control dependency back into an ``AddN`` (AddOpsRewrite), and it
    reorders the leaves when it does. One shared ``NoOp`` is not enough: the
    dependency optimizer drops its edges from all but the last sum as implied.

    An ``AddN`` that is part of a larger sum in the original step (an Add-family
    input or consumer) is left as it is: the arithmetic optimizer folds it there
    in an order of its own, which held pairs would not follow (the gradient-penalty
    step of tests/test_api.py: 7e-9).
    """
    original = {n.name: [i for i in n.input if not i.startswith("^")] for n in graph_def.node}
    op_of = {n.name: n.op for n in graph_def.node}
    shapes = shapes or {}
    reps = reps or {}

    def kept(tensor: str) -> str:
        op, idx = _split(tensor)
        return reps.get(op, op) + idx

    def shape_of(tensor: str):
        op, idx = _split(tensor)
        out = shapes.get(op)
        k = int(idx[1:]) if idx else 0
        return out[k] if out and k < len(out) else None

    def sort_name(tensor: str) -> str:
        # Down a chain of reshapes, the deepest tensor of the shape it started from:
        # the arithmetic optimizer folds the chain into one reshape, then drops that.
        top, walk = shape_of(tensor), tensor
        for _ in range(64):
            op = _split(walk)[0]
            ins = original.get(op)
            if op_of.get(op) != "Reshape" or not ins:
                break
            walk = ins[0]
            if top is not None and shape_of(walk) == top:
                tensor = walk
        return tensor
    summed = {_split(i)[0] for n in graph_def.node if n.op in _ADD_FAMILY for i in n.input if not i.startswith("^")}
    inner = []
    taken = {n.name for n in new.node}
    for n in list(new.node):
        data = [i for i in n.input if not i.startswith("^")]
        if n.op != "AddN" or len(data) <= 2 or n.attr["T"].type not in _FLOAT_DTYPES:
            continue
        if n.name in summed or any(op_of.get(_split(i)[0]) in _ADD_FAMILY for i in original.get(n.name, ())):
            continue  # part of a larger sum in the original step (see above)
        ctrl = [i for i in n.input if i.startswith("^")]
        names = original.get(n.name)
        names = [kept(sort_name(kept(x))) for x in names] if names is not None and len(names) == len(data) else data
        data = [data[j] for j in sorted(range(len(data)), key=names.__getitem__)]
        count = [0]

        def add(a: str, b: str) -> str:
            node = new.node.add()
            node.CopyFrom(n)
            node.name = _fresh(f"{n.name}{COPY_SEP}_sum{count[0]}", taken)
            count[0] += 1
            del node.input[:]
            node.input.extend([a, b])
            node.attr["N"].i = 2
            inner.append(node.name)
            return node.name

        def fold(xs):
            acc = xs[0]
            for x in xs[1:]:
                acc = add(acc, x)
            return acc

        m = len(data) % 8
        k = 8 if m == 0 else 9 if m == 1 else m
        groups = [data[:k]] + [data[r:r + 8] for r in range(k, len(data), 8)]
        if len(groups) == 1:
            left, right = fold(data[:-1]), data[-1]
        else:
            left = fold(groups[0])
            for g in groups[1:-1]:
                left = add(left, fold(g))
            right = fold(groups[-1])
        del n.input[:]
        n.input.extend([left, right] + ctrl)
        n.attr["N"].i = 2
    if not inner:
        return
    sink = _fanout_sink(new)
    # One preserved NoOp per inner sum: with all of them on one sink, the dependency
    # optimizer drops every edge but the last as implied by it (transitive reduction).
    for x in inner:
        hold = new.node.add()
        hold.name = _fresh(f"{x}/_hold", taken)
        hold.op = "NoOp"
        hold.input.append("^" + x)
        _preserved(hold)
        sink.input.append("^" + hold.name)


def _keep_control_twins_apart(new, graph_def) -> None:
    """Keep an op that only its control inputs set apart from a twin apart from a
    copy of that twin (in place).

    TensorFlow's swish gradient recomputes ``sigmoid(beta * x)`` under
    ``control_dependencies([dy])``: the same ops as the forward's, told apart only by
    that control input, so Grappler's common-subexpression elimination leaves them
    apart and oneDNN fuses the forward ``x * sigmoid(x)`` into ``_MklSwish``. Once the
    plan recomputes ``x`` and the forward pair, both read the copy of ``x``, whose
    chain waits for ``dy`` already: the dependency optimizer drops the gradient's
    ``^dy`` as implied, CSE merges its ``Sigmoid`` with the copy's, and the copy,
    with a shared ``Sigmoid``, runs as an unfused ``Mul``. Found on EfficientNetB0 at
    60 % of its baseline (session 27, 549-581 ops recomputed): seven recomputed
    swishes ran unfused, 727 variables up to 6.4e-4 apart after 3 Adam steps.

    Such an op (one with control inputs and a twin with other control inputs, in
    the original step) that reads a copy now waits for them through a preserved
    ``NoOp`` of its own, an edge no other path implies.
    """
    by_name = {n.name: n for n in graph_def.node}
    rep: dict = {}
    groups: dict = {}
    for name in _topo_order(graph_def):
        n = by_name[name]
        data = [_split(i) for i in n.input if not i.startswith("^")]
        data = [(rep.get(p, p), k or ":0") for p, k in data]
        if n.op in _COMMUTATIVE:
            data = sorted(data)
        ctrl = tuple(sorted(rep.get(i[1:], i[1:]) for i in n.input if i.startswith("^")))
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in n.attr.items()))
        key = (n.op, n.device, tuple(data), attrs)
        members = groups.setdefault(key, {})
        first = members.setdefault(ctrl, name)
        rep[name] = first  # the op CSE merges it with (same control inputs too)
    apart = {
        name
        for members in groups.values() if len(members) > 1
        for ctrl, name in members.items() if ctrl
    }
    if not apart:
        return
    taken = {n.name for n in new.node}
    for n in list(new.node):
        if n.name not in apart:
            continue
        if not any(COPY_SEP in _split(i)[0] for i in n.input if not i.startswith("^")):
            continue  # reads what the original read: its control inputs still set it apart
        ctrl = [i for i in by_name[n.name].input if i.startswith("^")]
        hold = new.node.add()
        hold.name = _fresh(f"{n.name}{COPY_SEP}_apart", taken)
        hold.op = "NoOp"
        hold.input.extend(ctrl)
        if n.device:
            hold.device = n.device
        _preserved(hold)
        n.input.append("^" + hold.name)


def _keep_regrouped_pairs_ordered(new, graph_def, graph: nx.DiGraph) -> None:
    """Keep a product Grappler regroups after the operand it loses.

    Grappler rebuilds ``(grad * fwd) * c`` as ``grad * (c * fwd)``
    (:func:`tfremat.graph._regrouped_pairs`): the inner op then waits for forward
    values only and runs in the forward pass, holding its output into the backward
    pass, where the plan put it after ``grad``. The operand it keeps goes through an
    ``Identity`` gate with a control input on the producer of the operand it loses, so
    it still runs after it. The pairing follows the leaves' sizes, then names, so the
    gate is added only where its name sorts where the operand's did (else the
    arithmetic would change); measured (TF 2.21, CPU): with the gate, the same pairing
    and the inner op after ``grad``. A SwiGLU model with pre-norm attention (the softmax
    gradient ``(g * softmax) * scale`` in each block): 9.0-9.5 MiB measured for a
    7.1 MiB prediction without the gates.
    """
    pairs = graph.graph.get("regrouped") or {}
    if not pairs:
        return
    nodes = {n.name: n for n in new.node}
    originals = {n.name: n for n in graph_def.node}
    for child, (pair, dropped, root, sizes, fixed) in pairs.items():
        node, orig, root_node = nodes.get(child), originals.get(child), nodes.get(root)
        if node is None or orig is None or root_node is None:
            continue
        traced = [i for i in orig.input if not i.startswith("^")]
        now = [i for i in node.input if not i.startswith("^")]
        if len(traced) != 2 or len(now) != 2 or dropped not in traced:
            continue
        k_lost = traced.index(dropped)
        kept_leaf, lost = now[1 - k_lost], now[k_lost]
        if traced[1 - k_lost] not in pair or _split(kept_leaf)[0] == _split(lost)[0]:
            continue
        if traced[1 - k_lost] in fixed:
            continue  # a gate would hide a constant from constant folding
        leaf = nodes.get(_split(kept_leaf)[0])
        if leaf is not None and leaf.op in _ALIAS_SOURCES:
            # Grappler reads through an alias (a tf.custom_gradient's IdentityN) to a
            # producer CSE may merge and rename; the constant of ``c * a * b`` then
            # joins the operand whose name sorts first, which a gate named after the
            # alias would change: (c * swish) * s where the plain step ran
            # (c * s) * swish (steps_fuzz 79, 21 of 28 values apart after 3 steps)
            continue
        kept_op, lost_op = _split(traced[1 - k_lost])[0], _split(dropped)[0]
        if kept_op in graph and lost_op in graph and nx.has_path(graph, lost_op, kept_op):
            continue  # it waits for the lost operand anyway
        third = [i for i in root_node.input if not i.startswith("^") and _split(i)[0] != child]
        if len(third) != 1:
            continue
        gate = _fresh(f"{_split(kept_leaf)[0]}{COPY_SEP}_regroup", nodes)
        ranked = sorted([(sizes[traced[1 - k_lost]], gate), (sizes[dropped], lost),
                         (sizes[pair[0] if pair[1] == traced[1 - k_lost] else pair[1]], third[0])])
        if lost == ranked[0][1] or lost == ranked[1][1]:
            continue  # the gate's name would change the pairing
        nodes[gate] = _add_identity(new, gate, kept_leaf, node.attr["T"].type, node.device,
                                    [_split(lost)[0]], preserved=True)
        node.input[list(node.input).index(kept_leaf)] = gate


def _fresh(name: str, taken) -> str:
    """``name``, with ``_`` appended until no op in ``taken`` has it.

    ``taken`` is a set of names, which the new name joins, or a mapping from
    names to nodes, which the caller fills in.
    """
    while name in taken:
        name += "_"
    if isinstance(taken, set):
        taken.add(name)
    return name


def _preserved(node) -> None:
    node.attr["_grappler_do_not_remove"].b = True


def _add_identity(gd, name: str, tensor: str, dtype: int, device: str, controls=(), preserved=False):
    """Append ``name = Identity(tensor)`` (waiting for ``controls``) to ``gd``."""
    node = gd.node.add()
    node.name = name
    node.op = "Identity"
    node.input.append(tensor)
    node.input.extend("^" + c for c in controls)
    node.attr["T"].type = dtype
    if device:
        node.device = device
    if preserved:
        _preserved(node)
    return node


def _copy_base(name: str) -> str | None:
    """The original op of a copy named ``<op>/_remat<k>``; None for any other node."""
    base, sep, k = name.rpartition(COPY_SEP)
    return base if sep and k.rstrip("_").isdigit() else None


_COMMUTATIVE = frozenset({"Add", "AddV2", "AddN", "Mul", "Maximum", "Minimum"})


def _cse_representatives(graph_def, graph: nx.DiGraph) -> dict:
    """Op name -> the op that Grappler's common-subexpression elimination keeps in
    its place: the first op, in graph order, with the same op, attributes and
    (canonical) inputs; an op no other matches, or a stateful one, stands for itself.

    Grappler's ``DedupComputations`` walks the graph in node order and keeps the
    first of each group, so ops are visited in topological order that follows the
    ``GraphDef``'s own order wherever it can (the traced order is topological).
    """
    by_name = {n.name: n for n in graph_def.node}
    rep: dict = {}
    groups: dict = {}
    for name in _topo_order(graph_def, stable=True):
        n = by_name[name]
        data = [_split(i) for i in n.input if not i.startswith("^")]
        data = [(rep.get(p, p), k or ":0") for p, k in data]
        if n.op in _COMMUTATIVE:
            data = sorted(data)
        ctrl = sorted(rep.get(i[1:], i[1:]) for i in n.input if i.startswith("^"))
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in n.attr.items()))
        stateful = graph.nodes[name].get("stateful", True) if name in graph else n.op not in _CONSTS
        if stateful or n.op in ("Placeholder", "_Arg"):  # arguments are never merged
            rep[name] = name
            continue
        key = (n.op, n.device, tuple(data), tuple(ctrl), attrs)
        first = groups.setdefault(key, name)
        rep[name] = first
    return rep


def _cse_twins(graph_def, graph: nx.DiGraph, rep: Mapping[str, str] | None = None) -> set:
    """Ops of ``graph_def`` that Grappler's common-subexpression elimination may merge
    with another: same op, attributes and (canonical) inputs, neither stateful
    (``rep``: :func:`_cse_representatives`, computed here when not given).

    An ordering edge on one of them makes them differ (a control input, or an
    ``Identity`` gate on an input), so the original step merges them and the rewritten
    one does not, and the gradients that meet there are then summed differently.
    Found by the random Keras-model test: ``x + BatchNorm(x)`` written twice; a gate on
    the second ``Add`` made a BatchNorm beta differ by 2e-8 after 2 Adam steps.
    """
    rep = _cse_representatives(graph_def, graph) if rep is None else rep
    members: dict = {}
    for name, r in rep.items():
        members.setdefault(r, []).append(name)
    return {name for ms in members.values() if len(ms) > 1 for name in ms}


def _anchor_ordering_edges(new, graph_def, gate_names, dtypes, position, twins=frozenset(),
                           merged=frozenset(), folded=frozenset()) -> None:
    """Re-seat every ordering control edge where Grappler does not see it (in place).

    Measured (docs/design.md): Grappler skips a float rewrite when an op involved has
    or drives a control dependency. The arithmetic optimizer merges Add trees into
    AddN and reassociates Mul chains only when no member does (Keras LayerNorm's
    ``x*s + (b - m*s)`` and the GELU gradient's products: ~1e-6 after 3 Adam steps);
    the remapper does not fuse MatMul+BiasAdd when the BiasAdd has a control input;
    the dependency optimizer keeps an ``IdentityN`` that drives a control edge, and
    with it the optimizer's Mul reassociation behind it (SGD momentum: 5e-10). An
    ordering edge ``u -> v`` of the rewrite therefore becomes:

    - nothing, when a data path already runs from ``u`` to ``v``;
    - for a source that is an identity, edges from the ops it forwards;
    - for a source the arithmetic optimizer may merge with a neighbour (an Add/Mul
      family op joined to one by a single-consumer edge), an edge from the first
      op downstream of it, outside that family and scheduled before ``v``; or
      nothing if there is none;
    - on the target side, a control input on an ``Identity`` gate in front of the
      input of ``v`` whose producer no rewrite merges into ``v`` (a variable read, a
      tensor with several consumers), so ``v`` itself has no control input. The
      gate, and every gate in front of a recomputed chain, is marked
      ``_grappler_do_not_remove``: otherwise the dependency optimizer removes it and
      moves its control inputs onto ``v``. Without such an input the control input
      stays on ``v``.

    An op with a common-subexpression twin (``twins``, see :func:`_cse_twins`) gets
    no ordering edge: either would keep Grappler from merging the two.

    ``folded``: ops Grappler folds into constants (graph.py): neither gated (a gate
    would become a second copy of the constant, held from the first call on) nor
    a signal (a constant is ready at the step's start).

    ``merged``: the later twins, whose readers the rewrite bound to the first twin.
    Nothing reads them, so the runtime prunes them before Grappler runs (and in the
    original step CSE merges them), and Grappler counts neither as a consumer of
    their inputs: neither does any rule here. Found on the SGD-with-Nesterov CNN
    (``benchmarks/keras_sweep.py variants``): Keras computes ``g * lr`` twice, so
    each BatchNorm scale's gradient ``AddN * Rsqrt`` looked like a tensor with two
    consumers, not a product the arithmetic optimizer merges with ``* lr``; it
    drove chain gates' control edges, which kept the optimizer from merging it, and
    three variables differed by 2.3e-10 after 3 steps (bisected by trigger op type).
    """
    nodes = {n.name: n for n in new.node}
    # (a merged twin still read by anything is not pruned: it counts)
    read = {_split(i.lstrip("^"))[0] for n in new.node for i in n.input}
    pruned = {t for t in merged if t in nodes and t not in read}
    orig_ctrl = {n.name: {i for i in n.input if i.startswith("^")} for n in graph_def.node}
    # Ordering edges added by the rewrite: (target, source).
    edges = []
    for n in new.node:
        if n.name not in gate_names and n.name not in orig_ctrl and _copy_base(n.name) not in orig_ctrl:
            continue  # an anchor or fan-out node of this rewrite
        added = [i for i in n.input if i.startswith("^")
                 and (n.name in gate_names or not _traced_control(n.name, i, orig_ctrl))]
        for i in added:
            edges.append((n.name, i[1:]))
    if not edges:
        return
    # Data graph of the rewritten step: consumers and ancestor bitsets.
    consumers: dict = {}
    for n in new.node:
        if n.name in pruned:
            continue
        for i in n.input:
            if not i.startswith("^"):
                consumers.setdefault(_split(i)[0], []).append(n.name)
    order = _topo_order(new)
    index = {name: k for k, name in enumerate(order)}
    anc: dict = {}
    # The same through the dependencies that hold at run time: not through a control
    # input of the traced step from an op Grappler rewrites (it drops the op's control
    # fanout). Used to find ordering edges already implied; cycle checks use ``anc``.
    held: dict = {}
    for name in order:
        bits = held_bits = 0
        for i in nodes[name].input:
            if i.startswith("^") and i not in orig_ctrl.get(name, ()):
                continue  # an ordering edge (not a dependency of the original step)
            p = _split(i.lstrip("^"))[0]
            if p in index:
                bits |= anc.get(p, 0) | (1 << index[p])
                if not (i.startswith("^") and nodes[p].op in _REWRITTEN_SOURCES):
                    held_bits |= held.get(p, 0) | (1 << index[p])
        anc[name] = bits
        held[name] = held_bits

    def is_ancestor(u, v) -> bool:
        return u in index and v in anc and bool(anc[v] >> index[u] & 1)

    def runs_before(u, v) -> bool:
        """u is an ancestor of v through dependencies Grappler keeps."""
        return u in index and v in held and bool(held[v] >> index[u] & 1)

    def sources(u, depth=0):
        n = nodes.get(u)
        if n is not None and n.op in _ALIAS_SOURCES and depth < 8:
            out = []
            for i in n.input:
                if not i.startswith("^"):
                    out += sources(_split(i)[0], depth + 1)
            return out
        return [u]

    def dtype_of(tensor: str) -> int:
        p, idx = _split(tensor)
        base = p.split(COPY_SEP)[0]
        k = int(idx[1:]) if idx else 0
        if base in dtypes and len(dtypes[base]) > k:
            return dtypes[base][k]
        return nodes[p].attr["T"].type

    tensor_consumers: dict = {}
    for n in new.node:
        if n.name in pruned:
            continue
        for i in n.input:
            if not i.startswith("^"):
                p, idx = _split(i)
                tensor_consumers.setdefault((p, int(idx[1:]) if idx else 0), []).append(n.name)

    def real_consumers(u, depth=0):
        """Consumers of u's outputs, looking through identities output by output."""
        out = []
        ks = {k for (p, k) in tensor_consumers if p == u} if depth == 0 else {0}
        for k in ks:
            out += _tensor_real_consumers(u, k, depth)
        return sorted(set(out))

    def _tensor_real_consumers(u, k, depth):
        out = []
        name = u if k == 0 else f"{u}:{k}"
        for c in tensor_consumers.get((u, k), ()):
            cn = nodes[c]
            if cn.op in _ALIAS_SOURCES and depth < 8 and c not in gate_names:
                for pos, i in enumerate(cn.input):
                    if i == name or (k == 0 and i == f"{u}:0"):
                        out += _tensor_real_consumers(c, pos if cn.op == "IdentityN" else 0, depth + 1)
            else:
                out.append(c)
        return out

    def real_producer(tensor, depth=0):
        p = nodes.get(_split(tensor)[0])
        while p is not None and p.op in _ALIAS_SOURCES and p.input and depth < 8:
            p = nodes.get(_split(p.input[0])[0])
            depth += 1
        return p

    def family(op):
        if op in _ADD_FAMILY:
            return "add"
        if op in _MUL_FAMILY:
            return "mul"
        return None

    def merges(p, c) -> bool:
        """The arithmetic optimizer may merge producer p into its only consumer c:
        same family (an Add tree, a Mul chain), a negation into an addition, or
        products sharing a factor summed by c."""
        fp, fc = family(p.op), family(c.op)
        if fp is None or fc is None:
            return False
        if fp == fc or p.op == "Neg":
            return True
        if fp == "mul" and fc == "add":
            factors = [set(nodes[_split(i)[0]].input) for i in c.input
                       if not i.startswith("^") and nodes[_split(i)[0]].op in _MUL_FAMILY]
            return len(factors) >= 2 and bool(set.intersection(*factors))
        return False

    def in_group(u) -> bool:
        """u may be merged with a neighbour by the arithmetic optimizer, through
        identities; see merges()."""
        n = nodes[u]
        if family(n.op) is None and n.op != "Neg":
            return False
        cs = real_consumers(u)
        if len(cs) == 1 and merges(n, nodes[cs[0]]):
            return True
        for i in n.input:
            if i.startswith("^"):
                continue
            p = real_producer(i)
            if p is not None and len(real_consumers(p.name)) == 1 and merges(p, n):
                return True
        return False

    def swish_sigmoid(u) -> bool:
        """u is the Sigmoid of a Swish, ``x * sigmoid(x)`` or ``x * sigmoid(beta * x)``:
        oneDNN fuses the pair unless the Sigmoid has or drives a control edge. Found
        on a SwiGLU feed-forward (``benchmarks/keras_sweep.py swiglu_prenorm``, 55
        ops recomputed): the gate's original Sigmoid drove an ordering gate, the pair
        ran as ``Mul(x, Sigmoid(x))`` instead of ``_MklSwish``, 110 variables up to
        1.7e-6 after 3 steps."""
        n = nodes.get(u)
        if n is None or n.op != "Sigmoid" or not n.input:
            return False
        xs = {_split(n.input[0])[0]}
        p = real_producer(n.input[0])
        if p is not None and p.op == "Mul":
            xs |= {_split(i)[0] for i in p.input if not i.startswith("^")}
        return any(
            nodes[c].op == "Mul" and any(_split(i)[0] in xs for i in nodes[c].input if not i.startswith("^"))
            for c in real_consumers(u)
        )

    fused: dict = {}  # fused_contraction's answers

    def fused_contraction(u) -> bool:
        """u is part of a contraction the remapper fuses with its bias add and
        activation (``MatMul`` -> ``BiasAdd``/``Add`` -> ``Relu``: one oneDNN kernel),
        which it does not when any member drives a control edge. Found on a GAN step
        (``benchmarks/steps_sweep.py gan``, 2 ops recomputed): the generator's Dense
        ``Relu``s and a discriminator ``MatMul`` were ordering sources, ran unfused,
        and 33 of 46 values differed by up to 1.2e-7 after one step. A residual sum
        of the biased contraction is a member too (``_MklNativeFusedMatMul`` with
        ``BiasAdd, Add``): a random residual MLP's ``h + Dense(f)`` drove an
        ordering edge, ran as a separate ``AddV2``, and the loss differed at the
        third step (keras_fuzz mlp 6, 48 variables apart).
        Memoized: the searches for a substitute source ask about the same ops again,
        and each answer scans consumers (the data graph does not change here)."""
        if u in fused:
            return fused[u]
        fused[u] = _fused_contraction(u)
        return fused[u]

    def _fused_contraction(u) -> bool:
        def only_reader(p, c) -> bool:
            return real_consumers(p) == [c]

        def biased(b) -> bool:  # b adds a bias to a contraction it alone reads
            if b.op not in _BIAS_ADDS:
                return False
            for i in b.input:
                if i.startswith("^"):
                    continue
                p = real_producer(i)
                if p is not None and p.op in _CONTRACTIONS and only_reader(p.name, b.name):
                    return True
            return False

        def summed(a) -> bool:  # a adds a tensor to a biased contraction it alone reads
            if a.op not in ("Add", "AddV2"):
                return False
            for i in a.input:
                if i.startswith("^"):
                    continue
                b = real_producer(i)
                if b is not None and biased(b) and only_reader(b.name, a.name):
                    return True
            return False

        n = nodes.get(u)
        if n is None:
            return False
        if n.op in _CONTRACTIONS:
            cs = real_consumers(u)
            return len(cs) == 1 and biased(nodes[cs[0]])
        if biased(n) or summed(n):
            return True
        if n.op in _FUSED_ACTIVATIONS and n.input and not n.input[0].startswith("^"):
            b = real_producer(n.input[0])
            return b is not None and (biased(b) or summed(b)) and only_reader(b.name, u)
        return False

    def limit(v):
        if v in gate_names:
            # a gate runs right before the chain it feeds: bound by its consumers
            found = [x for x in (limit(c) for c in consumers.get(v, ())) if x is not None]
            return min(found, default=None)
        return position.get(v)

    def sibling_after(c, v) -> bool:
        """An op sharing an input with c depends on v: Grappler may fuse the two
        (oneDNN's Conv2DBackpropFilter + BiasAddGrad), and an edge from c to v would
        then close a cycle."""
        for i in nodes[c].input:
            if i.startswith("^"):
                continue
            for sib in consumers.get(_split(i)[0], ()):
                if sib != c and (sib == v or is_ancestor(v, sib)):
                    return True
        return False

    def safe_successor(u, v):
        """A consumer of u (transitively) that is scheduled before v and drives no rewrite."""
        lim = limit(v)
        if lim is None:
            return None
        frontier, seen = [u], {u}
        while frontier:
            nxt = []
            for w in frontier:
                for c in sorted(consumers.get(w, ()), key=lambda c: position.get(c, 1 << 30)):
                    if c in seen or position.get(c, 1 << 30) >= lim:
                        continue
                    seen.add(c)
                    if nodes[c].op in _ALIAS_SOURCES or nodes[c].op in _REWRITTEN_SOURCES or fused_contraction(c):
                        nxt.append(c)
                    elif not sibling_after(c, v):
                        return c
            frontier = nxt[:64]
        return None

    def safe_predecessor(u, v):
        """The latest-scheduled op ``u`` reads (transitively) that drives no rewrite:
        when no safe op runs between ``u`` and ``v``, an earlier signal beats none.

        Measured on the Transformer test model at its smallest budget + 10 %: the only
        trigger of a chain recomputing a 2 MiB ``Dense`` output was a backward GELU
        product (an Add/Mul-family op) scheduled just before the chain; no op between
        them could signal instead, the gate was left without a control input, and the
        chain ran 860 positions early, in the previous block's backward pass (4.5 MiB
        over the prediction at the peak)."""
        heap = [(-position.get(u, -1), u)]
        seen = {u}
        for _ in range(256):
            if not heap:
                return None
            _, w = heapq.heappop(heap)
            n = nodes.get(w)
            if n is None:
                continue
            if w != u and w in position and n.op not in _ALIAS_SOURCES and n.op not in _CONSTS and w not in folded \
                    and n.op not in _STEP_INPUTS and not in_group(w) and not swish_sigmoid(w) \
                    and not fused_contraction(w) and not sibling_after(w, v):
                return w
            for i in n.input:
                p = _split(i.lstrip("^"))[0]
                if p not in seen and p in nodes:
                    seen.add(p)
                    heapq.heappush(heap, (-position.get(p, -1), p))
        return None

    def gateable_inputs(v):
        """Positions of v's data inputs from an op of the graph other than a constant."""
        out = []
        for k, i in enumerate(nodes[v].input):
            if not i.startswith("^"):
                p = nodes.get(_split(i)[0])
                if p is not None and p.op not in _CONSTS and p.name not in folded:
                    out.append(k)
        return out

    def stable_input(v, computed=True):
        """The input of v to gate: its producer is never merged with v by a rewrite.
        A variable read first; with ``computed``, else a tensor with several consumers.

        An op that may merge with a neighbour (``in_group``) passes ``computed=False``:
        a gate on a computed operand of a Mul chain changes how the arithmetic
        optimizer regroups it. Found on MobileNetV3Small at its smallest budget + 10 %
        (131 ops recomputed): the hard-swish gradient ``(g*x) / 6`` with g gated
        became ``(x/6) * g`` instead of the original ``(g/6) * x`` (MinimizeBroadcasts
        pairs the scalar with one operand; which one moved with the gate), 2.6e-4
        after 3 steps. A gated variable read (LayerNorm's scale) is left as it was."""
        if nodes[v].op in _FUSED_AFTER_CONTRACTION and 1 in gateable_inputs(v):
            # The bias: the remapper fuses the contraction on input 0 into the
            # BiasAdd, never the bias, and a control input left on the BiasAdd keeps
            # the pair apart. Found on the mixed_bfloat16 CNN of
            # ``benchmarks/keras_sweep.py variants`` (39 ops recomputed): a recomputed
            # BiasAdd whose bias came through a chain gate (one reader) kept its
            # ordering edges, ran apart from its convolution copy, and 62 variables
            # differed by up to 2.2e-3 after 3 steps.
            return 1
        if nodes[v].op in _CONTRACTIONS:
            # A contraction copy may read every input through its chain's gates (a
            # variable read among them): the gate in front of one is as stable. A
            # control input left on the copy keeps the remapper from fusing its bias
            # add and activation into it (the oneDNN pass still fuses the bias add):
            # a random U-Net of ``benchmarks/keras_fuzz.py`` (unet 3) recomputed a
            # convolution, its BiasAdd and ELU, the copy ran ``Elu`` alone where the
            # original ran ``_MklNativeFusedConv2D(BiasAdd, Elu)``, and 3 variables
            # differed after one step; with the edges on a gate, bitwise.
            for pos in gateable_inputs(v):
                if _split(nodes[v].input[pos])[0] in gate_names:
                    return pos
        best = None
        for pos in gateable_inputs(v):
            p = nodes[_split(nodes[v].input[pos])[0]]
            if p.op in _STABLE_PRODUCERS:
                return pos
            if computed and best is None and len(consumers.get(p.name, ())) >= 2:
                best = pos
        return best

    def _cone_entrance(v, pos, srcs):
        """Where the gate of copy ``v`` goes (op, input, the copies after the op that
        read that input: they read the gate too), so a fusion pattern that
        reads one tensor twice stays whole: in front of the nearest copy, ``v`` or an
        elementwise copy feeding it (at most 3 deep, none of them an ancestor of a
        source in ``srcs``), whose input a copy after it reads too; else on input
        ``pos`` of ``v`` (None: no input to gate, the control input stays on ``v``).

        Keras' Swish is ``x * sigmoid(1.0 * x)``: Grappler drops the ``1.0 *`` and
        oneDNN fuses ``Mul(x, Sigmoid(x))`` unless the Sigmoid has a control input
        or the two read different tensors. So neither a gate on the Sigmoid's input
        (``Mul(x, Sigmoid(gate(1.0*x)))``) nor a control input on it will do: the
        gate goes on ``1.0 * x``'s input ``x``, which the ``Mul`` then reads through
        the gate as well. Found on EfficientNetB0 with every update first (60 %):
        both, in two plans (a depthwise kernel's gradient 1.5e-7 off after one step;
        139 variables, up to 6e-4)."""
        if _copy_base(v) is not None:
            for k0 in [pos] if pos is not None else gateable_inputs(v):
                target, k = v, k0
                for _ in range(4):
                    readers = _copies_reading(target, nodes[target].input[k])
                    if readers:
                        return target, k, readers
                    p = _split(nodes[target].input[k])[0]
                    n = nodes.get(p)
                    if n is None or _copy_base(p) is None or n.op not in _ELEMENTWISE \
                            or any(s == p or is_ancestor(p, s) for s in srcs):
                        break
                    up = gateable_inputs(p)
                    if not up:
                        break
                    target, k = p, up[0]
        # (v, pos) itself was tried above when v is a copy: no copy after it reads it
        return None if pos is None else (v, pos, [])

    def _copies_reading(v, tensor, radius=4):
        """Copies reachable from v through copies (at most ``radius`` ops away) that
        read ``tensor`` as a data input."""
        if _copy_base(v) is None:
            return []
        found, frontier, seen = [], [v], {v}
        for _ in range(radius):
            nxt = []
            for w in frontier:
                for c in consumers.get(w, ()):
                    if c in seen or _copy_base(c) is None:
                        continue
                    seen.add(c)
                    nxt.append(c)
                    if tensor in nodes[c].input:
                        found.append(c)
            frontier = nxt
        return found

    order_gates: dict = {}
    by_target: dict = {}
    for v, u in edges:
        by_target.setdefault(v, []).append(u)
    for v, us in by_target.items():
        node = nodes[v]
        ins = [i for i in node.input if not (i.startswith("^") and i[1:] in us)]
        if v in twins:
            del node.input[:]
            node.input.extend(ins)
            continue
        if node.op in _UNORDERED_COPY_OPS and _copy_base(v) is not None:
            # A recomputed product keeps no ordering edge (its inputs, from its own
            # chain, still order it, and the next big allocation still waits for it):
            # with one, EfficientNetB0's recomputed Swish and BatchNorm products were
            # rewritten differently (1e-3 after 3 steps); without, bitwise, same peak.
            del node.input[:]
            node.input.extend(ins)
            continue
        srcs = []
        for u in us:
            for s in sources(u):
                if s not in nodes or s == v or runs_before(s, v):
                    continue
                if in_group(s) or swish_sigmoid(s) or fused_contraction(s):
                    # Driving a control edge would block the merge (or the Swish
                    # or contraction fusion): a later op that is scheduled before v
                    # anyway signals instead, or no edge.
                    s = safe_successor(s, v) or safe_predecessor(s, v)
                    if s is None or runs_before(s, v):
                        continue
                if s not in srcs:
                    srcs.append(s)
        if v in gate_names:
            _preserved(node)
            del node.input[:]
            node.input.extend(ins + ["^" + a for a in srcs])
            continue
        del node.input[:]
        node.input.extend(ins)
        if not srcs:
            continue
        if _copy_base(v) is None and swish_sigmoid(v):
            # An original Swish's Sigmoid takes no ordering edge: a gate in front
            # of its input (``beta * x``) would leave the product reading ``x`` and
            # the Sigmoid the gate, no Swish pattern (a copy's gate goes on ``x``
            # for both, _cone_entrance). Found by a keras_fuzz two-input model in a
            # hand-written step (steps_fuzz --keras 17): the forward pass ran
            # ``Mul(x, Sigmoid)`` where Keras' ran ``_MklSwish``, 54 of 62 values
            # apart after 3 steps.
            continue
        if node.op == "AddN":
            # A gradient AddN ordered through a control input or a gate on one of its
            # inputs was summed differently (NASNetMobile, nothing recomputed,
            # bisected by target op type: 0.1 in some variables after 3 Adam steps),
            # so it gets neither; its inputs still order it.
            continue
        grouped = in_group(v)
        pos = stable_input(v, computed=not grouped)
        cone = None if pos is None and grouped else _cone_entrance(v, pos, srcs)
        if cone is None:
            if grouped:
                # A control input on v would keep the arithmetic optimizer from
                # merging v's Add tree (or Mul chain), so its sum would be taken in
                # another order. Found on NASNetMobile, nothing recomputed: its cells
                # add two BatchNorm outputs (``x*s + b`` each); the strict edge on the
                # cell's Add changed the first loss in the 7th digit. v's inputs
                # still order it.
                continue
            node.input.extend("^" + a for a in srcs)
            continue
        target, pos, readers = cone
        inp = nodes[target].input[pos]
        key = (inp, tuple(srcs))
        g = order_gates.get(key)
        if g is None:
            g = _fresh(f"{v}{COPY_SEP}_order", nodes)
            nodes[g] = _add_identity(new, g, inp, dtype_of(inp), node.device, srcs, preserved=True)
            order_gates[key] = g
        nodes[target].input[pos] = g
        for c in readers:
            # A fusion pattern reads one tensor twice (oneDNN's Swish is
            # ``Mul(x, Sigmoid(x))``): the copies after the gated op that read inp
            # read the gate too, so the pattern sees one tensor. They descend from
            # the gated op, so they waited for its sources anyway. Found on
            # EfficientNetB0 with every update first (60 % budget): the Sigmoid copy
            # read the gate, the Mul copy ``x``, the pair ran unfused (Eigen's
            # sigmoid, not oneDNN's Swish) and a depthwise kernel's gradient, which
            # reads the recomputed activation, differed by 1.5e-7 after one step.
            nodes[c].input[:] = [g if i == inp else i for i in nodes[c].input]


def _traced_control(target: str, ctrl: str, traced: dict) -> bool:
    """Whether the control input ``ctrl`` (``^op``) of ``target`` is one the traced
    step gave it (``traced``: op name -> its control inputs): an original's own, or
    a copy's original's, which a copy waits on at the latest computation of its
    source (``^op/_remat<k>``; an original keeps the traced name). Any other is an ordering edge of the rewrite; so is
    every control input of a node the rewrite made (a gate)."""
    if target in traced:
        return ctrl in traced[target]
    base = _copy_base(target)
    if base not in traced:
        return False
    return ctrl in traced[base] or "^" + (_copy_base(ctrl[1:]) or "") in traced[base]


def _break_ordering_cycles(new, graph_def) -> int:
    """Drop ordering edges that close a cycle (in place); return how many.

    Each ordering edge follows the plan's schedule, but the re-seating rules of
    :func:`_anchor_ordering_edges` move an edge's source to a neighbour and a gate's
    wait to the readers of its input, and two such moves can close a cycle that
    ``import_graph_def`` refuses ("nodes in a cycle"). Found by a random hand-written
    step (``benchmarks/steps_fuzz.py 82``, 1 plan in 4): a gate in front of a
    BatchNorm product copy waited on a gradient ``AddN`` that, through a re-seated
    edge into the moments gradient, waited on that product. Data edges never close
    a cycle (a copy reads earlier computations) and neither do the traced step's
    own control inputs; an edge the rewrite added is only an order, so dropping
    one costs at most a measured peak above the prediction."""
    own = {n.name: {i for i in n.input if i.startswith("^")} for n in graph_def.node}
    nodes = {n.name: n for n in new.node}

    dropped = 0
    while True:
        g = nx.DiGraph()
        for n in new.node:
            g.add_node(n.name)
            for i in n.input:
                src = _split(i.lstrip("^"))[0]
                if src in nodes:
                    g.add_edge(src, n.name)
        try:
            cycle = nx.find_cycle(g)
        except nx.NetworkXNoCycle:
            return dropped
        for u, v in cycle:
            ctrl = "^" + u
            if ctrl in nodes[v].input and not _traced_control(v, ctrl, own):
                nodes[v].input.remove(ctrl)
                dropped += 1
                break
        else:
            raise AssertionError(f"a cycle of data edges and traced control edges: {cycle[:6]}")


def _topo_order(gd, stable: bool = False) -> list:
    """The ops of ``gd`` in a topological order; ``stable``: of the ready ops, the
    first in ``gd`` comes first (``gd``'s own order where that is topological)."""
    names = [n.name for n in gd.node]
    deps = {n.name: [_split(i.lstrip("^"))[0] for i in n.input] for n in gd.node}
    indeg = {k: 0 for k in names}
    out: dict = {}
    for k, ds in deps.items():
        for d in ds:
            if d in indeg:
                indeg[k] += 1
                out.setdefault(d, []).append(k)
    if stable:
        index = {k: i for i, k in enumerate(names)}
        heap = [index[k] for k in names if indeg[k] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            k = names[heapq.heappop(heap)]
            order.append(k)
            for c in out.get(k, ()):
                indeg[c] -= 1
                if indeg[c] == 0:
                    heapq.heappush(heap, index[c])
        return order
    ready = [k for k in names if indeg[k] == 0]
    order = []
    while ready:
        k = ready.pop()
        order.append(k)
        for c in out.get(k, ()):
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    return order
