"""The ``remat`` decorator: validate the budget, trace per input signature, cache.

Pipeline for each new input signature: trace (``trace.py``) -> planning graph
(``graph.py``) -> plan (``solvers``, re-checked by ``simulate.py``) -> rewritten
GraphDef (``rewrite.py``) -> callable (``emit.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
import warnings
import weakref
from typing import Any, Callable

from .errors import GIB, InfeasibleBudgetError, RematError
from .plan import Plan, Problem
from .solvers import SolverLike, get_solver, solve

# The simulator is exact for tensors the graph names, but kernels also allocate
# scratch space and the allocator rounds; plans aim this much under the budget.
DEFAULT_HEADROOM = 0.05
# Re-plans per entry for a measured peak over the budget (each has a first call that
# is measured again); bounded so a peak that keeps moving cannot re-plan forever.
_MAX_CALIBRATIONS = 2
# Solves again for a plan whose predicted allocator chunks are over the budget.
_ALLOCATOR_RESOLVES = 3
# How often an infeasible budget's answer is planned again at itself before it is
# named (each check is one more solve, on the error path only).
_MIN_BUDGET_CHECKS = 2
# Orders near a plan's schedule whose allocator peak is held to the budget as well
# (:func:`tfremat.allocator.nearby_orders`, :meth:`RematFunction._allocator_estimates`).
_NEARBY_ORDERS = 4
_NEARBY_BELOW = 16  # ... where the largest tensor is at least 1/16 of the budget


def budget_to_bytes(budget_gib: Any) -> int:
    """Validate ``budget_gib`` (GiB, 1 GiB = 2**30 bytes) and return bytes.

    Raises
    ------
    TypeError
        For a bool, a string, None or any non-real number.
    ValueError
        For NaN, infinity, zero or a negative budget, or one under one byte.
    """
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, numbers.Real):
        raise TypeError(
            f"budget_gib must be a real number of GiB (e.g. budget_gib=1.5), not "
            f"{type(budget_gib).__name__} {budget_gib!r}"
        )
    value = float(budget_gib)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"budget_gib must be finite, got {budget_gib!r}")
    if value <= 0:
        raise ValueError(f"budget_gib must be positive, got {budget_gib!r}")
    n = int(value * GIB)
    if n < 1:
        raise ValueError(f"budget_gib={budget_gib!r} is under one byte")
    return n


def _validate_headroom(headroom: Any) -> float:
    if isinstance(headroom, bool) or not isinstance(headroom, numbers.Real):
        raise TypeError(f"headroom must be a fraction in [0, 1), not {headroom!r}")
    if not 0 <= float(headroom) < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    return float(headroom)


@dataclasses.dataclass
class _Entry:
    traced: Any
    step_graph: Any
    plan: Plan
    fn: Callable
    rewrite_info: Any
    checked: bool = False  # the emitted function has run once (Grappler accepted it)
    other_bytes: int = 0  # memory held outside the step when it was planned
    replanned: bool = False  # the check after the first call has run
    allowance: int = 0  # measured peak bytes the memory model does not see
    calibrations: int = 0  # re-plans for a measured peak over the budget
    device: str = "CPU:0"  # whose allocator measures the step
    previous: Any = None  # (plan, fn, rewrite_info) that ran before a re-plan
    kept_for_streams: bool = False  # a re-plan was refused: seeded random streams


class RematFunction:
    """A train step rewritten to fit ``budget_bytes``; call it like the original.

    One rewritten function is traced, planned and cached per input signature (shapes,
    dtypes and non-tensor arguments), like ``tf.function``. The wrapped function is
    left untouched and keeps working.
    """

    def __init__(self, fn: Callable, budget_bytes: int, solver: SolverLike, headroom: float, strict: bool):
        self._fn = fn
        self.budget_bytes = budget_bytes
        self.solver = solver
        self.headroom = headroom
        self.strict = strict
        self._cache: dict = {}
        self._lock = threading.Lock()
        self._tf_fn = None
        self._unconverted_call = None
        self._warned_unmeasured = False
        self._counted_from: dict = {}  # device -> _smallest_counted(device)
        # Measure kernel scratch space per op signature while planning (tfremat.scratch).
        self.measure_scratch = True
        functools.update_wrapper(self, fn)

    # -- public --------------------------------------------------------------
    @property
    def budget_gib(self) -> float:
        return self.budget_bytes / GIB

    def __call__(self, *args, **kwargs):
        # Called inside someone else's tf.function, AutoGraph would convert tfremat's
        # own code (and mangle networkx calls); the planning code must run as Python.
        if self._unconverted_call is None:
            from ._tf import import_tf

            self._unconverted_call = import_tf().autograph.experimental.do_not_convert(self._call)
        return self._unconverted_call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        from .trace import flat_tensor_args

        entry = self._entry(args, kwargs)
        flat = flat_tensor_args(entry.traced.python_function, args, kwargs)
        if not entry.checked:
            return self._first_call(entry, flat)
        if entry.calibrations >= _MAX_CALIBRATIONS:
            return entry.fn(*flat)
        # Every call is measured until the re-plans are spent: the allocator's chunks
        # differ from call to call (BFC, every allocation counted: the Transformer's
        # later calls measured 23.7-29.2 MiB for one plan, the first 22.8).
        before = _allocator_peak_bytes(entry.device)
        out = entry.fn(*flat)
        measured = _peak_set_since(before, entry.device)
        if measured is not None:
            self._check_after_call(entry, flat, out, measured)
        return out

    def get_plan(self, *args, **kwargs) -> Plan:
        """The plan used for these arguments (traces and solves on first use).

        ``budget_bytes`` is the budget you gave; the solver aimed a margin under it
        (``headroom`` of the budget plus the step's largest tensor).

        Raises
        ------
        InfeasibleBudgetError
            When no plan fits; ``min_feasible_bytes`` says which budget would.
        """
        return self._entry(args, kwargs).plan

    def get_concrete_function(self, *args, **kwargs):
        """The rewritten ``tf.function``'s concrete function for these arguments."""
        entry = self._entry(args, kwargs)
        return entry.fn.get_concrete_function(*entry.traced.arg_specs)

    def explain(self, *args, **kwargs) -> str:
        """A human summary of the plan: peaks, cost, what is kept and recomputed."""
        entry = self._entry(args, kwargs)
        p, sg = entry.plan, entry.step_graph
        lines = [
            f"budget {p.budget_bytes / GIB:.3f} GiB (solver aimed at "
            f"{(p.budget_bytes - self._margin(p.budget_bytes, sg.graph) - entry.allowance) / GIB:.3f} GiB"
            + (f", {entry.allowance / 2**20:.1f} MiB of it for memory a measured call used beyond "
               "the plan's prediction" if entry.allowance else "") + ")",
            f"fixed (variables, arguments, constants, other live memory): {p.fixed_bytes / GIB:.3f} GiB",
            f"predicted peak without remat: {p.baseline_peak_bytes / GIB:.3f} GiB",
            f"predicted peak with plan:     {p.expected_peak_bytes / GIB:.3f} GiB"
            + (f" (the allocator's chunks; checked against the budget: "
               f"{p.allocator_peak_bytes / GIB:.3f} GiB; tensors: {p.predicted_peak_bytes / GIB:.3f} GiB)"
               if p.allocator_peak_bytes else ""),
            f"extra compute: {100 * p.extra_cost_fraction:.1f} % ({p.solver}, {p.status})",
            f"kept for backward: {len(p.kept)} tensors; recomputed: {len(p.recomputed)} ops",
        ]
        if sg.scratch:
            lines.insert(-1, f"kernel scratch (measured, live while its op runs): {len(sg.scratch)} ops, "
                             f"largest {max(sg.scratch.values()) / 2**20:.1f} MiB")
        for v in p.recomputed:
            g = sg.graph
            lines.append(f"  recompute {v} ({g.nodes[v]['op_type']}, {g.nodes[v]['bytes'] / 2**20:.1f} MiB)")
        return "\n".join(lines)

    # -- internals -------------------------------------------------------------
    def _margin(self, budget_bytes: int, graph) -> int:
        """Bytes the plan keeps free under the budget.

        ``headroom`` of the budget for kernel scratch space and allocator rounding,
        plus the step's largest tensor (none when ``headroom`` is 0), for the two
        things a plan cannot schedule exactly:

        - the executor runs an activation-sized op early now and then where ordering
          edges were left out (they would change Grappler's float rewrites): a
          residual CNN measured +4 MiB over the prediction on one call in four;
        - the allocator's best-fit chunk is not split when it is less than twice the
          request (BFC, which also serves the default CPU allocator's large
          requests), so a tensor can hold up to twice its bytes: the Transformer
          test model measured 0-2.4 MiB over the prediction in 120 steps, from this
          alone (profiler: same live tensors, a 2 MiB request given a 3.5 MiB chunk).
        """
        if self.headroom == 0:
            return 0
        return int(budget_bytes * self.headroom) + _largest_tensor(graph)

    def _first_call(self, entry: _Entry, flat):
        """Run a new entry once; fall back to minimal ordering if Grappler finds a cycle.

        Grappler fuses and rewrites ops after tfremat's ordering edges are placed; a
        fusion of two ops on either side of an edge can close a cycle. That error is
        raised when the function is instantiated, before any op runs, so retrying
        cannot apply an update twice. If the minimal ordering cycles too, a re-planned
        entry goes back to the plan that ran before it; a new one is a ``RematError``.
        """
        from ._tf import import_tf
        from .emit import emit
        from .rewrite import rewrite_graph_def

        tf = import_tf()
        device = entry.device = _step_device()
        peak_before = _allocator_peak_bytes(device)
        try:
            out = entry.fn(*flat)
        except tf.errors.InvalidArgumentError as e:
            if "cycle" not in str(e) or not self.strict:
                raise
            gd, info = rewrite_graph_def(
                entry.traced.graph_def, entry.plan.schedule, entry.step_graph.graph,
                entry.traced.dtypes, strict=False,
            )
            entry.fn, entry.rewrite_info = emit(entry.traced, gd), info
            _warn_user(
                "tfremat: Grappler's rewrites conflicted with the strict ordering edges "
                "(a cycle); running with minimal ordering edges, so the measured peak "
                "may differ more from the prediction"
            )
            try:
                out = entry.fn(*flat)
            except tf.errors.InvalidArgumentError as e2:
                if "cycle" not in str(e2):
                    raise
                if entry.previous is None:
                    raise RematError(
                        f"Grappler's rewrites closed a cycle in the rewritten step even with "
                        f"minimal ordering ({len(entry.plan.recomputed)} ops recomputed). Try "
                        "another solver (solver='chen_greedy') or a larger budget, and please "
                        "report the model"
                    ) from None
                entry.plan, entry.fn, entry.rewrite_info = entry.previous
                entry.previous = None
                _warn_user(
                    "tfremat: the re-planned step closed a cycle in Grappler's rewrites; "
                    "keeping the plan that ran before"
                )
                out = entry.fn(*flat)
        entry.checked = True
        # The plan before a re-plan is kept only as a fallback for that cycle: the
        # function holds its folded constants for as long as it lives (measured: a
        # step with 4 MiB of them held 4 MiB more after each re-plan).
        entry.previous = None
        if not _allocator_memory_info(device) and not self._warned_unmeasured:
            self._warned_unmeasured = True
            _warn_user(
                f"tfremat: TensorFlow reports no allocator statistics for {device}, so calls "
                "are not measured: memory the plan's model misses (kernel scratch space, the "
                "allocator's chunks) is not corrected for, and growth of memory held outside "
                "the step is not seen. On CPU the default allocator reports them only with "
                "oneDNN on, which TensorFlow enables by itself only on CPUs with AVX-512 "
                "VNNI/BF16 or AMX: start Python with TF_ENABLE_ONEDNN_OPTS=1 (or "
                "TF_CPU_ALLOCATOR_USE_BFC=true) to have them"
            )
        self._check_after_call(entry, flat, out, _peak_set_since(peak_before, device))
        return out

    def _check_after_call(self, entry: _Entry, flat, out, measured: int | None) -> None:
        """Plan again when a call shows the plan does not hold.

        Two things only a run shows:

        - Memory held outside the step grew (once per entry). Variables without
          memory of their own at planning time (Keras' optimizer slots share one
          zeros buffer until their first update) get it during the first call.
          Measured on EfficientNetB0 planned next to another model's leftovers: the
          first step fit, every later one ran 28 MiB over its plan.
        - A call's measured peak went over the budget (checked on every call until
          the re-plans are spent): memory the model does not see, such as a
          kernel's scratch buffers or the allocator's unsplit chunks. Measured on the BatchNorm CNN with
          oneDNN off: Eigen's ``Conv2DBackpropFilter`` allocates a 27 MiB column
          buffer, which BFC served from a 47 MiB chunk, and the step ran 21 MiB over
          its prediction and 6 MiB over the budget. The excess over the prediction
          is kept free in the next plan (at most ``_MAX_CALIBRATIONS`` times per
          entry), so the next calls fit.

        The next calls use the new plan, except in a step with seeded stateful
        random ops (``tf.nn.dropout(seed=...)``, ``tf.random.uniform`` under a global
        seed): their kernels hold their streams, and a new function would draw the
        first call's numbers again (measured: the loss of a dropout MLP's second
        step changed). There the plan is kept and a warning says why.

        The measured peak is the allocator's
        high-water mark, which tfremat resets only while probing kernel scratch before a new
        signature's first call (tfremat.scratch), so a call is measured only when
        it raises the mark; after one over the budget, a later peak under that mark
        is not seen (the new plan keeps the same excess free).
        """
        from ._tf import import_tf

        tf = import_tf()
        other = entry.other_bytes
        if not entry.replanned:
            entry.replanned = True
            # The outputs the caller now holds are the step's own too.
            outputs = [t for t in tf.nest.flatten(out, expand_composites=True) if isinstance(t, tf.Tensor)]
            smallest = self._smallest_counted() or 0
            now = _other_live_bytes(entry.step_graph, list(flat) + outputs, smallest)
            # The constants Grappler folded exist from the first call on, and the plan
            # counts them already (``StepGraph.folded_sizes``, in ``fixed_bytes``).
            # Measured: a step with 4 MiB of them saw the memory outside it grow by
            # 4.75 MiB and re-planned with 4 MiB less room than it had.
            now = max(0, now - sum(b for b in entry.step_graph.folded_sizes if b >= smallest))
            if now > entry.other_bytes + max(2**20, self.budget_bytes // 100):
                other = now
        allowance = entry.allowance
        if measured is not None and entry.calibrations < _MAX_CALIBRATIONS:
            # The prediction with the memory now held outside the step.
            predicted = max(entry.plan.predicted_peak_bytes, entry.plan.allocator_peak_bytes or 0)
            predicted += max(0, other - entry.other_bytes)
            # Only a peak over the budget: one under it may be the allocator's chunk
            # luck (the Transformer's first call: 23.5 MiB under a 23.7 MiB budget,
            # 18.5-21 MiB on the calls after it).
            if measured > self.budget_bytes and measured > predicted:
                allowance += measured - predicted
                entry.calibrations += 1
        if other == entry.other_bytes and allowance == entry.allowance:
            return
        if entry.traced.seeded_streams:
            # A new function would start every seeded random kernel's stream again
            # (tfremat.trace.seeded_stream_ops): the next call would repeat the first
            # call's draws, where the original step draws new ones.
            if not entry.kept_for_streams:
                entry.kept_for_streams = True
                names = ", ".join(entry.traced.seeded_streams[:3])
                _warn_user(
                    f"tfremat: {self._replan_reason(entry, other, allowance, measured)}; a "
                    f"re-planned step would restart the streams of its seeded random ops "
                    f"({names}{', ...' if len(entry.traced.seeded_streams) > 3 else ''}) "
                    "and repeat their first draws, so tfremat keeps the current plan, "
                    "which may exceed the budget. Stateless random ops "
                    "(tf.random.stateless_*, Keras' SeedGenerator, tf.random.Generator) "
                    "let it re-plan; or raise the budget"
                )
            return
        try:
            plan = self._solve(entry.step_graph, other, allowance)
        except InfeasibleBudgetError as e:
            _warn_user(
                f"tfremat: {self._replan_reason(entry, other, allowance, measured)}; no plan fits the budget with that room "
                f"(a budget of {e.min_feasible_bytes / GIB:.3f} GiB would); keeping the "
                "current plan, which may exceed the budget"
            )
            return
        fn, info = self._emit_plan(entry.traced, entry.step_graph, plan, allowance)
        entry.previous = (entry.plan, entry.fn, entry.rewrite_info)
        entry.plan, entry.fn, entry.rewrite_info = plan, fn, info
        entry.other_bytes, entry.allowance = other, allowance
        entry.checked = False  # the new function gets the cycle check on its first call

    @staticmethod
    def _replan_reason(entry: _Entry, other: int, allowance: int, measured: int | None) -> str:
        """Why :meth:`_check_after_call` wants a new plan, for a warning."""
        if other != entry.other_bytes:
            return (f"memory held outside the step grew by "
                    f"{(other - entry.other_bytes) / 2**20:.1f} MiB during the first call")
        return (f"a call's measured peak, {(measured or 0) / 2**20:.1f} MiB, used "
                f"{(allowance - entry.allowance) / 2**20:.1f} MiB more than the plan "
                "predicts (kernel scratch space, allocator chunks)")

    def _tf_function(self):
        if self._tf_fn is None:
            from .trace import as_tf_function

            self._tf_fn = as_tf_function(self._fn)
        return self._tf_fn

    def _key(self, args, kwargs):
        from ._tf import import_tf

        tf = import_tf()
        import numpy as np

        def leaf(x):
            if isinstance(x, (tf.Tensor, tf.Variable, np.ndarray)):
                return ("T", tuple(x.shape), str(x.dtype))
            try:
                hash(x)
                return ("V", type(x).__name__, x)
            except TypeError:
                return ("O", id(x))

        flat = tf.nest.flatten((args, kwargs), expand_composites=True)
        return (repr(tf.nest.map_structure(lambda _: 0, (args, kwargs))), tuple(leaf(x) for x in flat))

    def _entry(self, args, kwargs) -> _Entry:
        key = self._key(args, kwargs)
        entry = self._cache.get(key)
        if entry is not None:
            return entry
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                entry = self._build(args, kwargs)
                self._cache[key] = entry
        return entry

    def _build(self, args, kwargs) -> _Entry:
        from .graph import build_graph
        from .trace import flat_tensor_args, trace, written_variables

        traced = trace(self._tf_function(), args, kwargs)
        if _xla_compiled(traced.concrete):
            _warn_user(
                "tfremat.remat: the step is a tf.function(jit_compile=True); the rewritten "
                "step runs without XLA (XLA would reorder its ops and undo the plan), so its "
                "speed and last bits may differ from the compiled step's"
            )
        sg = build_graph(traced.records, traced.arg_placeholders, traced.handle_bytes, traced.gradients)
        if self.measure_scratch:
            from .scratch import measure_scratch

            sg = dataclasses.replace(sg, scratch=measure_scratch(traced, _step_device()))
        # TensorLists of elements the allocator's statistics leave out weigh nothing
        # (the budget is measured by those statistics; StepGraph.counted).
        sg = sg.counted(self._smallest_counted() or 0)
        # The step's own fixed memory, counted from the graph (variables, arguments,
        # constants including the splats Grappler folds into constants), plus the
        # memory the rest of the process holds now (another model, cached tensors).
        flat = flat_tensor_args(traced.python_function, args, kwargs)
        _own_buffers(written_variables(traced))
        other = _other_live_bytes(sg, flat, self._smallest_counted() or 0)
        plan = self._solve(sg, other)
        fn, info = self._emit_plan(traced, sg, plan)
        return _Entry(traced=traced, step_graph=sg, plan=plan, fn=fn, rewrite_info=info, other_bytes=other)

    def _emit_plan(self, traced, sg, plan: Plan, allowance: int = 0):
        """The function running ``plan`` and its RewriteInfo.

        A plan that recomputes nothing runs the traced step as it is when the
        executor's own order fits too: its ordering edges would only serialize the
        step (measured on the Transformer test model with a budget above its
        baseline: 1.11-1.22x Keras' step time with them, one core idle). Where ops
        the executor runs early (an optimizer's ``momentum * m``, ready at the start
        of the step) would take the free-running order over the plan's target, the
        step gets the plan's ordering edges (strict mode), with nothing recomputed.
        Measured on an SGD-momentum MLP at its smallest budget + 10 %: 28.0 MiB
        unchanged for a 27.9 MiB budget (23.1 predicted). The free-running order is
        simulated without the in-place takeovers that readers running beside an op
        may prevent (``free=True``, :func:`tfremat.graph._inplace_blockers`): an
        additive-attention model measured 131 MiB unchanged for a 99.9 MiB
        prediction. It is also run on as many threads as the executor has
        (:func:`tfremat.simulate.parallel_peak`): a Conv3D + BatchNorm model measured
        36-44 MiB unchanged where the single order gave 34.3, and the threads 42.2.
        Both count each op's kernel scratch while it runs, the single order also
        that of the largest kernel that may run beside it
        (:func:`tfremat.simulate.scratch_peak`): a mixed_float16 upsampling CNN
        measured 69.4 MiB unchanged for a 56.5 MiB budget where two float16
        convolution gradients ran side by side.
        And it is taken with the operands Grappler regroups products by
        (:func:`tfremat.graph.regrouped`): run as traced, an attention's
        ``softmax * scale`` is computed in the forward pass and held for the
        backward pass. A call measured over the budget still re-plans."""
        from .emit import emit
        from .rewrite import RewriteInfo, rewrite_graph_def
        from .graph import regrouped
        from .simulate import free_running_order, parallel_peak, scratch_peak

        if not plan.recomputed:
            target = self.budget_bytes - self._margin(self.budget_bytes, sg.graph) - allowance
            traced_graph = regrouped(sg.graph)
            order = free_running_order(traced_graph, plan.schedule)
            # Kernel scratch counts too, live while its op runs.
            free = max(scratch_peak(traced_graph, order, plan.fixed_bytes, sg.scratch, free=True),
                       parallel_peak(traced_graph, order, plan.fixed_bytes, _inter_op_threads(), sg.scratch))
            if not self.strict or free <= max(target, plan.predicted_peak_bytes):
                return emit(traced, traced.graph_def), RewriteInfo(copies=0, gates=0, rewired_inputs=0)
        # Big ops float where the schedule runs below its own peak, so the predicted
        # peak still holds for every order the executor may pick. Measured (2 cores,
        # 60 % budgets, 21 interleaved rounds): the budget less the margin as the limit
        # instead floated 2-6 % more ops, ran no faster, and measured up to 11 % over
        # the prediction (the BFC scratch test's CNN: 85.1 MiB for 76.8 predicted).
        gd, info = rewrite_graph_def(
            traced.graph_def, plan.schedule, sg.graph, traced.dtypes, strict=self.strict,
            limit_bytes=plan.predicted_peak_bytes, fixed_bytes=plan.fixed_bytes, scratch=sg.scratch,
        )
        return emit(traced, gd), info

    def _solve(self, sg, other: int, allowance: int = 0) -> Plan:
        """Plan ``sg`` with ``other`` bytes held outside the step, under the budget,
        keeping ``allowance`` bytes free on top of the margin (:meth:`_solve_order`).

        On the graph's order first, then, where that has no plan, on each of its
        ``other_orders`` (:func:`tfremat.graph.build_graph`): each is an order the
        rewrite can emit, and the one with the lower floor does not always have the
        lower smallest budget (the LSTM test model: 31.2 MiB in the first, 26.7 MiB
        in the other). No plan in any: the error names the smallest budget of all.
        """
        try:
            return self._solve_order(sg, other, allowance)
        except InfeasibleBudgetError as e:
            best, best_sg = e, sg
        for order in sg.graph.graph.get("other_orders", ()):
            g = sg.graph.copy()
            g.graph["order"] = list(order)
            try:
                return self._solve_order(dataclasses.replace(sg, graph=g), other, allowance)
            except InfeasibleBudgetError as e:
                if e.min_feasible_bytes < best.min_feasible_bytes:
                    best, best_sg = e, dataclasses.replace(sg, graph=g)
        # The budget the error names must be one that works: the solver is
        # time-bound and its plans depend on the target, so the smallest budget
        # found at one budget is planned again at itself (a random hand-written
        # step, steps_fuzz 0: told 6.81 MiB at a 6.0 MiB budget, refused at 7.49
        # with 7.85 named).
        need = best.min_feasible_bytes
        for _ in range(_MIN_BUDGET_CHECKS):
            try:
                self._solve_order(best_sg, other, allowance, budget=need)
                break
            except InfeasibleBudgetError as e:
                need = max(need + 1, e.min_feasible_bytes)
        if need == best.min_feasible_bytes:
            raise best
        budget, _, detail = best._init_args
        raise InfeasibleBudgetError(budget, need, detail)

    def _solve_order(self, sg, other: int, allowance: int = 0, budget: int | None = None) -> Plan:
        """Plan ``sg`` in its graph's order (see :meth:`_solve`).

        Two limits: the tensors' bytes (the simulator) stay under the budget less the
        margin, and the allocator's chunks (:mod:`tfremat.allocator`) under the
        budget less ``headroom``. A plan over the second is solved again with the
        target lowered by the excess (at most ``_ALLOCATOR_RESOLVES`` times).
        Measured on the mixed-precision CNN test model at its smallest budget + 10 %:
        43.4 MiB of tensors, 54.8-56.8 MiB of chunks on a 54.9 MiB budget.
        """
        budget = self.budget_bytes if budget is None else budget  # (another: a check)
        fixed = sg.fixed_bytes + other
        margin = self._margin(budget, sg.graph) + allowance
        limit = budget - int(budget * self.headroom) - allowance
        target = budget - margin
        over: list[int] = []  # allocator peaks of plans over ``limit``
        smallest = None  # the solver's smallest target, once a re-solve has hit it
        attempt = 0
        while True:
            try:
                plan = solve(Problem(sg.planning_graph, target, fixed), self.solver)
            except InfeasibleBudgetError as e:
                if over and smallest is None:
                    # Lowered past the solver's smallest target: its plan there may
                    # still fit (plans with less room often fragment less).
                    target = smallest = e.min_feasible_bytes
                    continue
                if over:
                    raise self._infeasible(fixed, margin, max(
                        self._budget_for_chunks(min(over), allowance),
                        self._budget_for_target(sg, e.min_feasible_bytes, allowance))) from None
                need = self._budget_for_target(sg, e.min_feasible_bytes, allowance)
                if self.headroom > 0:
                    need = max(need, self._chunks_at(sg, e.min_feasible_bytes, fixed, other, allowance))
                raise self._infeasible(fixed, margin, need) from None
            if self.headroom == 0:
                break
            chunks, expected = self._allocator_estimates(sg, plan.schedule, other)
            plan = dataclasses.replace(plan, allocator_peak_bytes=chunks, allocator_expected_bytes=expected)
            if chunks <= limit:
                break
            over.append(chunks)
            if target == smallest:
                # (a budget whose allocator limit holds the chunks may still leave the
                # tensors' target under the solver's smallest: a random hand-written
                # step, steps_fuzz 0, was told 6.81 MiB at a 6.0 MiB budget and
                # refused at 7.49, naming 7.85)
                raise self._infeasible(fixed, margin, max(self._budget_for_chunks(min(over), allowance),
                                                          self._budget_for_target(sg, smallest, allowance)))
            if attempt == _ALLOCATOR_RESOLVES:
                # The chunks do not fall with the target everywhere (a plan with more
                # room may fragment more), and the smallest budget an infeasible
                # budget's error names is checked on the plan at the solver's smallest
                # target (_chunks_at): try that plan before giving up. Found by a
                # random Keras model (relu, avgpool, conv, Adam): told 40847
                # bytes, its budget of 44931 was refused, naming 45158 (the three
                # re-solves' plans had 42900-44180 bytes of chunks, the smallest
                # target's 38804, under the 42685-byte limit).
                target = smallest = self._smallest_target(sg, fixed)
            else:
                # at least 2 % of the budget: a plan that barely changes must not stall
                target -= max(chunks - limit, budget // 50)
            attempt += 1
        if sg.planning_graph is not sg.graph:  # back to TensorFlow's ops: no scratch nodes
            plan = dataclasses.replace(
                plan,
                schedule=tuple(v for v in plan.schedule if v in sg.graph),
                kept=tuple(v for v in plan.kept if v in sg.graph),
            )
        return dataclasses.replace(plan, budget_bytes=budget)

    def _smallest_target(self, sg, fixed: int) -> int:
        """The smallest target (tensor bytes, ``fixed`` included) the solver meets."""
        try:
            solve(Problem(sg.planning_graph, 0, fixed), self.solver)
        except InfeasibleBudgetError as e:
            return e.min_feasible_bytes
        return 0

    def _infeasible(self, fixed: int, margin: int, need: int) -> InfeasibleBudgetError:
        return InfeasibleBudgetError(
            self.budget_bytes,
            max(need, self.budget_bytes + 1),
            f"fixed memory {fixed / GIB:.3f} GiB; plans aim "
            f"{margin / 2**20:.1f} MiB under the budget "
            "(headroom for kernel scratch space, allocator chunks and executor reordering)",
        )

    def _budget_for_target(self, sg, target: int, allowance: int) -> int:
        """The smallest budget whose target (budget less the margin and ``allowance``)
        reaches ``target``: need - margin(need) - allowance = target, with
        margin(b) = headroom * b + the largest tensor (or 0)."""
        need = target + allowance
        if self.headroom > 0:
            need = math.ceil((need + self._margin(0, sg.graph)) / (1 - self.headroom))
        return need

    def _budget_for_chunks(self, chunks: int, allowance: int) -> int:
        """The smallest budget whose allocator limit holds ``chunks``."""
        return math.ceil((chunks + allowance) / (1 - self.headroom))

    def _chunks_at(self, sg, target: int, fixed: int, other: int, allowance: int) -> int:
        """The budget the allocator limit needs for the plan at ``target`` (the
        solver's smallest): an infeasible budget's answer must be one that works."""
        try:
            plan = solve(Problem(sg.planning_graph, target, fixed), self.solver)
        except InfeasibleBudgetError:
            return 0
        return self._budget_for_chunks(self._allocator_estimate(sg, plan.schedule, other), allowance)

    def _allocator_estimate(self, sg, schedule, other: int) -> int:
        """The allocator peak the budget is checked against for ``schedule``: the
        first of :meth:`_allocator_estimates`."""
        return self._allocator_estimates(sg, schedule, other)[0]

    def _allocator_estimates(self, sg, schedule, other: int) -> tuple[int, int]:
        """The allocator peaks predicted for ``schedule`` (of ``sg.planning_graph``):
        ``(checked, expected)``.

        The pool model (:mod:`tfremat.allocator`) of the allocator the step's device
        uses, told apart by measurement (:func:`_smallest_counted`): BFC for every
        request (``TF_CPU_ALLOCATOR_USE_BFC=true``, GPUs), or the oneDNN CPU
        default, which pools requests from 256 KiB up and leaves smaller ones out of
        its statistics.

        ``checked``, what the budget is held against: for the oneDNN default, and
        where the allocator reports nothing, the larger of the two models. The
        oneDNN model alone was under the measured later calls of the
        mixed-precision CNN test model (46.8 MiB for 54.75-56.75), the every-request
        one over them (57.4). Under ``TF_CPU_ALLOCATOR_USE_BFC`` the oneDNN model
        describes an allocator that is not there: on the ``make demo`` MLP it
        predicted 79.0 MiB for a plan the pooled model put at 71.8 and that
        measured 69.7.

        ``expected``, the best guess (``Plan.expected_peak_bytes``): the model of
        the allocator in use alone, the larger of the two where it is not known.
        Measured on the Keras sweep's 42 models over 1 MiB (oneDNN default, docs/keras.md,
        session 33): within 5 % of the measured peak on 29 (the tensors: 19; the
        larger model: 17), median error 3.5 %; e.g. nasnetmobile 21.8 MiB for 20.6
        measured, where the larger model said 23.4. The pool's layout
        depends on the process's history, so neither model is exact
        (docs/design.md).
        """
        from .allocator import allocator_peak, nearby_orders

        counted = self._smallest_counted()
        models = [dict(smallest_pooled=0)]
        if counted != 0:  # not BFC for every request (or not known): oneDNN's too
            models.append(dict(smallest_pooled=_ONEDNN_SMALLEST_COUNTED, count_unpooled=False))
        # In the pool before the step: the variables, the arguments (unless
        # TensorFlow wrapped their buffers without a copy, as it may an aligned NumPy
        # array's: both layouts are checked) and the constants Grappler folded (made
        # at the start of the first call). Measured on the attention test model at a 22.8 MiB
        # budget: 23.0 MiB where its 0.5 MiB input was in the pool, 20.5 where it was
        # not; the profiler's allocations replayed through the pool model gave both.
        layouts = []
        for arguments in dict.fromkeys((sg.argument_sizes, ())):  # one layout where there are none
            resident = [int(b) for b in (*sg.variable_sizes, *arguments, *sg.folded_sizes)]
            layouts.append((resident, max(0, sg.fixed_bytes + other - sum(resident))))
        peaks = [[allocator_peak(sg.planning_graph, schedule, resident, outside, **kw).peak_bytes
                  for resident, outside in layouts] for kw in models]
        expected = peaks[-1][0] if counted == _ONEDNN_SMALLEST_COUNTED else max(p[0] for p in peaks)
        # The executor's order is not the schedule's, and the pool's layout moves with
        # it where a few big tensors fill a few regions: random attention models
        # measured up to 1.15x the schedule's chunks (a request of 2.25 MiB in a
        # 4 MiB chunk). Orders near the schedule are checked too (the first layout),
        # where the largest tensor is at least 1/16 of the budget: with smaller ones
        # the pool's layout moved little in the measurements (DenseNet121 at 60 %:
        # 72.5 MiB measured for 74.1 of chunks; checking the nearby orders there took
        # 27 s more planning and 5 points more recomputation for nothing). Kernel
        # scratch counts as a tensor here: it is a request to the same pool.
        near = []
        if _largest_tensor(sg.planning_graph) * _NEARBY_BELOW >= self.budget_bytes:
            resident, outside = layouts[0]
            near = [allocator_peak(sg.planning_graph, order, resident, outside, **kw).peak_bytes
                    for order in nearby_orders(sg.planning_graph, schedule, _NEARBY_ORDERS) for kw in models]
        return max([*near, *map(max, peaks)]), expected

    def _smallest_counted(self) -> int | None:
        """:func:`_smallest_counted` for the step's device, measured once per device
        (the allocator is chosen when TensorFlow starts)."""
        device = _step_device()
        if device not in self._counted_from:
            self._counted_from[device] = _smallest_counted(device)
        return self._counted_from[device]


# Measured on TF 2.21's default CPU allocator with oneDNN: allocations under 256 KiB
# are not counted in get_memory_info (a 200 KiB tensor leaves "current" as it was, a
# 256 KiB one counts), so the step's small variables are not in "current".
_ONEDNN_SMALLEST_COUNTED = 256 * 1024
# The probe of :func:`_smallest_counted`: under the oneDNN default's threshold.
_PROBE_BYTES = 64 * 1024


def _smallest_counted(device: str) -> int | None:
    """The smallest request ``device``'s allocator statistics count, measured.

    0 where every request is counted: GPUs' BFC, and the CPU's with
    ``TF_CPU_ALLOCATOR_USE_BFC=true``; 256 KiB for the CPU default with oneDNN,
    which serves smaller requests apart and leaves them out; None where the
    allocator reports no statistics (the CPU default without oneDNN). On CPU this
    allocates one 64 KiB tensor and reads ``current`` around it, because the
    allocator in use is chosen from the environment when TensorFlow starts and the
    process cannot ask which it got.
    """
    if device.startswith("GPU"):
        return 0
    from ._tf import import_tf

    tf = import_tf()
    before = _allocator_memory_info(device)
    if not before:
        return None
    with tf.device(device):
        probe = tf.fill([_PROBE_BYTES // 4], 1.0)
    grew = _allocator_current_bytes(device) - before.get("current", 0)
    del probe
    return 0 if grew >= _PROBE_BYTES else _ONEDNN_SMALLEST_COUNTED


def _xla_compiled(concrete) -> bool:
    """Whether a concrete function is compiled with XLA as a whole (``jit_compile=True``)."""
    attr = concrete.function_def.attr.get("_XlaMustCompile")
    return bool(attr is not None and attr.b)


def _warn_user(message: str) -> None:
    """A RuntimeWarning attributed to the first caller outside tfremat, TensorFlow
    (AutoGraph's wrappers) and Keras' trainer: their depth varies with the call path."""
    import os
    import sys

    internal = (os.path.dirname(os.path.abspath(__file__)), os.sep + "tensorflow" + os.sep,
                os.sep + "keras" + os.sep)
    level, f = 2, sys._getframe(1)
    while f is not None and any(s in f.f_code.co_filename for s in internal):
        f, level = f.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def _inter_op_threads() -> int:
    """How many ops TensorFlow's executor runs at once: its inter-op thread pool,
    by default one thread per core this process may run on."""
    import os

    from ._tf import import_tf

    n = import_tf().config.threading.get_inter_op_parallelism_threads()
    if n > 0:
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _step_device() -> str:
    """The device a step runs on by default: the first GPU if there is one."""
    from ._tf import import_tf

    tf = import_tf()
    try:
        return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    except RuntimeError:
        return "CPU:0"


def _largest_tensor(graph) -> int:
    """The graph's largest tensor, not its largest op: an LSTM's while loop outputs a
    dozen accumulators (8 MiB in all on the test model, 0.5 MiB each)."""
    return int(max((d.get("largest_tensor", d["bytes"]) for _, d in graph.nodes(data=True)), default=0))


def _other_live_bytes(step_graph, tensors, smallest: int) -> int:
    """Bytes the allocator holds now beyond the step's variables and ``tensors``.

    ``tensors``: the step's arguments (and, after a call, its outputs); ``smallest``:
    the smallest allocation the allocator's statistics count (:func:`_smallest_counted`).

    The graph counts the step's variables, arguments and constants itself
    (``StepGraph.fixed_bytes``); the allocator's ``current`` also holds whatever else
    the process keeps (another model, cached tensors), which the step cannot free.
    The step's own buffers are subtracted at their full size, an upper bound: a
    variable that has no memory of its own yet (Keras' optimizer slots share one
    zeros buffer until their first update) makes this an underestimate, which the
    check after the first call corrects (``RematFunction._first_call``).
    """
    device = _step_device()
    current = _allocator_current_bytes(device)
    if current <= 0:
        return 0
    own = sum(b for b in step_graph.variable_sizes if b >= smallest)
    for t in tensors:
        try:
            nbytes = int(t.shape.num_elements()) * t.dtype.size
        except (AttributeError, TypeError):  # unknown shape, or not a tensor
            nbytes = int(getattr(t, "nbytes", 0))
        if nbytes >= smallest:
            own += nbytes
    return max(0, current - own)


# Variables :func:`_own_buffers` copied, by id (weakly held: forgotten with the
# variable; variables are not hashable).
_OWNED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _own_buffers(variables) -> None:
    """Give each of ``variables`` a buffer of its own, with bit-for-bit the same values.

    Variables created while a function is traced can share one buffer until their
    first update copies it (copy-on-write): Keras builds its optimizer's slots while
    the train step is traced, and every slot of one shape starts on the same zeros.
    The allocator's ``current`` then holds less than the variables will, and
    :func:`_other_live_bytes`, which subtracts every variable at its full size,
    counts the memory held outside the step too low. Measured on Xception with
    Adam (56 MiB batch of 71x71 images): 134 MiB of slots were not in ``current`` at
    planning, the memory outside the step was counted as 0 instead of 15 MiB, and
    the first call left 29 MiB more than planned; the re-plan found no plan for the
    budget, and every later call ran over it. A step that writes a variable copies a
    shared buffer at its first call anyway, so copying it before planning costs no
    memory the step would not use, and the plan sees it. ``DeepCopy`` is a memory
    copy: ``x - 0`` would turn denormals to 0 where TensorFlow flushes them.
    """
    from ._tf import import_tf

    tf = import_tf()
    for v in variables:
        # Once per variable: copying again a buffer already its own changed
        # ``current`` by up to 1 MiB from one plan to the next (a tabular MLP planned
        # three times: smallest budgets 10.2, 11.3 and 10.8 MiB).
        if _OWNED.get(id(v)) is v:
            continue
        try:
            _OWNED[id(v)] = v
        except TypeError:  # not weakly referenceable: copied every time
            pass
        try:
            with tf.device(v.device):
                v.assign(tf.raw_ops.DeepCopy(x=v.read_value()), read_value=False)
        except Exception:  # noqa: BLE001 - best effort, the values are unchanged either way
            # No DeepCopy kernel for its dtype, not initialized, a distributed
            # variable assigned outside its strategy: left as it is, and the check
            # after the first call sees its memory.
            continue


def _allocator_current_bytes(device: str = "CPU:0") -> int:
    """Bytes the TF allocator of ``device`` holds now (0 when it does not report it)."""
    return _allocator_memory_info(device).get("current", 0)


def _allocator_peak_bytes(device: str = "CPU:0") -> int:
    """The allocator's high-water mark since start or since the last
    ``reset_memory_stats`` (0 when it does not report it); tfremat resets it only while
    probing kernel scratch (tfremat.scratch)."""
    return _allocator_memory_info(device).get("peak", 0)


def _peak_set_since(before: int, device: str) -> int | None:
    """The step's measured peak, if the call just made raised the allocator's
    high-water mark above ``before``: the call set it. Otherwise None: the step stayed
    under the earlier mark (and under the budget whenever that mark is)."""
    after = _allocator_peak_bytes(device)
    return after if after > before else None


def _allocator_memory_info(device: str) -> dict:
    from ._tf import import_tf

    tf = import_tf()
    try:
        return {k: int(v) for k, v in tf.config.experimental.get_memory_info(device).items()}
    except (ValueError, RuntimeError, tf.errors.OpError):
        return {}


def remat(
    fn: Callable | None = None,
    *,
    budget_gib: float,
    solver: SolverLike = "auto",
    headroom: float = DEFAULT_HEADROOM,
    strict: bool = True,
):
    """Rewrite a TF2 train step so its measured peak memory fits ``budget_gib``.

    Use as ``@tfremat.remat(budget_gib=1.5)`` above or below ``@tf.function``, or
    call ``tfremat.remat(step, budget_gib=1.5)``. The budget bounds the allocator's
    peak during one call of the step, everything included (variables, optimizer
    slots, inputs, activations, gradients, temporaries).

    Parameters
    ----------
    fn : callable, optional
        A ``tf.function`` or a plain Python function (wrapped in ``tf.function``).
    budget_gib : float
        Peak memory budget in GiB (1 GiB = 2**30 bytes).
    solver : str or callable
        A name in ``tfremat.SOLVERS`` or a callable ``Problem -> Plan``.
    headroom : float
        Fraction of the budget left free for kernel scratch space and allocator
        rounding; the plan also keeps the step's largest tensor free on top of it (the
        executor may run one op out of the planned order, and the allocator may give
        a tensor a chunk up to twice its size). ``headroom=0`` plans to the budget
        exactly.
    strict : bool
        Order the rewritten graph's ops as the plan's schedule (control edges), so
        the measured peak matches the predicted one. Turn off to give the executor
        freedom (parallel branches) at the price of a less predictable peak.

    Returns
    -------
    RematFunction, or a decorator returning one when ``fn`` is None.

    Raises
    ------
    TypeError, ValueError
        For a bad ``budget_gib``, ``solver`` or ``headroom`` (at decoration time).
    InfeasibleBudgetError
        At the first call for an input signature whose step cannot fit.
    """
    budget_bytes = budget_to_bytes(budget_gib)
    get_solver(solver)  # validate now, not at the first call
    headroom = _validate_headroom(headroom)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, not {strict!r}")

    def wrap(f: Callable) -> RematFunction:
        if isinstance(f, RematFunction):
            raise RematError("this function is already wrapped by tfremat.remat")
        if not callable(f):
            raise TypeError(f"tfremat.remat needs a callable, not {type(f).__name__}")
        return RematFunction(f, budget_bytes, solver, headroom, strict)

    return wrap if fn is None else wrap(fn)
