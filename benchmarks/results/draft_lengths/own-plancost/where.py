"""Where in each SpecBench call the default policy drafts (step: width and drafts accepted
over the batch), step costs fixed as in plan_cost.py. PYTHONPATH=. python THIS.py {}"""
import json, sys
import torch
torch.set_num_threads(1)
import specdec
from specdec import drafters, models, policy, prompts
R = [1.0, 1.48, 1.66, 1.94, 2.23]
class Fixed(policy.StepCosts):
    def ratios(self, rows, widths):
        return R[:widths]
target, tok = models.default_model()
chosen = prompts.load_jsonl("benchmarks/specbench_sample.jsonl")
ids = prompts.encode(chosen, tok)
pol = policy.AdaptivePolicy(calibration=policy.Calibration(Fixed()), **json.loads(sys.argv[1]))
for kind in dict.fromkeys(p.kind for p in chosen):
    sub = [ids[i] for i, p in enumerate(chosen) if p.kind == kind]
    steps = []
    def hook(phase, view):
        if phase == "commit":
            steps.append((view.k, int(view.accepted.sum()), int((~view.finished).sum()) if hasattr(view, "finished") else -1))
    res = specdec.generate(target, sub, drafter=drafters.NGramDrafter(), strategy="eqspec", k=4,
                           batch_size=8, max_new_tokens=48, policy=pol, hooks=[hook])
    print(kind, " ".join(f"{i}:w{k+1}a{a}" for i, (k, a, _) in enumerate(steps) if k), flush=True)
