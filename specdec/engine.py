"""``generate``: validate the arguments, then hand the prompts to the chosen strategy.

Reads top to bottom: ``generate`` checks its inputs at the boundary (``validate``, then
the strategy's own option and model checks), builds the run's ``Context`` (constants) and
``State`` (what changes), and calls the registry's strategy's ``run``, which decodes with
the shared phases (``specdec/phases.py``: prefill -> (draft -> verify -> commit ->
realign)*, hooks after each phase). The engine names no strategy: they come from
``specdec.strategies`` (the registry and the interface every strategy implements).

Validation (``validation.py``): ``generate`` checks every argument before any work
(``validate``, then the strategy's ``check_options`` and ``check_models``); during the
run ``phases.speculate`` checks each ``propose`` result (host facts at once; ids outside
the vocabulary are clamped for the verify forward and flagged on the device, and
``phases.sync`` raises ``ValueError`` when the flag is set, so such a step's output is
never returned) and ``phases.emit`` refuses a hook that writes to its view
(``validation.HookWatch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import torch

from . import cache as cache_mod
from . import compiled as compiled_mod
from . import policy as policy_mod
from . import sampling as sampling_mod
from . import static as static_mod
from . import strategies, validation
from .drafters import NGramDrafter
from .models import context_length, stop_token_ids as model_stop_ids, vocab_size
from .phases import Context, State, Stats, collect


@dataclass
class Result:
    # generated ids per prompt, in prompt order, the stop token included where one ended it
    sequences: list
    stats: Stats


# ---------------------------------------------------------------------------------------
# Validation at the boundary (the rules live in validation.py)
# ---------------------------------------------------------------------------------------

class Checked(NamedTuple):
    """``generate``'s arguments after ``validate``."""

    ids: list  # [[int]] per prompt
    drafter: object
    stops: list | None  # None: the model's generation config
    hooks: tuple
    k: int
    batch_size: int
    max_new_tokens: int


def validate(target, prompts, *, tokenizer, drafter, strategy, k, batch_size, max_new_tokens,
             stop_token_ids, hooks) -> Checked:
    """Every check of ``generate``'s common arguments, before any work; returns them
    checked (ints as ints, the prompts as id lists, the default drafter filled in, stop ids
    None for the model's own). Strategy options are the strategy's to check."""
    cache_mod.check_transformers()  # first: the engine runs on one transformers release
    ids = validation.prompt_ids(prompts, tokenizer)
    max_new_tokens, stops = validation.request(target, ids, max_new_tokens=max_new_tokens,
                                               stop_token_ids=stop_token_ids)
    validation.choice(strategy, "strategy", strategies.names())
    k = validation.integer(k, "k (drafts per step)", minimum=0)
    batch_size = validation.integer(batch_size, "batch_size", minimum=1)
    hooks = validation.hooks(hooks)
    drafter = NGramDrafter() if drafter is None else drafter
    validation.drafter(drafter)
    if hasattr(drafter, "check_compatible"):
        drafter.check_compatible(target)
    return Checked(ids, drafter, stops, hooks, k, batch_size, max_new_tokens)


# ---------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------

def generate(target, prompts, *, tokenizer=None, drafter=None, strategy="eqspec", k=4,
             batch_size=8, max_new_tokens=64, stop_token_ids=None, hooks=(), sampling=None,
             policy="adaptive", compile=None, static_shapes=None, **options) -> Result:
    """Speculative decoding of ``prompts`` with ``target``: greedy, or sampled.

    Returns ``Result(sequences, stats)``: ``sequences[i]`` is the list of generated ids of
    prompt i, the stop token included where one ended the row, equal to the target's own
    greedy decoding (``sampling`` None). ``stop_token_ids`` defaults to the target's
    generation config.

    ``sampling``: None (greedy) or ``specdec.Sampling(temperature, top_k, top_p, seed,
    mode)``: request i samples with (seed, i). Mode "coupled": ``sequences`` equal plain
    sampling (``reference_generate(..., sampling=)``) token for token; "rejection":
    speculative rejection sampling, a sample of the target's distribution
    (``specdec.sampling``).

    ``k`` is the most drafts a row verifies per step; ``policy`` chooses each row's own
    draft length ``k_b`` in ``0 .. k`` at every step (``specdec.policy``): ``"adaptive"``
    (the default: a row drafts only where its expected committed tokens per unit of
    cost beat a plain decode step; a step where no row drafts is plain decoding),
    ``"fixed"`` (every row drafts ``k``) or a policy object (``specdec.policy.DraftPolicy``;
    an ``AdaptivePolicy`` passed again keeps what it learned). ``"adaptive"`` starts from
    what earlier calls on the same model learned (``specdec.policy.calibration(target)``:
    step costs and acceptance), and plans the first step from the drafter's evidence on
    the prompts.

    ``strategy`` is a name of ``specdec.strategies.names()``. Strategy options are
    keywords (None: the default); each strategy declares its own: ``window`` (exspec:
    requests held in the pool, default ``2 * batch_size``, at least ``batch_size``);
    ``hole_threshold`` (holes: compact when the reclaimable share of the width passes it,
    in ``[0, 1]``; default ``holes.DEFAULT_THRESHOLD``; 1 never compacts unless the cache
    is full).

    ``compile``: None (eager), ``"inductor"`` or ``"cuda-graphs"`` (CUDA models only):
    the opt-in compiled fast path (``specdec.compiled``): inductor compiles the
    width-independent regions of the target's and a draft model's layers (attention and
    every hook eager); cuda-graphs captures the target's whole decode and verify
    forwards, one CUDA graph per shape bucket (``specdec.graphs``; static shapes on,
    ``Stats.graphs`` counts captures, replays and eager forwards); the tokens are the same.

    ``static_shapes``: None (the default: on with ``compile="cuda-graphs"``, else off),
    False (eager widths), or True: the decode and verify forwards run
    at few shapes (``specdec.static``: verify width 1 or ``k + 1``, key widths rounded up
    to buckets, inputs written into buffers allocated once per run, one cache per run);
    the tokens are the same.

    Bad input raises ``TypeError`` (a value of the wrong kind) or ``ValueError`` (out of
    range) with one line that states the rule (``specdec.validation``), before any work;
    a drafter's bad output, or a hook's write to its view, raises ``ValueError`` during
    the run.
    """
    a = validate(target, prompts, tokenizer=tokenizer, drafter=drafter, strategy=strategy, k=k,
                 batch_size=batch_size, max_new_tokens=max_new_tokens,
                 stop_token_ids=stop_token_ids, hooks=hooks)
    sampling = sampling_mod.checked(sampling)
    mode = compiled_mod.check(compile, target)
    static_shapes = static_mod.checked(static_shapes, mode)
    ids, drafter, k, batch_size, max_new_tokens = a.ids, a.drafter, a.k, a.batch_size, a.max_new_tokens
    plugin = strategies.get(strategy)
    given = {name: v for name, v in options.items() if v is not None}
    check_option_names(plugin, given)
    resolved = plugin.check_options(given, batch_size=batch_size)
    plugin.check_models(target, drafter)
    chosen = policy_mod.resolve(policy, target)
    if hasattr(chosen, "refills"):  # whether a finished row's place goes to a waiting request
        chosen.refills = plugin.refills
    dev = next(target.parameters()).device
    chosen.begin(k, len(ids), dev)
    stops = model_stop_ids(target) if a.stops is None else a.stops
    ctx_len = context_length(target)
    ctx = Context(
        target=target, drafter=drafter, k=k,
        stop_ids=torch.tensor(stops, dtype=torch.long, device=dev), stop_tuple=tuple(stops),
        hooks=a.hooks, max_position=(ctx_len - 1) if ctx_len else 2**31 - 1,
        strategy=strategy, options=MappingProxyType(dict(resolved)),
        target_window=cache_mod.sliding_window(target), vocab=vocab_size(target),
        sampling=sampling, policy=chosen, static_shapes=static_shapes,
    )
    state = State(profile=plugin.profile)
    if hasattr(drafter, "bind"):
        drafter.bind(ids)
    done: list = []
    draft_model = getattr(drafter, "model", None) if mode is not None else None
    if not isinstance(draft_model, torch.nn.Module):
        draft_model = None
    with compiled_mod.compiled(target, mode, whole=True) as graphs, \
            compiled_mod.compiled(draft_model, mode):
        plugin.run(ctx, state, ids, batch_size=batch_size, max_new_tokens=max_new_tokens,
                   done=done)
    if graphs is not None:
        state.stats.graphs = graphs.counts()
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
