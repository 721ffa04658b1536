"""Render the reliability table from what the test suite recorded (results/reliability.json,
written by tests/conftest.py) and put it into docs/reliability.md (and, with --readme,
README.md) between the <!-- reliability:start --> / <!-- reliability:end --> markers.

A row names the transports its tests actually ran on; a case that ran on one transport shows
on that transport only. A cell sums every variant run there (first / middle / last bucket,
...): "pass" only if all of them passed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("shm", "ipc", "broadcast", "none")
HEADS = {"shm": "shm", "ipc": "ipc (host)", "broadcast": "broadcast (gloo)", "none": "no transport"}
START, END = "<!-- reliability:start -->", "<!-- reliability:end -->"


def _cell(outcomes: list[str]) -> str:
    if not outcomes:
        return "—"
    n = len(outcomes)
    count = f" ({n})" if n > 1 else ""
    bad = [o for o in outcomes if o in ("failed", "xpass")]
    if bad:
        return f"**FAIL** ({len(bad)} of {n})"
    if all(o == "skipped" for o in outcomes):
        return "skip"
    if any(o == "xfail" for o in outcomes):
        return f"known gap (xfail){count}"
    return f"pass{count}"


def render(records: list[dict]) -> str:
    rows: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for r in records:
        rows.setdefault((r["kind"], r["name"]), {}).setdefault(r["transport"], []).append(r)
    columns = [c for c in COLUMNS if any(c in by for by in rows.values())]
    columns += sorted({t for by in rows.values() for t in by} - set(columns))
    lines = ["| kind | scenario | " + " | ".join(HEADS.get(c, c) for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for (kind, name), by in rows.items():
        cells = [_cell([r["outcome"] for r in by.get(c, [])]) for c in columns]
        lines.append(f"| {kind} | {name} | " + " | ".join(cells) + " |")
    passed = {k: sum(1 for r in records if r["kind"] == k and r["outcome"] == "passed")
              for k in sorted({r["kind"] for r in records})}
    lines += ["", "Passing cases: " + ", ".join(f"{k}: {n}" for k, n in passed.items()), ""]
    promised = [(key, t, rs) for key, by in rows.items() for t, rs in by.items() if rs[0].get("promise")]
    if promised:
        lines += ["### The one outcome each test asserts", "",
                  "| scenario | transport | promised outcome (asserted exactly) | result |", "|---|---|---|---|"]
        for (_, name), t, rs in promised:
            lines.append(f"| {name} | {HEADS.get(t, t)} | {rs[0]['promise']} | {_cell([r['outcome'] for r in rs])} |")
    return "\n".join(lines) + "\n"


def splice(path: Path, table: str) -> None:
    text = path.read_text()
    before, rest = text.split(START)
    _, after = rest.split(END)
    path.write_text(f"{before}{START}\n{table.strip()}\n{END}{after}")
    print(f"{path.name}: reliability table updated")


def main(argv: list[str]) -> None:
    root = Path(__file__).resolve().parents[1]
    table = render(json.loads((root / "results" / "reliability.json").read_text()))
    (root / "results" / "reliability.md").write_text(table)
    splice(root / "docs" / "reliability.md", table)
    if "--readme" in argv:
        splice(root / "README.md", table)


if __name__ == "__main__":
    main(sys.argv[1:])
