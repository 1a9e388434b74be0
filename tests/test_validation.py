"""Bad input gets a one-line error that states the rule, from every public entry point.

``BAD_INPUTS`` is the table of issue 11's probe: each row one bad input to
``specdec.generate`` (or ``reference_generate``), the exception type and a fragment of the
message that names the rule. The CLI and replay tables live in ``tests/test_cli.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

import specdec
from specdec import drafters, engine, models, phases, validation
from conftest import tiny_pair
from invariants.testing import no_host_transfers
from specdec.strategies import names as strategy_names

VOCAB = models.TINY_VOCAB
STRATEGIES = strategy_names()


@pytest.fixture(scope="module")
def target():
    return tiny_pair("llama")[0]


class CharTokenizer:
    """A tokenizer for tests: one id per character (so "" tokenises to no ids)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


class Misbehaving(drafters.NGramDrafter):
    """An n-gram drafter whose proposal is replaced by ``bad(drafts, step)`` from step
    ``at`` on."""

    def __init__(self, bad, at=0):
        super().__init__()
        self.bad, self.at, self.calls = bad, at, 0

    def propose(self, batch, k):
        drafts = super().propose(batch, k)
        self.calls += 1
        return self.bad(drafts) if self.calls - 1 >= self.at else drafts


def zeroing_hook(phase, view):
    if phase == "commit":
        view.output.zero_()


def masked_lm():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    return BertForMaskedLM(cfg).eval()


def bert_lm_head():
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    return BertLMHeadModel(cfg).eval()


def _entry(name):
    """Rows' calls of ``specdec.<name>``: the row's arguments over the defaults, on the
    tiny llama unless the row gives ``target=``."""
    def row(**kw):
        def call(target):
            args = {"prompts": [[5, 6, 7]], "max_new_tokens": 4, **kw}
            t = args.pop("target", target)
            return getattr(specdec, name)(t, args.pop("prompts"), **args)
        return call
    return row


gen, ref = _entry("generate"), _entry("reference_generate")


CTX = models.TINY_CONTEXT
# (row id, call, exception, message fragment): one row per bad input of the issue
BAD_INPUTS = [
    # 1. a text prompt that tokenises to 0 tokens, in every strategy and the reference
    *[(f"empty-text-{s}", gen(prompts=["", "Name three colours."], tokenizer=CharTokenizer(),
                              strategy=s), ValueError, "'' tokenises to 0 tokens") for s in STRATEGIES],
    ("empty-text-only", gen(prompts=[""], tokenizer=CharTokenizer()), ValueError,
     "prompt 0 is empty: every prompt needs at least one token"),
    ("empty-text-reference", ref(prompts=["", "abc"], tokenizer=CharTokenizer()), ValueError,
     "prompt 0 is empty"),
    # 2. drafter output, checked after every propose (every row drafts k: policy="fixed")
    ("drafts-at-vocab", gen(policy="fixed", drafter=Misbehaving(lambda d: torch.full_like(d, VOCAB))), ValueError,
     f"every draft must be a token id in the vocabulary [0, {VOCAB}); at step 0"),
    ("drafts-negative", gen(policy="fixed", drafter=Misbehaving(lambda d: d - 1000)), ValueError,
     "out-of-range ids: row 0 (prompt 0) proposed [-"),
    *[(f"drafts-bad-late-{s}", gen(policy="fixed", drafter=Misbehaving(lambda d: d + VOCAB, at=2), strategy=s,
                                   max_new_tokens=30, k=1),
       ValueError, "at step 2 drafter.propose returned out-of-range") for s in STRATEGIES],
    ("drafts-float", gen(policy="fixed", drafter=Misbehaving(lambda d: d.float())), TypeError,
     "of an integer dtype; at step 0 it returned dtype torch.float32"),
    ("drafts-other-device", gen(policy="fixed", drafter=Misbehaving(lambda d: d.to("meta"))), ValueError,
     "on the batch's device cpu; at step 0 it returned a tensor on meta"),
    ("drafts-list", gen(policy="fixed", drafter=Misbehaving(lambda d: d.tolist())), TypeError,
     "drafter.propose must return a tensor of token ids [B, k] = [1, 4]; at step 0 it returned"),
    ("drafts-none", gen(policy="fixed", drafter=Misbehaving(lambda d: None)), TypeError,
     "it returned None (NoneType)"),
    ("drafts-shape", gen(policy="fixed", drafter=Misbehaving(lambda d: d[:, :2])), ValueError,
     "it returned drafts of shape [1, 2]"),
    ("scripted-beyond-vocab", gen(drafter=drafters.ScriptedDrafter([[5, VOCAB + 3]])), ValueError,
     f"ScriptedDrafter script 0 (or fill) has token ids outside the target's vocabulary [0, {VOCAB})"),
    # 3. models that cannot decode left to right
    ("masked-lm-target", gen(target=masked_lm()), TypeError, "can_generate() is False"),
    ("masked-lm-draft", gen(drafter=drafters.ModelDrafter(masked_lm())), TypeError,
     "the draft model must be a transformers causal language model"),
    ("masked-lm-reference", ref(target=masked_lm()), TypeError, "can_generate() is False"),
    ("bidirectional-lm-head", gen(target=bert_lm_head()), TypeError, "config.is_decoder=False"),
    # 4. a hook that writes to the view
    ("hook-writes", gen(hooks=[zeroing_hook]), ValueError,
     "hooks must not modify the view (it is the engine's state): hook zeroing_hook wrote in "
     "place to view.output"),
    # 5. reference_generate has the engine's validation
    ("reference-oov", ref(prompts=[[5, VOCAB]]), ValueError, f"outside the vocabulary [0, {VOCAB})"),
    ("reference-negative", ref(prompts=[[-1, 5]]), ValueError, "outside the vocabulary"),
    ("reference-beyond-context-llama", ref(prompts=[[5] * CTX]), ValueError,
     "prompt + budget must be <= context"),
    ("reference-beyond-context-gpt2", ref(target=tiny_pair("gpt2")[0], prompts=[[5] * CTX]),
     ValueError, "prompt + budget must be <= context"),
    # 8. silently coerced, or failing without naming a rule
    ("float-id", gen(prompts=[[5, 6.7]]), TypeError,
     "prompt 0, position 1: a token id must be an integer (not a bool, a float or a list), got 6.7"),
    ("float-stop-id", gen(stop_token_ids=[2.7]), TypeError, "stop_token_ids, position 0: a token id must be an integer"),
    ("bool-id", gen(prompts=[[True, 5]]), TypeError, "got True (bool)"),
    ("bool-k", gen(k=True), TypeError, "k (drafts per step) must be an integer, got a bool"),
    ("float-k", gen(k=2.0), TypeError, "k (drafts per step) must be an integer, got 2.0"),
    ("nested-prompt", gen(prompts=[[[5, 6]]]), TypeError, "got [5, 6] (list)"),
    ("none-prompt", gen(prompts=[None]), TypeError, "prompt 0 must be a list of token ids"),
    ("bare-string-prompts", gen(prompts="hello"), TypeError, "prompts must be a list of prompts"),
    ("2d-tensor-prompts", gen(prompts=torch.tensor([[5, 6]])), TypeError,
     "padding is never inferred from ids"),
    ("int-stop-ids", gen(stop_token_ids=5), TypeError, "stop_token_ids must be a list of token ids"),
    ("stop-id-beyond-vocab", gen(stop_token_ids=[VOCAB]), ValueError,
     f"stop_token_ids must be token ids in the vocabulary [0, {VOCAB}), got [{VOCAB}]"),
    ("hooks-none", gen(hooks=None), TypeError, "hooks must be a list of callables hook(phase, view), got None"),
    ("hooks-not-callable", gen(hooks=[42]), TypeError, "hooks[0] must be callable as hook(phase, view), got 42"),
    ("hooks-single", gen(hooks=zeroing_hook), TypeError, "got a single function: pass hooks=[...]"),
    ("drafter-object", gen(drafter=object()), TypeError,
     "a drafter needs prefill(batch), propose(batch, k) -> [B, k] ids and a bool uses_cache"),
    ("tokenizer-string", gen(prompts=["hello"], tokenizer="gpt2"), TypeError,
     "tokenizer must be a tokenizer object (callable on text, returning input_ids), got 'gpt2'"),
    ("budget-float", gen(max_new_tokens=4.5), TypeError, "max_new_tokens must be an integer, got 4.5"),
    ("reference-batch-bool", ref(batch_size=True), TypeError, "batch_size must be an integer, got a bool"),
    ("reference-float-id", ref(prompts=[[5.0]]), TypeError, "a token id must be an integer"),
]


@pytest.mark.parametrize("call, exc, fragment", [r[1:] for r in BAD_INPUTS],
                         ids=[r[0] for r in BAD_INPUTS])
def test_every_bad_input_is_refused_naming_the_rule(target, call, exc, fragment):
    with pytest.raises(exc) as info:
        call(target)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message  # one line
    assert type(info.value) in (ValueError, TypeError)


def test_bad_drafts_never_reach_the_embedding_and_cost_no_host_read(target):
    """The range check is a device flag read by the step's one sync: speculate itself
    reads nothing on the host, the forward embeds only in-vocabulary ids, sync raises."""
    embedded = []
    emb = target.get_input_embeddings()
    handle = emb.register_forward_pre_hook(lambda m, args: embedded.append(args[0].clone()))
    drafter = Misbehaving(lambda d: torch.where(d > 0, d + VOCAB, -d - 1))
    ctx = phases.Context(target=target, drafter=drafter, k=3, hooks=(),
                         stop_ids=torch.tensor([2]), max_position=CTX - 1)
    state = phases.State()
    try:
        with torch.no_grad():
            batch = phases.prefill(ctx, state, [[5, 6, 7], [9, 10]], [0, 1], [8, 8])
            with no_host_transfers():
                spec = phases.speculate(ctx, state, batch)
    finally:
        handle.remove()
    assert all(int(e.min()) >= 0 and int(e.max()) < VOCAB for e in embedded)
    assert spec.bad_drafts.all()
    with pytest.raises(ValueError, match=r"at step 0 drafter.propose returned out-of-range ids: "
                                         r"row 0 \(prompt 0\) proposed \[1\d\d"):
        phases.sync(ctx, state, batch, spec)


def test_a_clean_step_reads_the_host_once(target, monkeypatch):
    ctx = phases.Context(target=target, drafter=drafters.NGramDrafter(), k=3, hooks=(),
                         stop_ids=torch.tensor([2]), max_position=CTX - 1)
    state = phases.State()
    with torch.no_grad():
        batch = phases.prefill(ctx, state, [[5, 6, 7], [9, 10]], [0, 1], [8, 8])
        spec = phases.speculate(ctx, state, batch)
    reads = []
    orig = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or orig(t))
    phases.sync(ctx, state, batch, spec)
    assert len(reads) == 1


def test_hooks_that_only_read_are_fine_and_inference_mode_still_decodes(target):
    prompts = [[5, 6, 7], [9]]
    want = specdec.reference_generate(target, prompts, max_new_tokens=5)
    reader = lambda phase, view: view.output.clone().zero_()  # noqa: E731 a copy may change
    assert specdec.generate(target, prompts, max_new_tokens=5, hooks=[reader]).sequences == want
    with torch.inference_mode():  # no version counters there: decoding is unchanged
        assert specdec.generate(target, prompts, max_new_tokens=5, hooks=[reader]).sequences == want


def test_the_engine_watches_every_hook_unless_all_declare_read_only(target, monkeypatch):
    from invariants import Monitor

    watched, steps = [], []
    real = validation.HookWatch
    monkeypatch.setattr(validation, "HookWatch",
                        lambda view, stores=(): watched.append(view.step) or real(view, stores))

    def probe(phase, view):  # declares read_only (it never writes): records the steps
        steps.append(view.step)

    probe.read_only = True

    def run(*hooks):
        watched.clear(), steps.clear()
        specdec.generate(target, [[5, 6, 7]], max_new_tokens=12, k=1, policy="fixed",
                         hooks=list(hooks))

    run(Monitor("fast"), probe)  # the Monitor declares read_only: the first steps only
    assert watched and max(watched) < validation.WATCH_STEPS < max(steps)
    run(Monitor("fast"), probe, lambda phase, view: None)  # one declares nothing: every step
    assert max(watched) == max(steps)
    liar = lambda phase, view: None  # noqa: E731
    liar.read_only = "yes"  # only True counts
    assert validation.watched([liar]) and not validation.watched([Monitor("fast")])


def test_a_hook_that_declares_read_only_falsely_is_named_in_the_first_steps(target):
    def liar(phase, view):
        if phase == "commit":
            view.output.add_(0)  # a write that changes nothing still bumps the version

    liar.read_only = True
    with pytest.raises(ValueError, match=r"hook .*liar wrote in place to view.output after the "
                                         r"commit phase of step 0 \(it declares read_only = True"):
        specdec.generate(target, [[5, 6, 7]], max_new_tokens=4, hooks=[liar])


def test_a_hook_writing_into_the_cache_is_named(target):
    def poke(phase, view):
        if phase == "verify":
            view.cache_tensors()[0][0].zero_()

    with pytest.raises(ValueError, match="hook .*poke wrote in place to view.target cache after the verify phase"):
        specdec.generate(target, [[5, 6, 7]], max_new_tokens=4, hooks=[poke])


def test_integer_scalars_of_numpy_and_torch_and_integer_tensors_are_ids(target):
    prompts = [[5, 6, 7], [9, 10]]
    want = specdec.generate(target, prompts, max_new_tokens=4).sequences
    given_ = [torch.tensor([5, 6, 7], dtype=torch.int32), np.array([9, 10])]
    got = specdec.generate(target, given_, k=np.int64(4), batch_size=torch.tensor(8),
                           max_new_tokens=np.int32(4), stop_token_ids=torch.tensor([2])).sequences
    assert got == want


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scripted_drafts_beyond_the_vocabulary_are_refused_before_decoding(target, strategy):
    with pytest.raises(ValueError, match=r"outside the target's vocabulary \[0, 128\): \[200\]"):
        specdec.generate(target, [[5], [6]], drafter=drafters.ScriptedDrafter([[1], [200]]),
                         strategy=strategy, max_new_tokens=2)


@pytest.mark.parametrize("scripts, fragment", [
    ([[1, -2]], "negative token ids: [-2]"),
    ([[1, 2.5]], "ScriptedDrafter script 0, position 1: a token id must be an integer"),
    ("12", "scripts must be a list of token-id lists"),
    ([[1, [2]]], "got [2] (list)"),
])
def test_scripted_drafter_scripts_are_checked_at_construction(scripts, fragment):
    with pytest.raises((ValueError, TypeError)) as info:
        drafters.ScriptedDrafter(scripts)
    assert fragment in str(info.value)


def test_forcing_drafter_checks_reference_and_vocabulary(target):
    with pytest.raises(ValueError, match=r"outside the target's vocabulary \[0, 64\)"):
        drafters.ForcingDrafter([[5, 70]], [[1]], vocab_size=64)
    with pytest.raises(TypeError, match="ForcingDrafter vocab_size must be an integer"):
        drafters.ForcingDrafter([[5]], [[1]], vocab_size=64.0)
    with pytest.raises(ValueError, match="ForcingDrafter vocab_size 200 exceeds the target's vocabulary of 128"):
        specdec.generate(target, [[5]], drafter=drafters.ForcingDrafter([[5]], [[1]], 200), max_new_tokens=2)


# -- the rules that were there before (kept) ------------------------------------------------

def test_empty_prompt_is_refused(target):
    with pytest.raises(ValueError, match="prompt 1 is empty: every prompt needs at least one token"):
        specdec.generate(target, [[5, 6], []], max_new_tokens=4)


def test_empty_prompt_list_is_refused(target):
    with pytest.raises(ValueError, match="at least one prompt"):
        specdec.generate(target, [], max_new_tokens=4)


def test_draft_vocabulary_mismatch_is_refused(target):
    cfg = target.config.__class__(**{**target.config.to_dict(), "vocab_size": 64})
    from transformers import AutoModelForCausalLM

    small = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="draft and target vocabularies must match: the draft model has 64 tokens, the target 128"):
        specdec.generate(target, [[5, 6]], drafter=drafters.ModelDrafter(small), max_new_tokens=4)


@pytest.mark.parametrize("k", [-1, -5])
def test_negative_k_is_refused(target, k):
    with pytest.raises(ValueError, match=r"k \(drafts per step\) must be an integer >= 0"):
        specdec.generate(target, [[5, 6]], k=k, max_new_tokens=4)


def test_k_zero_is_plain_greedy_decoding(target):
    prompts = [[5, 6, 7], [9]]
    want = specdec.reference_generate(target, prompts, max_new_tokens=6)
    assert specdec.generate(target, prompts, k=0, max_new_tokens=6).sequences == want


def test_prompt_plus_budget_beyond_context_is_refused(target):
    ctx = models.context_length(target)
    with pytest.raises(ValueError, match=r"prompt \+ budget must be <= context"):
        specdec.generate(target, [[5] * (ctx - 3)], max_new_tokens=4)
    # exactly at the limit is fine
    specdec.generate(target, [[5] * (ctx - 4)], max_new_tokens=4, k=2)


def test_non_causal_lm_is_refused():
    from transformers import LlamaConfig, LlamaModel

    base = LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2))
    for bad in (base, torch.nn.Linear(4, 4)):
        with pytest.raises(TypeError, match="must be a transformers causal language model"):
            specdec.generate(bad, [[1, 2]], max_new_tokens=2)


def test_token_ids_outside_the_vocabulary_are_refused(target):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        specdec.generate(target, [[5, 128]], max_new_tokens=2)


def test_unknown_strategy_is_refused(target):
    with pytest.raises(ValueError, match="strategy must be one of"):
        specdec.generate(target, [[5]], strategy="fast", max_new_tokens=2)


@pytest.mark.parametrize("kw", [{"batch_size": 0}, {"max_new_tokens": 0}])
def test_non_positive_sizes_are_refused(target, kw):
    args = {"max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=">= 1"):
        specdec.generate(target, [[5]], **args)


def test_text_prompts_need_a_tokenizer(target):
    with pytest.raises(ValueError, match="text prompts need tokenizer="):
        specdec.generate(target, ["hello"], max_new_tokens=2)


def test_scripted_drafter_needs_a_script_per_prompt(target):
    with pytest.raises(ValueError, match="one script per prompt"):
        specdec.generate(target, [[5], [6]], drafter=drafters.ScriptedDrafter([[1, 2]]), max_new_tokens=2)


# -- malformed prompt structures: refused naming a rule, or decoded exactly -----------------

_ids = st.integers(min_value=-3, max_value=VOCAB + 3)
_good_ids = st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=5)
_atoms = st.one_of(
    _ids, st.booleans(), st.floats(allow_nan=True, width=32), st.none(), st.text(max_size=3),
    _ids.map(np.int64), _ids.map(lambda t: torch.tensor(t)),
    st.just(torch.tensor(1.5)), st.just(torch.tensor(True)),
)
_sequences = st.one_of(
    _good_ids,
    _good_ids.map(lambda p: torch.tensor(p, dtype=torch.int32)),
    st.lists(_ids, max_size=5),
    st.lists(_atoms, max_size=4),
    st.lists(_ids, max_size=5).map(tuple),
    st.lists(_ids, max_size=5).map(lambda p: torch.tensor(p, dtype=torch.long)),
    st.lists(_ids, max_size=5).map(lambda p: torch.tensor(p, dtype=torch.float32)),
    st.lists(_ids, min_size=1, max_size=4).map(lambda p: torch.tensor([p])),  # 2-D
    st.lists(_ids, max_size=5).map(lambda p: np.array(p, dtype=np.int64)),
    st.lists(st.lists(_ids, max_size=2), max_size=2),  # nested one level too deep
    st.dictionaries(st.text(max_size=2), _ids, max_size=2),
    _atoms,
)
_prompt_structures = st.one_of(
    st.lists(_good_ids, min_size=1, max_size=3),  # well-formed: must decode
    st.lists(_sequences, min_size=0, max_size=3),
    st.lists(_sequences, max_size=3).map(tuple),
    _sequences,  # a single prompt where the list of prompts belongs
    st.none(),
)


#: every refusal states a rule: one of these phrases is in its message
RULE_WORDS = ("must", "is empty", "outside the vocabulary", "need")


def _expected_ids(prompts):
    """The ids a well-formed structure means; None when it is malformed (the test's own
    reading of the documented format, independent of specdec.validation)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return None
    out = []
    for p in prompts:
        if isinstance(p, torch.Tensor):
            if p.dim() != 1 or p.dtype.is_floating_point or p.dtype == torch.bool:
                return None
            p = p.tolist()
        elif isinstance(p, np.ndarray):
            if p.ndim != 1 or p.dtype.kind not in "iu":
                return None
            p = p.tolist()
        elif not isinstance(p, (list, tuple)):
            return None
        ids = []
        for t in p:
            if isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype in (torch.long, torch.int32):
                t = int(t)
            elif isinstance(t, np.integer):
                t = int(t)
            if type(t) is not int or not 0 <= t < VOCAB:
                return None
            ids.append(t)
        if not ids:
            return None
        out.append(ids)
    return out


@given(prompts=_prompt_structures)
def test_malformed_prompt_structures_are_refused_or_decoded_exactly(target, prompts):
    note(f"prompts={prompts!r}")
    want = _expected_ids(prompts)
    try:
        got = specdec.generate(target, prompts, k=3, max_new_tokens=3).sequences
    except (ValueError, TypeError) as e:
        msg = str(e)
        note(f"refused: {msg}")
        event(f"refused: {type(e).__name__}")
        assert want is None, f"a well-formed prompt list was refused: {msg}"
        assert any(rule in msg for rule in RULE_WORDS), msg
        assert "\n" not in msg
        return
    event("decoded")
    assert want is not None, "a malformed prompt list was decoded"
    assert got == [specdec.reference_generate(target, [p], max_new_tokens=3)[0] for p in want]


def test_validation_helpers_refuse_bools_and_floats_as_integers():
    assert validation.integer(np.int16(3), "x") == 3
    assert validation.integer(torch.tensor(3), "x") == 3
    for bad in (True, np.bool_(False), 3.0, "3", torch.tensor(3.0), torch.tensor([3]), None):
        with pytest.raises(TypeError, match="x must be an integer"):
            validation.integer(bad, "x")
    with pytest.raises(ValueError, match=r"x must be an integer in \[1, 4\], got 5"):
        validation.integer(5, "x", minimum=1, maximum=4)
