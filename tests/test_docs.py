"""The README and ``docs/`` say what the repository holds: every relative link resolves,
every section the README links to exists, every repository path it names exists, and its
test command is the one CI runs (``.ci/run``). Files move between sessions (round-by-round
logs went to ``docs/history/``); these tests keep the README from pointing at what is
gone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").rglob("*.md")])

#: a Markdown link's target: ``](target)`` or ``](target#anchor)``
LINK = re.compile(r"\]\(([^)\s#]*)(?:#[^)\s]*)?\)")
#: a path under one of the repository's top-level folders, as the README names it in prose
#: or code (``benchmarks/throughput.py``, ``tests/test_docs.py::test_x`` up to the ``::``)
PATH = re.compile(r"(?<![\w./-])((?:specdec|invariants|benchmarks|tests|proofs|docs|\.ci)"
                  r"/[\w/.-]*\w)")


def _relative_links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(doc.read_text(encoding="utf-8"))
            if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:, ...


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_in_the_docs_resolves(doc):
    missing = [t for t in _relative_links(doc) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_anchor_the_readme_links_to_is_one_of_its_headings():
    text = README.read_text(encoding="utf-8")
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # (a "# comment" is no heading)
    headings = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}
    anchors = re.findall(r"\]\(#([^)\s]+)\)", text)
    assert anchors, "the pattern still finds the README's links to its own sections"
    missing = [a for a in anchors if a not in headings]
    assert not missing, f"the README links to sections it does not have: {missing}"


def test_every_repository_path_the_readme_names_exists():
    named = sorted(set(PATH.findall(README.read_text(encoding="utf-8"))))
    assert len(named) > 20  # the pattern still finds what the README names
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, f"the README names paths that do not exist: {missing}"


def test_ci_runs_the_readmes_set_up_and_test_commands():
    """The README's test command (``bash setup.sh && HYPOTHESIS_PROFILE=ci .venv/bin/python
    -m pytest -q``) is what ``.ci/run`` runs: the same set-up script, the same profile by
    default, the same interpreter and pytest call (CI adds reporting flags only)."""
    readme = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(.*?)```", readme.split("## A short tour")[0], re.S)
    test = [c.strip() for c in commands if "pytest" in c]
    assert test == ["bash setup.sh && HYPOTHESIS_PROFILE=ci .venv/bin/python -m pytest -q"], test
    assert re.search(r"^bash setup\.sh$", ci, re.M)
    assert "HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}" in ci
    assert re.search(r"^\.venv/bin/python -m pytest -q( |$)", ci, re.M)
    assert any("specdec audit" in c for c in commands)  # and the main job's command
