"""How the property suite runs: Hypothesis profiles, the example database, campaign shards.

Profiles (``HYPOTHESIS_PROFILE``; default ``dev``):

- ``ci``: 12 examples a property, derandomized: every run draws the same examples,
  whichever pytest-xdist worker runs a test (``pytest -n N`` included); no database.
- ``dev``: 25 random examples a property, failures saved in the example database.
- ``thorough``: 400 random examples a property, in one process.
- ``campaign``: ``SPECDEC_CAMPAIGN_EXAMPLES`` (default 200) random examples a shard. Each
  property test runs as ``SPECDEC_CAMPAIGN_SHARDS`` shards (default: the number of xdist
  workers), test ids ``[shard0]``, ``[shard1]``, ...; xdist spreads them over its workers,
  each shard draws its own random examples, and all shards of a property share one
  database key, so a failure one shard found is replayed first by every later shard and
  run. Tests whose own settings derandomize (the real-model cases) run once.
- ``replay``: no generation, only the examples stored in the database (and explicit
  ``@example``\\s), not shrunk further: reproduces, in a fresh process, what a campaign
  found.

Example database (``HYPOTHESIS_DATABASE``; used by every profile but ``ci``):

- unset: the directory ``.hypothesis/examples`` under the current directory (Hypothesis's
  default place), which the xdist workers of one machine share;
- a path: that directory;
- ``redis://HOST:PORT/DB``: a Redis server, shared by machines (``hypothesis.extra.redis``;
  needs the ``redis`` package, a dependency of this project). Inside an xdist ``--tx``
  spec, where ``//`` separates keys, write it ``redis:HOST:PORT/DB``.

A mutant drill: ``SPECDEC_MUTANT=NAME`` (a name of ``specdec.mutants``) makes
``harness.run_case`` run the engine with that single-point mutation of the index math
(the reference stays correct), so a campaign must find it.

Tests marked ``campaign`` (the slowest Gemma 3 cases) run only under the ``campaign``
and ``thorough`` profiles; CI (``ci``) skips them to stay within its time.

``tests/conftest.py`` imports this module (profiles are registered and the chosen one
loaded on import) and its pytest hooks below.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

PROFILES = ("ci", "dev", "thorough", "campaign", "replay")
DEFAULT_EXAMPLES = 200
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def example_database(spec: str | None = None) -> ExampleDatabase:
    """The example database ``spec`` names (default: ``$HYPOTHESIS_DATABASE``; see the
    module docstring)."""
    spec = os.environ.get("HYPOTHESIS_DATABASE") if spec is None else spec
    if not spec:
        return DirectoryBasedExampleDatabase(os.path.join(".hypothesis", "examples"))
    if spec.startswith("redis:") and not spec.startswith("redis://"):
        spec = "redis://" + spec[len("redis:"):]  # the form without "//" (xdist --tx specs)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from hypothesis.extra.redis import RedisExampleDatabase
        from redis import Redis

        return RedisExampleDatabase(Redis.from_url(spec))
    return DirectoryBasedExampleDatabase(spec)


def profile() -> str:
    name = os.environ.get("HYPOTHESIS_PROFILE", "dev")
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE must be one of {PROFILES}, got {name!r}")
    return name


def shards() -> int:
    """Shards of every property test: ``$SPECDEC_CAMPAIGN_SHARDS``, else the number of
    xdist workers, under the ``campaign`` profile; 1 otherwise."""
    if profile() != "campaign":
        return 1
    value = os.environ.get("SPECDEC_CAMPAIGN_SHARDS") or os.environ.get("PYTEST_XDIST_WORKER_COUNT") or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SPECDEC_CAMPAIGN_SHARDS must be an integer >= 1, got {value!r}")
    return int(value)


def planted_mutant() -> str | None:
    """The mutant of a drill (``$SPECDEC_MUTANT``), or None."""
    return os.environ.get("SPECDEC_MUTANT") or None


def register() -> None:
    """Register every profile and load the one ``$HYPOTHESIS_PROFILE`` names."""
    name = profile()
    common = dict(deadline=None, suppress_health_check=_SLOW_OK, print_blob=True)
    settings.register_profile("ci", max_examples=12, derandomize=True, **common)
    # the database is built only for the profile in use (a Redis URL connects lazily, but
    # a directory database is cheap either way)
    db = example_database() if name != "ci" else None
    # derandomize stated: with CI set in the environment Hypothesis makes its own
    # derandomized "ci" profile the parent of every profile registered after import
    random = dict(common, database=db, derandomize=False)
    settings.register_profile("dev", max_examples=25, **random)
    settings.register_profile("thorough", max_examples=400, **random)
    examples = int(os.environ.get("SPECDEC_CAMPAIGN_EXAMPLES", DEFAULT_EXAMPLES))
    settings.register_profile("campaign", max_examples=examples, **random)
    settings.register_profile("replay", phases=[Phase.explicit, Phase.reuse], **random)
    settings.load_profile(name)


register()


# -- pytest hooks (imported by tests/conftest.py) ---------------------------------------

@pytest.fixture(autouse=True)
def campaign_shard(request) -> int:
    """The shard this test runs as (0 outside campaigns); pytest_generate_tests sets it.
    Autouse, so Hypothesis's function-scoped-fixture health check leaves it alone."""
    return getattr(request, "param", 0)


def pytest_generate_tests(metafunc) -> None:
    count = shards()
    if count < 2 or not hasattr(metafunc.function, "hypothesis"):
        return
    own = getattr(metafunc.function, "_hypothesis_internal_use_settings", settings.default)
    if own.derandomize:  # the same examples in every shard: nothing to spread
        return
    metafunc.parametrize("campaign_shard", range(count), indirect=True,
                         ids=[f"shard{i}" for i in range(count)])


def skip_campaign_cases(items) -> None:
    """Skip the cases marked ``campaign`` unless the profile is campaign or thorough
    (called from conftest's ``pytest_collection_modifyitems``)."""
    if profile() in ("campaign", "thorough"):
        return
    skip = pytest.mark.skip(reason="slow case: runs under HYPOTHESIS_PROFILE=campaign or thorough")
    for item in items:
        if item.get_closest_marker("campaign"):
            item.add_marker(skip)
