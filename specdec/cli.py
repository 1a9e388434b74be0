"""Command line: ``specdec generate``, ``specdec audit``, ``specdec replay TRACE.json``."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="target: a local Hugging Face directory or hub name, 'tiny:FAMILY', "
                        "or omitted for the default SmolLM2-135M-Instruct")
    p.add_argument("--draft-model", default=None,
                   help="draft model (same forms as --model); default: the n-gram drafter")
    p.add_argument("--k", type=int, default=4, help="drafts per step (default 4)")
    p.add_argument("--batch-size", type=int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--strategy", default="eqspec", choices=("eqspec", "exspec", "holes"))


def _read_prompts(args) -> list:
    """Prompts as Prompt objects (text) or id lists, from arguments or a JSONL file."""
    from . import prompts as prompt_mod

    items: list = []
    if args.jsonl:
        items.extend(prompt_mod.load_jsonl(args.jsonl))
    for text in args.prompts:
        items.append(prompt_mod.Prompt(id=f"arg{len(items)}", kind="custom",
                                       messages=({"role": "user", "content": text},)))
    if not items:
        raise SystemExit("specdec generate: give prompts as arguments or with --jsonl FILE")
    return items


def _encode(items, tokenizer, chat: bool) -> list[list[int]]:
    from . import prompts as prompt_mod

    if tokenizer is None:  # tiny models: prompts are space-separated token ids
        try:
            return [[int(t) for t in p.messages[-1]["content"].split()] for p in items]
        except ValueError:
            raise SystemExit("this model has no tokenizer: give prompts as space-separated token ids")
    if chat:
        return prompt_mod.encode(items, tokenizer)
    return [list(tokenizer(p.messages[-1]["content"], add_special_tokens=False)["input_ids"])
            for p in items]


def cmd_generate(args) -> int:
    from . import drafters, engine, models

    target, tok = models.resolve(args.model)
    drafter = drafters.NGramDrafter()
    if args.draft_model:
        drafter = drafters.ModelDrafter(models.resolve(args.draft_model)[0])
    items = _read_prompts(args)
    ids = _encode(items, tok, chat=not args.no_chat)
    t0 = time.perf_counter()
    res = engine.generate(target, ids, drafter=drafter, strategy=args.strategy, k=args.k,
                          batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    secs = time.perf_counter() - t0
    for item, seq in zip(items, res.sequences):
        if args.ids or tok is None:
            print(json.dumps({"id": item.id, "ids": seq}))
        else:
            print(f"=== {item.id}")
            print(tok.decode(seq, skip_special_tokens=True))
    n = sum(len(s) for s in res.sequences)
    st = res.stats
    print(f"# {n} tokens in {secs:.2f}s ({n / secs:.1f} tok/s), {st.steps} steps, "
          f"acceptance {st.acceptance:.2f}", file=sys.stderr)
    return 0


def cmd_replay(args) -> int:
    from .forensics.replay import replay

    same, report = replay(args.trace)
    print(report)
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative decoding of prompts (text out)")
    g.add_argument("prompts", nargs="*", help="prompt texts (token ids for tiny models)")
    g.add_argument("--jsonl", help="JSONL prompts: {'prompt': ...} or SpecBench {'turns': [...]}")
    g.add_argument("--ids", action="store_true", help="print generated token ids as JSON lines")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    _add_engine_options(g)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("replay", help="re-run a saved violation trace (or a z3 counterexample)")
    r.add_argument("trace", help="TRACE.json written by InvariantViolation.save or python -m proofs --save-trace")
    r.set_defaults(func=cmd_replay)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
