"""specdec: batched speculative decoding that stays exactly equal to greedy decoding.

Public names: ``generate``, ``reference_generate``, ``models``, ``drafters``.
"""

from . import drafters, models
from .engine import Result, Stats, generate
from .reference import reference_generate

__all__ = ["generate", "reference_generate", "models", "drafters", "Result", "Stats"]
