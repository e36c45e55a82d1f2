"""The simulator implements the README accounting exactly (hand-checked cases + properties)."""

import networkx as nx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfremat.errors import InvalidScheduleError
from tfremat.simulate import (
    free_running_order,
    parallel_peak,
    reference_simulation,
    scratch_peak,
    simulate,
    single_op_lower_bound,
)

from strategies import dags


def chain(sizes, costs=None):
    g = nx.DiGraph()
    for i, b in enumerate(sizes):
        g.add_node(i, bytes=b, cost=(costs or [1] * len(sizes))[i])
        if i:
            g.add_edge(i - 1, i)
    g.graph["order"] = list(range(len(sizes)))
    return g


def test_chain_frees_each_value_after_its_last_use():
    g = chain([10, 20, 30])
    sim = simulate(g, [0, 1, 2])
    # pos 0: {0}; pos 1: input 0 + output 1; pos 2: input 1 + output 2 (0 freed)
    assert sim.memory.tolist() == [10, 30, 50]
    assert sim.peak_bytes == 50 and sim.peak_position == 2 and sim.cost == 3


def test_recomputation_binds_to_most_recent_copy():
    # 0 -> 1, 0 -> 2; recomputing 0 before 2 ends the first copy's life at 1.
    g = nx.DiGraph([(0, 1), (0, 2)])
    for v, b in [(0, 100), (1, 1), (2, 1)]:
        g.nodes[v].update(bytes=b, cost=5)
    ref = simulate(g, [0, 1, 2])
    assert ref.memory.tolist() == [100, 101, 101]
    sim = simulate(g, [0, 1, 0, 2])
    # the 1 output is freed at once (no consumer); first copy of 0 dies at pos 1
    assert sim.memory.tolist() == [100, 101, 100, 101]
    assert sim.cost == 20


def test_fixed_bytes_and_sink_outputs():
    g = chain([4, 8])
    sim = simulate(g, [0, 1], fixed_bytes=100)
    assert sim.memory.tolist() == [104, 112]


@pytest.mark.parametrize(
    "schedule, match",
    [([1, 0], "before its input"), ([0], "never computed"), ([0, 9, 1], "unknown")],
)
def test_invalid_schedules_raise(schedule, match):
    g = chain([1, 1])
    with pytest.raises(InvalidScheduleError, match=match):
        simulate(g, schedule)


def test_non_recomputable_twice_raises():
    g = chain([1, 1])
    g.nodes[0]["recomputable"] = False
    with pytest.raises(InvalidScheduleError, match="not recomputable"):
        simulate(g, [0, 1, 0])


def brute_memory(g, schedule, fixed=0):
    """Direct transcription of the README: O(n^2), for cross-checking."""
    last = {}
    bound = []  # for each position, the positions its inputs bind to
    for j, v in enumerate(schedule):
        bound.append([last[u] for u in g.predecessors(v)])
        last[v] = j
    mem = []
    for j in range(len(schedule)):
        live = sum(
            g.nodes[schedule[i]]["bytes"]
            for i in range(j)
            if any(i in bound[k] for k in range(j, len(schedule)))
        )
        mem.append(live + g.nodes[schedule[j]]["bytes"] + fixed)
    return mem


@st.composite
def dag_and_schedule(draw):
    g = draw(dags(nonrecomputable=False))
    # valid schedule: the order with random recomputations of already-run nodes,
    # each inserted with its (already computed) inputs available by construction.
    sched = []
    for v in g.graph["order"]:
        for _ in range(draw(st.integers(0, 2))):
            if sched:
                sched.append(draw(st.sampled_from(sorted(set(sched)))))
        sched.append(v)
    return g, sched, draw(st.integers(0, 10))


@given(dag_and_schedule())
def test_simulate_matches_readme_transcription(case):
    g, sched, fixed = case
    sim = simulate(g, sched, fixed)
    assert sim.memory.tolist() == brute_memory(g, sched, fixed)
    assert sim.cost == sum(g.nodes[v]["cost"] for v in sched)
    assert sim.peak_bytes >= single_op_lower_bound(g, fixed)


def test_reference_simulation_uses_order_attribute():
    g = nx.DiGraph()
    g.add_nodes_from([(0, {"bytes": 5, "cost": 1}), (1, {"bytes": 7, "cost": 1})])
    g.graph["order"] = [1, 0]
    sim = reference_simulation(g)
    assert sim.memory.tolist() == [7, 5]
    assert isinstance(sim.memory, np.ndarray)


# -- kernel scratch space as input nodes (tfremat.graph.with_scratch) -----------------
from hypothesis import strategies as hst  # noqa: E402

from strategies import training_graphs  # noqa: E402
from tfremat.graph import scratch_node, with_scratch  # noqa: E402
from tfremat.plan import Problem  # noqa: E402
from tfremat.solvers import solve  # noqa: E402


def test_scratch_is_live_only_while_its_op_runs():
    g = with_scratch(chain([10, 20, 30]), {1: 100})
    assert g.graph["order"] == [0, scratch_node(1), 1, 2]
    sim = simulate(g, g.graph["order"])
    # pos 1: 0 + scratch; pos 2: 0 + scratch + 1's output; pos 3: 1 + 2 (scratch freed)
    assert sim.memory.tolist() == [10, 110, 130, 50]
    assert sim.peak_bytes == 130 and sim.cost == 3


def test_no_scratch_leaves_the_graph_itself():
    g = chain([1, 2])
    assert with_scratch(g, {}) is g and with_scratch(g, {0: 0, "absent": 5}) is g


@given(training_graphs(), hst.data())
def test_scratch_adds_to_the_peak_exactly_at_its_op(g, data):
    order = g.graph["order"]
    scratch = {v: data.draw(hst.integers(0, 50)) for v in order if data.draw(hst.booleans())}
    h = with_scratch(g, scratch)
    plain = simulate(g, order)
    with_ = simulate(h, h.graph["order"])
    # memory at each op of the plain order, plus that op's scratch while it runs
    at_op = [m for v, m in zip(h.graph["order"], with_.memory) if v in g]
    assert at_op == [m + scratch.get(v, 0) for v, m in zip(order, plain.memory)]
    assert with_.peak_bytes == max(m + scratch.get(v, 0) for v, m in zip(order, plain.memory))
    assert with_.cost == plain.cost


@given(training_graphs(tf_like=True), hst.data())
def test_a_plan_with_scratch_nodes_dropped_is_a_valid_plan_of_the_graph(g, data):
    order = g.graph["order"]
    scratch = {v: data.draw(hst.integers(1, 50)) for v in order if data.draw(hst.booleans())}
    h = with_scratch(g, scratch)
    budget = reference_simulation(h).peak_bytes
    plan = solve(Problem(h, budget), "auto")
    stripped = [v for v in plan.schedule if v in g]
    sim = simulate(g, stripped)  # raises if invalid
    # the scratch only adds memory: the plan without it peaks no higher
    assert sim.peak_bytes <= plan.predicted_peak_bytes <= budget


def _call_with_two_outputs():
    """x -> call (outputs: a 40-byte convolution read by f, a 5-byte value read by
    the last op z) -> f -> z: the call is never recomputed (a function call)."""
    g = nx.DiGraph()
    for v, b, rec in [("x", 10, True), ("call", 45, False), ("f", 20, True), ("z", 1, True)]:
        g.add_node(v, bytes=b, cost=1.0, recomputable=rec, phase="forward")
    g.add_edges_from([("x", "call"), ("call", "f"), ("f", "z"), ("call", "z")], kind="data")
    g.nodes["call"]["output_readers"] = ((40, ("f",)), (5, ("z",)))
    g.graph["order"] = ["x", "call", "f", "z"]
    return g


def test_a_calls_outputs_are_freed_apart():
    from tfremat.graph import output_node, with_call_outputs

    g = _call_with_two_outputs()
    h = with_call_outputs(g)
    assert h.graph["order"] == ["x", "call/_tfremat_outputs", "call", output_node("call", 0),
                                output_node("call", 1), "f", "z"]
    assert g.nodes["call"]["bytes"] == 45 and g.graph["order"] == ["x", "call", "f", "z"]  # a copy
    # node-level: the 40 bytes live until z; apart, the convolution's go after f
    assert simulate(g, g.graph["order"]).memory.tolist() == [10, 55, 65, 66]
    sim = simulate(h, h.graph["order"])
    # x; the outputs reserved (x + 45); the call runs; output 0 (x freed); output 1;
    # f (both outputs + 20); z (output 1 + f + 1: the convolution freed after f)
    assert sim.memory.tolist() == [10, 55, 55, 40, 45, 65, 26]
    assert sim.peak_bytes == 65 and sim.cost == 4
    # a plan of h is one of g once the nodes g lacks are dropped
    plan = solve(Problem(h, 65), "auto")
    assert [v for v in plan.schedule if v in g] == g.graph["order"]


def test_a_recomputable_op_or_one_without_readers_apart_keeps_its_node():
    from tfremat.graph import with_call_outputs

    g = _call_with_two_outputs()
    g.nodes["call"]["recomputable"] = True
    assert with_call_outputs(g) is g
    plain = chain([1, 2])
    assert with_call_outputs(plain) is plain


def test_free_running_order_runs_each_op_as_soon_as_its_inputs_allow():
    g = nx.DiGraph()
    for v in "xabcm":
        g.add_node(v, bytes=1, cost=1.0)
    g.add_edges_from([("x", "a"), ("a", "b"), ("b", "c"), ("x", "m"), ("m", "c")])
    g.graph["order_edges"] = [("a", "d")]
    g.add_node("d", bytes=1, cost=1.0)
    order = free_running_order(g, ["x", "a", "b", "d", "m", "c"])
    # m needs x only: it runs beside a, not where the program put it; d waits for a
    assert order == ["x", "a", "m", "b", "d", "c"]
    simulate(g, order)  # a valid order
    with pytest.raises(InvalidScheduleError):
        free_running_order(g, ["x", "a", "a", "b", "d", "m", "c"])


def test_two_threads_run_two_readers_of_one_tensor_side_by_side():
    """``x`` read by two in-place products: one thread runs them one after the other
    and the second takes ``x`` over; two threads start both at once, and neither may."""
    g = nx.DiGraph()
    for v in ("x", "m1", "m2", "out"):
        g.add_node(v, bytes=10, cost=2.0, inplace=v != "x")
    g.add_edges_from([("x", "m1"), ("x", "m2"), ("m1", "out"), ("m2", "out")])
    order = ["x", "m1", "m2", "out"]
    assert parallel_peak(g, order, workers=1) == simulate(g, order).peak_bytes == 20
    assert parallel_peak(g, order, workers=2) == 30
    assert parallel_peak(g, order, 5, workers=2) == 35  # fixed bytes on top
    with pytest.raises(InvalidScheduleError):
        parallel_peak(g, order[:-1])


@given(dags(nonrecomputable=False), st.data())
def test_one_thread_runs_the_order_as_the_simulator_does(g, data):
    """With one thread every op runs in the order's sequence: the same peak as the
    simulator's, in-place takeovers included."""
    for v in g.nodes:
        g.nodes[v]["inplace"] = data.draw(st.booleans())
    order = list(g.graph["order"])
    fixed = data.draw(st.integers(0, 100))
    assert parallel_peak(g, order, fixed, workers=1) == simulate(g, order, fixed).peak_bytes


def test_kernel_scratch_counts_while_its_op_runs_and_beside_any_op_that_may_overlap_it():
    """``a`` and ``b`` both read ``x`` and neither waits for the other, so the
    executor may run their kernels together: both scratches count. ``c`` reads ``a``
    and never runs beside it."""
    g = nx.DiGraph()
    for v, b in (("x", 10), ("a", 1), ("b", 1), ("c", 1), ("out", 1)):
        g.add_node(v, bytes=b, cost=1.0)
    g.add_edges_from([("x", "a"), ("x", "b"), ("a", "c"), ("b", "out"), ("c", "out")])
    order = ["x", "a", "b", "c", "out"]
    scratch = {"a": 100, "b": 50, "c": 70}
    base = simulate(g, order).memory
    assert scratch_peak(g, order) == base.max()
    # at b: x + a + b, its 50 and the largest beside it (a's 100; c's 70 at c's
    # position, where x is freed, comes to less)
    assert base[2] == 12
    assert scratch_peak(g, order, scratch=scratch) == 12 + 50 + 100
    # ordering edges a -> b -> c: nothing overlaps, each op's own scratch only
    chained = g.copy()
    chained.graph["order_edges"] = [("a", "b"), ("b", "c")]
    assert scratch_peak(chained, order, scratch=scratch) == max(
        int(m) + scratch.get(v, 0) for m, v in zip(base, order))
    assert scratch_peak(g, order, 7, scratch={"a": 100}) == base[1] + 7 + 100
    # two threads start a and b together: both scratches at once
    assert parallel_peak(g, order, workers=2, scratch=scratch) >= 100 + 50 + 10
    assert parallel_peak(g, order, workers=1, scratch=scratch) == max(
        int(m) + scratch.get(v, 0) for m, v in zip(base, order))
    with pytest.raises(InvalidScheduleError):
        scratch_peak(g, order + ["a"], scratch=scratch)


@given(dags(nonrecomputable=False), st.data())
def test_scratch_bounds_one_thread_with_scratch_from_above(g, data):
    """One thread holds each op's scratch while it runs; the pairwise count holds at
    least that, and exactly the simulator's peak without scratch."""
    order = list(g.graph["order"])
    scratch = {v: data.draw(st.integers(0, 50)) for v in g.nodes}
    fixed = data.draw(st.integers(0, 100))
    one = parallel_peak(g, order, fixed, workers=1, scratch=scratch)
    assert one == max(int(m) + scratch[v] for m, v in zip(simulate(g, order, fixed).memory, order))
    assert scratch_peak(g, order, fixed, scratch) >= one
    assert scratch_peak(g, order, fixed) == simulate(g, order, fixed).peak_bytes
