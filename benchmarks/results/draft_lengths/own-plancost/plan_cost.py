"""Deterministic plan cost: every adaptive variant on the same prompts with step costs fixed
to the README's batch-8 width table (no timing noise in the decisions), its steps priced by
that table, against plain decoding's steps (the longest output of each batch of 8). Every
variant runs the SpecBench file's kinds, then the 48 built-in prompts' kinds, in that order,
on its own calibration (carried from kind to kind, as the benchmark's is); its lines print
as soon as it is priced, and its outputs must equal the first variant's of the same
process (same=True). From the repository root, one torch thread:

    PYTHONPATH=. python benchmarks/results/draft_lengths/own-plancost/plan_cost.py \
        '{}' '{"own": 3}' '{"own": 12}' '{"own": 3, "own_call": 8}'

With ``--one-call``: the default policy in one EQSPEC call over each whole set, told
that the strategy refills and told that it does not (groups-plancost/output.txt).
With ``--where VARIANT``: where in each SpecBench call the variant drafts (step:wWIDTHaA,
A the drafts accepted over the batch), as in where.txt.
"""
import json, math, sys, time
import torch
torch.set_num_threads(1)
import specdec
from specdec import drafters, models, policy, prompts

R = [1.0, 1.48, 1.66, 1.94, 2.23]


class Fixed(policy.StepCosts):
    def ratios(self, rows, widths):
        return R[:widths]


target, tok = models.default_model()
if sys.argv[1] == "--one-call":
    # one EQSPEC call over a whole set at batch 8 (fixed batches of 8 consecutive prompts:
    # one kind per batch in the SpecBench file, kinds mixed in the built-in set's order),
    # with the policy told that the strategy refills (before ``Strategy.refills``: a
    # batch's drain only once no request waits, in the last batch) and told the truth
    # (EQSPEC never refills: every batch drains), each batch priced against its longest
    # output; README "fixed batches drain from the first batch on"
    from specdec import strategies
    sets = [("sb", prompts.load_jsonl("benchmarks/specbench_sample.jsonl")), ("bi", prompts.builtin_prompts())]
    eqspec = strategies.get("eqspec")
    out = {}
    for label, refills in (("told it refills (before)", True), ("never refills (now)", False)):
        eqspec.refills = refills  # an instance attribute: generate reads it from here
        t0 = time.time()
        for tag, chosen in sets:
            ids = prompts.encode(chosen, tok)
            pol = policy.AdaptivePolicy(calibration=policy.Calibration(Fixed()))
            steps = []
            res = specdec.generate(target, ids, drafter=drafters.NGramDrafter(), strategy="eqspec",
                                   k=4, batch_size=8, max_new_tokens=48, policy=pol, hooks=[
                                       lambda ph, v: steps.append((v.info["batch_index"], v.k))
                                       if ph == "commit" else None])
            ratios = []
            for g in range(0, len(ids), 8):
                kinds = {p.kind for p in chosen[g:g + 8]}
                kind = kinds.pop() if len(kinds) == 1 else f"batch{g // 8}"  # built-in: mixed
                plain = max(len(s) for s in res.sequences[g:g + 8])
                own = [k for b, k in steps if b == g // 8]
                cost = sum(R[k] for k in own)
                ratios.append((kind, plain / cost, sum(1 for k in own if k), len(own)))
            out[(label, tag)] = (ratios, res.sequences)
            geo = math.exp(sum(math.log(r) for _, r, _, _ in ratios) / len(ratios))
            same = res.sequences == out[(next(iter(out))[0], tag)][1]
            print(f"{label:26s} {tag} geo {geo:.3f} low {min(r for _, r, _, _ in ratios):.3f} same={same} | "
                  + "  ".join(f"{k[:6]} {r:.3f} ({d}/{n})" for k, r, d, n in ratios), flush=True)
        print(f"{label}: {time.time() - t0:.0f}s", flush=True)
    del eqspec.refills
    sys.exit(0)
if sys.argv[1] == "--where":
    chosen = prompts.load_jsonl("benchmarks/specbench_sample.jsonl")
    ids = prompts.encode(chosen, tok)
    pol = policy.AdaptivePolicy(calibration=policy.Calibration(Fixed()), **json.loads(sys.argv[2]))
    for kind in dict.fromkeys(p.kind for p in chosen):
        sub = [ids[i] for i, p in enumerate(chosen) if p.kind == kind]
        steps = []
        specdec.generate(target, sub, drafter=drafters.NGramDrafter(), strategy="eqspec", k=4,
                         batch_size=8, max_new_tokens=48, policy=pol, hooks=[
                             lambda ph, v: steps.append((v.k, int(v.accepted.sum())))
                             if ph == "commit" else None])
        print(kind, " ".join(f"{i}:w{k + 1}a{a}" for i, (k, a) in enumerate(steps) if k))
    sys.exit(0)
sets = [("sb", prompts.load_jsonl("benchmarks/specbench_sample.jsonl")), ("bi", prompts.builtin_prompts())]
variants = {v: dict(json.loads(v)) for v in sys.argv[1:]}
out = {}
for name, opts in variants.items():
    cal = policy.Calibration(Fixed())
    pol = policy.AdaptivePolicy(calibration=cal, **opts)
    res_v = {}
    t0 = time.time()
    for tag, chosen in sets:
        kinds = list(dict.fromkeys(p.kind for p in chosen))
        ids = prompts.encode(chosen, tok)
        for kind in kinds:
            sub = [ids[i] for i, p in enumerate(chosen) if p.kind == kind]
            res = specdec.generate(target, sub, drafter=drafters.NGramDrafter(), strategy="eqspec",
                                   k=4, batch_size=8, max_new_tokens=48, policy=pol)
            plain = sum(max(len(s) for s in res.sequences[i:i + 8]) for i in range(0, len(sub), 8))
            cost = sum(R[int(w) - 1] * n for w, n in res.stats.widths.items())
            res_v[f"{tag}:{kind}"] = dict(ratio=plain / cost, steps=res.stats.steps,
                                          drafting=res.stats.steps - res.stats.widths.get(1, 0),
                                          seqs=res.sequences)
    out[name] = res_v
    print(name, f"{time.time() - t0:.0f}s", flush=True)
    r = res_v
    base = next(iter(out.values()))
    same = all(r[k]["seqs"] == base[k]["seqs"] for k in r)
    for tag in ("sb", "bi"):
        ks = [k for k in r if k.startswith(tag)]
        g = math.exp(sum(math.log(r[k]["ratio"]) for k in ks) / len(ks))
        print(f"{name:40s} {tag} geo {g:.3f} low {min(r[k]['ratio'] for k in ks):.3f} same={same} | " +
              "  ".join(f"{k.split(':')[1][:6]} {r[k]['ratio']:.3f} ({r[k]['drafting']}/{r[k]['steps']})" for k in ks),
              flush=True)
