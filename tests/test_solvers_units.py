"""Unit tests for solver building blocks: graph files, orders, eviction planner options."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfremat import Problem
from tfremat.io import from_node_link, to_node_link
from tfremat.simulate import reference_simulation, simulate
from tfremat.solvers.evict import EvictionPlanner, low_peak_order

from strategies import dags, problems, training_graphs


def bench_data(order=(0, 1, 2), edges=((0, 1), (1, 2))):
    return {
        "directed": True, "multigraph": False, "graph": {"name": "t", "order": list(order)},
        "nodes": [{"id": i, "cost_cpu": i + 1, "cost_ram": 10 * (i + 1), "backward": i == 2}
                  for i in range(3)],
        "links": [{"source": s, "target": t} for s, t in edges],
    }


def test_from_node_link_maps_benchmark_attributes():
    g = from_node_link(bench_data())
    assert g.nodes[1]["bytes"] == 20 and g.nodes[1]["cost"] == 2
    assert g.nodes[2]["phase"] == "backward" and g.nodes[0]["phase"] == "forward"
    assert all(g.nodes[v]["recomputable"] for v in g)
    assert g.graph["order"] == [0, 1, 2]
    # tfremat's own attribute names round-trip
    h = from_node_link(to_node_link(g))
    assert dict(h.nodes(data="bytes")) == dict(g.nodes(data="bytes"))


@pytest.mark.parametrize(
    "data, match",
    [
        (bench_data(order=(1, 0, 2)), "not topological"),
        (bench_data(order=(0, 1)), "every node"),
        (bench_data(edges=((0, 1), (1, 2), (2, 0))), "cycle"),
    ],
)
def test_from_node_link_rejects_bad_graphs(data, match):
    with pytest.raises(ValueError, match=match):
        from_node_link(data)


def test_from_node_link_requires_sizes():
    data = bench_data()
    del data["nodes"][0]["cost_ram"]
    with pytest.raises(ValueError, match="cost_ram"):
        from_node_link(data)


@given(g=dags(nonrecomputable=False), frac=st.floats(0.3, 1.0))
def test_low_peak_order_is_a_topological_order_no_worse_than_reference(g, frac):
    ref = reference_simulation(g).peak_bytes
    order, peak = low_peak_order(Problem(g, int(frac * ref)), deadline=0.0)
    assert sorted(order) == sorted(g.nodes)
    pos = {v: i for i, v in enumerate(order)}
    assert all(pos[u] < pos[v] for u, v in g.edges)
    assert peak == simulate(g, order).peak_bytes <= ref


@given(g=training_graphs(tf_like=False), frac=st.floats(0.3, 1.0),
       score=st.sampled_from(["belady", "cost_bytes", "cost_bytes_dist"]),
       keep=st.booleans())
def test_forward_only_planner_recomputes_forward_values_only(g, frac, score, keep):
    ref = reference_simulation(g).peak_bytes
    pl = EvictionPlanner(g, g.graph["order"], forward_only=True)
    pos = pl.run(int(frac * ref), score, keep_sources=keep)
    if pos is None:
        return
    sched = pl.nodes(pos)
    sim = simulate(g, sched)  # valid
    assert sim.peak_bytes <= int(frac * ref)  # the tracked count is conservative
    for v in g:
        if g.nodes[v]["phase"] == "backward":
            assert sched.count(v) == 1


@given(g=dags(), frac=st.floats(0.2, 1.0), keep=st.booleans(), nb=st.booleans(),
       inplace=st.booleans(), data=st.data())
def test_planner_schedules_are_valid_and_within_the_working_cap(g, frac, keep, nb, inplace, data):
    if inplace:  # the planner's takeover of an input's buffer must match the simulator's
        _mark_some_inplace(g, data)
    ref = reference_simulation(g).peak_bytes
    cap = int(frac * ref)
    pl = EvictionPlanner(g, g.graph["order"])
    pos = pl.run(cap, "cost_bytes", neighbourhood=nb, keep_sources=keep)
    if pos is not None:
        sched = pl.nodes(pos)
        assert simulate(g, sched).peak_bytes <= cap  # raises if invalid
        firsts = list(dict.fromkeys(sched))
        assert firsts == list(g.graph["order"])


@given(g=dags(), frac=st.floats(0.2, 1.0), keep=st.booleans(), nb=st.booleans(),
       score=st.sampled_from(["belady", "cost_bytes", "cost_bytes_dist"]))
def test_cone_planner_rebuilds_each_missing_value_at_most_once_per_step(g, frac, keep, nb, score):
    ref = reference_simulation(g).peak_bytes
    cap = int(frac * ref)
    pl = EvictionPlanner(g, g.graph["order"])
    pos = pl.run(cap, score, neighbourhood=nb, keep_sources=keep, cone=True)
    if pos is None:
        return
    sched = pl.nodes(pos)
    assert simulate(g, sched).peak_bytes <= cap  # raises if invalid
    assert list(dict.fromkeys(sched)) == list(g.graph["order"])
    # One step of the reference order (its recomputations, then its first
    # occurrence) runs every node at most once: the cone is rebuilt without repeats.
    seen, step = set(), []
    for v in sched:
        step.append(v)
        if v not in seen:
            seen.add(v)
            assert len(step) == len(set(step)), step
            step = []
    assert step == []
    for v in g:
        if not g.nodes[v]["recomputable"]:
            assert sched.count(v) == 1



def _mark_some_inplace(g, data) -> None:
    """Make some ops elementwise and in place, with an input of their own size (as TF's
    Relu, Add, ...): the simulator lets them take over that input's buffer."""
    for v in g:
        if data.draw(st.integers(0, 3)) == 0:
            ins = list(g.predecessors(v))
            if ins:
                g.nodes[v]["inplace"] = True
                g.nodes[v]["bytes"] = g.nodes[ins[0]]["bytes"]

@given(g=st.one_of(training_graphs(), dags()), frac=st.floats(0.2, 1.0), seed=st.integers(0, 99),
       fixed=st.sampled_from([0, 16]), data=st.data())
def test_once_lower_bound_holds_for_schedules_that_run_those_nodes_once(g, frac, seed, fixed, data):
    import random

    from tfremat.simulate import single_op_lower_bound
    from tfremat.solvers.bounds import backward_once, once_lower_bound
    from tfremat.solvers.evict import memory_greedy_order

    _mark_some_inplace(g, data)

    hard = once_lower_bound(g, fixed)  # non-recomputable nodes: every schedule
    soft = once_lower_bound(g, fixed, once=backward_once)
    assert single_op_lower_bound(g, fixed) <= hard <= soft
    o = memory_greedy_order(g, g.graph["order"], random.Random(seed), sigma=2.0)
    scheds = [o, list(g.graph["order"])]
    for forward_only in (False, True):
        pl = EvictionPlanner(g, o, forward_only=forward_only)
        pos = pl.run(int(frac * reference_simulation(g).peak_bytes), "cost_bytes")
        if pos is not None:
            scheds.append(pl.nodes(pos))
    for s in scheds:
        peak = simulate(g, s, fixed).peak_bytes
        assert peak >= hard
        if all(s.count(v) == 1 for v in backward_once(g)):
            assert peak >= soft


def test_single_op_bound_lets_an_inplace_op_reuse_its_input():
    import networkx as nx

    from tfremat.simulate import single_op_lower_bound

    g = nx.DiGraph([("x", "relu")])
    g.add_node("x", bytes=10, cost=1)
    g.add_node("relu", bytes=10, cost=1, inplace=True)
    assert simulate(g, ["x", "relu"]).peak_bytes == 10
    assert single_op_lower_bound(g) == 10  # was 20: above a real schedule's peak


def test_planner_lets_an_inplace_op_take_over_its_input_as_the_simulator_does():
    import networkx as nx

    # A gradient's elementwise chain (nothing in it may be recomputed): each op
    # overwrites its input, so one buffer of 10 is live at a time.
    g = nx.DiGraph([("x", "a"), ("a", "b"), ("b", "c")])
    for v in "xabc":
        g.add_node(v, bytes=10, cost=1, recomputable=False, inplace=v != "x")
    order = ["x", "a", "b", "c"]
    assert simulate(g, order).peak_bytes == 10
    # Counting input and output both (20), the planner found no schedule at 10.
    pos = EvictionPlanner(g, order).run(10, "cost_bytes")
    assert pos is not None and EvictionPlanner(g, order).nodes(pos) == order
    # Not when the input is read again later: both buffers are live.
    g.add_edge("a", "c")
    assert EvictionPlanner(g, order).run(10, "cost_bytes") is None
    assert EvictionPlanner(g, order).run(20, "cost_bytes") is not None


def test_once_lower_bound_counts_a_gradient_held_across_a_branch():
    # g0 feeds b1 (a branch) and b3 (after it): g0 is live while b1 -> b2 run.
    import networkx as nx

    from tfremat.solvers.bounds import backward_once, once_lower_bound

    g = nx.DiGraph([("f", "g0"), ("g0", "b1"), ("b1", "b2"), ("b2", "b3"), ("g0", "b3")])
    for v, b in {"f": 1, "g0": 10, "b1": 10, "b2": 10, "b3": 1}.items():
        g.add_node(v, bytes=b, cost=1, phase="forward" if v == "f" else "backward")
    g.graph["order"] = ["f", "g0", "b1", "b2", "b3"]
    assert once_lower_bound(g, once=()) == 21  # single-op: b3 reads b2 and g0
    assert once_lower_bound(g, once=backward_once) == 30  # + g0 while b2 runs
    assert reference_simulation(g).peak_bytes == 30


@given(g=st.one_of(training_graphs(), dags()), frac=st.floats(0.2, 1.0),
       fixed=st.sampled_from([0, 16]), data=st.data())
def test_fixed_order_lower_bound_holds_for_plans_in_reference_order(g, frac, fixed, data):
    from tfremat.solvers.bounds import backward_once, fixed_order_lower_bound, once_lower_bound

    _mark_some_inplace(g, data)
    hard = fixed_order_lower_bound(g, fixed)
    soft = fixed_order_lower_bound(g, fixed, once=backward_once)
    assert once_lower_bound(g, fixed) <= hard <= soft
    ref = reference_simulation(g, fixed).peak_bytes
    assert soft <= ref
    for forward_only in (False, True):
        pl = EvictionPlanner(g, g.graph["order"], forward_only=forward_only)
        pos = pl.run(int(frac * ref), data.draw(st.sampled_from(["belady", "cost_bytes"])),
                     cone=data.draw(st.booleans()))
        if pos is None:
            continue
        sched = pl.nodes(pos)  # first occurrences in reference order (tested above)
        peak = simulate(g, sched, fixed).peak_bytes
        assert peak >= hard
        if all(sched.count(v) == 1 for v in backward_once(g)):
            assert peak >= soft


def _quadratic_greedy_order(graph, order, rng=None, sigma=0.0):
    """memory_greedy_order's rule, written the obvious way (min over the ready set)."""
    pos = {v: i for i, v in enumerate(order)}
    scale = {v: rng.lognormvariate(0.0, sigma) for v in graph} if rng is not None else None
    remaining = {v: graph.out_degree(v) for v in graph}
    indeg = {v: graph.in_degree(v) for v in graph}
    ready, out = {v for v in graph if indeg[v] == 0}, []

    def delta(v):
        freed = sum(graph.nodes[u]["bytes"] for u in graph.predecessors(v) if remaining[u] == 1)
        own = graph.nodes[v]["bytes"] if graph.out_degree(v) else 0
        return ((own - freed) * (scale[v] if scale else 1), pos[v])

    while ready:
        v = min(ready, key=delta)
        ready.remove(v)
        out.append(v)
        for u in graph.predecessors(v):
            remaining[u] -= 1
        for w in graph.successors(v):
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.add(w)
    return out


@given(g=st.one_of(training_graphs(), dags(max_nodes=14)), seed=st.integers(0, 99),
       sigma=st.sampled_from([0.0, 0.3, 2.0]))
def test_memory_greedy_order_is_the_quadratic_rule(g, seed, sigma):
    """The heap version (n log n: an 11,000-op trace in 0.1 s, was 16 s) picks the
    same op at every step as the rule it implements."""
    import random

    from tfremat.solvers.evict import memory_greedy_order

    rng = random.Random(seed) if sigma else None
    want = _quadratic_greedy_order(g, g.graph["order"], random.Random(seed) if sigma else None, sigma)
    assert memory_greedy_order(g, g.graph["order"], rng, sigma) == want


@given(g=st.one_of(training_graphs(), dags(max_nodes=14)), seed=st.integers(0, 99), data=st.data())
def test_contiguous_orders_keep_what_a_rewrite_fuses_together(g, seed, data):
    """``contiguous``: topological (order edges too), an op's only consumer right after
    it when the op is its last input, and sibling-group members that become ready
    together side by side."""
    import random

    from tfremat.solvers.evict import memory_greedy_order

    ref = list(g.graph["order"])
    # Precedences without bytes, consistent with the reference order.
    pairs = data.draw(st.lists(st.tuples(st.integers(0, len(ref) - 1), st.integers(0, len(ref) - 1)),
                               max_size=4))
    g.graph["order_edges"] = [(ref[min(a, b)], ref[max(a, b)]) for a, b in pairs if a != b]
    # Two siblings reading the same node (oneDNN's Conv2DBackpropFilter + BiasAddGrad).
    p = data.draw(st.sampled_from(ref))
    for s in ("s1", "s2"):
        g.add_node(s, bytes=4, cost=1, phase="backward", recomputable=False, sibling_group="t")
        g.add_edge(p, s)
        ref.append(s)
    g.graph["order"] = ref
    o = memory_greedy_order(g, ref, random.Random(seed), sigma=1.0, contiguous=True)
    at = {v: i for i, v in enumerate(o)}
    assert sorted(o, key=str) == sorted(g.nodes, key=str)
    preds = {v: set(g.predecessors(v)) for v in g}
    for u, v in g.graph["order_edges"]:
        preds[v].add(u)
    assert all(at[u] < at[v] for v in g for u in preds[v])
    assert abs(at["s1"] - at["s2"]) == 1
    for v in g:
        succ = list(g.successors(v))
        if len(succ) == 1 and "sibling_group" not in g.nodes[v]:
            (w,) = succ
            if max(at[u] for u in preds[w]) == at[v] and at[v] + 1 < len(o) \
                    and "sibling_group" not in g.nodes[o[at[v] + 1]]:
                assert o[at[v] + 1] == w


def _held_gradients(n: int = 5):
    """A TensorFlow-like step whose reference order computes every backward op's side
    input (as TF's gradient code computes a BatchNorm gradient's partial results)
    right after the loss and holds it until that op runs."""
    import networkx as nx

    g = nx.DiGraph()
    order = []
    for i in range(n):
        g.add_node(("f", i), bytes=10, cost=1, phase="forward", recomputable=True)
        if i:
            g.add_edge(("f", i - 1), ("f", i))
        order.append(("f", i))
    g.add_node("loss", bytes=1, cost=1, phase="forward", recomputable=False)
    g.add_edge(("f", n - 1), "loss")
    order.append("loss")
    for i in reversed(range(n)):
        g.add_node(("side", i), bytes=10, cost=1, phase="backward", recomputable=False)
        g.add_edge("loss", ("side", i))
        order.append(("side", i))
    for i in reversed(range(n)):
        g.add_node(("b", i), bytes=10, cost=1, phase="backward", recomputable=False)
        g.add_edge(("side", i), ("b", i))
        g.add_edge(("f", i), ("b", i))
        g.add_edge(("b", i + 1) if i + 1 < n else "loss", ("b", i))
        order.append(("b", i))
    g.graph["order"] = order
    return g


def test_auto_reorder_plans_traces_below_the_floor_of_their_reference_order():
    """No plan keeping TensorFlow's order of first computations goes under its proven
    floor (``auto`` keeps it); ``auto_reorder_solver`` reorders first computations
    (each once-op still once) and does."""
    from tfremat.errors import InfeasibleBudgetError
    from tfremat.solvers import solve
    from tfremat.solvers.auto import auto_reorder_solver
    from tfremat.solvers.bounds import fixed_order_lower_bound

    g = _held_gradients()
    floor = fixed_order_lower_bound(g)
    budget = floor - 10
    plan = solve(Problem(g, budget), auto_reorder_solver)
    assert plan.predicted_peak_bytes <= budget
    assert all(plan.schedule.count(v) == 1 for v in g if not g.nodes[v]["recomputable"])
    for keep in (False, True):
        g.graph["keep_order"] = keep
        with pytest.raises(InfeasibleBudgetError) as e:
            solve(Problem(g, budget), "auto" if not keep else auto_reorder_solver)
        assert e.value.min_feasible_bytes >= floor


@given(p=problems(training_graphs(tf_like=True)))
def test_auto_reorder_is_valid_and_never_above_the_budget(p):
    """The experimental solver under the same contract as every registered one: the
    simulator accepts its schedule (``solve`` re-checks it), once-ops run once, and it
    plans wherever ``auto`` does."""
    from tfremat.errors import InfeasibleBudgetError
    from tfremat.solvers import solve
    from tfremat.solvers.auto import auto_reorder_solver

    g, budget, fixed = p
    try:
        base = solve(Problem(g, budget, fixed), "auto")
    except InfeasibleBudgetError:
        base = None
    try:
        plan = solve(Problem(g, budget, fixed), auto_reorder_solver)
    except InfeasibleBudgetError:
        assert base is None
        return
    assert plan.predicted_peak_bytes <= budget
    assert all(plan.schedule.count(v) == 1 for v in g if not g.nodes[v]["recomputable"])
    if base is not None:
        assert plan.cost <= base.cost


def test_contiguous_orders_run_asap_ops_when_ready():
    """An op the rewrite cannot hold back (node attribute ``asap``) is placed where
    TensorFlow runs it: as soon as its inputs exist. Memory-greedy alone would delay
    it (it allocates and frees nothing)."""
    import networkx as nx

    from tfremat.solvers.evict import memory_greedy_order

    g = nx.DiGraph()
    for v, b in (("s", 1), ("x1", 4), ("x2", 4), ("x3", 4), ("a", 50), ("out", 1)):
        g.add_node(v, bytes=b, cost=1)
    g.add_edges_from([("s", "x1"), ("x1", "x2"), ("x2", "x3"), ("s", "a"), ("a", "out"), ("x3", "out")])
    order = ["s", "a", "x1", "x2", "x3", "out"]
    assert memory_greedy_order(g, order).index("a") > 1  # delayed by the greedy rule
    g.nodes["a"]["asap"] = True
    o = memory_greedy_order(g, order, contiguous=True)
    assert o.index("a") == o.index("s") + 1


@given(g=st.one_of(training_graphs(), dags()), frac=st.floats(0.2, 1.0), extra=st.floats(0.0, 0.5),
       keep=st.booleans())
def test_dropping_recomputations_keeps_plans_valid_within_budget_and_never_dearer(g, frac, extra, keep):
    """Plans made under a working cap (eviction) are given a higher budget: the pass
    may only remove recomputations, stay within that budget and keep the order of
    first computations."""
    from tfremat.solvers.common import drop_recomputations

    ref = reference_simulation(g).peak_bytes
    cap = int(frac * ref)
    pl = EvictionPlanner(g, g.graph["order"])
    pos = pl.run(cap, "cost_bytes", keep_sources=keep)
    if pos is None:
        return
    sched = pl.nodes(pos)
    before = simulate(g, sched)
    budget = max(before.peak_bytes, int(cap * (1 + extra)))
    out = drop_recomputations(Problem(g, budget, 0), sched)
    after = simulate(g, out)  # raises if invalid
    assert after.peak_bytes <= budget
    assert after.cost <= before.cost
    assert list(dict.fromkeys(out)) == list(dict.fromkeys(sched))
    assert len(out) <= len(sched)


def test_dropping_recomputations_removes_what_the_budget_does_not_need():
    """Chain a -> b -> c -> d, and e reads a: recomputing a before e keeps the peak at
    two values; with room for three the recomputation goes, with room for two it
    stays. A recomputation nobody reads goes whatever the budget."""
    import networkx as nx

    from tfremat.solvers.common import drop_recomputations

    g = nx.DiGraph()
    for v in "abcde":
        g.add_node(v, bytes=10, cost=1)
    g.add_edges_from([("a", "b"), ("b", "c"), ("c", "d"), ("a", "e")])
    g.graph["order"] = list("abcde")
    sched = list("abcdae")
    assert simulate(g, sched).peak_bytes == 20
    assert drop_recomputations(Problem(g, 20, 0), sched) == sched
    assert drop_recomputations(Problem(g, 30, 0), sched) == list("abcde")
    assert drop_recomputations(Problem(g, 20, 0), list("abcdaeb")) == sched


def test_a_first_computation_nobody_reads_serves_its_readers_in_any_solvers_plan():
    """x -> s -> m (a Swish's Sigmoid and product), and y: a plan computing s, then y,
    then s again before m. The rewrite made m's input the gated copy of s, and
    oneDNN's Swish pattern ``Mul(x, Sigmoid(x))`` no longer matched
    (EfficientNetV2B0: every variable differed after 3 steps). The first s serves m
    instead (first computations keep their order), in every plan ``solve`` returns
    where the budget allows; unread copies go."""
    import networkx as nx

    from tfremat.solvers import solve
    from tfremat.solvers.common import drop_unread, make_plan, serve_unread_firsts

    g = nx.DiGraph()
    for v in "xsmy":
        g.add_node(v, bytes=10, cost=1, recomputable=True)
    g.add_edges_from([("x", "s"), ("x", "m"), ("s", "m"), ("x", "y")])
    g.graph["order"] = list("xsmy")
    assert serve_unread_firsts(g, list("xsysm")) == list("xsym")
    assert serve_unread_firsts(g, list("xsmsm")) == list("xsms")  # s was read; m serves its first
    assert drop_unread(g, list("xsmsm")) == list("xsm")  # the last m unread, then its s
    assert drop_unread(g, list("xsmyy")) == list("xsmy")

    def wasteful(problem):
        return make_plan(problem, list("xsysm"), "wasteful", "heuristic")

    plan = solve(Problem(g, 100, 0), wasteful)
    assert plan.schedule == tuple("xsym") and plan.cost == 4 and plan.solver == "wasteful"


@given(g=dags(), frac=st.floats(0.3, 0.9))
def test_restarts_bisect_their_working_budget_around_the_cap_that_fit(g, frac):
    """With the cap at which the winning rule fit, every restart's working budget
    stays within twice that distance above the budget (plus 1/16 of it); without it
    the bisection starts halfway to every value's bytes, far from where plans fit
    on big traces (docs/solvers.md)."""
    import time

    from tfremat.solvers.evict import restart_search

    ref = reference_simulation(g)
    problem = Problem(g, max(1, int(frac * ref.peak_bytes)), 0)
    best = (ref.cost * 10, list(g.graph["order"]))  # an incumbent that prunes nothing
    caps = []

    class Spy(EvictionPlanner):
        def run(self, cap, *a, **kw):
            caps.append(cap)
            return super().run(cap, *a, **kw)

    pl = Spy(g, g.graph["order"])
    lo = problem.budget_bytes
    fit = lo + (int(pl.size.sum()) - lo) // 8
    restart_search(problem, pl, ("cost_bytes",), best, time.perf_counter() + 5, cap=fit)
    assert caps and min(caps) == lo
    assert max(caps) <= lo + 2 * max(0, fit - lo) + lo // 16
    caps.clear()
    restart_search(problem, pl, ("cost_bytes",), best, time.perf_counter() + 5)
    full = int(pl.size.sum()) + 1
    if full - lo > max(1, lo // 2000):
        assert (lo + full) // 2 in caps  # the wide bisection's first step
