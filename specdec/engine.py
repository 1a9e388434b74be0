"""``generate``: validate the arguments, then hand the prompts to the chosen strategy.

Reads top to bottom: ``generate`` checks its inputs at the boundary (``validate``, then
the strategy's own option and model checks), builds the run's ``Context`` (constants) and
``State`` (what changes), and calls the registry's strategy's ``run``, which decodes with
the shared phases (``specdec/phases.py``: prefill -> (draft -> verify -> commit ->
realign)*, hooks after each phase). The engine names no strategy: they come from
``specdec.strategies`` (the registry and the interface every strategy implements).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Sequence

import torch

from . import cache as cache_mod
from . import strategies
from .drafters import NGramDrafter
from .models import context_length, stop_token_ids as model_stop_ids, vocab_size
from .phases import Context, State, Stats, collect


@dataclass
class Result:
    # generated ids per prompt, in prompt order, the stop token included where one ended it
    sequences: list
    stats: Stats


# ---------------------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------------------

def _check_causal_lm(model, role: str) -> None:
    ok = (isinstance(model, torch.nn.Module) and hasattr(model, "config")
          and not getattr(model.config, "is_encoder_decoder", False)
          and callable(getattr(model, "get_output_embeddings", None))
          and model.get_output_embeddings() is not None)
    if not ok:
        raise TypeError(
            f"the {role} must be a transformers causal language model (a *ForCausalLM with an "
            f"LM head), got {type(model).__name__}"
        )


def _to_ids(prompts, tokenizer) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of token-id lists or a list of strings")
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need tokenizer=; or pass token-id lists")
        return [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if isinstance(p, str):
            raise TypeError("prompts must be all strings or all token-id lists, not a mix")
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token "
                             "(the model predicts the next token from it)")
        out.append(p)
    return out


def validate(target, ids, *, drafter, strategy, k, batch_size, max_new_tokens):
    _check_causal_lm(target, "target")
    strategies.get(strategy)  # the registry refuses an unknown name
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k (drafts per step) must be an integer >= 0, got {k!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    vocab = vocab_size(target)
    for i, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    ctx = context_length(target)
    if ctx is not None:
        for i, p in enumerate(ids):
            if len(p) + max_new_tokens > ctx:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it "
                    f"needs {len(p) + max_new_tokens} positions, beyond the model's context of "
                    f"{ctx}: prompt + budget must be <= context"
                )
    if hasattr(drafter, "check_compatible"):
        drafter.check_compatible(target)
    if hasattr(drafter, "model"):
        _check_causal_lm(drafter.model, "draft model")


# ---------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------

def generate(target, prompts, *, tokenizer=None, drafter=None, strategy="eqspec", k=4,
             batch_size=8, max_new_tokens=64, stop_token_ids=None, hooks=(), **options) -> Result:
    """Greedy speculative decoding of ``prompts`` with ``target``.

    Returns ``Result(sequences, stats)``: ``sequences[i]`` is the list of generated ids of
    prompt i, the stop token included where one ended the row, equal to the target's own
    greedy decoding. ``stop_token_ids`` defaults to the target's generation config.

    ``strategy`` is a name of ``specdec.strategies.names()``. Strategy options are
    keywords (None: the default); each strategy declares its own: ``window`` (exspec:
    requests held in the pool, default ``2 * batch_size``, at least ``batch_size``);
    ``hole_threshold`` (holes: compact when the reclaimable share of the width passes it,
    in ``[0, 1]``; default ``holes.DEFAULT_THRESHOLD``; 1 never compacts unless the cache
    is full).
    """
    ids = _to_ids(prompts, tokenizer)
    drafter = NGramDrafter() if drafter is None else drafter
    validate(target, ids, drafter=drafter, strategy=strategy, k=k, batch_size=batch_size,
             max_new_tokens=max_new_tokens)
    plugin = strategies.get(strategy)
    given = {name: v for name, v in options.items() if v is not None}
    check_option_names(plugin, given)
    resolved = plugin.check_options(given, batch_size=batch_size)
    plugin.check_models(target, drafter)
    dev = next(target.parameters()).device
    stops = model_stop_ids(target) if stop_token_ids is None else [int(s) for s in stop_token_ids]
    ctx_len = context_length(target)
    ctx = Context(
        target=target, drafter=drafter, k=k,
        stop_ids=torch.tensor(stops, dtype=torch.long, device=dev), stop_tuple=tuple(stops),
        hooks=tuple(hooks), max_position=(ctx_len - 1) if ctx_len else 2**31 - 1,
        strategy=strategy, options=MappingProxyType(dict(resolved)),
        target_window=cache_mod.sliding_window(target),
    )
    state = State(profile=plugin.profile)
    if hasattr(drafter, "bind"):
        drafter.bind(ids)
    done: list = []
    plugin.run(ctx, state, ids, batch_size=batch_size, max_new_tokens=max_new_tokens, done=done)
    return Result(sequences=collect(done, len(ids)), stats=state.stats)


def check_option_names(plugin: strategies.Strategy, given: dict) -> None:
    """Refuse options ``plugin`` does not declare, naming the strategies that take them."""
    own = {o.name for o in plugin.options}
    for name in given:
        if name in own:
            continue
        takers = [n for n in strategies.names() if name in {o.name for o in strategies.get(n).options}]
        if not takers:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        which = " or ".join(f"strategy={t!r}" for t in takers)
        raise ValueError(f"{name}= applies to {which} only, not {plugin.name!r}")
