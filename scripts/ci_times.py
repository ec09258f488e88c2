"""Where CI's time went: each stage of ``.ci/run``, each notebook and the slowest tests.

    python scripts/ci_times.py                  # the reports of the last .ci/run (.ci-reports/)
    python scripts/ci_times.py REPORTS --top 30

``.ci/run`` writes ``stages.tsv`` (stage, start, end, exit status; a skipped stage has the status
``skipped``) and a JUnit XML report per pytest stage into its reports folder. This prints the
stages' wall times, each notebook's seconds (papermill pass and JupyterLab) and the slowest tests,
so a change that slows CI shows at once.
"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPORTS = Path(__file__).resolve().parents[1] / ".ci-reports"
NOTEBOOK_PROPERTIES = ("notebook_seconds", "browser_times")   # tests/conftest.py, tests/browser


def stages(folder: Path) -> list[tuple[str, float, str]]:
    """(stage, seconds, status) in the order .ci/run ran them."""
    rows = []
    for line in (folder / "stages.tsv").read_text().splitlines():
        name, start, end, status = line.split("\t")
        rows.append((name, float(end) - float(start), status))
    return rows


def testcases(folder: Path) -> list[dict]:
    """Every test case of every JUnit report: stage, test id, seconds, outcome, properties."""
    cases = []
    for report in sorted(folder.glob("*.xml")):
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = next((child.tag for child in case
                            if child.tag in ("failure", "error", "skipped")), "passed")
            properties = {p.get("name"): p.get("value") for p in case.iter("property")}
            cases.append({"stage": report.stem, "seconds": float(case.get("time", 0)),
                          "id": f"{case.get('classname')}::{case.get('name')}",
                          "outcome": outcome, "properties": properties})
    return cases


def report(folder: Path, top: int = 15) -> str:
    lines = ["stage                      seconds  status"]
    for name, seconds, status in stages(folder):
        lines.append(f"{name:25s} {seconds:8.0f}  {status}")
    cases = testcases(folder)
    for stage in sorted({c["stage"] for c in cases}):
        mine = [c for c in cases if c["stage"] == stage]
        counts = {o: sum(c["outcome"] == o for c in mine)
                  for o in ("passed", "failed", "error", "skipped")}
        lines.append(f"{stage}: {len(mine)} tests, " + ", ".join(
            f"{n} {o}" for o, n in counts.items() if n) + f", {sum(c['seconds'] for c in mine):.0f} s"
            " of test time")
    notebooks = [(c["stage"], c["id"].split("::")[-1], key, c["properties"][key])
                 for c in cases for key in NOTEBOOK_PROPERTIES if key in c["properties"]]
    if notebooks:
        lines += ["", "notebooks"]
        for stage, test, key, value in sorted(notebooks, key=lambda n: n[1].split("[")[-1]):
            shown = f"{float(value):6.1f} s" if key == "notebook_seconds" else value
            lines.append(f"  {stage:8s} {test:60s} {shown}")
    lines += ["", f"the {top} slowest tests"]
    for c in sorted(cases, key=lambda c: -c["seconds"])[:top]:
        lines.append(f"  {c['seconds']:7.1f} s  {c['stage']:8s} {c['id']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="?", type=Path, default=REPORTS,
                        help=f"the folder .ci/run wrote (default {REPORTS})")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests")
    args = parser.parse_args(argv)
    if not (args.reports / "stages.tsv").exists():
        print(f"no {args.reports / 'stages.tsv'}: run .ci/run first (or name its reports folder)",
              file=sys.stderr)
        return 2
    print(report(args.reports, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
