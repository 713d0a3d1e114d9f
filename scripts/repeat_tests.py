"""Run a pytest selection N times in a row and log every run: the evidence that a test does not fail by chance.

    .venv/bin/python scripts/repeat_tests.py --group soak --runs 10 -- tests -k soak
    .venv/bin/python scripts/repeat_tests.py --summary            # markdown table of every logged group

``--root DIR`` runs the selection in another checkout (a git worktree at a fixed commit, so the runs test one commit
while this one changes); ``--first-run N`` numbers a resumed group's runs on from N; ``--pause-file PATH`` waits
before each run while PATH exists (a gap for a quiet measurement without stopping a run half-way).

Each run appends one JSON line to ``docs/flaky/runs.jsonl``: the group, the selection, the commit, the CPU, the
load average before and after, pass/fail/skip counts and the ids of failed tests (from pytest's junit XML). A group
stops at the first failure only with ``--stop-on-failure``; by default it runs all N so the count is honest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "docs" / "flaky" / "runs.jsonl"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit(root: Path = ROOT) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    passed = failed = skipped = 0
    failures: list[str] = []
    messages: dict[str, str] = {}
    times: list[tuple] = []
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        times.append((float(case.get("time") or 0.0), tid))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failed += 1
            failures.append(tid)
            # the assertion's own message (the output's tail holds the captured stdout, not the line that failed)
            messages[tid] = (bad.get("message") or "")[:1500] + "\n" + (bad.text or "")[-2500:]
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    slowest = [[tid, round(t, 1)] for t, tid in sorted(times, reverse=True)[:8]]
    return {"passed": passed, "failed": failed, "skipped": skipped, "failures": failures, "slowest": slowest,
            **({"messages": messages} if messages else {})}


def run_once(group: str, args: list[str], index: int, runs: int, root: Path = ROOT) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        load0 = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={xml}", *args], cwd=root,
                              env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
                                   "TRANSFORMERS_OFFLINE": "1"},
                              capture_output=True, text=True)
        seconds = time.time() - t0
        counts = junit_counts(xml) if xml.exists() else {"passed": 0, "failed": 0, "skipped": 0,
                                                         "failures": [f"pytest exited {proc.returncode}"]}
    rec = {"group": group, "selection": " ".join(args), "run": index, "of": runs,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "commit": commit(root), "cpu": cpu_name(),
           "cores": os.cpu_count(), "load_before": round(load0[0], 2), "load_after": round(os.getloadavg()[0], 2),
           "seconds": round(seconds, 1), "exit": proc.returncode, **counts}
    if proc.returncode not in (0, 5):
        rec["tail"] = proc.stdout[-3000:]
    return rec


def summary(path: Path = LOG) -> str:
    """One row per group, CPU and commit (a claim of N green runs in a row holds for one commit): runs, green runs,
    the green streak the latest runs end with, failed tests, load, minutes a run, dates."""
    rows: dict[tuple, list[dict]] = defaultdict(list)
    sels: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["group"], r["cpu"], r["commit"])].append(r)
            sels[r["group"]] = r["selection"]
    out = ["| group | CPU | commit | runs | green runs | green in a row (latest) | tests per run | failed tests | load (1 min) | minutes a run | dates |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (group, cpu, com), rs in rows.items():
        ok = [r["failed"] == 0 and r["exit"] in (0, 5) for r in sorted(rs, key=lambda r: r["date"])]
        streak = next((i for i, g in enumerate(reversed(ok)) if not g), len(ok))
        tests = sorted({r["passed"] + r["failed"] for r in rs})
        fails = sorted({f for r in rs for f in r["failures"]})
        loads = [r["load_before"] for r in rs] + [r["load_after"] for r in rs]
        mins = [r["seconds"] / 60 for r in rs]
        dates = sorted({r["date"][:10] for r in rs})
        out.append(f"| {group} | {cpu} | {com} | {len(rs)} | {sum(ok)} | {streak} | {'/'.join(map(str, tests))} | "
                   f"{'; '.join(fails) or '—'} | {min(loads):.1f}–{max(loads):.1f} | "
                   f"{min(mins):.1f}–{max(mins):.1f} | {', '.join(dates)} |")
    out.append("")
    out += [f"- `{g}`: `{sel}`" for g, sel in sels.items()]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", help="a name for this selection in the log")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--stop-on-failure", action="store_true")
    ap.add_argument("--log", type=Path, default=LOG)
    ap.add_argument("--summary", action="store_true", help="print the markdown table of the log and exit")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to test (default: this one)")
    ap.add_argument("--first-run", type=int, default=1, help="the number of the first run (a resumed group)")
    ap.add_argument("--pause-file", type=Path, default=None, help="wait before each run while this file exists")
    ap.add_argument("pytest_args", nargs="*", help="after --: the pytest selection")
    a = ap.parse_args()
    if a.summary:
        if not a.log.exists():
            print(f"no log at {a.log}", file=sys.stderr)
            return 1
        print(summary(a.log))
        return 0
    if not a.group or not a.pytest_args:
        ap.error("give --group NAME and a pytest selection after --")
    a.log.parent.mkdir(parents=True, exist_ok=True)
    bad = 0
    for i in range(a.first_run, a.runs + 1):
        while a.pause_file is not None and a.pause_file.exists():
            time.sleep(5)
        rec = run_once(a.group, a.pytest_args, i, a.runs, a.root.resolve())
        with a.log.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        ok = rec["failed"] == 0 and rec["exit"] in (0, 5)
        bad += not ok
        print(f"[{a.group}] run {i}/{a.runs}: {rec['passed']} passed, {rec['failed']} failed, {rec['skipped']} skipped "
              f"in {rec['seconds']:.0f} s, load {rec['load_before']}→{rec['load_after']}"
              + ("" if ok else f"  FAILED: {rec['failures']}"), flush=True)
        if not ok and a.stop_on_failure:
            break
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
