"""Shared fixtures: tiny models per family, the real model (loaded once per session)."""

from __future__ import annotations

import os

import pytest
import torch

from specdec import models

torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "2")))


@pytest.fixture(scope="session", params=models.FAMILIES)
def family(request) -> str:
    return request.param


_TINY: dict = {}


def tiny_pair(family: str):
    """(target, draft) for a tiny family, built once per session."""
    if family not in _TINY:
        _TINY[family] = (models.tiny(family), models.tiny_draft(family))
    return _TINY[family]


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer) of SmolLM2-135M-Instruct; the first load converts the GGUF."""
    return models.default_model()


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (long statistical runs) run only with SPECDEC_SLOW=1."""
    if os.environ.get("SPECDEC_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="a long statistical run: set SPECDEC_SLOW=1 (the slow profile)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# -- hypothesis profiles: HYPOTHESIS_PROFILE=ci|dev|thorough (default dev; .ci/run uses ci)
from hypothesis import HealthCheck, settings  # noqa: E402

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=12, derandomize=True, deadline=None,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
