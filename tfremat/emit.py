"""Rewritten GraphDef -> a callable tf.function bound to the step's own variables.

Public APIs only: the new function's body imports the GraphDef with
``tf.graph_util.import_graph_def``, mapping each argument placeholder to the new
function's argument and each captured placeholder (variable handles, captured
tensors) to a capture of the *same* external handle, so the rewritten step reads and
updates the user's variables. Automatic control dependencies inside ``tf.function``
keep every imported stateful op (assigns, optimizer updates) in the function's
control outputs, as in the original.
"""

from __future__ import annotations

from typing import Any

from ._tf import import_tf
from .rewrite import FANOUT_SINK
from .trace import TracedStep


def emit(traced: TracedStep, graph_def, name: str = "remat") -> Any:
    """Return a ``tf.function`` taking the step's flat tensor arguments.

    The returned function returns the step's outputs with their original structure.
    """
    tf = import_tf()
    specs = list(traced.arg_specs)
    arg_names = list(traced.arg_placeholders)
    captures = list(traced.captures)
    outputs = list(traced.output_names)
    structure = traced.structured_outputs

    # The placeholders that get fed are dropped from the imported graph: the mapped
    # tensors replace every use, and an unfed Placeholder inside a function fails.
    fed = set(arg_names) | {n for _, n in captures}
    gd = type(graph_def)()
    gd.CopyFrom(graph_def)
    kept_nodes = [n for n in gd.node if n.name not in fed]
    del gd.node[:]
    gd.node.extend(kept_nodes)
    _drop_colocation_with(gd, fed | _missing_colocations(gd))
    # import_graph_def refuses to map a tensor nothing reads: an argument the step
    # ignores (``step(x, y, seed)`` with no dropout) or a capture the rewrite left unused
    read = {i.split(":")[0] for n in gd.node for i in n.input if not i.startswith("^")}

    def body(*args):
        g = tf.compat.v1.get_default_graph()
        input_map = {f"{ph}:0": a for ph, a in zip(arg_names, args) if ph in read}
        for handle, ph in captures:
            if ph in read:
                input_map[f"{ph}:0"] = g.capture(handle)
        sink = [FANOUT_SINK] if any(n.name == FANOUT_SINK for n in gd.node) else []
        flat = tf.graph_util.import_graph_def(
            gd, input_map=input_map, return_elements=outputs + sink, name=name
        )
        if sink:
            # the unused consumers tfremat.rewrite adds so Grappler sees the original
            # consumer counts; waiting for them keeps the runtime from pruning them
            with tf.control_dependencies([flat[-1]]):
                flat = [tf.identity(t) for t in flat[:-1]]
        return tf.nest.pack_sequence_as(structure, list(flat), expand_composites=True)

    return tf.function(body, input_signature=specs, autograph=False, reduce_retracing=False)


def _missing_colocations(graph_def) -> set:
    """Nodes named by a colocation constraint (``_class: loc:@NAME``) but absent from
    ``graph_def``: ones the trace bypassed (an ``IdentityN`` of
    ``tf.recompute_grad``'s gradient, which ``tf.clip_by_global_norm``'s ``L2Loss``
    is colocated with), which ``import_graph_def`` would refuse."""
    present = {n.name for n in graph_def.node}
    named = {v[5:].decode() for n in graph_def.node if "_class" in n.attr
             for v in n.attr["_class"].list.s if v.startswith(b"loc:@")}
    return named - present


def _drop_colocation_with(graph_def, names) -> None:
    """Remove colocation constraints (``_class: loc:@NAME``) naming dropped nodes.

    TensorFlow colocates some ops with an argument or a captured variable handle
    (``tf.nn.embedding_lookup`` with the table's handle, ``tf.image``'s stateless ops
    with their input); those placeholders are fed, not imported, and
    ``import_graph_def`` rejects a constraint naming a node it does not have. The fed
    tensor lives where the original did, so the constraint has nothing left to say.
    """
    for node in graph_def.node:
        if "_class" not in node.attr:
            continue
        values = list(node.attr["_class"].list.s)
        keep = [v for v in values if not (v.startswith(b"loc:@") and v[5:].decode() in names)]
        if len(keep) == len(values):
            continue
        if keep:
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(keep)
        else:
            del node.attr["_class"]
