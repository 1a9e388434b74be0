"""Stateful tests: submit, step and finish in any order, with the invariants checked.

``EngineMachine`` drives the shared phases (``phases.prefill`` / ``phases.step``) over
batches formed from submitted requests; ``PoolMachine`` drives EXSPEC's scheduling pool
(submit -> admit -> schedule/build -> speculate -> write back). Both check, as
``@invariant``s, that every submitted request is in exactly one of waiting, active and
finished, that each finished output is the batch-1 greedy reference, and (through a
strict Monitor hook) I1-I6 at every phase.
"""

from __future__ import annotations

from collections import deque

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import invariants
import specdec
from specdec import batch as batch_mod
from specdec import drafters, models, phases, strategies
from specdec.strategies import exspec
from harness import tiny_target

K = 3
BATCH = 3
MAX_LEN, MAX_BUDGET = 24, 6


def request(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, models.TINY_VOCAB, (length,), generator=g).tolist()


def context(target, drafter, monitor, **options):
    stops = models.stop_token_ids(target)
    return phases.Context(target=target, drafter=drafter, k=K,
                          stop_ids=torch.tensor(stops, dtype=torch.long), hooks=(monitor,),
                          max_position=models.context_length(target) - 1,
                          stop_tuple=tuple(stops), options=options)


class Requests:
    """Submitted requests and their batch-1 references (computed when they finish)."""

    def __init__(self, target):
        self.target = target
        self.prompts: list = []
        self.budgets: list = []
        self.outputs: dict = {}
        self.checked: set = set()

    def add(self, seed, length, budget) -> int:
        self.prompts.append(request(seed, length))
        self.budgets.append(budget)
        return len(self.prompts) - 1

    def finish(self, rid: int, output: list) -> None:
        assert rid not in self.outputs, f"request {rid} finished twice"
        self.outputs[rid] = output

    def check_outputs(self) -> None:
        for rid, out in self.outputs.items():
            if rid in self.checked:  # outputs never change once finished (finish asserts once)
                continue
            ref = specdec.reference_generate(self.target, [self.prompts[rid]],
                                             max_new_tokens=self.budgets[rid])[0]
            assert out == ref, f"request {rid}: {out} != reference {ref}"
            self.checked.add(rid)


class Machine(RuleBasedStateMachine):
    """What both machines share: a tiny target under a strict Monitor, the run's context
    and state, the submitted requests."""

    def __init__(self):
        super().__init__()
        self.target = tiny_target("llama")
        self.monitor = invariants.Monitor(mode="strict")
        self.ctx = context(self.target, drafters.NGramDrafter(), self.monitor)
        self.state = phases.State()
        self.reqs = Requests(self.target)
        self.done: list = []

    @invariant()
    def finished_outputs_equal_the_reference(self):
        self.reqs.check_outputs()

    def teardown(self):
        self.monitor.check()


class EngineMachine(Machine):
    def __init__(self):
        super().__init__()
        self.eqspec = strategies.get("eqspec")
        self.waiting: deque = deque()
        self.active: list = []
        self.batch = None

    @rule(seed=st.integers(0, 50), length=st.integers(1, MAX_LEN), budget=st.integers(1, MAX_BUDGET))
    def submit(self, seed, length, budget):
        self.waiting.append(self.reqs.add(seed, length, budget))

    @precondition(lambda self: self.batch is None and self.waiting)
    @rule()
    def start_batch(self):
        take = [self.waiting.popleft() for _ in range(min(BATCH, len(self.waiting)))]
        self.active = take
        self.state.batch_index = 0
        self.batch = phases.prefill(self.ctx, self.state, [self.reqs.prompts[r] for r in take],
                                    take, [self.reqs.budgets[r] for r in take])

    @precondition(lambda self: self.batch is not None)
    @rule()
    def step(self):
        self.batch = phases.step(self.ctx, self.state, self.batch, self.done,
                                 self.eqspec.after_step)
        for row_ids, output, generated in self.done:
            for r, out, g in zip(row_ids.tolist(), output.tolist(), generated.tolist()):
                self.reqs.finish(r, out[:g])
                self.active.remove(r)
        self.done.clear()
        if self.batch is None:
            assert not self.active

    @invariant()
    def every_request_is_in_exactly_one_state(self):
        states = list(self.waiting) + self.active + list(self.reqs.outputs)
        assert sorted(states) == list(range(len(self.reqs.prompts)))


class PoolMachine(Machine):
    """EXSPEC's pool: requests join the waiting queue at any time, not only at the start."""

    def __init__(self):
        super().__init__()
        self.state.stats.grouped_steps = 0
        # the pool is sized for the largest request the rules can submit
        cap = [request(0, MAX_LEN)]
        self.pool = exspec.Pool(self.ctx, cap * 1, [MAX_BUDGET], 2 * BATCH, torch.device("cpu"))
        self.pool.prompts, self.pool.budget_list, self.pool.waiting = self.reqs.prompts, self.reqs.budgets, deque()
        self.tcache = specdec.cache.new_cache(self.target, self.pool.compute_capacity)
        self.reusable = None
        self.returned = 0

    @rule(seed=st.integers(0, 50), length=st.integers(1, MAX_LEN), budget=st.integers(1, MAX_BUDGET))
    def submit(self, seed, length, budget):
        self.pool.waiting.append(self.reqs.add(seed, length, budget))

    @precondition(lambda self: self.pool.waiting and len(self.pool.active()) < self.pool.size)
    @rule()
    def admit(self):
        exspec.admit(self.ctx, self.state, self.pool)
        self.reusable = None

    @precondition(lambda self: self.pool.active())
    @rule()
    def step(self):
        rows, grouped, reuse = exspec.schedule(self.pool, BATCH, self.reusable)
        R = batch_mod.host_rows(rows, self.pool.tokens.device)
        batch = exspec.build(self.pool, rows, R, reuse, self.tcache, None)
        self.state.profile = exspec.PROFILE if grouped else exspec.FALLBACK_PROFILE
        phases.emit(self.ctx, self.state, "realign", batch)
        spec = phases.speculate(self.ctx, self.state, batch)
        host = phases.sync(self.ctx, self.state, batch, spec)
        exspec.write_back(self.ctx, self.state, self.pool, rows, R, batch, spec, host)
        phases.retire(batch, host, self.done)
        same = len(set(host.committed)) == 1 and not any(host.finished)
        self.reusable = rows if grouped and same else None

    @precondition(lambda self: self.done)
    @rule()
    def finish(self):
        """Return finished outputs to the caller (once each)."""
        for row_ids, output, generated in self.done:
            for r, out, g in zip(row_ids.tolist(), output.tolist(), generated.tolist()):
                self.reqs.finish(r, out[:g])
        self.done.clear()

    @invariant()
    def every_request_is_in_exactly_one_state(self):
        s = self.pool.state()
        states = s["waiting"] + s["active"] + s["finished"]
        assert sorted(states) == list(range(len(self.reqs.prompts)))
        assert set(self.reqs.outputs) <= set(s["finished"])


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(TestEngineMachine.settings, stateful_step_count=12)
TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(TestPoolMachine.settings, stateful_step_count=12)
