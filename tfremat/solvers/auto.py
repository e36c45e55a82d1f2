"""The default solver: a measured portfolio of fast planners, best plan wins.

Every candidate is scored by the simulator on the real graph. Members, in order:

1. Low-peak orders (graphs without a backward phase whose every node may be
   recomputed): randomized memory-greedy list scheduling; an order that fits is
   optimal (every node once) and returned at once.
2. Chen et al.'s greedy, swept, over articulation points and over every forward
   value (so ``auto`` is never worse than either baseline on the same problem).
3. The dropped set solved whole as a covering MILP (:mod:`.cover`, graphs with a
   backward phase, where its simulations fit in 2 s), and segment checkpointing
   with greedy refinement (:mod:`.segments`, up to 1,500 ops).
4. Offline eviction planning (:mod:`.evict`): recompute-on-demand with
   future-aware eviction rules and perturbed restarts, pruned by the best cost so
   far; also on the low-peak order of member 1 when there is one, there with the
   ``cone`` variants (an op's missing inputs rebuilt as one cone, each node once),
   and the restarts go to whichever order and variant won.
5. A CP-SAT polish of the best plan (fully recomputable graphs up to 400 nodes,
   when OR-Tools is installed), in the time left.
6. The winning plan loses the recomputations it does not need to stay at its own
   simulated peak (:func:`~tfremat.solvers.common.drop_recomputations`).
7. When no member fits: on graphs without a backward phase whose every node may
   be recomputed, the backward pebbling search (:mod:`.pebble`) at the budget
   itself, whose plans may recompute a lot; failing that, the smallest budget the
   portfolio meets (eviction bisections, and the pebbling search's own downward
   search), raised in :class:`~tfremat.errors.InfeasibleBudgetError`.

On graphs with an op that must run exactly once (TensorFlow traces: variable reads,
placeholders, stateful and backward ops) only members 2-4 and 6 run, and every schedule
keeps one order of first occurrences, recomputations inserted before the op that
needs them: what the TensorFlow rewriter emits. ``auto`` keeps the reference order;
the experimental :func:`auto_reorder_solver` also plans on the memory-greedy order with
the lowest proven floor (:func:`_trace_order`). See ``docs/solvers.md`` for the
measurements behind each choice.
"""

from __future__ import annotations

import dataclasses
import time

from ..errors import InfeasibleBudgetError, SolverUnavailableError
from ..plan import Plan, Problem
from ..simulate import reference_simulation, simulate, single_op_lower_bound
from .baselines import articulation_candidates, greedy_sweep, linear_candidates
from .common import drop_recomputations, make_plan
from .bounds import fixed_order_lower_bound
from .cover import cover_schedule
from .evict import (
    CONE_VARIANTS,
    KEEP_SOURCE_VARIANTS,
    RESTART_SIGMAS,
    VARIANTS,
    EvictionPlanner,
    evict_plan,
    low_peak_order,
    memory_greedy_order,
    min_feasible_budget,
    restart_search,
    variants_pass,
)
from .pebble import CONFIGS, LATE_CONFIGS, pebble_min_budget, pebble_plan
from .segments import segments_solver

__all__ = ["auto_solver", "auto_reorder_solver"]

DEFAULT_TIME_LIMIT_S = 9.0  # the 10 s per-solve target, with a margin
RESTART_S = 5.0
RESTART_FIXED_ORDER_S = 1.5
#: Op-level traces: the eviction variants and their restarts get
#: ``n / TRACE_OPS_PER_S`` seconds, between RESTART_FIXED_ORDER_S and
#: TRACE_RESTART_MAX_S (a restart takes ~0.1 s on 2,000 ops, and their gains keep
#: coming). Measured at the 60 % budgets: the test CNN's 2,098-op trace went from
#: +59.5 % compute after the deterministic variants to +34 % (seed 1) or +51 %
#: (seed 0) after 25 restarts, +26-27 % after 100; the Transformer's 2,577 ops from
#: +20.1 % to +15-17 % after 100.
TRACE_OPS_PER_S = 300.0
TRACE_RESTART_MAX_S = 8.0
#: Noise of the restarts on traces (log-space standard deviations, cycled). On the
#: two traces above, 100 restarts with seeds 0 and 1: CNN +26.2/+26.6 % (the
#: layer-graph schedule 0.1/0.3/1.0: +26.2/+27.1 %), Transformer +15.2/+15.9 %
#: (+17.5/+18.6 %).
TRACE_SIGMAS = (0.3, 1.0, 2.0)
#: Default limit and restart time for graphs without a backward phase whose every
#: node may be reordered, above POLISH_MAX_NODES nodes.
FORWARD_TIME_LIMIT_S = 20.0
RESTART_FORWARD_S = 10.0
REORDER_S = 3.0  # randomized list scheduling, fully recomputable graphs only
POLISH_S = 4.0  # time kept back for the CP-SAT polish
#: Above this many nodes (op-level traces) only the three best eviction variants
#: run and random restarts are skipped, to stay within a few seconds.
LARGE_GRAPH = 1500
#: Fully recomputable graphs up to this size get a CP-SAT polish of the best plan
#: in the time left (layer-level graphs; op-level traces rely on the heuristics).
POLISH_MAX_NODES = 400
#: When no member fits a graph without a backward phase: seconds for the pebbling
#: search at the budget itself, then for its smallest-budget search.
PEBBLE_PLAN_S = 3.0
PEBBLE_MIN_S = 5.0
#: Seconds for the pebbling search as a portfolio member (graphs without a backward
#: phase), with its cheap rules only.
PEBBLE_MEMBER_S = 3.0
#: Seconds at most for the covering MILP (graphs with a backward phase): 0.01-0.4 s
#: on the Checkmate graphs where its first solution fits, 1.3-1.5 s on a 2,237-op
#: Transformer trace; it leaves at once where its simulations would take longer.
COVER_S = 2.0
#: Op-level traces: the memory-greedy orders of first computations scored (noise
#: spreads; 0 is the deterministic order) and the seconds allowed for them.
TRACE_ORDER_SIGMAS = (0.0,) + (0.3, 1.0, 2.0) * 5
TRACE_ORDER_S = 2.0


def _polish(problem: Problem, best, deadline: float) -> Plan | None:
    """Improve ``best`` with the CP-SAT model, hinted with it, in the time left.

    Skipped (None) when OR-Tools is missing or under half a second is left. First
    computations keep the reference order unless the graph may be reordered.
    """
    left = deadline - time.perf_counter()
    if left < 0.5:
        return None
    try:
        from .exact import cpsat_plan

        hint = make_plan(problem, best[1], "auto", "heuristic")
        return cpsat_plan(problem, hint, name="auto", limit=left,
                          keep_order=not _may_reorder(problem.graph))
    except (SolverUnavailableError, InfeasibleBudgetError):
        return None


def _may_reorder(g) -> bool:
    """True unless the graph says otherwise or has an op that must run exactly once."""
    flag = g.graph.get("allow_reorder")
    if flag is not None:
        return bool(flag)
    return all(a.get("recomputable", True) for _, a in g.nodes(data=True))


def _with_order(g, order):
    h = g.copy(as_view=False)
    h.graph["order"] = list(order)
    return h


def _trace_order(problem: Problem, deadline: float) -> list | None:
    """A first-computation order for a graph with ops that run once (a TensorFlow
    trace) whose proven floor is below the reference order's; None if none is.

    Every plan that keeps an order of first computations and runs the non-recomputable
    ops once peaks at least at :func:`~tfremat.solvers.bounds.fixed_order_lower_bound`
    of that order: a value such an op produced is held until its last consumer runs,
    whatever is recomputed. TensorFlow's gradient order holds many such values longer
    than needed (a BatchNorm gradient's three activation-sized partial results across
    forty ops, weight gradients from their op to the optimizer). Memory-greedy list
    orders, deterministic and randomized, are scored by that floor (linear time) and
    the lowest wins. Measured floors and smallest solver targets, reference -> this
    order (with the ``contiguous`` and ``asap`` constraints): MobileNetV2 (batch 64)
    65.0 -> 59.0 MiB and 68.0 -> 61.1 MiB, the BatchNorm CNN 49.4 -> 41.4 and
    51.4 -> 43.4, the LSTM+GRU model 31.1 -> 27.1 and 33.9 -> 31.1; none lower for
    the Transformer. (Without the constraints MobileNetV2 reached 53.0 and 55.8, in
    orders the executor would not follow.)
    """
    import random

    g, fixed = problem.graph, problem.fixed_bytes
    ref = problem.order
    best, best_bound = None, fixed_order_lower_bound(g, fixed, order=ref)
    rng = random.Random(0)
    for k, sigma in enumerate(TRACE_ORDER_SIGMAS):
        if k and time.perf_counter() > deadline:
            break
        order = memory_greedy_order(g, ref, rng if sigma else None, sigma=sigma, contiguous=True)
        bound = fixed_order_lower_bound(g, fixed, order=order)
        if bound < best_bound:
            best, best_bound = order, bound
    return best


def auto_solver(problem: Problem) -> Plan:
    """Cheapest plan of the portfolio (orders, Chen sweeps, covering MILP, segments,
    eviction, polish).

    Parameters
    ----------
    problem : Problem
        ``time_limit_s`` bounds the portfolio (default 9 s); members that run
        out of time return the best they have.

    Returns
    -------
    Plan
        Status ``"optimal"`` when the reference order or a reordering fits with
        nothing recomputed, else ``"heuristic"``; ``cost_lower_bound`` is the
        every-node-once cost.

    Raises
    ------
    InfeasibleBudgetError
        When no member fits; ``min_feasible_bytes`` is the smallest budget the
        portfolio meets (a simulated peak), never below the single-op lower bound.
    """
    return _portfolio(problem)


def auto_reorder_solver(problem: Problem) -> Plan:
    """Experimental: :func:`auto_solver`, and on a TensorFlow trace also a reordering of
    its first computations. Pass it as ``solver=`` (it is not in the registry).

    On a graph with ops that must run once whose reference order does not fit, the
    portfolio runs on the reference order and on the first-computation order of
    :func:`_trace_order` (when its floor is lower), each with half the time, and the
    cheaper plan wins (the reference order on a tie). Set the graph attribute
    ``keep_order`` to True to plan on the reference order only. Measured (docs/
    solvers.md): lower smallest budgets on the small test models, bitwise and under
    budget there; but on VGG16 and ResNet50 at their new smallest budgets + 2-10 % the
    measured peak went over the budget (828 vs 736 MiB, 464 vs 446 MiB): the executor
    does not follow the reordered first computations closely enough. So it is not the
    default.
    """
    g = problem.graph
    if _may_reorder(g) or g.graph.get("keep_order"):
        return _portfolio(problem)
    t0 = time.perf_counter()
    ref = reference_simulation(g, problem.fixed_bytes)
    if ref.peak_bytes <= problem.budget_bytes:
        return _portfolio(problem)
    limit = problem.time_limit_s or DEFAULT_TIME_LIMIT_S
    order = _trace_order(problem, t0 + TRACE_ORDER_S)
    if order is None:
        return _portfolio(problem)
    share = max(0.5, (limit - (time.perf_counter() - t0)) / 2)
    plans, errors = [], []
    for graph in (g, _with_order(g, order)):
        try:
            plans.append(_portfolio(dataclasses.replace(problem, graph=graph, time_limit_s=share)))
        except InfeasibleBudgetError as e:
            errors.append(e)
    if not plans:
        raise InfeasibleBudgetError(
            problem.budget_bytes, min(e.min_feasible_bytes for e in errors), "auto portfolio"
        )
    best = min(plans, key=lambda p: p.cost)  # the first (reference order) on a tie
    return make_plan(problem, best.schedule, "auto", best.status, cost_lower_bound=ref.cost,
                     solve_s=time.perf_counter() - t0)


def _portfolio(problem: Problem) -> Plan:
    """:func:`auto_solver` on the graph's own order of first computations (op-level
    traces) or on any order (graphs every op of which may be recomputed)."""
    t0 = time.perf_counter()
    limit = problem.time_limit_s or DEFAULT_TIME_LIMIT_S
    deadline = t0 + limit
    g, fixed, budget = problem.graph, problem.fixed_bytes, problem.budget_bytes
    ref = reference_simulation(g, fixed)
    if ref.peak_bytes <= budget:
        return make_plan(problem, problem.order, "auto", "optimal", cost_lower_bound=ref.cost,
                         solve_s=time.perf_counter() - t0)

    best: tuple[float, list] | None = None
    lowest = ref.peak_bytes

    def offer(plan: Plan | None) -> None:
        nonlocal best
        if plan is not None and plan.predicted_peak_bytes <= budget:
            if best is None or plan.cost < best[0]:
                best = (plan.cost, list(plan.schedule))

    n = g.number_of_nodes()
    big = n > LARGE_GRAPH
    # Op-level traces (some op must run exactly once) are planned inside a user's
    # first call: keep them to a couple of seconds. Layer-level graphs get the
    # restarts and the CP-SAT polish that close the gap to the best known plans.
    reorder = _may_reorder(g)
    polish = reorder and n <= POLISH_MAX_NODES
    restart_s = RESTART_S if reorder else min(
        TRACE_RESTART_MAX_S, max(RESTART_FIXED_ORDER_S, n / TRACE_OPS_PER_S))
    # Reordering only graphs without a backward phase: on the seven Checkmate
    # training graphs no reordered peak was below the reference order's, and the
    # search took up to 2 s (ResNet50) better spent on the members below.
    reorder_search = reorder and not big and not any(
        a.get("phase", "forward") == "backward" for _, a in g.nodes(data=True)
    )
    order0 = pebbled = None
    if reorder_search and not polish and problem.time_limit_s is None:
        # Larger graphs without a backward phase (random layered n500, n1000): their
        # plans recompute whole cones and restarts keep paying off, so they get a
        # longer default (the target there is 30 s; training graphs and
        # traces keep the 9 s default).
        restart_s = RESTART_FORWARD_S
        limit = FORWARD_TIME_LIMIT_S
        deadline = t0 + limit
    if reorder_search:
        # Every node once is the least compute: an order that fits is optimal.
        order0, peak0 = low_peak_order(problem, time.perf_counter() + REORDER_S)
        if peak0 <= budget:
            return make_plan(problem, order0, "auto", "optimal", cost_lower_bound=ref.cost,
                             solve_s=time.perf_counter() - t0)
        # The pebbling search's "late" rule recomputes little at moderate budgets
        # and runs in well under a second there: a candidate like the others (n1000
        # at 0.8: +16 % compute, where eviction's restarts reach +74-79 %). Offered
        # after eviction planning: as an incumbent it would prune the eviction
        # variants and so skip their restarts (n1000 at 0.9: +2.3 % instead of +0.3 %).
        pebbled = pebble_plan(problem, {"ref": problem.order, "low": order0},
                              time.perf_counter() + PEBBLE_MEMBER_S, configs=LATE_CONFIGS)
    # Each checkpoint candidate costs a schedule build and a simulation (~0.1 s at
    # 5,000 ops): sweep fewer thresholds on big graphs, where eviction planning wins.
    for cands in (articulation_candidates(g), linear_candidates(g)):
        plan, low = greedy_sweep(problem, cands, "auto", n_thresholds=12 if big else 64)
        lowest = min(lowest, low)
        offer(plan)
    # The dropped set solved whole (the sweeps above pick it value by value): vgg_unet
    # at 0.8, 615 extra where eviction and the CP-SAT polish stop at 655; the
    # Transformer's 2,237-op trace at 60 % of its activations +8.9 % compute, +11.3 %
    # without. It skips graphs where its simulations would not fit in the time.
    cover = cover_schedule(problem, min(deadline, time.perf_counter() + COVER_S))
    if cover is not None:
        offer(make_plan(problem, cover, "auto", "heuristic"))
    if not big:
        try:
            offer(segments_solver(dataclasses.replace(problem, time_limit_s=max(0.1, limit / 3))))
        except InfeasibleBudgetError as e:
            lowest = min(lowest, e.min_feasible_bytes)
    planner = EvictionPlanner(g, problem.order)
    evict_deadline = min(deadline - (POLISH_S if polish else 0.0),
                         time.perf_counter() + (1.0 if big and reorder else restart_s))
    if order0 is not None:
        # No backward phase and every op may be reordered: plan on the low-peak
        # order too, with the cone variants (which alone find plans on the larger
        # random layered graphs); restarts go to the order and variant that won.
        low_planner = EvictionPlanner(g, order0)
        alt = dataclasses.replace(problem, graph=_with_order(g, order0))
        # On the larger random graphs the recursive variants never fit on the
        # low-peak order and cost ~1 s each: keep the one that sometimes wins.
        low_variants = CONE_VARIANTS + (
            VARIANTS[:2] + KEEP_SOURCE_VARIANTS if n <= POLISH_MAX_NODES else KEEP_SOURCE_VARIANTS[:1]
        )
        best, low, win, cap = variants_pass(alt, low_variants, low_planner, evict_deadline, best)
        lowest = lowest if low is None else min(lowest, low)
        planner_win, prob_win = low_planner, alt
        best, low, win2, cap2 = variants_pass(
            problem, VARIANTS + KEEP_SOURCE_VARIANTS, planner,
            evict_deadline if polish else min(evict_deadline, time.perf_counter() + 1.5), best,
        )
        if win2 is not None:
            win, cap, planner_win, prob_win = win2, cap2, planner, problem
        if best is not None and win is not None:
            # Belady-cone is a feasibility fallback; when it won, the cost-aware cone
            # rules often fit under perturbed keys (n1000 at 0.8: 3.9x -> see docs).
            others = CONE_VARIANTS[:2] if win[0] == "belady" and planner_win is low_planner else ()
            best = restart_search(prob_win, planner_win, win, best, evict_deadline,
                                  others=others, cap=cap)
    else:
        # Random restarts get what time is left, but at most a few seconds past the
        # deterministic variants: their gains flatten quickly (docs/solvers.md).
        # Big traces: the three best variants and the first keep-source one (the
        # Transformer's trace at 60 %: +20.1 % compute alone, the others +22.7 % or
        # more), then restarts in the time left.
        best, low = evict_plan(
            problem,
            variants=VARIANTS[:3] + KEEP_SOURCE_VARIANTS[:1] if big else VARIANTS,
            deadline=evict_deadline,
            planner=planner,
            best=best,
            restarts=not big or not reorder,
            sigmas=RESTART_SIGMAS if reorder else TRACE_SIGMAS,
        )
    if low is not None:
        lowest = min(lowest, low)
    if pebbled is not None:
        offer(make_plan(problem, pebbled, "auto", "heuristic"))
    if best is not None and polish:
        polished = _polish(problem, best, deadline)
        if polished is not None and polished.cost < best[0]:
            best = (polished.cost, list(polished.schedule))
    if best is None:
        mf, sched = ref.peak_bytes, list(problem.order)
        orders = None
        if order0 is not None:
            # No backward phase and every op may be recomputed and reordered: search
            # the pebble game itself (:mod:`.pebble`), which goes far below what
            # eviction reaches on the smaller random layered graphs (n100: 1.25 vs
            # 1.58 x the single-op bound, and 1.25 is proven optimal), at a high
            # compute cost where it must.
            orders = {"ref": problem.order, "low": order0}
            # The member above already tried the "late" configs at this budget.
            found = pebble_plan(problem, orders, time.perf_counter() + PEBBLE_PLAN_S,
                                configs=tuple(c for c in CONFIGS if c not in LATE_CONFIGS))
            if found is not None:
                return make_plan(problem, found, "auto", "heuristic", cost_lower_bound=ref.cost,
                                 solve_s=time.perf_counter() - t0)
            if n <= POLISH_MAX_NODES:
                # Small graphs: the pebbling bisection's minimum was never beaten by
                # the eviction tries below (n100, n250), which only run if it fails.
                mf2, sched2 = pebble_min_budget(problem, orders,
                                                time.perf_counter() + PEBBLE_MIN_S)
                if mf2 is not None and mf2 < mf:
                    mf, sched = mf2, sched2
        if mf > budget and (orders is None or n > POLISH_MAX_NODES or mf >= ref.peak_bytes):
            # Belady reaches the lowest budgets on the Checkmate graphs, the
            # cost-aware rule on random DAGs (1.77 vs 2.31 x the lower bound on
            # n100): try both. Evicting forward values only goes lower where there is
            # a backward phase.
            stop = time.perf_counter() + min(limit, DEFAULT_TIME_LIMIT_S)
            fwd_planner = EvictionPlanner(g, problem.order, forward_only=True)
            tries = [(planner, ("belady",)), (planner, ("cost_bytes_dist",)),
                     (fwd_planner, ("belady",)), (fwd_planner, ("cost_bytes_dist",))]
            if order0 is not None:
                # No backward phase: rebuilding missing cones at once reaches far lower
                # budgets on the random layered graphs (docs/solvers.md); try it first.
                low_planner = EvictionPlanner(g, order0)
                tries = [(pl, v) for v in CONE_VARIANTS for pl in (low_planner, planner)] + tries[:2]
            for k, (pl, (score, *flags)) in enumerate(tries):
                kw = dict(zip(("neighbourhood", "keep_sources", "cone"), flags))
                # An equal share of the time left to each try, so none starves the rest.
                share = (stop - time.perf_counter()) / (len(tries) - k)
                mf2, sched2 = min_feasible_budget(problem, pl, score=score,
                                                  deadline=time.perf_counter() + share, **kw)
                if mf2 < mf:
                    mf, sched = mf2, sched2
            if orders is not None and mf > budget and n > POLISH_MAX_NODES:
                # Larger graphs: pebbling below the eviction minimum, downwards from it
                # (n1000: 8.6 vs 8.85 x the single-op bound in 8 s; gains are small).
                mf2, sched2 = pebble_min_budget(problem, orders,
                                                time.perf_counter() + PEBBLE_MIN_S,
                                                hi=min(mf, lowest))
                if mf2 is not None and mf2 < mf:
                    mf, sched = mf2, sched2
        if mf <= budget:  # the bisection found a plan after all
            return make_plan(problem, sched, "auto", "heuristic", cost_lower_bound=ref.cost,
                             solve_s=time.perf_counter() - t0)
        lowest = min(lowest, mf)
        raise InfeasibleBudgetError(
            budget, max(lowest, single_op_lower_bound(g, fixed)), "auto portfolio"
        )
    # Give back the recomputations the plan does not need to stay at its own peak.
    # Not up to the budget: on the Transformer's trace at its smallest budget + 10 %,
    # dropping up to the budget raised the predicted peak by 0.05 MiB and the
    # measured one by 1.5-3 MiB (over the budget; cause not found); at the plan's own
    # peak the measured peaks were those of the plan before the pass.
    peak = simulate(problem.graph, best[1], problem.fixed_bytes).peak_bytes
    schedule = drop_recomputations(dataclasses.replace(problem, budget_bytes=peak), best[1])
    return make_plan(problem, schedule, "auto", "heuristic",
                     cost_lower_bound=ref.cost, solve_s=time.perf_counter() - t0)
