"""An abstract model of the scheduling pool (scheduled batching) and its inductive proof.

Model. ``N`` requests, numbered in submission order; a capacity ``C >= 1`` of active
rows (symbolic). State: ``submitted`` (requests ``0 .. S-1`` have been submitted), per
request the flags ``waiting``, ``active``, ``finished``, ``returned``, and ``next_out``
(how many outputs the pool has handed back). One step takes a symbolic move:

- ``submit``: request ``S`` arrives and waits (when ``S < N``);
- ``admit r``: the oldest waiting request ``r`` becomes active (when fewer than ``C`` are);
- ``finish r``: active request ``r`` finishes (its output is complete);
- ``emit``: the output of request ``next_out`` is handed back (when it has finished);
- anything else (or a move whose guard fails) leaves the state unchanged.

Obligations, for every ``N`` up to the bound and any ``C``: the initial state satisfies
the invariant and every move preserves it (induction), where the invariant is: every
submitted request is in exactly one of waiting/active/finished and an unsubmitted one in
none; the returned requests are exactly ``0 .. next_out-1`` and all finished; at most
``C`` are active. From it: an emitted output belongs to a finished request not returned
before (each output returned once), and outputs come back in submission order.

The model is written over a tiny boolean ops interface (``Z3Bool`` for proofs,
``PyBool`` for concrete states), so the EXSPEC pool, when it exists, can be tied to it: a
test drives the real pool and checks after each of its transitions that
``invariant(PY, state)`` holds and that the transition equals ``step`` on the
abstracted state (``State.from_flags``).
"""

from __future__ import annotations

from dataclasses import dataclass

import z3

from .core import Obligation, Query, symbolic, val

SUBMIT, ADMIT, FINISH, EMIT = 0, 1, 2, 3
MOVES = {SUBMIT: "submit", ADMIT: "admit", FINISH: "finish", EMIT: "emit"}


class Z3Bool:
    ite = staticmethod(z3.If)
    and_ = staticmethod(lambda *xs: z3.And(*xs))
    or_ = staticmethod(lambda *xs: z3.Or(*xs))
    not_ = staticmethod(z3.Not)

    @staticmethod
    def count(xs):
        return z3.Sum([z3.If(x, 1, 0) for x in xs]) if xs else z3.IntVal(0)


class PyBool:
    ite = staticmethod(lambda c, a, b: a if c else b)
    and_ = staticmethod(lambda *xs: all(xs))
    or_ = staticmethod(lambda *xs: any(xs))
    not_ = staticmethod(lambda x: not x)
    count = staticmethod(lambda xs: sum(bool(x) for x in xs))


Z3B, PY = Z3Bool(), PyBool()


@dataclass
class State:
    submitted: object      # S: requests 0 .. S-1 submitted
    waiting: list
    active: list
    finished: list
    returned: list
    next_out: object       # outputs handed back so far

    @staticmethod
    def symbolic(N: int, tag: str) -> "State":
        f = lambda name: [z3.Bool(f"{name}{r}_{tag}") for r in range(N)]  # noqa: E731
        return State(z3.Int(f"S_{tag}"), f("waiting"), f("active"), f("finished"), f("returned"),
                     z3.Int(f"next_out_{tag}"))

    @staticmethod
    def initial(N: int, symbolic: bool = False) -> "State":
        """The empty pool (z3 constants with ``symbolic``, Python values otherwise)."""
        f = z3.BoolVal(False) if symbolic else False
        zero = z3.IntVal(0) if symbolic else 0
        return State(zero, [f] * N, [f] * N, [f] * N, [f] * N, zero)

    @staticmethod
    def from_flags(submitted, waiting, active, finished, returned, next_out) -> "State":
        """Abstract a concrete pool (for tying a real pool to the model)."""
        return State(submitted, list(waiting), list(active), list(finished), list(returned), next_out)


def invariant(ops, st: State, capacity) -> list:
    """The inductive invariant, as a list of named clauses (name, formula)."""
    N = len(st.waiting)
    one_state, order = [], []
    for r in range(N):
        w, a, f = st.waiting[r], st.active[r], st.finished[r]
        exactly_one = ops.or_(ops.and_(w, ops.not_(a), ops.not_(f)),
                              ops.and_(ops.not_(w), a, ops.not_(f)),
                              ops.and_(ops.not_(w), ops.not_(a), f))
        none = ops.and_(ops.not_(w), ops.not_(a), ops.not_(f))
        one_state.append(ops.ite(r < st.submitted, exactly_one, none))
        ret = st.returned[r]
        order.append(ops.and_(ret == (r < st.next_out), ops.or_(ops.not_(ret), f)))
    return [
        ("range", ops.and_(0 <= st.submitted, st.submitted <= N,
                           0 <= st.next_out, st.next_out <= st.submitted)),
        ("exactly one state", ops.and_(*one_state)),
        ("returned = prefix of finished", ops.and_(*order)),
        ("active <= capacity", ops.count(st.active) <= capacity),
    ]


def step(ops, st: State, move, r, capacity) -> State:
    """The successor of ``st`` under ``move`` on request ``r`` (z3 terms or concrete)."""
    N = len(st.waiting)
    oldest_waiting = [ops.and_(st.waiting[i], *[ops.not_(st.waiting[q]) for q in range(i)])
                      for i in range(N)]
    room = ops.count(st.active) < capacity
    waiting, active, finished, returned = [], [], [], []
    for i in range(N):
        arrive = ops.and_(move == SUBMIT, st.submitted == i)
        admit = ops.and_(move == ADMIT, r == i, oldest_waiting[i], room)
        finish = ops.and_(move == FINISH, r == i, st.active[i])
        emit = ops.and_(move == EMIT, st.next_out == i, st.finished[i])
        waiting.append(ops.ite(arrive, True, ops.ite(admit, False, st.waiting[i])))
        active.append(ops.ite(admit, True, ops.ite(finish, False, st.active[i])))
        finished.append(ops.ite(finish, True, st.finished[i]))
        returned.append(ops.ite(emit, True, st.returned[i]))
    can_submit = ops.and_(move == SUBMIT, st.submitted < N)
    can_emit = ops.and_(move == EMIT, st.next_out < st.submitted,
                        ops.or_(*[ops.and_(st.next_out == i, st.finished[i]) for i in range(N)]))
    return State(ops.ite(can_submit, st.submitted + 1, st.submitted), waiting, active, finished,
                 returned, ops.ite(can_emit, st.next_out + 1, st.next_out))


class PoolProblem:
    def __init__(self, N: int):
        self.N = N
        self.C = z3.Int("capacity")
        self.move = z3.Int("move")
        self.r = z3.Int("request")
        self.pre = State.symbolic(N, "pre")
        self.post = step(Z3B, self.pre, self.move, self.r, self.C)
        self.inv_pre = invariant(Z3B, self.pre, self.C)
        self.inv_post = invariant(Z3B, self.post, self.C)
        self.base = [self.C >= 1, self.move >= 0, self.move <= 3, self.r >= 0, self.r < max(N, 1)]

    def witness(self, model) -> dict:
        def state(st):
            return {"submitted": val(model, st.submitted), "next_out": val(model, st.next_out),
                    "flags": [{"w": val(model, st.waiting[i]), "a": val(model, st.active[i]),
                               "f": val(model, st.finished[i]), "ret": val(model, st.returned[i])}
                              for i in range(self.N)]}
        return {"model": "pool", "requests": self.N, "capacity": val(model, self.C),
                "move": MOVES.get(val(model, self.move)), "request": val(model, self.r),
                "before": state(self.pre)}


#: ``problem(N)``: the pool's step relation over ``N`` requests, built once per ``N``
problem = symbolic(PoolProblem)


def _initial(N: int) -> Query:
    C = z3.Int("capacity")
    clauses = invariant(Z3B, State.initial(N, symbolic=True), C)
    bad = z3.Or(*[z3.Not(f) for _, f in clauses])
    return Query([C >= 1], bad, lambda mdl: {"model": "pool", "requests": N,
                                             "capacity": val(mdl, C), "state": "initial"}, [C])


def _cases(p: PoolProblem) -> list:
    """An exhaustive case split of the symbolic move: submit, emit, and admit/finish of
    each request (the split keeps every query small; together they cover every move)."""
    cases = [[p.move == SUBMIT], [p.move == EMIT]]
    cases += [[p.move == mv, p.r == i] for mv in (ADMIT, FINISH) for i in range(p.N)]
    return cases


def _preserves(clause: str):
    def build(N: int) -> list[Query]:
        p = problem(N)
        post = dict(p.inv_post)[clause]
        inv = [f for _, f in p.inv_pre]
        assume = p.base + inv
        return [Query(assume, z3.Not(post), p.witness, [p.C], case) for case in _cases(p)]
    return build


def _emit_once_in_order(N: int) -> list[Query]:
    # an emit hands back request next_out: finished, not returned before, and every
    # earlier request was returned before it
    p = problem(N)
    pre = p.pre
    emitted = [z3.And(z3.Not(pre.returned[i]), p.post.returned[i]) for i in range(N)]
    bad = []
    for i in range(N):
        earlier_missing = z3.Or(*[z3.Not(pre.returned[q]) for q in range(i)]) if i else z3.BoolVal(False)
        bad.append(z3.And(emitted[i], z3.Or(z3.Not(pre.finished[i]), earlier_missing,
                                            p.post.next_out != pre.next_out + 1)))
    # emitting must never hand back an output that was already returned
    twice = [z3.And(pre.returned[i], p.move == EMIT, pre.next_out == i) for i in range(N)]
    assume = p.base + [f for _, f in p.inv_pre]
    return [Query(assume, z3.Or(*bad, *twice), p.witness, [p.C], case) for case in _cases(p)]


def obligations() -> list[Obligation]:
    P = "pool/"
    scope = "capacity unbounded, any move"
    ob = lambda name, doc, build: Obligation(P + name, doc, build, size_name="N", scope=scope)  # noqa: E731
    return [
        ob("initial state satisfies invariant", "an empty pool satisfies the invariant", _initial),
        ob("exactly one state preserved",
           "every submitted request stays in exactly one of waiting/active/finished",
           _preserves("exactly one state")),
        ob("returned = finished prefix preserved",
           "the returned requests stay exactly 0..next_out-1, all finished",
           _preserves("returned = prefix of finished")),
        ob("active <= capacity preserved", "admission never exceeds the capacity",
           _preserves("active <= capacity")),
        ob("counters in range preserved", "0 <= next_out <= submitted <= N", _preserves("range")),
        ob("outputs returned once, in order",
           "an emitted output is finished, not returned before, and all earlier ones were",
           _emit_once_in_order),
    ]
