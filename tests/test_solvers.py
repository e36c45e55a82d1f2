"""Every registered solver: valid plans within budget, or a typed, meaningful error."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
from hypothesis import given

import tfremat
from tfremat import InfeasibleBudgetError, Problem, simulate, solve
from tfremat.simulate import reference_simulation, single_op_lower_bound
from tfremat.solvers import SOLVERS, get_solver

from strategies import problems, training_graphs

FAST = [name for name in SOLVERS if name != "exact"]


def check_outcome(name, g, budget, fixed):
    problem = Problem(g, budget, fixed, time_limit_s=2.0)
    try:
        plan = solve(problem, name)
    except InfeasibleBudgetError as e:
        # The error must say something true and useful: above the budget asked
        # for, and never below what any schedule needs.
        assert e.min_feasible_bytes > budget
        assert e.min_feasible_bytes >= single_op_lower_bound(g, fixed)
        return None
    sim = simulate(g, plan.schedule, fixed)  # raises on an invalid schedule
    assert sim.peak_bytes <= budget
    assert plan.predicted_peak_bytes == sim.peak_bytes and plan.cost == sim.cost
    assert plan.cost >= reference_simulation(g, fixed).cost - 1e-9
    if plan.cost_lower_bound is not None:
        assert plan.cost_lower_bound <= plan.cost + 1e-9
    return plan


@pytest.mark.parametrize("name", FAST)
@given(case=problems())
def test_solver_plans_fit_or_raise(name, case):
    check_outcome(name, *case)


def first_occurrences(schedule):
    seen, out = set(), []
    for v in schedule:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


@given(case=problems(training_graphs(tf_like=True)))
def test_auto_keeps_reference_order_of_first_occurrences(case):
    # The TensorFlow rewriter keeps original ops in reference order.
    g, budget, fixed = case
    plan = check_outcome("auto", g, budget, fixed)
    if plan is not None:
        assert first_occurrences(plan.schedule) == list(g.graph["order"])


@given(case=problems())
def test_auto_never_worse_than_chen_greedy(case):
    g, budget, fixed = case
    auto = check_outcome("auto", g, budget, fixed)
    for baseline in ("chen_greedy", "chen_greedy_linearized", "checkpoint_all"):
        other = check_outcome(baseline, g, budget, fixed)
        if other is not None:
            assert auto is not None, f"{baseline} fits but auto does not"
            assert auto.cost <= other.cost + 1e-9


def test_reference_fits_means_no_recomputation():
    g = nx.DiGraph([(0, 1), (1, 2)])
    for v in g:
        g.nodes[v].update(bytes=10, cost=1)
    g.graph["order"] = [0, 1, 2]
    for name in FAST:
        plan = solve(Problem(g, 20), name)
        assert list(plan.schedule) == [0, 1, 2] and plan.recomputed == ()


def test_checkpoint_all_reports_reference_peak_when_infeasible():
    g = nx.DiGraph([(0, 1), (0, 2), (1, 2)])
    for v in g:
        g.nodes[v].update(bytes=10, cost=1)
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(Problem(g, 25), "checkpoint_all")
    assert ei.value.min_feasible_bytes == 30


def test_below_single_op_bound_raises_with_that_bound_or_more():
    g = nx.DiGraph([(0, 2), (1, 2)])
    for v, b in [(0, 10), (1, 20), (2, 30)]:
        g.nodes[v].update(bytes=b, cost=1)
    g.graph["order"] = [0, 1, 2]
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(Problem(g, 59), "auto")
    assert ei.value.min_feasible_bytes == 60
    assert solve(Problem(g, 60), "auto").predicted_peak_bytes == 60


def test_auto_recomputes_cheap_values_on_a_training_chain():
    # f0 -> f1 -> f2 -> loss and the mirrored backward; keeping all activations
    # peaks high, recomputing the cheap one fits.
    g = nx.DiGraph()
    sizes = {"f0": 10, "f1": 10, "f2": 10}
    for v, b in sizes.items():
        g.add_node(v, bytes=b, cost=1, phase="forward")
    g.add_node("loss", bytes=1, cost=1, phase="forward")
    for v in ["b2", "b1", "b0"]:
        g.add_node(v, bytes=1, cost=1, phase="backward", recomputable=False)
    g.add_edges_from([("f0", "f1"), ("f1", "f2"), ("f2", "loss"), ("loss", "b2"), ("f2", "b2"),
                      ("b2", "b1"), ("f1", "b1"), ("b1", "b0"), ("f0", "b0")])
    g.graph["order"] = ["f0", "f1", "f2", "loss", "b2", "b1", "b0"]
    ref = reference_simulation(g)
    plan = solve(Problem(g, ref.peak_bytes - 5), "auto")
    assert plan.recomputed and plan.cost > ref.cost
    assert plan.predicted_peak_bytes <= ref.peak_bytes - 5


def test_registry_is_read_only_and_resolves_names_and_callables():
    with pytest.raises(TypeError):
        SOLVERS["mine"] = SOLVERS["auto"]  # type: ignore[index]
    assert get_solver("auto") is SOLVERS["auto"]
    fn = SOLVERS["checkpoint_all"]
    assert get_solver(fn) is fn
    with pytest.raises(ValueError, match="choose one of"):
        get_solver("nope")
    with pytest.raises(TypeError):
        get_solver(3)  # type: ignore[arg-type]
    assert tfremat.SOLVERS is SOLVERS
    for name in ("checkpoint_all", "chen_sqrtn", "chen_greedy", "chen_sqrtn_linearized",
                 "chen_greedy_linearized", "cover", "auto"):
        assert name in SOLVERS


def test_solve_rejects_a_plan_over_budget():
    g = nx.DiGraph([(0, 1)])
    for v in g:
        g.nodes[v].update(bytes=10, cost=1)

    def liar(problem):
        plan = SOLVERS["checkpoint_all"](dataclasses.replace(problem, budget_bytes=10**9))
        return dataclasses.replace(plan, budget_bytes=problem.budget_bytes)

    with pytest.raises(tfremat.RematError, match="over"):
        solve(Problem(g, 15), liar)


# --- op-level graphs like a traced TensorFlow train step -------------------------


def op_level_mlp(layers: int = 40, width_bytes: int = 4096, seed: int = 0) -> nx.DiGraph:
    """Per layer: ReadVariableOp (not recomputable) -> MatMul -> BiasAdd -> Relu, with a
    mirrored backward (ReluGrad, BiasAddGrad, MatMul grads; not recomputable) and
    optimizer updates; many tiny elementwise ops, as a trace produces."""
    import random

    rnd = random.Random(seed)
    g = nx.DiGraph()
    order = []

    def add(name, nbytes, cost, phase, recomputable=True, inputs=()):
        g.add_node(name, bytes=int(nbytes), cost=cost, phase=phase, recomputable=recomputable)
        for u in inputs:
            g.add_edge(u, name)
        order.append(name)

    add("x", width_bytes, 0, "input", recomputable=False)
    prev = "x"
    for i in range(layers):
        w = width_bytes * rnd.choice([1, 2, 4])
        add(f"w{i}", 0, 0, "forward", recomputable=False)  # variable read (aliased)
        add(f"b{i}", 0, 0, "forward", recomputable=False)
        add(f"mm{i}", w, 8, "forward", inputs=[prev, f"w{i}"])
        add(f"ba{i}", w, 1, "forward", inputs=[f"mm{i}", f"b{i}"])
        add(f"relu{i}", w, 1, "forward", inputs=[f"ba{i}"])
        add(f"cast{i}", w // 2, 1, "forward", inputs=[f"relu{i}"])  # tiny elementwise op
        prev = f"relu{i}"
    add("loss", 4, 1, "forward", inputs=[prev] + [f"cast{i}" for i in range(layers)])
    grad = "loss"
    for i in reversed(range(layers)):
        src = "x" if i == 0 else f"relu{i-1}"
        add(f"rg{i}", g.nodes[f"relu{i}"]["bytes"], 1, "backward", False, [grad, f"relu{i}"])
        add(f"bg{i}", 64, 1, "backward", False, [f"rg{i}"])
        add(f"wg{i}", 64, 8, "backward", False, [f"rg{i}", src])
        add(f"xg{i}", g.nodes[src]["bytes"], 8, "backward", False, [f"rg{i}", f"w{i}"])
        add(f"upd{i}", 0, 1, "update", False, [f"wg{i}", f"bg{i}", f"w{i}", f"b{i}"])
        grad = f"xg{i}"
    g.graph["order"] = order
    return g


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.4])
def test_auto_on_op_level_graph(fraction):
    g = op_level_mlp()
    ref = reference_simulation(g)
    budget = int(fraction * ref.peak_bytes)
    plan = check_outcome("auto", g, budget, 0)
    assert plan is not None, "auto must fit an MLP at this budget"
    assert first_occurrences(plan.schedule) == list(g.graph["order"])
    for v in g:
        if not g.nodes[v]["recomputable"]:
            assert plan.schedule.count(v) == 1
    # never worse than the segment solver it replaces
    try:
        seg = solve(Problem(g, budget), "segments")
        assert plan.cost <= seg.cost
    except InfeasibleBudgetError:
        pass


def test_auto_infeasible_on_op_level_graph_reports_reachable_budget():
    g = op_level_mlp(layers=10)
    lb = single_op_lower_bound(g)
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(Problem(g, lb - 1, time_limit_s=2), "auto")
    mf = ei.value.min_feasible_bytes
    assert mf >= lb
    plan = solve(Problem(g, mf, time_limit_s=2), "auto")
    assert plan.predicted_peak_bytes <= mf
