"""Diff the graph a rewritten step executed against the original's, op by op.

A debugging aid for bitwise differences: Grappler and oneDNN's passes rewrite both
steps after tfremat is done, and a copy that runs another kernel than its original
(an unfused pair, a division turned into a product) computes other bits. Dump both
steps' executed graphs, one process each, then diff them::

    TF_DUMP_GRAPH_PREFIX=/tmp/ref TF_DUMP_GRAPH_NAME_FILTER='*' python step.py plain
    TF_DUMP_GRAPH_PREFIX=/tmp/rem TF_DUMP_GRAPH_NAME_FILTER='*' python step.py remat
    python benchmarks/executed_diff.py /tmp/ref/<step>_partition_*after_partition_passes.pbtxt \\
        /tmp/rem/<body>_partition_*after_partition_passes.pbtxt

Every node of the rewritten graph is compared with the original node it stands
for (its own name, or a copy's ``<op>/_remat<k>``): the op, ``fused_ops``, and the
data inputs by the original each stands for (constants by value, arguments as
``ARG``). tfremat's own nodes (gates, fan-out dummies, pair sums) are skipped;
``--chain NODE`` prints NODE's recomputed inputs instead, with each op beside its
original's. Run a single step first: after one step, the variables that differ
point at the gradient to follow with ``--chain``.

Found with it (session 21): an ordering gate that split a recomputed Swish, so the
copy ran ``Mul`` where the original ran ``_MklSwish`` (docs/design.md).
"""
from __future__ import annotations

import argparse
import collections

COPY_SEP = "/_remat"
SCOPE = "remat/"  # the import scope tfremat.emit gives the rewritten step's ops
# Two-input ops whose inputs may come in either order (IEEE addition and
# multiplication commute exactly, and ``(a-b)**2 == (b-a)**2``: IEEE subtraction
# rounds ``a-b`` to exactly ``-(b-a)``); AddN is not here: its summation order is its
# input order.
COMMUTATIVE = frozenset({"Add", "AddV2", "Mul", "Maximum", "Minimum", "Equal", "NotEqual", "SquaredDifference"})
OWN = ("_remat_fanout", "_remat_sum", "_remat_gate", "_remat_order", "_hold")


def load(path: str) -> dict:
    from google.protobuf import text_format
    from tensorflow.core.framework import graph_pb2

    g = graph_pb2.GraphDef()
    with open(path) as f:
        text_format.Parse(f.read(), g)
    return {n.name: n for n in g.node}


def origin(name: str) -> str:
    """The original op ``name`` stands for."""
    if name.startswith(SCOPE):
        name = name[len(SCOPE):]
    return name.split(COPY_SEP)[0]


def through_own(graph: dict, tensor: str) -> str:
    """``tensor``, or what a chain of tfremat's identities (gates, named after the op
    they feed, not the tensor they pass) forwards."""
    for _ in range(8):
        name = tensor.split(":")[0]
        n = graph.get(name)
        if n is None or n.op != "Identity" or not any(o in name for o in OWN):
            break
        tensor = next(i for i in n.input if not i.startswith("^"))
    return tensor


def signature(node, graph: dict) -> tuple:
    """What decides the bits ``node`` computes, up to its inputs' own signatures."""
    ins = []
    for i in node.input:
        if i.startswith("^"):
            continue
        name, _, slot = through_own(graph, i).partition(":")
        p = graph.get(name)
        if p is not None and p.op == "_Arg":
            ins.append(("ARG", slot))
        elif p is not None and p.op == "Const":
            ins.append(("CONST", p.attr["value"].tensor.SerializeToString(deterministic=True).hex()[:64]))
        else:
            ins.append((origin(name), slot or "0"))
    fused = tuple(node.attr["fused_ops"].list.s) if "fused_ops" in node.attr else ()
    if node.op in COMMUTATIVE:  # the same bits in either order
        ins.sort()
    return node.op, fused, tuple(ins)


def diff(ref: dict, rem: dict) -> list:
    """(rewritten node, original's signature, its signature) wherever they differ."""
    out = []
    for name, node in rem.items():
        base = origin(name)
        if base not in ref or node.op in ("_Arg", "_Retval", "Const", "NoOp") or any(o in name for o in OWN):
            continue
        a, b = signature(ref[base], ref), signature(node, rem)
        if a != b:
            out.append((name, a, b))
    return out


def chain(ref: dict, rem: dict, start: str) -> list:
    """``start`` and the recomputed ops it reads, depth first: (depth, name, op, original's op)."""
    out, seen, stack = [], set(), [(start, 0)]
    while stack:
        name, depth = stack.pop()
        if name in seen or name not in rem:
            continue
        seen.add(name)
        node = rem[name]
        original = ref.get(origin(name))
        out.append((depth, name, node.op, original.op if original is not None else None))
        if depth == 0 or COPY_SEP in name:
            for i in node.input:
                p = i.split(":")[0]
                if not i.startswith("^") and p in rem and rem[p].op not in ("Const", "_Arg"):
                    stack.append((p, depth + 1))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original", help="the original step's executed graph (.pbtxt)")
    ap.add_argument("rewritten", help="the rewritten step's executed graph (.pbtxt)")
    ap.add_argument("--chain", help="print this node's recomputed inputs instead")
    ap.add_argument("--limit", type=int, default=40, help="differences printed in full")
    args = ap.parse_args(argv)
    ref, rem = load(args.original), load(args.rewritten)
    if args.chain:
        for depth, name, op, ref_op in chain(ref, rem, args.chain):
            mark = "" if op == ref_op or ref_op is None or op == "Identity" else "   <-- differs"
            print(f"{'  ' * depth}{name} [{op}] original [{ref_op}]{mark}")
        return
    found = diff(ref, rem)
    kinds = collections.Counter((a[0], b[0]) for _, a, b in found)
    for name, a, b in found[: args.limit]:
        print(f"{name}\n  original  {a}\n  rewritten {b}")
    print(f"{len(found)} differing nodes of {len(rem)}; (original op, rewritten op): {dict(kinds)}")


if __name__ == "__main__":
    main()
