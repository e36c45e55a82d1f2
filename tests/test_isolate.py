"""CP-SAT with TensorFlow loaded: solved in a child process (it segfaults in-process)."""

from __future__ import annotations

import networkx as nx
import pytest

pytest.importorskip("ortools")
pytest.importorskip("tensorflow")

import tfremat  # noqa: E402
from tfremat.simulate import reference_simulation, simulate  # noqa: E402
from tfremat.solvers.isolate import tensorflow_loaded  # noqa: E402


def training_chain(n=6):
    g = nx.DiGraph()
    fwd = [f"f{i}" for i in range(n)]
    bwd = [f"b{i}" for i in reversed(range(n))]
    for v in fwd:
        g.add_node(v, bytes=10, cost=1, phase="forward")
    for v in bwd:
        g.add_node(v, bytes=10, cost=1, phase="backward")
    for a, b in zip(fwd, fwd[1:]):
        g.add_edge(a, b)
    g.add_edge(fwd[-1], bwd[0])
    for a, b in zip(bwd, bwd[1:]):
        g.add_edge(a, b)
    for i in range(n - 1):
        g.add_edge(f"f{i}", f"b{i + 1}")
    g.graph["order"] = fwd + bwd
    return g


def test_exact_solver_works_after_tensorflow_import():
    assert tensorflow_loaded()
    g = training_chain()
    ref = reference_simulation(g)
    problem = tfremat.Problem(g, int(0.75 * ref.peak_bytes), time_limit_s=5)
    plan = tfremat.solve(problem, "exact")
    assert plan.recomputed
    assert simulate(g, plan.schedule).peak_bytes <= problem.budget_bytes


def test_isolated_solver_errors_come_back_typed():
    g = training_chain()
    with pytest.raises(tfremat.InfeasibleBudgetError):
        tfremat.solve(tfremat.Problem(g, 15, time_limit_s=2), "exact")


def test_errors_survive_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(tfremat.InfeasibleBudgetError(10, 20, "why")))
    assert (e.budget_bytes, e.min_feasible_bytes) == (10, 20) and "why" in str(e)
    u = pickle.loads(pickle.dumps(tfremat.UnknownShapeError("x:0", "(None, 3)")))
    assert u.tensor_name == "x:0"
    assert str(pickle.loads(pickle.dumps(tfremat.RematError("plain")))) == "plain"


def test_what_the_child_prints_to_stdout_does_not_break_its_result():
    """HiGHS prints from C to file descriptor 1 at low budgets (a generated residual
    training graph at 0.6 of its peak, ``exact``'s covering warm start): the child
    sends its result on the original stdout and everything else goes to stderr."""
    import os

    from tfremat.solvers.isolate import call_isolated

    noise = b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n"
    assert call_isolated(os.write, 1, noise) == len(noise)
