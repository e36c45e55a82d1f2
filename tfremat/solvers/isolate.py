"""Run a solver function in a fresh Python process that has not loaded TensorFlow.

Why: with TensorFlow 2.21 imported first, OR-Tools' CP-SAT segfaults on solve
(measured with ortools 9.15: `import tensorflow` then `from ortools.sat.python import
cp_model` and a 200-variable model -> SIGSEGV; the other import order works). Users
import TensorFlow before tfremat plans, so any CP-SAT solve in such a process runs
in a child process instead: the problem goes in pickled, the plan (or the solver's
exception) comes back pickled.

    python -m tfremat.solvers.isolate   # the child: reads a pickled call on stdin
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
from typing import Any, Callable

from ..errors import RematError


def tensorflow_loaded() -> bool:
    return "tensorflow" in sys.modules


def _address_space_cap(cap: int) -> Callable[[], None]:
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    return apply


def call_isolated(func: Callable, *args: Any, timeout: float | None = None,
                  address_space_bytes: int | None = None, **kwargs: Any) -> Any:
    """Return ``func(*args, **kwargs)`` computed in a child process.

    ``address_space_bytes`` caps the child's address space (POSIX ``RLIMIT_AS``):
    a call that needs more fails in the child (``MemoryError`` re-raised here, or
    ``RematError`` if the child died) and leaves this process's memory alone.

    Raises
    ------
    Exception
        Whatever ``func`` raised in the child (re-raised here).
    RematError
        If the child process died (its stderr is in the message).
    """
    payload = pickle.dumps((func.__module__, func.__qualname__, args, kwargs))
    env = dict(os.environ, TFREMAT_ISOLATED="1")
    proc = subprocess.run(
        [sys.executable, "-m", __name__],
        input=payload,
        capture_output=True,
        env=env,
        timeout=timeout,
        preexec_fn=None if address_space_bytes is None else _address_space_cap(address_space_bytes),
    )
    if proc.returncode != 0 or not proc.stdout:
        raise RematError(
            f"isolated solver process failed (exit {proc.returncode}): "
            f"{proc.stderr.decode(errors='replace')[-1500:]}"
        )
    ok, value = pickle.loads(proc.stdout)
    if not ok:
        raise value
    return value


def _main() -> None:
    # The result goes back on the original stdout; everything else written to fd 1
    # goes to stderr. HiGHS prints progress lines from C at low budgets
    # (``HighsMipSolverData::transformNewIntegerFeasibleSolution``), which would
    # otherwise sit in front of the pickle and break the parent's load (found on a
    # generated residual training graph at 0.6 of its peak, benchmarks/solver_sweep.py).
    result_out = os.fdopen(os.dup(1), "wb")
    sys.stdout.flush()
    os.dup2(2, 1)
    module, qualname, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    func = importlib.import_module(module)
    for part in qualname.split("."):
        func = getattr(func, part)
    try:
        result = (True, func(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - shipped back to the parent and re-raised
        result = (False, e)
    result_out.write(pickle.dumps(result))
    result_out.flush()


if __name__ == "__main__":
    _main()
