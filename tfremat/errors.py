"""Typed errors. Every message says what the user can do about it."""

from __future__ import annotations

import math

GIB = 2**30


def _size(n: int | float) -> str:
    """``n`` bytes in the largest unit that keeps it at 1 or more (GiB at most)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def _bytes(n: int) -> str:
    """``n`` bytes in a unit, with the exact count beside it where they differ."""
    return _size(n) if abs(n) < 2**10 else f"{_size(n)} ({int(n)} bytes)"


def _gib_at_least(n: int | float) -> str:
    """The shortest decimal GiB value (4 significant digits, at least 3 decimals) that
    is at least ``n`` bytes: a budget_gib to ask for, never rounded below."""
    x = n / GIB
    if x <= 0:
        return "0"
    digits = max(3, 3 - math.floor(math.log10(x)))
    return f"{math.ceil(x * 10**digits) / 10**digits:.{digits}f}"


class RematError(Exception):
    """Base class of every error tfremat raises on purpose."""

    def __reduce__(self):
        # Errors cross process boundaries (solvers/isolate.py): rebuild them from
        # their constructor arguments, not from the formatted message.
        args = getattr(self, "_init_args", self.args)
        return (type(self), tuple(args))


class UnsupportedGraphError(RematError):
    """The traced step contains something tfremat cannot rewrite safely."""


class UnknownShapeError(UnsupportedGraphError):
    """A tensor has a dimension unknown at trace time, so its size cannot be planned."""

    def __init__(self, tensor_name: str, shape: object):
        self.tensor_name = tensor_name
        self.shape = shape
        self._init_args = (tensor_name, shape)
        super().__init__(
            f"tensor {tensor_name!r} has shape {shape} with an unknown dimension, so its "
            "bytes cannot be planned. Call the step with fully defined shapes (e.g. a "
            "fixed batch size: drop_remainder=True in tf.data, or an input_signature "
            "with static dims)."
        )


class InvalidScheduleError(RematError, ValueError):
    """A schedule is not a valid execution of its graph (a solver bug, or bad input)."""


class InfeasibleBudgetError(RematError, ValueError):
    """No plan the solver can find fits in the budget.

    Attributes
    ----------
    budget_bytes : int
        The budget asked for.
    min_feasible_bytes : int
        The smallest budget this solver can meet (or a proven lower bound when the
        solver could not find any plan): asking for at least this much works.
    """

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, detail: str = ""):
        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        self._init_args = (budget_bytes, min_feasible_bytes, detail)
        msg = (
            f"budget {_bytes(budget_bytes)} is too small: the smallest budget this "
            f"solver can meet is {_bytes(min_feasible_bytes)}. Raise budget_gib to at least "
            f"{_gib_at_least(min_feasible_bytes)}, reduce the batch size, or try another "
            "solver (solver='exact')."
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class SolverUnavailableError(RematError, ImportError):
    """A solver needs an optional dependency that is not installed."""
