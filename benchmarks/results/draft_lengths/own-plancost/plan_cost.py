"""Deterministic plan cost: every adaptive variant on the same prompts with step costs fixed
to the README's batch-8 width table (no timing noise in the decisions), its steps priced by
that table, against plain decoding's steps (the longest output of each batch of 8). Every
variant runs the SpecBench file's kinds, then the 48 built-in prompts' kinds, in that order,
on its own calibration (carried from kind to kind, as the benchmark's is); its lines print
as soon as it is priced, and its outputs must equal the first variant's of the same
process (same=True). From the repository root, one torch thread:

    PYTHONPATH=. python benchmarks/results/draft_lengths/own-plancost/plan_cost.py \
        '{}' '{"own": 3}' '{"own": 12}' '{"own": 3, "own_call": 8}'

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
