"""Copy the reliability table the test suite wrote (results/reliability.md) into README.md."""

from pathlib import Path

root = Path(__file__).resolve().parents[1]
table = (root / "results" / "reliability.md").read_text().strip()
readme = (root / "README.md").read_text()
start, end = "<!-- reliability:start -->", "<!-- reliability:end -->"
before, rest = readme.split(start)
_, after = rest.split(end)
(root / "README.md").write_text(f"{before}{start}\n{table}\n{end}{after}")
print("README.md: reliability table updated")
