"""Every registered solver on generated graphs none of the solvers was tuned on.

Usage (from the repository root)::

    python benchmarks/solver_sweep.py [--graphs SUBSTR ...] [--exact-time-limit S] [--json OUT]

The Checkmate/Moccasin graphs (``benchmarks/solvers.py``) are what ``auto``'s
portfolio was measured and tuned on; this sweep asks whether its choices hold on
graphs it never saw. It generates, from fixed seeds:

- **training graphs** in the shape Checkmate extracts from Keras models (forward
  layers, a loss, and one gradient node per forward layer that reads the gradients
  of the layer's consumers, the layer's inputs and its output): a residual network,
  a U-Net, a DenseNet block stack, an Inception-style network of parallel branches,
  a Transformer encoder (a big attention-score tensor per block) and a plain chain
  with uneven sizes;
- **random layered graphs** in the style of Gagrani et al. (layers of random width,
  edges to the previous layer and skip edges to earlier ones), at sizes between the
  published ones.

Each graph is solved at 0.9, 0.8, 0.7 and 0.6 of its reference order's peak by
``auto`` (default limits), ``exact`` (CP-SAT, in a memory-capped child process, 30 s
unless ``--exact-time-limit``) and every baseline. Per point it prints ``auto``'s
extra compute (cost minus the every-node-once cost) against the best other solver's,
and flags the points where ``auto`` is worse than a baseline, more than 5 % above the
best extra, infeasible where another solver found a plan, or slower than the issue's
targets (10 s on training graphs, 30 s on the layered ones). Per graph it also prints
the smallest budget ``auto`` meets against the proven bound (the larger of the
single-op and the recomputation bound), flagged above 1.10x.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import networkx as nx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfremat.io import from_node_link  # noqa: E402
from tfremat.simulate import reference_simulation, single_op_lower_bound  # noqa: E402
from tfremat.solvers import SOLVERS  # noqa: E402
from tfremat.solvers.bounds import recompute_lower_bound  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from solvers import run_one  # noqa: E402

FRACTIONS = (0.9, 0.8, 0.7, 0.6)
#: Seconds per auto solve (the issue's target for training graphs).
AUTO_TARGET_S = 10.0


def _graph(name: str, nodes: list, edges: list) -> nx.DiGraph:
    """A tfremat graph from (bytes, cost, backward) node tuples, in the node-link
    format of the shared benchmark graphs (node ids in reference order)."""
    data = {
        "directed": True, "multigraph": False, "graph": {"name": name, "order": list(range(len(nodes)))},
        "nodes": [{"id": i, "name": f"n{i}", "cost_ram": int(b), "cost_cpu": int(c), "backward": bool(bw)}
                  for i, (b, c, bw) in enumerate(nodes)],
        "links": [{"source": int(u), "target": int(v)} for u, v in edges],
    }
    return from_node_link(data)


def training_graph(name: str, fwd_bytes: list, fwd_edges: list, rng) -> nx.DiGraph:
    """Forward layers, a loss, one gradient node per layer (Checkmate's shape).

    ``fwd_edges`` join layer indices (``u < v``); layer 0 is the input. The gradient
    of layer ``v`` reads the gradients of ``v``'s consumers (the loss's for the last
    layer), ``v``'s inputs and ``v``'s output; it costs about twice the layer.
    """
    n = len(fwd_bytes)
    cost = [max(1, int(b // 1000 * rng.uniform(0.5, 1.5))) for b in fwd_bytes]
    nodes = [(b, c, False) for b, c in zip(fwd_bytes, cost)]
    loss = n
    nodes.append((4, 1, False))
    edges = list(fwd_edges) + [(n - 1, loss)]
    preds = {v: [u for u, w in fwd_edges if w == v] for v in range(n)}
    succs = {u: [w for x, w in fwd_edges if x == u] for u in range(n)}
    grad = {}
    for v in range(n - 1, 0, -1):  # the input (layer 0) needs no gradient
        grad[v] = len(nodes)
        nodes.append((fwd_bytes[v], 2 * cost[v], True))
        ups = [grad[c] for c in succs[v] if c in grad] or [loss]
        edges += [(g, grad[v]) for g in ups]
        edges += [(u, grad[v]) for u in preds[v]] + [(v, grad[v])]
    return _graph(name, nodes, edges)


def resnet(rng, blocks=12):
    sizes, edges = [8_000_000], []
    h = 0
    for b in range(blocks):
        scale = 2 ** -(b // 4)
        a = len(sizes); sizes.append(int(8e6 * scale * rng.uniform(0.8, 1.2))); edges.append((h, a))
        c = len(sizes); sizes.append(int(8e6 * scale)); edges.append((a, c))
        s = len(sizes); sizes.append(int(8e6 * scale)); edges += [(c, s), (h, s)]
        h = s
    out = len(sizes); sizes.append(40_000); edges.append((h, out))
    return sizes, edges


def unet(rng, depth=5):
    sizes, edges, skips = [4_000_000], [], []
    h = 0
    for d in range(depth):
        for _ in range(2):
            v = len(sizes); sizes.append(int(16e6 / 2 ** d * rng.uniform(0.9, 1.1))); edges.append((h, v)); h = v
        skips.append(h)
        v = len(sizes); sizes.append(int(4e6 / 2 ** d)); edges.append((h, v)); h = v  # pool
    for d in reversed(range(depth)):
        v = len(sizes); sizes.append(int(16e6 / 2 ** d)); edges += [(h, v)]; h = v  # up
        v = len(sizes); sizes.append(int(32e6 / 2 ** d)); edges += [(h, v), (skips[d], v)]; h = v  # concat
        v = len(sizes); sizes.append(int(16e6 / 2 ** d)); edges.append((h, v)); h = v
    out = len(sizes); sizes.append(4_000_000); edges.append((h, out))
    return sizes, edges


def densenet(rng, blocks=3, layers=6):
    sizes, edges = [6_000_000], []
    h = 0
    for b in range(blocks):
        members = [h]
        for _ in range(layers):
            bn = len(sizes); sizes.append(int(6e6 / 2 ** b * rng.uniform(0.5, 1.5)))
            edges += [(m, bn) for m in members]  # reads the concatenation of all before
            conv = len(sizes); sizes.append(int(2e6 / 2 ** b)); edges.append((bn, conv))
            members.append(conv)
        t = len(sizes); sizes.append(int(3e6 / 2 ** b)); edges += [(m, t) for m in members]
        h = t
    out = len(sizes); sizes.append(10_000); edges.append((h, out))
    return sizes, edges


def inception(rng, modules=8):
    sizes, edges = [6_000_000], []
    h = 0
    for m in range(modules):
        scale = 2 ** -(m // 3)
        ends = []
        for width in range(int(rng.integers(2, 5))):  # parallel branches of 1-3 layers
            prev = h
            for _ in range(int(rng.integers(1, 4))):
                v = len(sizes); sizes.append(int(3e6 * scale * rng.uniform(0.5, 2.0))); edges.append((prev, v)); prev = v
            ends.append(prev)
        cat = len(sizes); sizes.append(int(sum(sizes[e] for e in ends))); edges += [(e, cat) for e in ends]
        h = cat
    out = len(sizes); sizes.append(10_000); edges.append((h, out))
    return sizes, edges


def transformer(rng, blocks=6):
    d, scores = 2_000_000, 16_000_000  # the attention scores dwarf the activations
    sizes, edges = [d], []
    h = 0
    for _ in range(blocks):
        ln = len(sizes); sizes.append(d); edges.append((h, ln))
        q, k, v = (len(sizes) + i for i in range(3)); sizes += [d, d, d]; edges += [(ln, q), (ln, k), (ln, v)]
        s = len(sizes); sizes.append(scores); edges += [(q, s), (k, s)]
        p = len(sizes); sizes.append(scores); edges.append((s, p))  # softmax
        o = len(sizes); sizes.append(d); edges += [(p, o), (v, o)]
        r = len(sizes); sizes.append(d); edges += [(o, r), (h, r)]
        ln2 = len(sizes); sizes.append(d); edges.append((r, ln2))
        f1 = len(sizes); sizes.append(4 * d); edges.append((ln2, f1))
        f2 = len(sizes); sizes.append(d); edges.append((f1, f2))
        h2 = len(sizes); sizes.append(d); edges += [(f2, h2), (r, h2)]
        h = h2
    out = len(sizes); sizes.append(10_000); edges.append((h, out))
    return sizes, edges


def chain(rng, n=40):
    sizes = [int(b) for b in rng.lognormal(15, 1.0, n)]
    return sizes, [(i, i + 1) for i in range(n - 1)]


def layered(name: str, n: int, rng, width=0.35, edge_p=0.2, skip_p=0.14) -> nx.DiGraph:
    """A random layered DAG in the style of Gagrani et al.: one source, one sink,
    layers of random width, each node reading 1-3 nodes of the previous layer and,
    with probability ``skip_p`` each, nodes of earlier layers."""
    layers, count = [[0]], 1
    while count < n - 1:
        w = max(1, min(n - 1 - count, int(rng.integers(1, max(2, int(width * math.sqrt(n) * 2))))))
        layers.append(list(range(count, count + w)))
        count += w
    layers.append([count])
    nodes = [(int(rng.integers(1, 400)) * 20, int(rng.integers(0, 1000)), False) for _ in range(count + 1)]
    edges = set()
    for li in range(1, len(layers)):
        prev = layers[li - 1]
        for v in layers[li]:
            k = 1 + int(rng.binomial(min(2, len(prev) - 1), edge_p * 3)) if len(prev) > 1 else 1
            for u in rng.choice(prev, size=min(k, len(prev)), replace=False):
                edges.add((int(u), v))
            for lj in range(max(0, li - 8), li - 1):
                for u in layers[lj]:
                    if rng.random() < skip_p / len(layers[lj]):
                        edges.add((u, v))
    # Every node but the sink feeds something: a loose end feeds a random node of the
    # next layer (the sink only for the last layer), so the sink's in-degree stays
    # like the published graphs' (their single-op bound is 0.1-0.4 of the peak).
    has_out = {u for u, _ in edges}
    for li, layer in enumerate(layers[:-1]):
        for u in layer:
            if u not in has_out:
                edges.add((u, int(rng.choice(layers[li + 1]))))
    return _graph(name, nodes, sorted(edges))


def graphs() -> dict:
    out = {}
    for name, build, seed in (("resnet", resnet, 1), ("unet", unet, 2), ("densenet", densenet, 3),
                              ("inception", inception, 4), ("transformer", transformer, 5),
                              ("chain", chain, 6)):
        rng = np.random.default_rng(seed)
        sizes, edges = build(rng)
        out[f"train_{name}"] = training_graph(f"train_{name}", sizes, edges, rng)
    for n, seed in ((150, 7), (400, 8)):
        out[f"layered_n{n}"] = layered(f"layered_n{n}", n, np.random.default_rng(seed))
    return out


def _selected(patterns):
    """(name, graph) of the generated graphs whose name contains one of ``patterns``."""
    for name, g in graphs().items():
        if not patterns or any(p in name for p in patterns):
            yield name, g


def _point(gname, g, f, exact_limit, names):
    """Every solver at ``f`` of the reference peak: the row, its table line, its flags."""
    ref = reference_simulation(g, 0)
    budget = math.ceil(f * ref.peak_bytes)
    res = {"auto": run_one(g, budget, "auto", None)}
    res["exact"] = run_one(g, budget, "exact", exact_limit, mem_gib=4)
    for s in names:
        res[s] = run_one(g, budget, s, 10.0)
    extra = {s: r["cost"] - ref.cost for s, r in res.items() if "cost" in r}
    others = {s: e for s, e in extra.items() if s != "auto"}
    best_s = min(others, key=others.get) if others else None
    notes = []
    a = res["auto"]
    if "cost" not in a:
        if others:
            notes.append(f"auto {a['status']} where {best_s} plans")
    else:
        worse = [s for s in others if s != "exact" and others[s] < extra["auto"] - 1e-9]
        if worse:
            notes.append("worse than " + ", ".join(worse))
        if best_s is not None and extra["auto"] > 1.05 * others[best_s] + 1e-9:
            notes.append(f"> 1.05x best ({best_s})")
    # 10 s for training graphs; 30 s (a plan at 0.8) for the random layered ones
    limit = AUTO_TARGET_S if gname.startswith("train") else 30.0
    if a.get("solve_s", 0) > limit:
        notes.append(f"{a['solve_s']:.1f} s")
    ratio = None
    if "auto" in extra and best_s:
        ratio = extra["auto"] / others[best_s] if others[best_s] else (1.0 if extra["auto"] == 0 else math.inf)
    line = (f"| {gname} | {g.number_of_nodes()} | {f} | {extra.get('auto', a['status'])} "
            f"| {others.get(best_s, '—')} ({best_s}; exact {res['exact']['status']}) "
            f"| {'—' if ratio is None else f'{ratio:.3f}'} | {a.get('solve_s', 0):.1f} | {'; '.join(notes)} |")
    row = {"graph": gname, "fraction": f, "budget": budget, "base": ref.cost, "results": res}
    return row, line, [(gname, f, x) for x in notes]


def _smallest(gname, g):
    """auto's smallest budget against the proven bound (the larger of the single-op
    and the recomputation bound): the table line and its flags."""
    bound = max(single_op_lower_bound(g, 0), recompute_lower_bound(g, depth=20, max_steps=1_000_000))
    r = run_one(g, bound, "auto", None)  # at the bound itself: a plan, or auto's smallest budget
    smallest = bound if "cost" in r else r.get("min_feasible")
    if not isinstance(smallest, int):
        return f"| {gname} | {bound} | {r.get('status')} | — |", []
    ratio = smallest / bound
    flags = [(gname, "smallest", f"{ratio:.3f} x the proven bound")] if ratio > 1.10 else []
    return f"| {gname} | {bound} | {smallest} | {ratio:.3f} |", flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", nargs="*", default=None, help="substrings of graph names to run")
    ap.add_argument("--exact-time-limit", type=float, default=30.0)
    ap.add_argument("--fractions", nargs="*", type=float, default=list(FRACTIONS))
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args()
    names = [s for s in SOLVERS if s not in ("auto", "exact")]
    rows, flags = [], []
    print("| graph | nodes | fraction | auto extra | best other extra (solver) | auto / best | auto s | notes |")
    print("|---|---|---|---|---|---|---|---|")
    selected = list(_selected(args.graphs))
    for gname, g in selected:
        for f in args.fractions:
            row, line, notes = _point(gname, g, f, args.exact_time_limit, names)
            rows.append(row)
            flags += notes
            print(line, flush=True)
    print("\n| graph | proven bound | auto's smallest budget | / bound |")
    print("|---|---|---|---|")
    for gname, g in selected:
        line, notes = _smallest(gname, g)
        flags += notes
        print(line, flush=True)
    print(f"\n{len(flags)} flagged point(s)")
    for x in flags:
        print("  ", *x)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
