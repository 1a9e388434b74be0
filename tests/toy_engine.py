"""A model-free toy engine that emits correct ``StepView``s (contiguous profile), and a
tiny Hugging Face Llama built from transformers alone.

The invariants package must not depend on specdec, so its unit tests drive the Monitor
with views from this ~100-line reimplementation of the decoding loop: a deterministic
fake target (``toy_next``), random drafts accepted with probability ``accept_p``,
right-aligned rows realigned to the minimal width after every step.
"""

from __future__ import annotations

import torch

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


#: the tiny families ``hf_tiny`` builds, with the kind of positions each one uses
HF_TINY_POSITIONS = {"llama": "relative", "qwen3": "relative", "mistral": "relative",
                     "glm4": "relative", "gemma3": "relative", "gpt2": "absolute"}


def hf_tiny(family: str, seed: int = 0, vocab: int = 64):
    """A seeded fp32 2-layer causal LM of ``family`` (a key of ``HF_TINY_POSITIONS``) from
    transformers alone, on 4.51 and 5.24 alike; weights scaled as in ``hf_tiny_llama``."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=vocab, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
                  pad_token_id=2)
    attn = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    configs = {
        "llama": ("LlamaConfig", attn),
        "qwen3": ("Qwen3Config", attn),
        "mistral": ("MistralConfig", dict(attn, sliding_window=None)),
        "glm4": ("Glm4Config", attn),
        "gemma3": ("Gemma3TextConfig", dict(attn, query_pre_attn_scalar=8, sliding_window=16)),
        "gpt2": ("GPT2Config", dict(n_embd=32, n_head=4, n_positions=128)),
    }
    name, extra = configs[family]
    if family == "gpt2":
        common["n_layer"] = common.pop("num_hidden_layers")
    cfg = getattr(transformers, name)(**common, **extra)
    cfg._attn_implementation = "eager" if family == "gemma3" else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / p.shape[-1] ** 0.5)
    return model.float().eval()
