"""Bad input gets an error that states the rule."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec import drafters, models
from conftest import tiny_pair


@pytest.fixture(scope="module")
def target():
    return tiny_pair("llama")[0]


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
    ref = specdec.reference_generate(target, prompts, max_new_tokens=6)
    assert specdec.generate(target, prompts, k=0, max_new_tokens=6).sequences == ref


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


def test_the_engine_refuses_a_transformers_its_cache_was_not_written_for(monkeypatch):
    """The package installs next to transformers 4.51 (the checker works there); the engine
    refuses at run time, saying which release it needs and how to get it."""
    from specdec import cache
    from strategies import hf_tiny_llama

    model = hf_tiny_llama()  # transformers alone: builds on 4.51 and 5.24 alike
    monkeypatch.setattr(cache.transformers, "__version__", "4.51.3")
    with pytest.raises(cache.UnsupportedTransformersError,
                       match=r"needs transformers 5\.24\.x.*found transformers 4\.51\.3.*"
                             r"pip install 'transformers>=5\.24,<5\.25'"):
        specdec.generate(model, [[5, 6, 7]], max_new_tokens=2)
