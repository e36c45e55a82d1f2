"""The CP-SAT solver against a brute-force oracle, and its monotonicity in the budget."""

from __future__ import annotations


import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfremat import InfeasibleBudgetError, Problem, solve
from tfremat.simulate import reference_simulation, single_op_lower_bound

from strategies import dags, training_graphs

pytest.importorskip("ortools")

from tfremat.solvers.exact import make_exact_solver  # noqa: E402

# Cold start (no auto hint) so the model is exactly "at most 2 computations per node",
# the set the oracle enumerates.
EXACT2 = make_exact_solver(max_computations=2, workers=2, warm_start=None, name="exact2")


def readme_peak(g, schedule, fixed=0):
    """Peak of a (possibly partial) schedule, straight from the README's definition."""
    last, bound = {}, []
    for j, v in enumerate(schedule):
        bound.append([last[u] for u in g.predecessors(v)])
        last[v] = j
    last_use = list(range(len(schedule)))
    for j, b in enumerate(bound):
        for i in b:
            last_use[i] = max(last_use[i], j)
    return max(
        sum(g.nodes[schedule[i]]["bytes"] for i in range(j + 1) if last_use[i] >= j) + fixed
        for j in range(len(schedule))
    )


def oracle(g, budget, fixed=0, max_comp=2):
    """Cheapest schedule with each node run 1..max_comp times (1 if not recomputable)."""
    nodes = list(g.nodes)
    cap = {v: max_comp if g.nodes[v].get("recomputable", True) else 1 for v in nodes}
    best = [None]

    def dfs(seq, counts, cost):
        if best[0] is not None and cost >= best[0]:
            return
        # Adding positions only lengthens lifetimes, so a partial peak over budget
        # can only grow: prune.
        if seq and readme_peak(g, seq, fixed) > budget:
            return
        if all(counts[v] >= 1 for v in nodes):
            best[0] = cost
            return
        for v in nodes:
            if counts[v] < cap[v] and all(counts[u] for u in g.predecessors(v)):
                counts[v] += 1
                seq.append(v)
                dfs(seq, counts, cost + g.nodes[v]["cost"])
                seq.pop()
                counts[v] -= 1

    dfs([], {v: 0 for v in nodes}, 0)
    return best[0]


small = st.one_of(dags(min_nodes=1, max_nodes=5), training_graphs(max_forward=2))


@settings(max_examples=25)
@given(g=small, frac=st.floats(0.0, 1.0), fixed=st.sampled_from([0, 5]))
def test_exact_equals_brute_force_oracle(g, frac, fixed):
    ref = reference_simulation(g, fixed).peak_bytes
    lb = single_op_lower_bound(g, fixed)
    budget = int(lb + frac * (ref - lb))
    want = oracle(g, budget, fixed)
    try:
        plan = solve(Problem(g, budget, fixed, time_limit_s=20), EXACT2)
    except InfeasibleBudgetError as e:
        assert want is None
        assert e.min_feasible_bytes > budget
        return
    assert plan.predicted_peak_bytes <= budget
    assert want is not None
    assert plan.status == "optimal"
    assert plan.cost == pytest.approx(want)
    assert plan.cost_lower_bound == pytest.approx(want)


@settings(max_examples=15)
@given(g=st.one_of(dags(min_nodes=2, max_nodes=6), training_graphs(max_forward=3)),
       a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0))
def test_exact_cost_never_rises_with_budget(g, a, b):
    ref = reference_simulation(g).peak_bytes
    lb = single_op_lower_bound(g)
    lo, hi = sorted((int(lb + a * (ref - lb)), int(lb + b * (ref - lb))))
    try:
        p_lo = solve(Problem(g, lo, time_limit_s=20), EXACT2)
    except InfeasibleBudgetError:
        return
    p_hi = solve(Problem(g, hi, time_limit_s=20), EXACT2)  # a plan at lo fits hi
    if p_lo.status == p_hi.status == "optimal":
        assert p_hi.cost <= p_lo.cost + 1e-9


def test_exact_default_is_warm_started_and_never_worse_than_auto():
    g = nx.DiGraph()
    n = 6
    for i in range(n):
        g.add_node(("f", i), bytes=10, cost=1 + i % 2, phase="forward")
        if i:
            g.add_edge(("f", i - 1), ("f", i))
    for i in reversed(range(n)):
        g.add_node(("b", i), bytes=10, cost=1, phase="backward")
        g.add_edge(("f", i), ("b", i))
        g.add_edge(("b", i + 1) if i < n - 1 else ("f", n - 1), ("b", i))
    g.graph["order"] = [("f", i) for i in range(n)] + [("b", i) for i in reversed(range(n))]
    budget = int(0.6 * reference_simulation(g).peak_bytes)
    auto = solve(Problem(g, budget), "auto")
    exact = solve(Problem(g, budget, time_limit_s=20), "exact")
    assert exact.cost <= auto.cost
    assert exact.status in ("optimal", "feasible")
    assert exact.cost_lower_bound <= exact.cost


def test_exact_below_lower_bound_raises():
    g = nx.DiGraph([(0, 1)])
    for v in g:
        g.nodes[v].update(bytes=10, cost=1)
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(Problem(g, 19), "exact")
    assert ei.value.min_feasible_bytes == 20


def test_exact_keeps_precedences_without_bytes():
    """TensorFlow control edges (graph attribute ``order_edges``) order first
    computations: here q may not run before r, nor s before p, so both 10-byte
    values exist before either consumer runs, which costs a recomputation."""
    from tfremat.simulate import check_precedences

    g = nx.DiGraph()
    for v, b in dict(x=1, p=10, q=1, r=10, s=1).items():
        g.add_node(v, bytes=b, cost=1.0)
    g.add_edges_from([("x", "p"), ("p", "q"), ("x", "r"), ("r", "s")])
    free = solve(Problem(g, 13), EXACT2)
    assert free.cost == 5  # q right after p, nothing recomputed
    g.graph["order_edges"] = [("r", "q"), ("p", "s")]
    plan = solve(Problem(g, 13), EXACT2)  # solve() also checks the precedences
    check_precedences(g, plan.schedule)
    first = {v: plan.schedule.index(v) for v in g}
    assert first["r"] < first["q"] and first["p"] < first["s"]
    assert plan.cost == 6
