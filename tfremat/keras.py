"""Keras 3 integration: ``tfremat.keras.remat(model, budget_gib=...)``.

After the call, ``model.fit`` and ``model.train_on_batch`` run a train step
rewritten by :func:`tfremat.remat` (one plan per input signature: batch shape and
dtypes), computing exactly what Keras' own step computes. ``evaluate`` and
``predict`` are untouched (they keep no activations for a backward pass).

How it hooks in (the one Keras internal the training path relies on): Keras 3's
TensorFlow trainer builds ``model.train_function`` in ``model.make_train_function()``,
which ``fit`` and ``train_on_batch`` call before each use, and ``compile()`` resets
``model.train_function`` to None. tfremat sets an instance attribute
``make_train_function`` that builds a train function with the same contract (it
takes an iterator, runs up to ``steps_per_execution`` steps, returns the last
step's logs, raises ``StopIteration`` when the iterator is exhausted) whose step is
``model.train_step`` traced and rewritten by tfremat. Because it is rebuilt after
every ``compile()``, a recompiled model (new optimizer, new variables) is re-traced
and re-planned rather than updating stale variables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._tf import import_tf
from .api import DEFAULT_HEADROOM, RematFunction, remat as _remat
from .errors import RematError
from .plan import Plan
from .solvers import SolverLike

_STATE_ATTR = "_tfremat_state"


@dataclasses.dataclass
class _State:
    budget_gib: float
    solver: Any
    headroom: float
    strict: bool
    step: RematFunction | None = None  # the current compile()'s rewritten step


def _check_model(model) -> None:
    import keras

    if keras.backend.backend() != "tensorflow":
        raise RematError(
            f"tfremat.keras needs the TensorFlow Keras backend, not {keras.backend.backend()!r}: "
            "set KERAS_BACKEND=tensorflow before importing keras"
        )
    if not isinstance(model, keras.Model):
        raise TypeError(f"tfremat.keras.remat needs a keras.Model, not {type(model).__name__}")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise RematError(
            "the model is not compiled: call model.compile(optimizer=..., loss=...) "
            "before tfremat.keras.remat(model, budget_gib=...)"
        )
    if model.run_eagerly:
        raise RematError(
            "the model is compiled with run_eagerly=True: tfremat rewrites a traced graph; "
            "compile with run_eagerly=False"
        )


def _to_tensors(data):
    """Optional -> None (as Keras does), numpy -> tensors (one signature for both)."""
    tf = import_tf()
    import numpy as np

    def conv(x):
        if isinstance(x, tf.experimental.Optional):
            return None
        if isinstance(x, np.ndarray):
            return tf.convert_to_tensor(x)
        return x

    return tf.nest.map_structure(conv, data)


def _make_step(model, state: _State) -> RematFunction:
    tf = import_tf()

    def one_step_on_data(data):
        strategy = model.distribute_strategy
        if strategy.num_replicas_in_sync != 1:
            raise RematError(
                "tfremat.keras supports single-replica training only "
                f"(this model's strategy has {strategy.num_replicas_in_sync} replicas)"
            )
        return strategy.run(model.train_step, args=(data,))

    # Keras does not autograph-convert train_step either.
    fn = tf.function(one_step_on_data, autograph=False)
    return _remat(
        fn,
        budget_gib=state.budget_gib,
        solver=state.solver,
        headroom=state.headroom,
        strict=state.strict,
    )


def _make_train_function(model, force: bool = False):
    """Replacement for ``model.make_train_function`` (same contract as Keras')."""
    tf = import_tf()
    if model.train_function is not None and not force:
        return model.train_function
    state: _State = getattr(model, _STATE_ATTR)
    step = _make_step(model, state)
    state.step = step

    def function(iterator):
        steps = max(1, int(model.steps_per_execution))
        outputs = None
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            for _ in range(steps):
                try:
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    break
                outputs = step(_to_tensors(data))
            if outputs is None:
                raise StopIteration
            return outputs
        for _, data in zip(range(steps), iterator):
            outputs = step(_to_tensors(data))
        return outputs

    model.train_function = function
    return function


def remat(
    model,
    *,
    budget_gib: float,
    solver: SolverLike = "auto",
    headroom: float = DEFAULT_HEADROOM,
    strict: bool = True,
):
    """Make ``model.fit`` / ``model.train_on_batch`` fit their train step in ``budget_gib``.

    Parameters
    ----------
    model : keras.Model
        A compiled Keras 3 model (TensorFlow backend, ``run_eagerly=False``).
    budget_gib, solver, headroom, strict
        As in :func:`tfremat.remat`. The budget bounds the allocator's peak during one
        train step, everything included (weights, optimizer slots, the batch,
        activations, gradients).

    Returns
    -------
    keras.Model
        The same model. Calling ``remat`` again replaces the budget and solver;
        ``compile()`` again keeps tfremat and re-plans for the new optimizer.

    Raises
    ------
    RematError
        If the model is not compiled, runs eagerly, or the backend is not TensorFlow.
    InfeasibleBudgetError
        At the first train step of an input signature whose step cannot fit.
    """
    import types

    from .api import _validate_headroom, budget_to_bytes
    from .solvers import get_solver

    _check_model(model)
    budget_to_bytes(budget_gib)
    get_solver(solver)
    headroom = _validate_headroom(headroom)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, not {strict!r}")
    if getattr(model, "jit_compile", False):
        import warnings

        warnings.warn(
            "tfremat.keras: the model was compiled with jit_compile=True; the rewritten "
            "train step runs without XLA (XLA would reorder it and undo the plan)",
            stacklevel=2,
        )
    object.__setattr__(
        model, _STATE_ATTR, _State(float(budget_gib), solver, headroom, strict)
    )
    object.__setattr__(
        model, "make_train_function", types.MethodType(_make_train_function, model)
    )
    model.train_function = None  # rebuilt by fit/train_on_batch with the new budget
    return model


def unremat(model):
    """Undo :func:`remat`: ``model`` trains with Keras' own train step again."""
    if hasattr(model, _STATE_ATTR):
        object.__delattr__(model, "make_train_function")
        object.__delattr__(model, _STATE_ATTR)
        model.train_function = None
    return model


def is_remat(model) -> bool:
    return hasattr(model, _STATE_ATTR)


def _step_for(model) -> RematFunction:
    if not is_remat(model):
        raise RematError("call tfremat.keras.remat(model, budget_gib=...) first")
    model.make_train_function()
    return getattr(model, _STATE_ATTR).step


def _batch(model, x, y=None, sample_weight=None):
    # Private Keras hook, used only by get_plan/explain: train_on_batch calls it to
    # build the model, its metrics and optimizer variables before the first trace.
    # Without it, planning before any training would trace an unbuilt model.
    model._maybe_symbolic_build(data_batch=(x, y, sample_weight))
    return _to_tensors((x, y, sample_weight))


def get_plan(model, x, y=None, sample_weight=None) -> Plan:
    """The plan ``train_on_batch(x, y, sample_weight)`` uses (traces and solves on first use)."""
    return _step_for(model).get_plan(_batch(model, x, y, sample_weight))


def explain(model, x, y=None, sample_weight=None) -> str:
    """:meth:`tfremat.RematFunction.explain` for the train step on this batch."""
    return _step_for(model).explain(_batch(model, x, y, sample_weight))
