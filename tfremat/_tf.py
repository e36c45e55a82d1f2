"""Lazy TensorFlow import with an actionable message (the core never needs it)."""

from __future__ import annotations


def import_tf():
    try:
        import tensorflow as tf  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "tfremat needs TensorFlow to trace and rewrite train steps. Install it with "
            "`pip install 'tfremat[cpu]'` (tensorflow-cpu) or `pip install 'tfremat[gpu]'` "
            "(tensorflow[and-cuda]). The solvers and the graph-file CLI work without it."
        ) from e
    return tf
