"""Sampling on CUDA: the same noise bits and Gumbel noise as on the CPU (the counter-based
generator uses exact int64 arithmetic, no device RNG), coupled speculative sampling equal
to plain sampling on the device, and no stream synchronisation inside a choice (CUDA's
sync debug mode set to "error"). ``benchmarks/gpu_check.sh`` runs it on a GPU. Without a
CUDA device (or with ``INVARIANTS_TEST_DEVICE=cpu``) it runs on the CPU against itself, in
CI, with ``invariants.testing`` (host reads, uploads and data-dependent shapes) in place
of the sync debug mode."""

from __future__ import annotations

import os

import pytest
import torch

import specdec
from specdec import drafters, models, sampling as S
from specdec.sampling import Sampling
from invariants.testing import no_host_transfers

DEVICE = os.environ.get("INVARIANTS_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.gpu


def test_noise_bits_and_gumbel_noise_are_the_same_on_the_device_and_the_cpu():
    rows = torch.arange(64).repeat_interleave(64)
    t = torch.arange(64).repeat(64)
    ids = torch.arange(49_152 if DEVICE.startswith("cuda") else 4_096)  # smaller CPU self-check
    for seed in (0, 12345, 2**64 - 1):
        k_cpu = S.keys(seed, rows, t, S.COUPLED)
        k_dev = S.keys(seed, rows.to(DEVICE), t.to(DEVICE), S.COUPLED)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(k_cpu, k_dev))
        cpu = S.gumbel(seed, rows[:256, None], t[:256, None], ids)
        dev = S.gumbel(seed, rows[:256, None].to(DEVICE), t[:256, None].to(DEVICE), ids.to(DEVICE))
        same = (cpu == dev.cpu()).double().mean().item()
        assert same > 1 - 1e-6, same  # fp64 logs rounded to fp32: equal but for rare ulp cases
        u = S.uniform(*k_cpu)
        assert torch.equal(u, S.uniform(*k_dev).cpu())


def test_coupled_choices_of_the_same_logits_agree_across_devices():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5, 4096, generator=g) * 3
    rows, t = torch.arange(16)[:, None], torch.arange(5)[None, :] + 7
    for s in (Sampling(0.7), Sampling(1.2, 50, 0.9, 3)):
        cpu = S.coupled_choice(logits, s, rows, t)
        dev = S.coupled_choice(logits.to(DEVICE), s, rows.to(DEVICE), t.to(DEVICE))
        assert torch.equal(cpu, dev.cpu())


@pytest.mark.parametrize("mode", S.MODES)
def test_a_choice_never_synchronises_the_stream(mode):
    s = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=1, mode=mode)
    logits = torch.randn(8, 4, 512, device=DEVICE)
    rows = torch.arange(8, device=DEVICE)
    t = torch.arange(4, device=DEVICE)[None, :].expand(8, 4)
    drafts = torch.randint(0, 512, (8, 3), device=DEVICE)
    S.choose(logits, s, rows, t, drafts, logits)  # warm-up (lazy initialisation)
    if DEVICE.startswith("cuda"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            S.choose(logits, s, rows, t, drafts, logits)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        with no_host_transfers():
            S.choose(logits, s, rows, t, drafts, logits)


def test_coupled_speculative_sampling_equals_plain_sampling_on_the_device():
    target = models.tiny("llama").to(DEVICE)
    draft = models.tiny_draft("llama").to(DEVICE)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, models.TINY_VOCAB, (n,), generator=g).tolist() for n in (1, 30, 7, 12)]
    s = Sampling(temperature=0.9, top_p=0.95, seed=4)
    plain = specdec.reference_generate(target, prompts, max_new_tokens=16, sampling=s)
    from specdec.strategies import names

    for strategy in names():
        res = specdec.generate(target, prompts, drafter=drafters.ModelDrafter(draft), k=3,
                               strategy=strategy, max_new_tokens=16, sampling=s)
        assert res.sequences == plain, strategy
