"""``python -m tfremat solve``: budgets, JSON output in the README's accounting, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

from tfremat.__main__ import main
from tfremat.io import load_graph
from tfremat.simulate import reference_simulation, simulate

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks" / "checkmate-graphs"


def write_graph(path: Path) -> Path:
    """A small training graph in the benchmark file format (cost_ram/cost_cpu/backward)."""
    nodes = [
        {"id": 0, "name": "f0", "cost_cpu": 3, "cost_ram": 100, "backward": False},
        {"id": 1, "name": "f1", "cost_cpu": 2, "cost_ram": 100, "backward": False},
        {"id": 2, "name": "f2", "cost_cpu": 2, "cost_ram": 100, "backward": False},
        {"id": 3, "name": "loss", "cost_cpu": 1, "cost_ram": 10, "backward": False},
        {"id": 4, "name": "b2", "cost_cpu": 2, "cost_ram": 100, "backward": True},
        {"id": 5, "name": "b1", "cost_cpu": 2, "cost_ram": 100, "backward": True},
        {"id": 6, "name": "b0", "cost_cpu": 2, "cost_ram": 100, "backward": True},
    ]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (2, 4), (4, 5), (1, 5), (5, 6), (0, 6)]
    data = {"directed": True, "multigraph": False, "graph": {"name": "tiny", "order": list(range(7))},
            "nodes": nodes, "links": [{"source": s, "target": t} for s, t in edges]}
    path.write_text(json.dumps(data))
    return path


def test_solve_fraction_writes_readme_accounting(tmp_path, capsys):
    gpath = write_graph(tmp_path / "g.json")
    out = tmp_path / "out.json"
    rc = main(["solve", str(gpath), "--budget-fraction", "0.75", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {"graph", "budget", "solver", "status", "cost", "peak", "lower_bound", "solve_s",
            "schedule"} <= set(res)
    g = load_graph(gpath)
    ref = reference_simulation(g)
    assert res["budget"] == math.ceil(0.75 * ref.peak_bytes)
    sim = simulate(g, res["schedule"])  # ids as in the file
    assert res["peak"] == sim.peak_bytes <= res["budget"]
    assert res["cost"] == sim.cost and res["cost"] > ref.cost  # it had to recompute
    assert res["lower_bound"] <= res["cost"]
    assert "auto" in capsys.readouterr().out


def test_solve_budget_bytes_with_named_solver(tmp_path):
    gpath = write_graph(tmp_path / "g.json")
    out = tmp_path / "o.json"
    assert main(["solve", str(gpath), "--budget-bytes", "100000", "--solver", "checkpoint_all",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["schedule"] == list(range(7)) and res["status"] == "optimal"


def test_infeasible_budget_exit_status_and_json(tmp_path, capsys):
    gpath = write_graph(tmp_path / "g.json")
    out = tmp_path / "o.json"
    rc = main(["solve", str(gpath), "--budget-bytes", "50", "--json", str(out)])
    assert rc == 3
    res = json.loads(out.read_text())
    assert res["status"] == "infeasible" and res["min_feasible_bytes"] > 50
    err = capsys.readouterr().err
    assert "too small" in err and f"--budget-bytes {res['min_feasible_bytes']}" in err


def test_a_graph_of_zero_byte_tensors_solves(tmp_path, capsys):
    """Nothing to divide by: the summary leaves out its ratios instead of failing."""
    data = {"directed": True, "multigraph": False, "graph": {"name": "z", "order": [0, 1, 2]},
            "nodes": [{"id": i, "name": str(i), "cost_cpu": 1, "cost_ram": 0} for i in range(3)],
            "links": [{"source": 0, "target": 1}, {"source": 1, "target": 2}]}
    gpath = tmp_path / "z.json"
    gpath.write_text(json.dumps(data))
    out = tmp_path / "o.json"
    assert main(["solve", str(gpath), "--budget-fraction", "0.8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["peak"] == 0 and res["schedule"] == [0, 1, 2]
    assert "x budget" not in capsys.readouterr().out


def test_bad_arguments(tmp_path, capsys):
    gpath = write_graph(tmp_path / "g.json")
    with pytest.raises(SystemExit):
        main(["solve", str(gpath)])  # a budget is required
    assert main(["solve", str(gpath), "--budget-bytes", "9", "--solver", "nope"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main(["solve", str(tmp_path / "missing.json"), "--budget-bytes", "9"]) == 2


def test_module_entry_point(tmp_path):
    gpath = write_graph(tmp_path / "g.json")
    r = subprocess.run([sys.executable, "-m", "tfremat", "solve", str(gpath), "--budget-fraction",
                        "0.9"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "peak" in r.stdout


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/benchmarks/checkmate-graphs absent")
def test_shared_graph_round_trip(tmp_path):
    out = tmp_path / "o.json"
    gpath = SHARED / "VGG16_b256_224x224_train.json"
    assert main(["solve", str(gpath), "--budget-fraction", "0.9", "--time-limit", "3",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    g = nx.node_link_graph(json.loads(gpath.read_text()), edges="links")
    # Re-check in the file's own vocabulary, independently of tfremat.io.
    for v in g:
        g.nodes[v]["bytes"], g.nodes[v]["cost"] = g.nodes[v]["cost_ram"], g.nodes[v]["cost_cpu"]
    sim = simulate(g, res["schedule"])
    assert sim.peak_bytes == res["peak"] <= res["budget"]
    assert sim.cost == res["cost"]


def test_solver_errors_are_reported_not_raised(tmp_path, capsys, monkeypatch):
    from tfremat import SolverUnavailableError
    from tfremat.solvers import exact as exact_mod

    def missing():
        raise SolverUnavailableError("solver 'exact' needs OR-Tools: pip install 'tfremat[exact]'")

    monkeypatch.setattr(exact_mod, "_import_cp_model", missing)
    gpath = write_graph(tmp_path / "g.json")
    assert main(["solve", str(gpath), "--budget-fraction", "0.8", "--solver", "exact"]) == 2
    assert "pip install" in capsys.readouterr().err
