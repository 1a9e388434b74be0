"""Campaigns (tests/campaign.py): the suite under pytest-xdist, shared example databases.

- Under the ``ci`` profile every test draws the same examples with ``-n 2`` as in one
  process (a probe suite that records what it drew).
- A campaign over 2 xdist workers with a shared directory database finds a planted
  mutant of the engine's index math; a fresh process replays the failing example from
  the database alone (``replay`` profile: no generation) and fails the same way; without
  the mutant the same replay passes.
- The same with a real ``redis-server`` (started here, on a free loopback port) as the
  database, the workers started through ``--tx`` specs as the README's several-machines
  command starts them (``popen`` in place of ``ssh``); skipped when the binary is not
  installed (Debian: ``redis-server``).

The probes run pytest in a subprocess: a campaign is a command line, so that is what is
tested. Durations (2 shared cores): the probes a few seconds each, the engine drill
about 40 s.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import campaign

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

PROBE_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from campaign import campaign_shard, pytest_generate_tests  # noqa: F401
"""

#: three properties that record every example they draw; the last fails from 5000 on
PROBE_TESTS = """
import os
from hypothesis import given, note, strategies as st

def record(name, value):
    with open(os.path.join(os.environ["PROBE_OUT"], f"{name}-{os.getpid()}"), "a") as f:
        f.write(repr(value) + "\\n")

@given(st.lists(st.integers(-100, 100), max_size=6))
def test_lists(xs):
    record("lists", xs)

@given(st.text(max_size=5), st.booleans())
def test_text(s, b):
    record("text", (s, b))

@given(st.integers(0, 10_000))
def test_small(x):
    record("small", x)
    note(f"x: {x}")
    assert x < 5000 or os.environ.get("PROBE_FIXED")
"""


def run_pytest(args, cwd, **env):
    """pytest in a fresh process with only the given campaign settings in its environment."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("HYPOTHESIS_", "SPECDEC_CAMPAIGN", "SPECDEC_MUTANT", "PYTEST_"))}
    clean.update({"OMP_NUM_THREADS": "1", "SPECDEC_TEST_THREADS": "1", **env})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
                          cwd=cwd, env=clean, capture_output=True, text=True, timeout=900)


@pytest.fixture
def probe(tmp_path):
    """A directory holding the probe suite (run it with ``PROBE_ARGS``)."""
    (tmp_path / "conftest.py").write_text(PROBE_CONFTEST)
    (tmp_path / "test_probe.py").write_text(PROBE_TESTS)
    return tmp_path


#: the probe needs no torch: leave out the invariants plugin (it imports torch)
PROBE_ARGS = ["-p", "no:invariants", "test_probe.py"]


def drawn(out: Path) -> dict:
    """Examples per probe test, in the order drawn (each test runs in one process)."""
    result: dict = {}
    for f in sorted(out.iterdir()):
        result.setdefault(f.name.split("-")[0], []).extend(f.read_text().splitlines())
    return result


def notes(output: str) -> set:
    return set(re.findall(r"^E?\s*(x: \d+|case: Case\(.*\))$", output, flags=re.M))


def test_ci_profile_draws_the_same_examples_with_and_without_xdist(probe):
    runs = []
    for args in (["-n", "2"], ["-n", "2"], ["-p", "no:xdist"]):
        out = probe / f"out{len(runs)}"
        out.mkdir()
        r = run_pytest([*args, "-k", "not small", *PROBE_ARGS], probe, PROBE_OUT=str(out),
                       HYPOTHESIS_PROFILE="ci")
        assert r.returncode == 0, r.stdout[-2000:]
        runs.append(drawn(out))
    assert set(runs[0]) == {"lists", "text"} and all(len(v) >= 12 for v in runs[0].values())
    assert runs[0] == runs[1] == runs[2]


def test_campaign_shards_property_tests_over_the_workers(probe, tmp_path):
    out = probe / "out"
    out.mkdir()
    r = run_pytest(["-n", "2", "-rA", "-k", "not small", *PROBE_ARGS], probe, PROBE_OUT=str(out),
                   HYPOTHESIS_PROFILE="campaign", SPECDEC_CAMPAIGN_EXAMPLES="20",
                   HYPOTHESIS_DATABASE=str(tmp_path / "db"))
    assert r.returncode == 0, r.stdout[-2000:]
    for test in ("test_lists", "test_text"):
        assert f"{test}[shard0]" in r.stdout and f"{test}[shard1]" in r.stdout
    per_process = [f for f in out.iterdir()]
    assert len({f.name.split("-")[1] for f in per_process}) == 2  # both workers drew


def replay_finds(database, cwd, args, expected_notes, **env):
    """A fresh process replays the database alone: it fails with one of the campaign's
    falsifying examples; without the planted fault the same replay passes."""
    fixed = env.pop("fixed")
    r = run_pytest(args, cwd, HYPOTHESIS_PROFILE="replay", HYPOTHESIS_DATABASE=database, **env)
    assert r.returncode == 1, r.stdout[-3000:]
    found = notes(r.stdout)
    assert found and found <= expected_notes, (found, expected_notes)
    r = run_pytest(args, cwd, HYPOTHESIS_PROFILE="replay", HYPOTHESIS_DATABASE=database,
                   **{**env, **fixed})
    assert r.returncode == 0, r.stdout[-3000:]


def test_two_workers_find_a_planted_mutant_and_a_fresh_process_replays_it(tmp_path):
    database = str(tmp_path / "examples")
    args = ["tests/test_properties.py", "-k", "test_ids_equal_the_batch_1_reference"]
    mutant = "source_off_by_one"
    r = run_pytest(["-n", "2", "-rA", *args], ROOT, HYPOTHESIS_PROFILE="campaign",
                   SPECDEC_CAMPAIGN_EXAMPLES="30", HYPOTHESIS_DATABASE=database,
                   SPECDEC_MUTANT=mutant)
    # both shards ran, one per worker; at least one found the mutant (the shards run at
    # the same time, so the other may finish its 30 examples before the failure is stored)
    assert r.returncode == 1 and "[shard0]" in r.stdout and "[shard1]" in r.stdout, r.stdout[-3000:]
    assert "FAILED tests/test_properties.py::test_ids_equal_the_batch_1_reference[shard" in r.stdout
    found = notes(r.stdout)
    assert found, r.stdout[-3000:]
    print(f"campaign found {mutant}:", *sorted(found), sep="\n  ")
    assert any(Path(database).rglob("*"))
    replay_finds(database, ROOT, args, found, SPECDEC_MUTANT=mutant,
                 fixed={"SPECDEC_MUTANT": ""})


# -- Redis ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    """A throwaway redis-server on a free loopback port, no persistence; its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    from redis import Redis

    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(100):
            try:
                if client.ping():
                    break
            except Exception:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not answer within 5 s")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_url_selects_a_redis_database(redis_url):
    from hypothesis.extra.redis import RedisExampleDatabase

    db = campaign.example_database(redis_url)
    assert isinstance(db, RedisExampleDatabase)
    db.save(b"key", b"value")
    short = redis_url.replace("redis://", "redis:")  # the form for xdist --tx specs
    assert list(campaign.example_database(short).fetch(b"key")) == [b"value"]


def remote_workers(count: int, cwd: Path, **env) -> list[str]:
    """``--tx`` specs of the README's several-machines command, with ``popen`` (a local
    process) standing in for ``ssh=USER@HOST``: interpreter, directory and campaign
    settings travel in the spec (an ssh worker does not inherit the caller's environment).
    Such workers take no file arguments (xdist maps them onto rsync roots, and there are
    none): select tests with -k."""
    spec = f"{count}*popen//python={sys.executable}//chdir={cwd}"
    spec += "".join(f"//env:{k}={v}" for k, v in env.items())
    return ["--dist", "load", "--tx", spec]


def test_a_campaign_shares_failures_through_redis(probe, redis_url):
    from redis import Redis

    out = probe / "out"
    out.mkdir()
    args = ["-k", "small", "-p", "no:invariants"]  # no file argument: the probe directory
    workers = remote_workers(2, probe, PROBE_OUT=out, HYPOTHESIS_PROFILE="campaign",
                             SPECDEC_CAMPAIGN_EXAMPLES=50,  # no "//" inside a --tx spec:
                             HYPOTHESIS_DATABASE=redis_url.replace("redis://", "redis:"))
    r = run_pytest([*workers, *args], probe)  # the caller's own environment has none of it
    assert r.returncode == 1 and "2 failed" in r.stdout, r.stdout[-2000:]
    assert len({f.name.split("-")[1] for f in out.iterdir()}) == 2  # both workers drew
    assert Redis.from_url(redis_url).keys(b"hypothesis-example:*")
    replay_finds(redis_url, probe, args, notes(r.stdout), PROBE_OUT=str(out),
                 fixed={"PROBE_FIXED": "1"})


# -- the settings themselves --------------------------------------------------------------

def test_random_profiles_stay_random_when_ci_is_set():
    """Hypothesis loads its own derandomized "ci" profile when CI is set; the campaign's
    profiles must not inherit that (they would all draw one sequence of examples)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import campaign; "
            "from hypothesis import settings; "
            "print([settings.get_profile(p).derandomize for p in campaign.PROFILES])")
    out = subprocess.run([sys.executable, "-c", code, str(TESTS)], capture_output=True,
                         text=True, env={**os.environ, "CI": "true", "HYPOTHESIS_PROFILE": "campaign"})
    assert out.stdout.strip() == "[True, False, False, False, False]", out.stderr[-2000:]


def test_database_and_shards_follow_the_environment(monkeypatch, tmp_path):
    from hypothesis.database import DirectoryBasedExampleDatabase

    monkeypatch.delenv("HYPOTHESIS_DATABASE", raising=False)
    assert campaign.example_database().path == Path(".hypothesis", "examples")
    assert campaign.example_database(str(tmp_path)).path == tmp_path
    assert isinstance(campaign.example_database(str(tmp_path)), DirectoryBasedExampleDatabase)
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "campaign")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.delenv("SPECDEC_CAMPAIGN_SHARDS", raising=False)
    assert campaign.shards() == 3
    monkeypatch.setenv("SPECDEC_CAMPAIGN_SHARDS", "5")
    assert campaign.shards() == 5
    monkeypatch.setenv("SPECDEC_CAMPAIGN_SHARDS", "0")
    with pytest.raises(ValueError, match="integer >= 1"):
        campaign.shards()
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    assert campaign.shards() == 1
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "fast")
    with pytest.raises(ValueError, match="HYPOTHESIS_PROFILE must be one of"):
        campaign.profile()
