"""Render the reliability table from what the test suite recorded (results/reliability.json,
written by tests/conftest.py) and put it into docs/reliability.md between the
<!-- reliability:start --> / <!-- reliability:end --> markers. The README links the page and
keeps no copy of the table. The hosts tier's table (results/reliability-hosts.json), where a run
left one, goes into docs/multinode.md between <!-- hosts-reliability:start / end --> markers.

One row per scenario: the transports its tests actually ran on, each with the sum of every
variant run there (first / middle / last bucket, ...; "pass" only if all of them passed), and
the outcome the tests assert, written once when every transport promises the same.
"""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("shm", "ipc", "broadcast", "relay", "none")
HEADS = {"shm": "shm", "ipc": "ipc (host)", "broadcast": "broadcast (gloo)", "relay": "relay (gloo)", "none": "no transport"}
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
    order = {c: i for i, c in enumerate(COLUMNS)}
    lines = ["| kind | scenario | result per transport | promised outcome (asserted exactly) |", "|---|---|---|---|"]
    for (kind, name), by in rows.items():
        ran = sorted(by, key=lambda t: (order.get(t, len(order)), t))
        results = "<br>".join(f"{HEADS.get(t, t)}: {_cell([r['outcome'] for r in by[t]])}" for t in ran)
        lines.append(f"| {kind} | {name} | {results} | {_promises(ran, by)} |")
    passed = {k: sum(1 for r in records if r["kind"] == k and r["outcome"] == "passed")
              for k in sorted({r["kind"] for r in records})}
    lines += ["", "Passing cases: " + ", ".join(f"{k}: {n}" for k, n in passed.items())]
    return "\n".join(lines) + "\n"


def _promises(ran: list[str], by: dict[str, list[dict]]) -> str:
    """The scenario's promise once when every transport makes the same one, else each distinct
    promise once, headed by the transports that make it."""
    same: dict[str, list[str]] = {}
    for t in ran:
        same.setdefault(by[t][0].get("promise") or "", []).append(HEADS.get(t, t))
    if len(same) == 1:
        return next(iter(same)) or "—"
    return "<br>".join(f"**{', '.join(heads)}**: {promise or '—'}" for promise, heads in same.items())


def splice(path: Path, table: str, start: str = START, end: str = END) -> None:
    text = path.read_text()
    before, rest = text.split(start)
    _, after = rest.split(end)
    path.write_text(f"{before}{start}\n{table.strip()}\n{end}{after}")
    print(f"{path.name}: reliability table updated")


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    suite, hosts = root / "results" / "reliability.json", root / "results" / "reliability-hosts.json"
    if not suite.exists() and not hosts.exists():
        raise SystemExit(f"no {suite} (run the test suite) nor {hosts} (run the hosts tier)")
    if suite.exists():
        table = render(json.loads(suite.read_text()))
        (root / "results" / "reliability.md").write_text(table)
        splice(root / "docs" / "reliability.md", table)
    # the hosts tier's faults (tests/test_hosts.py, root only) go to the multi-node page, where
    # that tier's run left them
    if hosts.exists():
        splice(root / "docs" / "multinode.md", render(json.loads(hosts.read_text())),
               "<!-- hosts-reliability:start -->", "<!-- hosts-reliability:end -->")


if __name__ == "__main__":
    main()
