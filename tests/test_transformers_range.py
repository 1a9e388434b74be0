"""The transformers range: the package installs next to transformers 4.51 (the checker,
``invariants``, works there) while the engine runs on 5.24.x only. This module imports no
tiny model at collection, so the checker's CI job on transformers 4.51 runs it too."""

from __future__ import annotations

import pytest

import specdec


def test_the_engine_refuses_a_transformers_its_cache_was_not_written_for(monkeypatch):
    """The package installs next to transformers 4.51 (the checker works there); the engine
    refuses at run time, saying which release it needs and how to get it."""
    from specdec import cache
    from toy_engine import hf_tiny_llama

    model = hf_tiny_llama()  # transformers alone: builds on 4.51 and 5.24 alike
    monkeypatch.setattr(cache.transformers, "__version__", "4.51.3")
    with pytest.raises(cache.UnsupportedTransformersError,
                       match=r"needs transformers 5\.24\.x.*found transformers 4\.51\.3.*"
                             r"pip install 'transformers>=5\.24,<5\.25'"):
        specdec.generate(model, [[5, 6, 7]], max_new_tokens=2)
