"""Command line: ``specdec generate``, ``specdec audit``, ``specdec replay TRACE.json``.

A user error (a bad option, a missing or malformed file, an unknown model, input the
engine refuses) is one line on stderr, ``specdec COMMAND: <the rule and the value>``, and
exit code 2, without a traceback; options and files are checked before any model loads
or any decoding runs. ``SPECDEC_TRACEBACK=1`` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import strategies
#: what the commands raise for bad input (validation.py raises ValueError and TypeError)
USER_ERRORS = (ValueError, TypeError, OSError, ImportError, NotImplementedError)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one ``--help`` away), exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _policy_option(text: str) -> str:
    """An argparse type: a policy string (``specdec.policy.parse``), kept as given."""
    from .policy import parse

    try:
        parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return text


_policy_option.__name__ = "policy"


def _int_option(name: str, minimum: int):
    """An argparse type: an integer >= minimum, with the rule in the message."""
    from .validation import integer

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {minimum}, got {text!r}")
        try:
            return integer(value, name, minimum=minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    parse.__name__ = name  # argparse names the type in some messages
    return parse


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="target: 'gemma3-270m', a local Hugging Face directory or hub name, "
                        "'tiny:FAMILY', or omitted for the default SmolLM2-135M-Instruct")
    p.add_argument("--draft-model", default=None,
                   help="draft model (same forms as --model); default: the n-gram drafter")
    p.add_argument("--k", type=_int_option("k (drafts per step)", 0), default=4,
                   help="drafts per step (default 4)")
    p.add_argument("--batch-size", type=_int_option("batch size", 1), default=8,
                   help="rows decoded together (default 8)")
    p.add_argument("--max-new-tokens", type=_int_option("max new tokens", 1), default=64,
                   help="new tokens per prompt (default %(default)s)")
    p.add_argument("--strategy", default="eqspec", choices=strategies.names())
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the models are cast to and compute in (default float32)")
    p.add_argument("--policy", default="adaptive", type=_policy_option,
                   help="draft lengths per row and step: adaptive (draft where it pays), "
                        "adaptive:NAME=VALUE,.. (its options, specdec.policy.OPTIONS) or "
                        "fixed (every row drafts k); default %(default)s")


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "seed", "sampling_mode")


def _add_sampling_options(p: argparse.ArgumentParser, what: str, mode: bool = True) -> None:
    """--temperature --top-k --top-p --seed [--sampling-mode] (``specdec.Sampling``)."""
    g = p.add_argument_group("sampling", what)
    g.add_argument("--temperature", type=float, default=None, help="> 0 (default 1)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default 0: all)")
    g.add_argument("--top-p", type=float, default=None,
                   help="keep the most likely tokens up to this mass, in (0, 1] (default 1: all)")
    g.add_argument("--seed", type=int, default=None,
                   help="request i samples with (seed, i); 0 <= seed < 2**64 (default 0)")
    if mode:
        g.add_argument("--sampling-mode", default=None, choices=("coupled", "rejection"),
                       help="coupled: equal to plain sampling token for token (default); "
                            "rejection: speculative rejection sampling (equal in distribution)")


def _sampling(args, always: bool = False):
    """The ``specdec.Sampling`` of the sampling flags (None when none was given, unless
    ``always``); bad values raise the rule (checked before any model loads)."""
    from .sampling import Sampling

    given = {n: getattr(args, n) for n in SAMPLING_FLAGS if getattr(args, n, None) is not None}
    if not given and not always:
        return None
    if "sampling_mode" in given:
        given["mode"] = given.pop("sampling_mode")
    return Sampling(**given)


def _add_strategy_options(p: argparse.ArgumentParser) -> None:
    """Every registered strategy's options as flags (``--window``, ``--hole-threshold``)."""
    seen: set = set()
    for name in strategies.names():
        for opt in strategies.get(name).options:
            if opt.name not in seen:
                seen.add(opt.name)
                p.add_argument(opt.flag, dest=opt.name, type=opt.type, default=None,
                               help=f"{name}: {opt.help}")


def _strategy_options(args) -> dict:
    """The strategy options given on the command line (absent ones left out)."""
    names = {o.name for n in strategies.names() for o in strategies.get(n).options}
    return {n: getattr(args, n) for n in sorted(names) if getattr(args, n, None) is not None}


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
        raise ValueError("give prompts as arguments or with --jsonl FILE (the file has none)"
                         if args.jsonl else "give prompts as arguments or with --jsonl FILE")
    return items


def _encode(items, tokenizer, chat: bool) -> list[list[int]]:
    from . import prompts as prompt_mod

    if tokenizer is None:  # tiny models: prompts are space-separated token ids
        out = []
        for p in items:
            text = p.text
            try:
                out.append([int(t) for t in text.split()])
            except ValueError:
                raise ValueError(f"this model has no tokenizer: give prompts as space-separated "
                                 f"token ids, got {text[:40]!r} (prompt {p.id})") from None
        return out
    if chat:
        return prompt_mod.encode(items, tokenizer)
    return [list(tokenizer(prompt_mod.plain_text(p.messages), add_special_tokens=False)["input_ids"])
            for p in items]


def cmd_generate(args) -> int:
    from . import compiled, drafters, engine, models

    items = _read_prompts(args)  # files and options first: no model loads for bad input
    sampling = _sampling(args)
    options = _strategy_options(args)
    plugin = strategies.get(args.strategy)
    engine.check_option_names(plugin, options)
    plugin.check_options(options, batch_size=args.batch_size)
    target, tok = models.resolve(args.model, dtype=args.dtype)
    compiled.check(args.compile, target)  # before any work on the prompts
    drafter = drafters.NGramDrafter()
    if args.draft_model:
        drafter = drafters.ModelDrafter(models.resolve(args.draft_model, dtype=args.dtype)[0])
    ids = _encode(items, tok, chat=not args.no_chat)
    t0 = time.perf_counter()
    res = engine.generate(target, ids, drafter=drafter, strategy=args.strategy, k=args.k,
                          batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                          sampling=sampling, policy=args.policy, compile=args.compile,
                          static_shapes=args.static_shapes, **_strategy_options(args))
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
    from pathlib import Path

    from .forensics.replay import replay

    same, report = replay(Path(args.trace))  # a path, never JSON text
    print(report)
    return 0 if same else 1  # 0: the saved violation (or counterexample) came back


def cmd_audit(args) -> int:
    from . import drafters, models, validation
    from . import prompts as prompt_mod
    from .forensics import audit

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    engines = args.engines or list(audit.engine_names())
    audit.check_engines(engines)  # options and files first: no work for a bad one
    sampling = _sampling(args, always=True)
    if args.out:
        validation.writable_dir(args.out, "--out")
    items = prompt_mod.prompt_set(args.prompts)
    if not items:
        raise ValueError(f"prompt file {args.prompts} holds no prompts")
    items = items[: args.limit] if args.limit else items
    target, tok = models.resolve(args.model, dtype=args.dtype)
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
                                           "max_new_tokens": args.max_new_tokens, "drafter": dname,
                                           "policy": args.policy})
    once = sum(e in audit.distribution_names() for e in engines)  # distribution tests
    steps = (len(engines) - once) * -(-len(ids) // args.batch_size) + once + 1  # + reference
    bar = tqdm(total=steps, desc="audit", file=sys.stderr) if tqdm else None
    t0 = time.perf_counter()
    try:
        audit.run_audit(target, tok, ids, model_name=name, engines=engines,
                        batch_size=args.batch_size, k=args.k, max_new_tokens=args.max_new_tokens,
                        drafter_factory=factory, drafter_name=dname,
                        progress=bar.update if bar else None, report=report, sampling=sampling,
                        policy=args.policy)
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
    bad_correct = [e.name for e in report.engines if e.expected_correct and (
        e.desyncs or e.violations or e.error
        or (e.distribution is not None and not e.distribution["passed"]))]
    if bad_correct:
        print(f"# FAILED: correct engines with desyncs, violations, errors or a failed "
              f"distribution test: {', '.join(bad_correct)}")
        return 1
    return 130 if report.interrupted else 0


def main(argv=None) -> int:
    parser = Parser(prog="specdec", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="speculative decoding of prompts (text out)")
    g.add_argument("prompts", nargs="*", help="prompt texts (token ids for tiny models)")
    g.add_argument("--jsonl", help="JSONL prompts: {'prompt': ...}, {'messages': [...]} or "
                                   "SpecBench {'turns': [...], 'category': ...}")
    g.add_argument("--ids", action="store_true", help="print generated token ids as JSON lines")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--compile", default=None, choices=("inductor", "cuda-graphs"),
                   help="the compiled fast path (default: eager): inductor (CPU: needs a C++ "
                        "compiler) or cuda-graphs (CUDA models only: the whole decode and verify "
                        "forwards captured per shape bucket); same tokens")
    g.add_argument("--static-shapes", action="store_true", default=None,
                   help="decode and verify forwards of few shapes (verify width 1 or k+1, key "
                        "widths in 32-slot buckets, inputs in per-run buffers: specdec/static.py);"
                        " same tokens, more work on a CPU (on with --compile cuda-graphs)")
    _add_engine_options(g)
    _add_strategy_options(g)
    _add_sampling_options(g, "any of these turns sampling on (greedy decoding otherwise)")
    g.set_defaults(func=cmd_generate)

    a = sub.add_parser("audit", help="which engines stay exact, which corrupt text, and where")
    a.add_argument("--prompts", help="JSONL prompts ({'prompt': ...}, {'messages': [...]} or "
                                     "SpecBench questions), or 'long' (built-in texts joined "
                                     "past a 512-token window); default: the built-in set")
    a.add_argument("--limit", type=_int_option("limit", 0), default=16,
                   help="first N prompts (default 16; 0 = all)")
    a.add_argument("--engines", nargs="+", help="engines to run (default: all)")
    a.add_argument("--out", help="directory for report.md, report.json and PNG figures")
    _add_engine_options(a)
    _add_sampling_options(a, "the parameters of the sampling engines (coupled:*, rejection:* "
                             "and the known-bad sampling engines; the mode is each engine's own)",
                          mode=False)
    from .forensics.audit import POLICY  # the audit exercises its engines' drafting
    a.set_defaults(func=cmd_audit, max_new_tokens=32, policy=POLICY)

    r = sub.add_parser("replay", help="re-run a saved violation trace (or a z3 counterexample)")
    r.add_argument("trace", help="TRACE.json written by InvariantViolation.save or python -m proofs --save-trace")
    r.set_defaults(func=cmd_replay)

    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad option (one line, Parser.error) or --help
        return e.code
    try:
        return args.func(args)
    except USER_ERRORS as e:  # bad input: the rule in one line, not a traceback
        if os.environ.get("SPECDEC_TRACEBACK"):
            raise
        print(f"specdec {args.command}: {one_line(e)}", file=sys.stderr)
        return 2


def one_line(e: BaseException) -> str:
    """The first non-empty line of an error's message (its type when there is none)."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if isinstance(e, OSError) and e.filename and text and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
