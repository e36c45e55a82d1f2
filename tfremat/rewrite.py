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
from typing import Hashable, Mapping, Sequence

import networkx as nx

from .errors import RematError

COPY_SEP = "/_remat"
MAX_BARRIER_EDGES = 64

# Ops the remapper fuses with a sibling (an op reading the same tensor): oneDNN fuses
# Conv2DBackpropFilter with the BiasAddGrad of the same gradient, but not when either
# has a control input. Found by the Keras Hypothesis test: the strict-ordering edge
# Conv2DBackpropInput -> Conv2DBackpropFilter blocked the fusion and the conv bias
# differed by ~3e-8 after 2 Adam steps. These ops get no ordering control inputs;
# like small ops, the next big allocation waits for them (a control fanout does not
# block the fusion).
_FUSED_WITH_SIBLING = frozenset({"BiasAddGrad", "Conv2DBackpropFilter"})


@dataclasses.dataclass(frozen=True)
class RewriteInfo:
    copies: int
    gates: int
    rewired_inputs: int


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
        allocation) waits, through a control edge, for the previous big allocation
        and for every smaller op scheduled since then that reads a big tensor (its
        run frees that tensor). Chaining *every* op instead put control edges
        between ops Grappler later fuses or rewrites, which closed cycles.
        Measured (2 cores): without it the allocator peak of an 8-layer MLP varied
        by +-40 MiB from call to call around the prediction, and a residual CNN's
        by one activation; with it, peaks were identical on every call and within
        2 MiB of the prediction (docs/design.md).

    Raises
    ------
    RematError
        If the schedule names an op absent from the GraphDef.
    """
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
    is_copy = []
    for v in schedule:
        k = count.get(v, 0)
        count[v] = k + 1
        is_copy.append(k > 0)
    count.clear()

    def phase(v):
        return graph.nodes[v].get("phase", "forward") if v in graph else "input"

    data_consumers: dict = {}
    for n in graph_def.node:
        for i in n.input:
            if not i.startswith("^"):
                data_consumers.setdefault(_split(i)[0], set()).add(n.name)

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
        candidates: list[str] = []
        if end < n:
            consumer = schedule[end]
            preds = [
                u
                for u in graph.predecessors(consumer)
                if u in pos_of_original and phase(u) in ("backward", "update")
            ]
            candidates += sorted(preds, key=lambda u: -pos_of_original[u])
        for i in range(j - 1, max(-1, j - 200), -1):
            if not is_copy[i] and phase(schedule[i]) != "input":
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

        triggers: list[str] = []
        for t in candidates:
            if not risky(t):
                triggers.append(t)
                break
        # Barrier: also wait for every op the schedule ran since the previous chain
        # (its sinks suffice). Without it the executor postponed small ops that hold
        # big inputs (weight gradients holding an activation and its gradient), and
        # the measured peak varied by one activation from call to call.
        window = [
            schedule[i]
            for i in range(prev_chain_end, j)
            if not is_copy[i] and phase(schedule[i]) != "input"
        ]
        in_window = set(window)
        for u in window:
            if len(triggers) >= MAX_BARRIER_EDGES:
                break
            if u in triggers or any(w in in_window for w in graph.successors(u)):
                continue
            if not risky(u):
                triggers.append(u)
        return triggers

    def fused_later(u: str) -> bool:
        """Whether ``u`` may be fused with a sibling the schedule has not run yet.

        The fused node runs when the sibling does, so an op waiting on ``u`` may be an
        ancestor of the fused node: a cycle (measured: a recomputed residual input of
        a convolution waited on that convolution's BiasAddGrad, which oneDNN then
        fused with the Conv2DBackpropFilter that reads the recomputed input).
        """
        src = originals.get(u)
        if src is None or src.op not in _FUSED_WITH_SIBLING:
            return False
        for inp in src.input:
            if inp.startswith("^"):
                continue
            for sib in data_consumers.get(_split(inp)[0], ()):
                if sib != u and originals[sib].op in _FUSED_WITH_SIBLING and sib not in pos_of_original:
                    return True
        return False

    gates: dict = {}
    n_copies = n_rewired = 0
    chain_triggers: list[str] = []
    prev_chain_end = 0
    prev_serial = None
    pending_small: list[str] = []
    # Strict ordering chains only ops whose output matters for the peak: chaining
    # every op put control edges between ops Grappler later fuses (oneDNN's
    # Conv2DBackpropFilter + BiasAddGrad), and the fused node closed a cycle.
    largest = max((graph.nodes[v]["bytes"] for v in graph.nodes), default=0)
    min_bytes = max(1, largest // 64)
    for j, v in enumerate(schedule):
        k = count.get(v, 0)
        count[v] = k + 1
        src = originals[v]
        if k == 0:
            node = nodes[v]
            pos_of_original[v] = j
        else:
            if not is_copy[j - 1] if j else True:
                chain_triggers = chain_triggers_for(j)
                prev_chain_end = j
            node = new.node.add()
            node.CopyFrom(src)
            name = f"{v}{COPY_SEP}{k}"
            while name in taken:
                name += "_"
            taken.add(name)
            node.name = name
            n_copies += 1
        del node.input[:]
        for inp in src.input:
            if inp.startswith("^"):
                node.input.append(inp)
                continue
            op, idx = _split(inp)
            bound = latest.get(op, op)
            if k > 0 and bound == op and chain_triggers:
                key = (inp, tuple(chain_triggers))
                gate = gates.get(key)
                if gate is None:
                    gate = f"{op}{COPY_SEP}_gate{len(gates)}"
                    while gate in taken:
                        gate += "_"
                    taken.add(gate)
                    g = new.node.add()
                    g.name = gate
                    g.op = "Identity"
                    g.input.append(inp)
                    g.input.extend("^" + t for t in chain_triggers)
                    g.attr["T"].type = dtypes[op][int(idx[1:]) if idx else 0]
                    if src.device:
                        g.device = src.device
                    gates[key] = gate
                node.input.append(gate)
                continue
            if bound != op:
                n_rewired += 1
            node.input.append(bound + idx)
        latest[v] = node.name
        # Copies are ordered too: a gate releases a whole recomputation chain at once,
        # and independent branches of it (two BatchNorm blocks' statistics) ran
        # interleaved, holding one activation more each (docs/design.md).
        if strict and phase(v) != "input":
            data_srcs = {_split(i)[0] for i in node.input if not i.startswith("^")}
            if graph.nodes[v]["bytes"] >= min_bytes and src.op not in _FUSED_WITH_SIBLING:
                # A big allocation waits for the previous big one and for every
                # small op since then that reads a big tensor (and so frees it).
                waits = pending_small + ([prev_serial] if prev_serial else [])
                for u in waits:
                    if u not in data_srcs and not fused_later(u):
                        node.input.append("^" + u)
                pending_small = []
                prev_serial = node.name
            elif any(
                graph.nodes[producer_of].get("bytes", 0) >= min_bytes
                for producer_of in (_split(i)[0] for i in src.input if not i.startswith("^"))
                if producer_of in graph
            ):
                pending_small.append(node.name)
    return new, RewriteInfo(copies=n_copies, gates=len(gates), rewired_inputs=n_rewired)
