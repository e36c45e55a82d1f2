"""tfremat: make a TensorFlow train step fit a memory budget by rematerialization."""

from .errors import (
    InfeasibleBudgetError,
    InvalidScheduleError,
    RematError,
    SolverUnavailableError,
    UnknownShapeError,
    UnsupportedGraphError,
)
from .plan import Plan, Problem
from .simulate import Simulation, simulate
from .solvers import SOLVERS, get_solver, solve
from .api import RematFunction, remat

__version__ = "0.1.0"


def __getattr__(name):
    # `tfremat.keras` imports TensorFlow and Keras: only on first use.
    if name == "keras":
        import importlib

        return importlib.import_module(".keras", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "InfeasibleBudgetError",
    "InvalidScheduleError",
    "Plan",
    "Problem",
    "RematError",
    "RematFunction",
    "SOLVERS",
    "Simulation",
    "SolverUnavailableError",
    "UnknownShapeError",
    "UnsupportedGraphError",
    "get_solver",
    "remat",
    "simulate",
    "solve",
]
