"""Shared fixtures: tiny models per family, the real model (loaded once per session).

Tests marked ``engine`` need specdec's engine: where transformers is not the release its
cache is written for (the checker's CI job on transformers 4.51), they are skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

import campaign
from specdec import models

torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    campaign.skip_campaign_cases(items)  # slow cases run under the campaign profiles only
    _skip_slow(items)
    from specdec.cache import SUPPORTED_TRANSFORMERS, transformers_supported

    if transformers_supported():
        return
    import transformers

    skip = pytest.mark.skip(reason=f"specdec's engine needs transformers "
                                   f"{SUPPORTED_TRANSFORMERS}.x, found {transformers.__version__}")
    for item in items:
        if "engine" in item.keywords:
            item.add_marker(skip)


def _skip_slow(items):
    """``slow`` tests (long statistical runs) run only with SPECDEC_SLOW=1."""
    if os.environ.get("SPECDEC_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="a long statistical run: set SPECDEC_SLOW=1 (the slow profile)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_calibration():
    """Every test starts with nothing learned by adaptive policies (``policy="adaptive"``
    keeps per-model calibration across calls, and tests share models): a test's draft
    lengths never depend on which tests ran before it."""
    from specdec.policy import forget_calibration

    forget_calibration()
    yield


@pytest.fixture(scope="session", params=models.FAMILIES)
def family(request) -> str:
    return request.param


_TINY: dict = {}


def tiny_pair(family: str):
    """(target, draft) for a tiny family, built once per session."""
    if family not in _TINY:
        _TINY[family] = (models.tiny(family), models.tiny_draft(family))
    return _TINY[family]


_REAL: dict = {}


def real(name: str):
    """(model, tokenizer) of a real model (``models.REAL_MODELS``), loaded once per
    session (per pytest-xdist worker); the first load ever converts its GGUF."""
    if name not in _REAL:
        _REAL[name] = models.load(name)
    return _REAL[name]


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer) of SmolLM2-135M-Instruct, the default model."""
    return real(models.DEFAULT.name)


# -- hypothesis profiles (HYPOTHESIS_PROFILE=ci|dev|thorough|campaign|replay), the example
# database (HYPOTHESIS_DATABASE), campaign shards: tests/campaign.py
from campaign import campaign_shard, pytest_generate_tests  # noqa: E402,F401
