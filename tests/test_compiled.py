"""The opt-in compiled fast path (issue #19, point 3): ``generate(..., compile=)`` and
``reference_generate(..., compile=)``.

Specified: the values ``compile`` takes are checked at the boundary (unknown values,
``"cuda-graphs"`` on a CPU model, inductor without a C++ compiler), the compiled path is
exact (token ids equal batch-1 eager greedy decoding) on every tiny family and every
strategy, the regions really run compiled and the model is left as it was, and the
Monitor and ``guard_model`` check a compiled run as they check an eager one.

Compilation costs seconds per family (inductor builds C++ kernels; cached on disk across
runs), so each family compiles once and serves every strategy, with short budgets; the
tests are marked ``compiled`` and ``engine``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import specdec
from conftest import tiny_pair
from invariants import Monitor, guard_model
from specdec import compiled, drafters, models
from specdec.strategies import names as strategy_names

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22]]
BUDGET = 8

needs_cxx = pytest.mark.skipif(compiled.cxx_compiler() is None,
                               reason="inductor on a CPU needs a C++ compiler")


# -- the boundary ------------------------------------------------------------------------

@pytest.mark.engine
@pytest.mark.parametrize("bad, error, match", [
    ("tensorrt", ValueError, r"compile must be one of \(None, 'inductor', 'cuda-graphs'\), got 'tensorrt'"),
    (True, TypeError, r"compile must be one of .*got bool True"),
    ("cuda-graphs", ValueError, r"compile='cuda-graphs' captures CUDA graphs: it needs a model "
                                r"on a CUDA device, the model is on 'cpu'"),
])
def test_compile_values_are_checked_before_any_work(bad, error, match):
    target, _ = tiny_pair("llama")
    with pytest.raises(error, match=match):
        specdec.generate(target, PROMPTS, compile=bad)
    with pytest.raises(error, match=match):
        specdec.reference_generate(target, PROMPTS, max_new_tokens=2, compile=bad)


@pytest.mark.engine
def test_inductor_on_a_cpu_without_a_cxx_compiler_is_refused_with_the_rule(monkeypatch):
    target, _ = tiny_pair("llama")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match=r"compile='inductor' on a CPU builds C\+\+ kernels: it "
                                         r"needs a C\+\+ compiler"):
        specdec.generate(target, PROMPTS, compile="inductor")


def test_the_cli_offers_compile_and_refuses_cuda_graphs_on_a_cpu(capsys):
    from specdec import cli

    code = cli.main(["generate", "--model", "tiny:llama", "--compile", "cuda-graphs",
                     "--max-new-tokens", "2", "5 6 7"])
    assert code == 2
    assert "compile='cuda-graphs' captures CUDA graphs" in capsys.readouterr().err
    assert cli.main(["generate", "--compile", "jit", "x"]) == 2


def test_regions_are_every_non_attention_child_of_every_layer():
    """Norms named after attention (``post_attention_layernorm``) are compiled; the
    attention modules, which read and write the cache, are not."""
    for family in ("llama", "gpt2", "gemma3"):
        target, _ = tiny_pair(family)
        found = compiled.regions(target)
        layers = compiled.decoder_layers(target)
        assert not any(compiled.is_attention(m) for m in found)
        attention = [m for layer in layers for m in layer.children() if compiled.is_attention(m)]
        assert len(attention) == len(layers)
        assert len(found) == sum(len(list(layer.children())) - 1 for layer in layers) + 1


# -- exactness ------------------------------------------------------------------------------

@pytest.mark.engine
@pytest.mark.compiled
@needs_cxx
def test_the_compiled_path_is_exact_on_every_family_and_strategy(family):
    target, draft = tiny_pair(family)
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    torch._dynamo.utils.counters.clear()
    got = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, batch_size=3,
                                     compile="inductor")
    assert got == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # compiled regions ran
    drafter = drafters.ModelDrafter(draft) if family == "llama" else drafters.NGramDrafter()
    for strategy in strategy_names():
        try:
            res = specdec.generate(target, PROMPTS, drafter=drafter, strategy=strategy, k=3,
                                   batch_size=3, max_new_tokens=BUDGET, policy="fixed",
                                   compile="inductor")
        except NotImplementedError:  # a strategy this model cannot serve (eager alike)
            continue
        assert res.sequences == expected, strategy
        assert res.stats.accepted > 0
    # the model is left as it was: no region keeps a compiled forward
    assert not any("forward" in vars(m) for m in compiled.regions(target))


@pytest.mark.engine
@pytest.mark.compiled
@needs_cxx
def test_the_monitor_and_the_guard_check_a_compiled_run():
    target, draft = tiny_pair("llama")
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    monitor = Monitor("strict")
    stops = models.stop_token_ids(target)
    with guard_model(target, mode="strict", prompts=PROMPTS, max_new_tokens=BUDGET,
                     stop_token_ids=stops) as guard:
        res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=3,
                               batch_size=3, max_new_tokens=BUDGET, policy="fixed",
                               hooks=[monitor], compile="inductor")
        guard.check_outputs(res.sequences)
    assert res.sequences == expected
    assert monitor.check() == [] and guard.forwards > 2
    # and a fault in a compiled run is still caught (a position shifted after a realign)
    from specdec.validation import fault_injection

    def shift(phase, view):
        if phase == "realign" and view.step == 1:
            view.positions[:, -1] += 1

    caught = Monitor("strict", raise_on_violation=False)
    specdec.generate(target, PROMPTS, k=3, batch_size=3, max_new_tokens=BUDGET, policy="fixed",
                     hooks=[fault_injection(shift), caught], compile="inductor")
    assert [v.invariant for v in caught.check()][:1] == ["I3"]
