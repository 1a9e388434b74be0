"""Priced plans of one call over a whole prompt set at batch 8 under EQSPEC (fixed batches
of 8 consecutive prompts: one kind per batch in the SpecBench file, kinds mixed in the
built-in set's order), with the policy told
that the strategy refills (the behaviour before ``Strategy.refills``: a batch's drain only
once no request waits, i.e. in the last batch) and told the truth (EQSPEC never refills:
every batch drains). Step costs fixed to the README's batch-8 width table, each batch's
steps priced by it against plain decoding's (its longest output). From the repository
root, one torch thread:

    PYTHONPATH=. python benchmarks/results/draft_lengths/groups-plancost/group_cost.py
"""
import math, sys, time
import torch
torch.set_num_threads(1)
import specdec
from specdec import drafters, models, policy, prompts, strategies

R = [1.0, 1.48, 1.66, 1.94, 2.23]


class Fixed(policy.StepCosts):
    def ratios(self, rows, widths):
        return R[:widths]


target, tok = models.default_model()
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
