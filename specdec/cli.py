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
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the models are cast to and compute in (default float32)")


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

    target, tok = models.resolve(args.model, dtype=args.dtype)
    drafter = drafters.NGramDrafter()
    if args.draft_model:
        drafter = drafters.ModelDrafter(models.resolve(args.draft_model, dtype=args.dtype)[0])
    items = _read_prompts(args)
    ids = _encode(items, tok, chat=not args.no_chat)
    t0 = time.perf_counter()
    try:
        res = engine.generate(target, ids, drafter=drafter, strategy=args.strategy, k=args.k,
                              batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                              window=args.window, hole_threshold=args.hole_threshold)
    except (ValueError, NotImplementedError) as e:  # bad input: the rule, not a traceback
        raise SystemExit(f"specdec generate: {e}")
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

    try:
        same, report = replay(args.trace)
    except (ValueError, KeyError, OSError) as e:  # JSONDecodeError is a ValueError
        print(f"specdec replay: cannot replay {args.trace}: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if same else 1  # 0: the saved violation (or counterexample) came back


def cmd_audit(args) -> int:
    from . import drafters, models
    from . import prompts as prompt_mod
    from .forensics import audit

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    engines = args.engines or list(audit.engine_names())
    target, tok = models.resolve(args.model, dtype=args.dtype)
    items = prompt_mod.load_jsonl(args.prompts) if args.prompts else prompt_mod.builtin_prompts()
    items = items[: args.limit] if args.limit else items
    if tok is None:  # a tiny model: seeded random ids, as long as the prompts' word counts
        import torch

        g = torch.Generator().manual_seed(0)
        top = min(models.context_length(target) // 2, 200)
        vocab = models.vocab_size(target)
        ids = [torch.randint(3, vocab, (max(1, min(p.word_count(), top)),), generator=g).tolist()
               for p in items]
    else:
        ids = _encode(items, tok, chat=True)
    if args.draft_model:
        draft = models.resolve(args.draft_model, dtype=args.dtype)[0]
        factory, dname = (lambda: drafters.ModelDrafter(draft)), f"model {args.draft_model}"
    else:
        factory, dname = drafters.NGramDrafter, "ngram"
    name = args.model or models.DEFAULT_MODEL_NAME
    report = audit.Report(name, len(ids), {"batch_size": args.batch_size, "k": args.k,
                                           "max_new_tokens": args.max_new_tokens, "drafter": dname})
    bar = tqdm(total=len(engines) + 1, desc="audit", file=sys.stderr) if tqdm else None
    t0 = time.perf_counter()
    try:
        audit.run_audit(target, tok, ids, model_name=name, engines=engines,
                        batch_size=args.batch_size, k=args.k, max_new_tokens=args.max_new_tokens,
                        drafter_factory=factory, drafter_name=dname,
                        progress=bar.update if bar else None, report=report)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        if bar:
            bar.close()
    report.settings["seconds"] = round(time.perf_counter() - t0, 1)
    print(report.header())
    print(report.table())
    print(f"# audit took {report.settings['seconds']}s (batch-1 reference {report.reference_seconds:.1f}s)")
    if args.out:
        report.write(args.out)
        print(f"# wrote {args.out}/report.md, report.json, exactness.png, phases.png")
    bad_correct = [e.name for e in report.engines if e.expected_correct and (e.desyncs or e.violations)]
    if bad_correct:
        print(f"# FAILED: correct engines with desyncs or violations: {', '.join(bad_correct)}")
        return 1
    return 130 if report.interrupted else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative decoding of prompts (text out)")
    g.add_argument("prompts", nargs="*", help="prompt texts (token ids for tiny models)")
    g.add_argument("--jsonl", help="JSONL prompts: {'prompt': ...} or SpecBench {'turns': [...]}")
    g.add_argument("--ids", action="store_true", help="print generated token ids as JSON lines")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    _add_engine_options(g)
    g.add_argument("--window", type=int, default=None,
                   help="exspec: requests held in the pool (default 2x batch size)")
    g.add_argument("--hole-threshold", type=float, default=None,
                   help="holes: compact when the reclaimable share of the width passes this "
                        "(0..1, default 0.5)")
    g.set_defaults(func=cmd_generate)

    a = sub.add_parser("audit", help="which engines stay exact, which corrupt text, and where")
    a.add_argument("--prompts", help="JSONL prompts (SpecBench questions or {'prompt': ...}); "
                                     "default: the built-in set")
    a.add_argument("--limit", type=int, default=16, help="first N prompts (default 16; 0 = all)")
    a.add_argument("--engines", nargs="+", help="engines to run (default: all)")
    a.add_argument("--out", help="directory for report.md, report.json and PNG figures")
    _add_engine_options(a)
    a.set_defaults(func=cmd_audit, max_new_tokens=32)

    r = sub.add_parser("replay", help="re-run a saved violation trace (or a z3 counterexample)")
    r.add_argument("trace", help="TRACE.json written by InvariantViolation.save or python -m proofs --save-trace")
    r.set_defaults(func=cmd_replay)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
