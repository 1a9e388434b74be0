"""invariants: checks that a batched (speculative) decoding loop keeps its tensors aligned.

This package never imports ``specdec``: any engine builds a ``StepView`` and calls hooks.
"""

from .view import PHASES, PROFILES, ForwardRecord, StepView

__all__ = ["StepView", "ForwardRecord", "PHASES", "PROFILES"]
