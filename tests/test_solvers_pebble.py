"""The backward pebbling search and the recomputation lower bound against an exact oracle.

The oracle is a bottleneck shortest path over (live values, values ever computed):
the smallest peak of any schedule, recomputation and reordering unlimited, under the
simulator's accounting. Tiny fully recomputable graphs only (no ``inplace``).
"""

from __future__ import annotations

import heapq

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfremat import InfeasibleBudgetError, Problem, solve
from tfremat.simulate import reference_simulation, simulate, single_op_lower_bound
from tfremat.solvers.bounds import recompute_lower_bound
from tfremat.solvers.pebble import RULES, PebbleSearch, pebble_min_budget, pebble_plan

from strategies import dags, training_graphs


def exact_min_peak(g, fixed=0):
    """Smallest peak over every schedule (each node computed at least once)."""
    nodes = list(g.nodes)
    idx = {v: i for i, v in enumerate(nodes)}
    size = [int(g.nodes[v]["bytes"]) for v in nodes]
    preds = [sum(1 << idx[u] for u in g.predecessors(v)) for v in nodes]
    full = (1 << len(nodes)) - 1

    def nbytes(mask):
        return sum(size[i] for i in range(len(nodes)) if mask >> i & 1)

    # A state is (live, done); computing x needs its inputs live and costs
    # bytes(live) + bytes(x) at that position; dropping a live value is free (a
    # value the rest never reads is not live in the simulator).
    start = (0, 0)
    best = {start: 0}
    heap = [(0, start)]
    while heap:
        peak, (live, done) = heapq.heappop(heap)
        if best.get((live, done), None) != peak:
            continue
        if done == full:
            return peak + fixed
        moves = []
        for i in range(len(nodes)):
            if live >> i & 1:
                moves.append((peak, (live & ~(1 << i), done)))
            elif preds[i] & live == preds[i]:
                p = max(peak, nbytes(live) + size[i])
                moves.append((p, (live | 1 << i, done | 1 << i)))
        for p, s in moves:
            if p < best.get(s, float("inf")):
                best[s] = p
                heapq.heappush(heap, (p, s))
    raise AssertionError("unreachable: every node can be computed")


def recomputable(g):
    h = g.copy()
    for v in h:
        h.nodes[v]["recomputable"] = True
        h.nodes[v].pop("inplace", None)
    return h


tiny = st.one_of(dags(min_nodes=1, max_nodes=6, nonrecomputable=False),
                 training_graphs(max_forward=2).map(recomputable))


@settings(max_examples=60, deadline=None)
@given(g=tiny, fixed=st.sampled_from([0, 7]))
def test_recompute_lower_bound_is_sound_and_at_least_single_op(g, fixed):
    opt = exact_min_peak(g, fixed)
    for depth in (1, 3, 6):
        lb = recompute_lower_bound(g, fixed, depth=depth)
        assert single_op_lower_bound(g, fixed) <= lb <= opt


@settings(max_examples=60, deadline=None)
@given(g=tiny, fixed=st.sampled_from([0, 7]), rule=st.sampled_from(RULES))
def test_pebble_search_is_exact_when_exhaustive(g, fixed, rule):
    # Depth-first over every chain with dead states memoized: with no step limit it
    # finds a schedule at the optimal peak, and none below it.
    opt = exact_min_peak(g, fixed)
    ps = PebbleSearch(g, g.graph["order"])
    pos = ps.run(opt - fixed, rule, max_len=10**6, max_moves=10**7)
    assert pos is not None
    sched = ps.nodes(pos)
    sim = simulate(g, sched, fixed)  # raises on an invalid schedule
    assert sim.peak_bytes == opt
    if opt - fixed > 0:
        assert ps.run(opt - fixed - 1, rule, max_len=10**6, max_moves=10**7) is None


@settings(max_examples=40, deadline=None)
@given(g=dags(min_nodes=1, max_nodes=9, nonrecomputable=False), frac=st.floats(0.0, 1.2),
       rule=st.sampled_from(RULES), reserve=st.integers(0, 40), seed=st.none() | st.integers(0, 3))
def test_pebble_search_schedules_are_valid_and_fit(g, frac, rule, reserve, seed):
    lb = single_op_lower_bound(g)
    ref = reference_simulation(g).peak_bytes
    cap = int(lb + frac * (ref - lb))
    ps = PebbleSearch(g, g.graph["order"])
    pos = ps.run(cap, rule, reserve, max_len=50 * g.number_of_nodes(), max_moves=2000, seed=seed)
    if pos is None:
        assert ps.why
        return
    sim = simulate(g, ps.nodes(pos))
    assert sim.peak_bytes <= cap
    assert len(pos) <= 50 * g.number_of_nodes()


def test_pebble_search_gives_up_on_step_limit():
    # A layered graph whose low caps need many recomputations: tiny step limits stop.
    g = layered(6, 3, seed=1)
    lb = single_op_lower_bound(g)
    ps = PebbleSearch(g, g.graph["order"])
    assert ps.run(lb, max_moves=5) is None
    assert ps.why in ("step limit", "no chain fits the cap", "schedule length limit")
    with pytest.raises(ValueError):
        ps.run(lb, rule="nope")


def layered(layers, width, seed=0):
    import random

    rng = random.Random(seed)
    g = nx.DiGraph()
    g.add_node(0, bytes=rng.randint(5, 50), cost=1)
    prev, k = [0], 1
    allv = [0]
    for _ in range(layers):
        cur = []
        for _ in range(width):
            g.add_node(k, bytes=rng.randint(5, 50), cost=rng.randint(1, 9))
            ins = set(rng.sample(prev, min(len(prev), 2)))
            if rng.random() < 0.3:
                ins.add(rng.choice(allv))
            for u in ins:
                g.add_edge(u, k)
            cur.append(k)
            k += 1
        allv += cur
        prev = cur
    g.add_node(k, bytes=10, cost=1)
    for u in prev:
        g.add_edge(u, k)
    for v, a in g.nodes(data=True):
        a.update(phase="forward", recomputable=True)
    g.graph["order"] = list(range(k + 1))
    return g


def test_pebble_min_budget_and_plan_on_a_layered_graph():
    g = layered(8, 4, seed=3)
    prob = Problem(g, single_op_lower_bound(g))
    import time

    orders = {"ref": g.graph["order"]}
    peak, sched = pebble_min_budget(prob, orders, time.perf_counter() + 5)
    assert peak is not None
    assert simulate(g, sched).peak_bytes == peak
    assert single_op_lower_bound(g) <= peak <= reference_simulation(g).peak_bytes
    plan = pebble_plan(Problem(g, peak), orders, time.perf_counter() + 5)
    assert plan is not None and simulate(g, plan).peak_bytes <= peak


@settings(max_examples=15, deadline=None)
@given(g=dags(min_nodes=2, max_nodes=6, nonrecomputable=False), fixed=st.sampled_from([0, 7]))
def test_auto_meets_the_exact_minimum_budget_on_tiny_recomputable_graphs(g, fixed):
    # Graphs without a backward phase whose every node may be recomputed: auto's
    # fallback searches the pebble game, so it meets the optimal peak.
    opt = exact_min_peak(g, fixed)
    plan = solve(Problem(g, opt, fixed, time_limit_s=2), "auto")
    assert plan.predicted_peak_bytes <= opt
    if opt > single_op_lower_bound(g, fixed):
        with pytest.raises(InfeasibleBudgetError) as ei:
            solve(Problem(g, opt - 1, fixed, time_limit_s=2), "auto")
        assert ei.value.min_feasible_bytes >= opt


def test_auto_plans_below_the_eviction_planner_on_a_layered_graph():
    g = layered(10, 4, seed=5)
    import time

    peak, _ = pebble_min_budget(Problem(g, 0), {"ref": g.graph["order"]}, time.perf_counter() + 5)
    plan = solve(Problem(g, peak, time_limit_s=3), "auto")
    assert plan.predicted_peak_bytes <= peak
