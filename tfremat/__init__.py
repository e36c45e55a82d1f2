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

__version__ = "0.1.0"

__all__ = [
    "InfeasibleBudgetError",
    "InvalidScheduleError",
    "Plan",
    "Problem",
    "RematError",
    "SOLVERS",
    "Simulation",
    "SolverUnavailableError",
    "UnknownShapeError",
    "UnsupportedGraphError",
    "get_solver",
    "simulate",
    "solve",
]
