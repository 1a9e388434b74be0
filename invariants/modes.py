"""The checking modes shared by ``Monitor``, ``guard_model`` and the pytest plugin.

Imports nothing (the pytest plugin loads it in every session).

- ``off``: no check;
- ``fast``: checks run as tensor ops on the tensors' device; nothing is read back until
  the run (or block) ends: no host read, upload or data-dependent shape inside a hook;
- ``strict``: the same checks, read back once per engine step (``Monitor``) or per
  forward (``guard_model``); a violation raises inside the engine;
- ``deep``: strict plus the checks that recompute with the model (I5 KV, I7 reference).
"""

MODES = ("off", "fast", "strict", "deep")

#: when a strict or deep ``Monitor`` reads its flags: once per engine step (default) or
#: after every phase (the behaviour before per-step reads; one host read per phase)
READS = ("step", "phase")


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode
