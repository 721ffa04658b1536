"""The docs read as a manual: every page is short enough to read (the API reference, rendered
from docstrings, excepted), and every page speaks of the project and the machines it ran on,
never of who ran it, how the work was organised or what else ran beside it. A machine is
described by what it is and how loaded it was ("2-core VM, load average 5-6"); the history of
the runs lives in results/*.json and git.

Both checks read text only (no weightsync import), so they also run on a page taken from an
older commit: ``pages_over_limit`` and ``organisation_words`` take (name, text) pairs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# docs/changelog.md renders CHANGELOG.md (a snippet): its words are checked, its length is not
RENDERED = [ROOT / "CHANGELOG.md"]
MAX_LINES = 300
LONG_ALLOWED = {"api.md"}  # rendered from the docstrings; grows with the public API

# Words of organisation, case-insensitive and word-bounded: the wording removed when the docs
# became a manual. "session" alone is a weightsync term (a coordinator session, vLLM's update
# session), so only the phrases that meant a working session are listed.
ORGANISATION = [
    r"helpers?", r"helper's",
    r"the lead", r"lead's",
    r"worktrees?",
    r"another CI", r"CI run of",
    r"beside another", r"ran beside", r"running beside", r"tests? beside it",
    r"sub-?agents?", r"other agents?",
    r"this session", r"the session under", r"for the session",
    r"other jobs?", r"other job's", r"other users",
    r"we ran", r"no GPU in this task", r"deadline of this work",
]
# a phrase may wrap onto the next line: its spaces match any whitespace
_PATTERN = re.compile(r"\b(?:" + "|".join(w.replace(" ", r"\s+") for w in ORGANISATION) + r")\b", re.IGNORECASE)


def pages_over_limit(pages: list[tuple[str, str]]) -> list[str]:
    return [f"{name}: {len(text.splitlines())} lines (at most {MAX_LINES})"
            for name, text in pages if Path(name).name not in LONG_ALLOWED and len(text.splitlines()) > MAX_LINES]


def organisation_words(pages: list[tuple[str, str]]) -> list[str]:
    found = []
    for name, text in pages:
        lines = text.splitlines()
        for m in _PATTERN.finditer(text):
            number = text.count("\n", 0, m.start()) + 1
            found.append(f"{name}:{number}: {' '.join(m.group(0).split())!r} in: {lines[number - 1].strip()}")
    return found


def _read(paths: list[Path]) -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in paths]


def test_no_docs_page_but_the_api_reference_is_over_300_lines():
    long = pages_over_limit(_read(PAGES))
    assert not long, "split or tighten:\n" + "\n".join(long)


def test_no_page_speaks_of_who_ran_it_or_what_ran_beside_it():
    found = organisation_words(_read(PAGES + RENDERED))
    assert not found, "speak of the machine (e.g. '2-core VM, load average 5-6'), not of who ran it:\n" + "\n".join(found)
