"""Every drafting step of the default's priced plans (own-plancost/plan_cost.py's setting:
step costs fixed to the README's batch-8 width table, the SpecBench kinds then the built-in
kinds on one calibration): what the policy expected the step to return and what it got.
Per drafting step: width; vsum, the rows' summed drain weights; pred_extra, the weighted
expected tokens beyond one per row; need, what the width's cost asks of them with the 5%
margin; acc, each row's accepted drafts; E, each row's expected tokens at that width; v,
the weights; f, the evidence classes (3 x match-length class + agreement - 1); rem, the
remaining budgets. From the repository root, one torch thread:

    PYTHONPATH=. python benchmarks/results/draft_lengths/floor-plancost/decisions.py > decisions.txt
"""
import json, sys

import torch

import specdec
from specdec import drafters, models, policy, prompts

torch.set_num_threads(1)
R = [1.0, 1.48, 1.66, 1.94, 2.23]  # the width table's batch-8 ratios
costs = policy.StepCosts()
costs.ratios = lambda rows, widths: R[:widths]
target, tok = models.default_model()
sets = [("sb", prompts.load_jsonl("benchmarks/specbench_sample.jsonl")), ("bi", prompts.builtin_prompts())]
opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
pol = policy.AdaptivePolicy(calibration=policy.Calibration(costs), **opts)
log = []
orig = policy.AdaptivePolicy.decide
def decide(self, batch, features):
    e = self.expected(batch, features)
    v = self.weights(batch)
    nxt = orig(self, batch, features)
    log.append(dict(rows=batch.row_ids.tolist(), v=v.tolist(), e=e.tolist(), k=int(nxt.max()), feat=features[:, 0].tolist(),
                    rem=batch.remaining.tolist(), fin=batch.finished.tolist()))
    return nxt
policy.AdaptivePolicy.decide = decide
for tag, chosen in sets:
    ids = prompts.encode(chosen, tok)
    for kind in dict.fromkeys(p.kind for p in chosen):
        sub = [ids[i] for i, p in enumerate(chosen) if p.kind == kind]
        log.clear()
        acc = []
        res = specdec.generate(target, sub, drafter=drafters.NGramDrafter(), strategy="eqspec",
                               k=4, batch_size=8, max_new_tokens=48, policy=pol, hooks=[
                                   lambda ph, v: acc.append((int(v.k), v.batch.row_ids.tolist() if hasattr(v, 'batch') else None, v.accepted.tolist())) if ph == "commit" else None])
        print("==", tag, kind, res.stats.steps)
        # log[i] plans step i (log[0] from admit); acc[i] is step i's commit
        for i, (k, rows, a) in enumerate(acc):
            if k == 0: continue
            d = log[i]
            w = k
            pred = [(vv * (ee[w] - 1)) for vv, ee, f in zip(d["v"], d["e"], d["fin"]) if not f]
            print(f" step {i} w{w+1} vsum {sum(v for v,f in zip(d['v'],d['fin']) if not f):.2f} pred_extra(weighted) {sum(pred):.2f} "
                  f"need {sum(v for v,f in zip(d['v'],d['fin']) if not f)*(R[w]*1.05-1):.2f} | acc {a} | E {[round(ee[w],2) for ee in d['e']]} | v {[round(x,2) for x in d['v']]} | f {d['feat']} rem {d['rem']}")
