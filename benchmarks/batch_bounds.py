"""Proven lower bounds on a test model's train step at given batch sizes.

    python benchmarks/batch_bounds.py vgg16 64 72 128

Traces Keras' own train step (forward, ``GradientTape``, the optimizer's update) of a
model of ``tests/test_models.py`` (or of ``benchmarks/keras_sweep.py`` with
``--sweep``) at each batch, builds tfremat's planning graph, and prints, in MiB: the
fixed memory (weights, optimizer slots, inputs), the single-op bound, the bound for
every schedule that computes each non-recomputable op once (any order), and the floor
of schedules that keep the traced order (the plans tfremat emits; the lower of the
graph's orders). Tensors only: no kernel scratch, no allocator chunks, no margin.
Nothing runs but the trace, so large batches cost no activation memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv) -> None:
    if argv and argv[0] == "--sweep":
        import keras_sweep  # noqa: F401  (adds the sweep's models to test_models')

        argv = argv[1:]
    import test_models as tm
    import tensorflow as tf

    from tfremat.graph import build_graph
    from tfremat.simulate import single_op_lower_bound
    from tfremat.solvers.bounds import fixed_order_lower_bound, once_lower_bound
    from tfremat.trace import trace

    name, batches = argv[0], [int(b) for b in argv[1:]]
    _, shape = tm.MODELS[name]
    model = tm._builders()[name]()
    model.compile(**tm._compile_kwargs(name))
    mib = 2**20
    print("| batch | fixed | single-op bound | every gradient once, any order | fixed-order floor |")
    print("|---|---|---|---|---|")
    for batch in batches:
        x, y, _ = tm._data(name, batch, shape)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply(grads, model.trainable_variables)
            return loss

        traced = trace(step, (x, y))
        sg = build_graph(traced.records, traced.arg_placeholders, traced.handle_bytes, traced.gradients)
        g, fixed = sg.planning_graph, sg.fixed_bytes
        orders = [g.graph["order"], *g.graph.get("other_orders", ())]
        floor = min(fixed_order_lower_bound(g, fixed, order=o) for o in orders)
        print(f"| {batch} | {fixed / mib:.1f} | {single_op_lower_bound(g, fixed) / mib:.1f} | "
              f"{once_lower_bound(g, fixed) / mib:.1f} | {floor / mib:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
