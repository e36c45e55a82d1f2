"""Traced ops -> networkx dataflow graph with bytes, cost, phase, recomputability.

No TensorFlow here: :mod:`tfremat.trace` turns a concrete function into
:class:`OpRecord` s, and this module builds the planning graph from them.

Phases are found by structure and memory, never by op names:

* ``input``: placeholders (arguments, captured variable handles) and constants;
* ``update``: ops that write a variable (assign, ``ResourceApply*``, ...) and every
  op downstream of one;
* ``forward`` / ``backward``: the remaining ops split at the peak of the
  un-rematerialized schedule in program order. Values computed before that point and
  consumed after it are exactly what rematerialization can free, which is the only
  use tfremat makes of the split. A misplaced op can cost savings, never
  correctness: recomputing a stateless op yields the same value wherever it sits.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import networkx as nx

from .costs import ALIASING_OPS, NEVER_RECOMPUTE, op_cost
from .simulate import simulate

WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter", "ResourceStridedSliceAssign")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    bytes: int


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


def producer(tensor_name: str) -> str:
    return tensor_name.rsplit(":", 1)[0] if ":" in tensor_name else tensor_name


def is_variable_write(op_type: str) -> bool:
    return op_type.startswith(WRITE_PREFIXES)


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """The planning graph and the fixed memory of a traced step."""

    graph: nx.DiGraph
    fixed_bytes: int
    variable_bytes: int
    argument_bytes: int
    constant_bytes: int


def build_graph(records: Sequence[OpRecord], argument_ops: Iterable[str] = ()) -> StepGraph:
    """Build the planning graph of a step from its ops in program (creation) order.

    Parameters
    ----------
    records : sequence of OpRecord
        Every op of the step's graph, in creation order (a topological order).
    argument_ops : iterable of str
        Placeholders that are function arguments (their bytes are fixed: the caller
        holds them for the whole step).
    """
    argument_ops = set(argument_ops)
    by_name = {r.name: r for r in records}
    g = nx.DiGraph()
    order = [r.name for r in records]
    variable_sizes: dict[str, int] = {}
    argument_bytes = constant_bytes = 0

    for r in records:
        out_bytes = sum(t.bytes for t in r.outputs)
        alias = r.op_type in ALIASING_OPS
        if r.op_type in ("Const", "HostConst"):
            constant_bytes += out_bytes  # allocated once, before the step runs
            out_bytes = 0
        elif r.op_type == "Placeholder":
            if r.name in argument_ops:
                argument_bytes += out_bytes
            out_bytes = 0
        elif alias:
            out_bytes = 0
        in_shapes = []
        for t in r.inputs:
            src = by_name.get(producer(t))
            idx = int(t.rsplit(":", 1)[1]) if ":" in t else 0
            in_shapes.append(src.outputs[idx].shape if src and idx < len(src.outputs) else None)
        recomputable = not (
            r.stateful
            or r.calls_function
            or r.op_type in NEVER_RECOMPUTE
            or any(t.dtype in ("resource", "variant") for t in r.outputs)
        )
        g.add_node(
            r.name,
            op_type=r.op_type,
            bytes=int(out_bytes),
            cost=op_cost(r.op_type, in_shapes, [t.shape for t in r.outputs]),
            recomputable=recomputable,
            phase="forward",
            alias=alias,
        )
        # Variable sizes: what reads return and what assigns write, per handle.
        if r.op_type == "ReadVariableOp" and r.outputs and r.inputs:
            h = producer(r.inputs[0])
            variable_sizes[h] = max(variable_sizes.get(h, 0), r.outputs[0].bytes)

    for r in records:
        for t in r.inputs:
            g.add_edge(producer(t), r.name)
        for c in r.control_inputs:
            g.add_edge(c, r.name)
        if is_variable_write(r.op_type) and len(r.inputs) > 1 and r.op_type.startswith("Assign"):
            h = producer(r.inputs[0])
            src = by_name.get(producer(r.inputs[1]))
            if src is not None:
                idx = int(r.inputs[1].rsplit(":", 1)[1]) if ":" in r.inputs[1] else 0
                if idx < len(src.outputs):
                    variable_sizes[h] = max(variable_sizes.get(h, 0), src.outputs[idx].bytes)

    # An aliasing op's consumers keep its source buffer alive: add liveness edges
    # from the buffer's owner (the first non-aliasing producer) to those consumers.
    def owner(name: str) -> str:
        seen = set()
        while g.nodes[name]["alias"] and name not in seen:
            seen.add(name)
            rec = by_name[name]
            if not rec.inputs:
                break
            name = producer(rec.inputs[0])
        return name

    for r in records:
        if g.nodes[r.name]["alias"] and r.inputs:
            root = owner(r.name)
            if root == r.name:
                continue
            for c in list(g.successors(r.name)):
                if c != root:
                    g.add_edge(root, c, liveness=True)

    # Program order, except where control edges added after creation (automatic
    # control dependencies) demand otherwise.
    # Variable writes run as soon as they are ready (the executor runs ready ops, and
    # that frees each gradient early), so they sort first among ready ops.
    position = {name: i for i, name in enumerate(order)}
    writes = {r.name for r in records if is_variable_write(r.op_type)}
    order = list(
        nx.lexicographical_topological_sort(
            g, key=lambda v: (0 if v in writes else 1, position[v])
        )
    )

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
    sim = simulate(g, order)
    cut = sim.peak_position
    for i, v in enumerate(order):
        if g.nodes[v]["phase"] == "forward" and i > cut:
            g.nodes[v]["phase"] = "backward"
    for v in g.nodes:
        if g.nodes[v]["phase"] != "forward":
            g.nodes[v]["recomputable"] = False
    g.graph["order"] = order
    variable_bytes = sum(variable_sizes.values())
    return StepGraph(
        graph=g,
        fixed_bytes=int(variable_bytes + argument_bytes + constant_bytes),
        variable_bytes=int(variable_bytes),
        argument_bytes=int(argument_bytes),
        constant_bytes=int(constant_bytes),
    )
