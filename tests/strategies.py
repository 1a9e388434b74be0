"""Test helpers and hypothesis strategies shared by the suite."""

from __future__ import annotations

import torch

#: prompt lengths mixed in one batch: from 1 token to 60
MIXED_LENGTHS = (1, 60, 7, 33, 2, 18, 45, 12)


def random_prompts(lengths, vocab: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Seeded random prompts of the given lengths, ids in [low, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """Hugging Face generate at batch 1: the independent oracle (stop token kept)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=list(stop_ids),
                         pad_token_id=list(stop_ids)[0] if stop_ids else 0)
    ids = out[0, len(prompt):].tolist()
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids


#: bugs of ``broken_greedy``: each row's first real token masked out (the padding mask off
#: by one), or every generated token but the newest masked out (the mask not extended)
BROKEN_LOOPS = ("first_token_masked", "history_masked")


@torch.no_grad()
def broken_greedy(model, prompts, max_new_tokens: int, stop_ids=None,
                  bug: str = "history_masked") -> list[list[int]]:
    """A batched greedy loop (left padding, explicit positions, a ``DynamicCache``) with
    one bug of ``BROKEN_LOOPS``. Greedy ids per prompt, cut after the first stop token."""
    from transformers import DynamicCache

    assert bug in BROKEN_LOOPS, bug
    stops = {int(s) for s in ([model.generation_config.eos_token_id] if stop_ids is None
                              else stop_ids)}
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    pad = torch.tensor([width - len(p) for p in prompts])[:, None]
    slots = torch.arange(width)[None, :]
    positions = (slots - pad).clamp(min=0)
    mask = (slots > pad if bug == "first_token_masked" else slots >= pad).long()
    cache, out = DynamicCache(), []
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                   cache=cache, use_cache=True).logits[:, -1]
    nxt_pos = positions[:, -1:] + 1
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if bug == "history_masked" and len(out) > 1:
            mask[:, -1] = 0  # the previous generated token drops out of the context
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        logits = model(input_ids=nxt, position_ids=nxt_pos, attention_mask=mask,
                       cache=cache, use_cache=True).logits[:, -1]
        nxt_pos = nxt_pos + 1
    seqs = []
    for row in torch.cat(out, dim=1).tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        seqs.append(row[:cut])
    return seqs


# ---------------------------------------------------------------------------------------
# invariants: a model-free toy engine that emits correct StepViews (contiguous profile)
# ---------------------------------------------------------------------------------------
# The invariants package must not depend on specdec, so its unit tests drive the Monitor
# with views from this ~100-line reimplementation of the decoding loop: a deterministic
# fake target (``toy_next``), random drafts accepted with probability ``accept_p``,
# right-aligned rows realigned to the minimal width after every step.

TOY_VOCAB = 16
TOY_STOP = 2
TOY_LAYERS = 2


def toy_next(seq) -> int:
    """The fake target's greedy next token after ``seq``."""
    prev = seq[-2] if len(seq) > 1 else 0
    return (seq[-1] * 5 + prev * 3 + len(seq)) % TOY_VOCAB


def toy_view(rows, *, phase, step, k, stop=(TOY_STOP,), profile="contiguous", extra=None):
    """A StepView of ``rows`` (dicts: rid, seq, plen, out, budget, finished) at ``phase``."""
    from invariants.view import ForwardRecord, StepView

    b = len(rows)
    w = max(len(r["seq"]) for r in rows)
    tokens = torch.zeros(b, w, dtype=torch.long)
    valid = torch.zeros(b, w, dtype=torch.bool)
    positions = torch.zeros(b, w, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["seq"])
        tokens[i, w - n:] = torch.tensor(r["seq"])
        valid[i, w - n:] = True
        positions[i, w - n:] = torch.arange(n)
    t = max(r["budget"] for r in rows) + k + 1
    output = torch.zeros(b, t, dtype=torch.long)
    for i, r in enumerate(rows):
        if r["out"]:
            output[i, : len(r["out"])] = torch.tensor(r["out"])
    lt = lambda key: torch.tensor([r[key] for r in rows], dtype=torch.long)  # noqa: E731
    extra = dict(extra or {})
    cw = w + k if phase in ("verify", "commit") else w - 1
    if phase == "prefill" and w > 1:
        extra["forward"] = ForwardRecord(tokens[:, : w - 1], positions[:, : w - 1],
                                         valid[:, : w - 1], 0)
    return StepView(
        step=step, phase=phase, profile=profile, k=k, tokens=tokens, valid=valid,
        positions=positions, lengths=torch.tensor([len(r["seq"]) for r in rows]),
        prompt_lengths=lt("plen"), budgets=lt("budget"),
        generated=torch.tensor([len(r["out"]) for r in rows]),
        finished=torch.tensor([r["finished"] for r in rows]), row_ids=lt("rid"),
        output=output, stop_token_ids=tuple(stop), cache_widths=(cw,) * TOY_LAYERS,
        cache_batch_sizes=(b,) * TOY_LAYERS, **extra)


def toy_views(prompts, *, k=3, budget=8, seed=0, accept_p=0.6, stop=(TOY_STOP,)):
    """Yield (phase, view) of a correct speculative run of the fake target."""
    import random

    rng = random.Random(seed)
    rows = [dict(rid=i, seq=list(p), plen=len(p), out=[], budget=budget, finished=False)
            for i, p in enumerate(prompts)]
    step = 0
    view = toy_view(rows, phase="prefill", step=0, k=k, stop=stop)
    yield "prefill", view
    while rows:
        b = len(rows)
        drafts, limits = [], []
        for r in rows:
            ctx, d = list(r["seq"]), []
            for _ in range(k):
                true = toy_next(ctx + d)
                d.append(true if rng.random() < accept_p else (true + 1 + rng.randrange(TOY_VOCAB - 1)) % TOY_VOCAB)
            drafts.append(d)
            limits.append(max(0, min(k, r["budget"] - len(r["out"]) - 1)))
        dt = torch.tensor(drafts, dtype=torch.long).reshape(b, k)
        lim = torch.tensor(limits)
        yield "draft", toy_view(rows, phase="draft", step=step, k=k, stop=stop,
                                extra=dict(drafts=dt, draft_limit=lim))
        preds = [[toy_next(r["seq"] + d[:i]) for i in range(k + 1)] for r, d in zip(rows, drafts)]
        pt = torch.tensor(preds, dtype=torch.long)
        w = max(len(r["seq"]) for r in rows)
        valid = torch.zeros(b, w, dtype=torch.bool)
        for i, r in enumerate(rows):
            valid[i, w - len(r["seq"]):] = True
        n = torch.tensor([len(r["seq"]) for r in rows])
        from invariants.view import ForwardRecord

        fwd = ForwardRecord(
            torch.cat([torch.tensor([[r["seq"][-1]] for r in rows]), dt], dim=1),
            n[:, None] - 1 + torch.arange(k + 1)[None, :],
            torch.cat([valid[:, : w - 1], torch.ones(b, k + 1, dtype=torch.bool)], dim=1), w - 1)
        yield "verify", toy_view(rows, phase="verify", step=step, k=k, stop=stop,
                                 extra=dict(drafts=dt, draft_limit=lim, predictions=pt, forward=fwd))
        before = [len(r["out"]) for r in rows]
        accepted, committed = [], []
        for r, d, y, l in zip(rows, drafts, preds, limits):
            a = 0
            while a < l and d[a] == y[a]:
                a += 1
            upto = min(a + 1, r["budget"] - len(r["out"]))
            m = next((i + 1 for i in range(upto) if y[i] in stop), upto)
            r["out"] += y[:m]
            r["finished"] = y[m - 1] in stop or len(r["out"]) >= r["budget"]
            accepted.append(a)
            committed.append(m)
        commit_view = toy_view(rows, phase="commit", step=step, k=k, stop=stop, extra=dict(
            drafts=dt, draft_limit=lim, predictions=pt, accepted=torch.tensor(accepted),
            committed=torch.tensor(committed), generated_before=torch.tensor(before)))
        # the commit view shows the tokens of before the commit: rebuild them
        for i, (r, m) in enumerate(zip(rows, committed)):
            r["seq"] += r["out"][len(r["out"]) - m:]
        yield "commit", _with_old_tokens(commit_view, rows, committed)
        step += 1
        rows = [r for r in rows if not r["finished"]]
        if rows:
            yield "realign", toy_view(rows, phase="realign", step=step, k=k, stop=stop)


def _with_old_tokens(view, rows, committed):
    """The commit view with tokens/valid/positions/lengths of before the commit."""
    import dataclasses

    old = [dict(r, seq=r["seq"][: len(r["seq"]) - m]) for r, m in zip(rows, committed)]
    ref = toy_view(old, phase="commit", step=view.step, k=view.k, stop=view.stop_token_ids)
    return dataclasses.replace(view, tokens=ref.tokens, valid=ref.valid,
                               positions=ref.positions, lengths=ref.lengths)


def hf_tiny_llama(seed: int = 0, vocab: int = 64):
    """A seeded fp32 2-layer Llama built from transformers alone (for invariants tests
    that must not depend on specdec); weights scaled so greedy choices are not ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    return model.eval()


class HostReadError(AssertionError):
    """A tensor value was read on the host where no host transfer is allowed."""


def forbid_host_reads():
    """Context manager: any read of a tensor's values on the host (``item``, ``tolist``,
    ``bool(t)``, ``int(t)``, ``cpu``, ``numpy``, ``nonzero``) raises ``HostReadError``.

    On CPU this stands in for CUDA's sync debug mode (which the GPU tests use); it does
    not see reads made inside C++ (boolean-mask indexing), so code under test avoids those
    by construction.
    """
    import contextlib

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
             "numpy", "nonzero")

    @contextlib.contextmanager
    def guard():
        saved = {n: getattr(torch.Tensor, n) for n in names}
        saved_nonzero = torch.nonzero

        def refuse(name):
            def f(*a, **k):
                raise HostReadError(f"host read of a tensor value: Tensor.{name}")
            return f
        try:
            for n in names:
                setattr(torch.Tensor, n, refuse(n))
            torch.nonzero = refuse("nonzero")
            yield
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)
            torch.nonzero = saved_nonzero
    return guard()


# ---------------------------------------------------------------------------------------
# hypothesis strategies for the adversarial property suite
# ---------------------------------------------------------------------------------------
# One strategy per kind of adversarial input; ``cases()`` composes them. Shrinking goes
# toward few rows (the row count is drawn first, from 1), few steps (small budgets, short
# patterns) and short prompts.

from dataclasses import dataclass, field  # noqa: E402

from hypothesis import strategies as st  # noqa: E402

PATTERN_KINDS = ("all_zero", "all_max", "one_lagging", "alternating", "staircase", "random")


def shape_pattern(kind: str, row: int, rows: int, k: int, steps: int, drawn: list) -> list:
    """Row ``row``'s accepted count per step under pattern ``kind`` (``drawn``: the row's own
    random counts, used by "random" and to pick the lagging row)."""
    if kind == "all_zero":
        return [0] * steps
    if kind == "all_max":
        return [k] * steps
    if kind == "one_lagging":
        return [0 if row == 0 else k] * steps  # row 0 lags (shrinking keeps it first)
    if kind == "alternating":
        return [(k if (row + s) % 2 else 0) for s in range(steps)]
    if kind == "staircase":
        return [min(k, (row + s) % (k + 1)) for s in range(steps)]
    return [min(a, k) for a in drawn]


@st.composite
def acceptance_patterns(draw, rows: int, k: int, steps: int):
    """Per row, per step, the accepted count in [0, k] an engine must produce."""
    kind = draw(st.sampled_from(PATTERN_KINDS))
    drawn = [draw(st.lists(st.integers(0, k), min_size=1, max_size=steps)) for _ in range(rows)]
    return [shape_pattern(kind, r, rows, k, steps, drawn[r]) for r in range(rows)]


def prompt_length(context: int, budget: int):
    """A prompt length from 1 token to near the context limit (prompt + budget <= context),
    mostly short so that batches mix short and long rows."""
    return st.one_of(st.integers(1, 12), st.integers(1, context - budget))


def stop_placements(rows: int, budget: int):
    """None, or (row, offset): the reference token of that row at that offset becomes a stop
    token (so the row, and any row that meets the same id, stops there)."""
    return st.one_of(st.none(), st.tuples(st.integers(0, rows - 1), st.integers(0, budget - 1)))


@dataclass
class Case:
    """One adversarial workload."""

    family: str
    lengths: list
    budget: int
    k: int
    batch_size: int
    pattern: list
    stop: tuple | None
    seed: int = 0
    note: dict = field(default_factory=dict)
    strategy: str = "eqspec"

    @property
    def rows(self) -> int:
        return len(self.lengths)


@st.composite
def cases(draw, families=("llama", "qwen3", "glm4", "gpt2", "mistral"), max_rows: int = 16,
          max_budget: int = 12, context: int = 256, ks=(1, 2, 3, 4, 8),
          strategies=("eqspec", "exspec", "holes")):
    """A whole workload. Rows are drawn as one list of (prompt length, own accepted counts)
    so that shrinking deletes whole rows; the pattern kind shapes every row's counts."""
    family = draw(st.sampled_from(families))
    k = draw(st.sampled_from(ks))
    budget = draw(st.integers(1, max_budget))
    kind = draw(st.sampled_from(PATTERN_KINDS))
    row = st.tuples(prompt_length(context, budget),
                    st.lists(st.integers(0, k), min_size=1, max_size=budget))
    drawn = draw(st.lists(row, min_size=1, max_size=max_rows))
    rows = len(drawn)
    lengths = [length for length, _ in drawn]
    pattern = [shape_pattern(kind, r, rows, k, budget, counts) for r, (_, counts) in enumerate(drawn)]
    # drawn independently of the row count (then capped) so that deleting a row while
    # shrinking never invalidates the batch size
    batch_size = min(draw(st.integers(1, max_rows)), rows)
    stop = draw(stop_placements(rows, budget))
    seed = draw(st.integers(0, 3))
    strategy = draw(st.sampled_from(strategies))
    return Case(family, lengths, budget, k, batch_size, pattern, stop, seed, note={"kind": kind},
                strategy=strategy)


# ---------------------------------------------------------------------------------------
# running a Case on an engine, with the Monitor and a record of every commit
# ---------------------------------------------------------------------------------------

_MODELS: dict = {}
_FREE: dict = {}


def tiny_target(family: str):
    if family not in _MODELS:
        from specdec import models

        _MODELS[family] = models.tiny(family)
    return _MODELS[family]


def case_prompts(case: Case) -> list[list[int]]:
    from specdec import models

    return random_prompts(case.lengths, models.TINY_VOCAB, seed=case.seed)


def free_reference(target, prompts, budget, key=None):
    """Batch-1 greedy continuations without stop tokens (memoised per key)."""
    import specdec

    if key is None or key not in _FREE:
        ref = specdec.reference_generate(target, prompts, max_new_tokens=budget, stop_token_ids=[])
        if key is None:
            return ref
        _FREE[key] = ref
    return _FREE[key]


def cut_at_stop(seqs, stop_ids):
    """Greedy output with stop tokens = the free continuation cut after the first stop."""
    out = []
    for s in seqs:
        cut = next((i + 1 for i, t in enumerate(s) if t in stop_ids), len(s))
        out.append(s[:cut])
    return out


@dataclass
class Outcome:
    sequences: list
    reference: list
    forced: list  # per step: [B] forced accepted counts (before the draft limit)
    commits: list  # per step: (row_ids, draft_limit, accepted, committed) host lists
    violations: list
    k: int
    budget: int
    stops: list

    def steps(self) -> int:
        """Verify steps run (over all batches)."""
        return len(self.commits)

    def divergence_step(self) -> int | None:
        """1-based step (over all batches) that committed the first wrong token, if any."""
        first = None
        for row_id, (got, want) in enumerate(zip(self.sequences, self.reference)):
            if got == want:
                continue
            j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            total = 0
            for step, (rows, _, _, committed) in enumerate(self.commits, start=1):
                if row_id in rows:
                    total += committed[rows.index(row_id)]
                    if total > j:
                        first = step if first is None else min(first, step)
                        break
        return first

    def steps_to_failure(self) -> int:
        """Steps up to the first violation or the first wrong token (all steps when none)."""
        marks = [s for s in (self.divergence_step(),) if s is not None]
        if self.violations:
            marks.append(self.violations[0].step + 1)
        return min(marks) if marks else self.steps()


class CommitRecorder:
    def __init__(self):
        self.commits = []

    def __call__(self, phase, view):
        if phase == "commit":
            self.commits.append((view.row_ids.tolist(), view.draft_limit.tolist(),
                                 view.accepted.tolist(), view.committed.tolist()))


def run_case(case: Case, *, strategy: str | None = None, known_bad=None, mutant=None, target=None,
             raise_on_violation: bool = False) -> Outcome:
    """Run ``case`` with a ForcingDrafter under a strict Monitor (recording by default).

    ``mutant`` (a name of specdec.mutants) applies to the engine run only: the reference
    is always computed with the real layout (reference decoding shares left_pad's math).
    """
    import contextlib

    import invariants
    import specdec
    from specdec import drafters, models, mutants

    target = target if target is not None else tiny_target(case.family)
    prompts = case_prompts(case)
    free = free_reference(target, prompts, case.budget,
                          key=(id(target), tuple(case.lengths), case.budget, case.seed))
    stops = models.stop_token_ids(target)
    if case.stop is not None:
        row, off = case.stop
        off = min(off, len(free[row]) - 1)
        stops = [free[row][off]]
    ref = cut_at_stop(free, set(stops))
    drafter = drafters.ForcingDrafter(free, case.pattern, models.vocab_size(target))
    forced = []
    orig = drafter.propose

    def propose(batch, k):
        forced.append(drafter.forced(batch, k).tolist())
        return orig(batch, k)

    drafter.propose = propose
    mon = invariants.Monitor(mode="strict", raise_on_violation=raise_on_violation)
    rec = CommitRecorder()
    strategy = strategy or case.strategy
    with mutants.apply(mutant) if mutant else contextlib.nullcontext():
        seqs = _run_engine(case, target, prompts, drafter, stops, strategy, known_bad, [mon, rec])
    violations = mon.check()
    return Outcome(seqs, ref, forced, rec.commits, violations, case.k, case.budget, stops)


#: ``run_case(known_bad=NAIVE)``: the known-bad engines' shared loop without a defect
NAIVE = "naive"


def _run_engine(case, target, prompts, drafter, stops, strategy, known_bad, hooks):
    import specdec

    if known_bad is None:
        return specdec.generate(target, prompts, drafter=drafter, strategy=strategy, k=case.k,
                                batch_size=case.batch_size, max_new_tokens=case.budget,
                                stop_token_ids=stops, hooks=hooks).sequences
    from specdec.forensics.known_bad import generate_known_bad

    fault = None if known_bad == NAIVE else known_bad
    seqs, _ = generate_known_bad(fault, target, prompts, drafter=drafter, k=case.k,
                                 max_new_tokens=case.budget, stop_token_ids=stops, hooks=hooks,
                                 batch_size=case.batch_size)
    return seqs


def outcome_failures(o: Outcome) -> list[str]:
    """Every property an outcome breaks (empty: all hold)."""
    bad = []
    if o.violations:
        v = o.violations[0]
        bad.append(f"invariant {v.invariant} at step {v.step}, {v.phase}")
    if o.sequences != o.reference:
        bad.append("ids differ from the batch-1 reference")
    for (rows, limit, acc, com), forced in zip(o.commits, o.forced):
        for lim, a, c, f in zip(limit, acc, com, forced):
            if a != min(f, lim):
                bad.append(f"accepted {a} != forced min({f}, {lim})")
            if not 1 <= c <= o.k + 1:
                bad.append(f"committed {c} outside [1, k+1]")
    for s in o.sequences:
        if len(s) > o.budget:
            bad.append("budget exceeded")
        if any(t in o.stops for t in s[:-1]):
            bad.append("tokens after a stop token")
    return bad


# ---------------------------------------------------------------------------------------
# drafters for the equivalence grids (tests/test_engine.py, tests/test_strategies.py)
# ---------------------------------------------------------------------------------------

def corrupted(seqs, vocab: int, every: int = 3):
    """The reference with every ``every``-th token replaced: forces partial acceptance."""
    return [[(t + 1) % vocab if i % every == every - 1 else t for i, t in enumerate(s)]
            for s in seqs]


def make_drafter(kind: str, draft_model, ref, vocab: int):
    """The grid's drafter of ``kind``: ngram, model (``draft_model``) or scripted
    (the corrupted reference)."""
    from specdec import drafters

    if kind == "ngram":
        return drafters.NGramDrafter()
    if kind == "model":
        return drafters.ModelDrafter(draft_model)
    if kind == "scripted":
        return drafters.ScriptedDrafter(corrupted(ref, vocab))
    raise AssertionError(kind)
