"""scripts/repeat_tests.py, the evidence that no test fails by chance: each run's failed tests keep their assertion
message, and the summary counts green runs per commit with the green streak the latest runs end with."""

import json
import runpy

from conftest import ROOT

rt = runpy.run_path(str(ROOT / "scripts" / "repeat_tests.py"), run_name="repeat_tests")


def test_junit_counts_keep_the_assertion_message(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.t" name="a" time="1.5"/>'
                   '<testcase classname="tests.t" name="b" time="3"><failure message="ValueError: max() arg is an empty sequence">'
                   'tests/t.py:35: in b</failure></testcase><testcase classname="tests.t" name="c" time="0.1"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    c = rt["junit_counts"](xml)
    assert (c["passed"], c["failed"], c["skipped"]) == (1, 1, 1) and c["failures"] == ["tests.t::b"]
    assert c["messages"]["tests.t::b"].startswith("ValueError: max() arg is an empty sequence") and "t.py:35" in c["messages"]["tests.t::b"]
    assert c["slowest"][0] == ["tests.t::b", 3.0]


def test_summary_counts_per_commit_and_the_latest_streak(tmp_path):
    log = tmp_path / "runs.jsonl"
    def run(group, commit, i, failed):
        return {"group": group, "selection": "tests -k soak", "cpu": "AMD EPYC", "commit": commit, "date": f"2026-12-07T0{i}:00:00Z",
                "exit": 1 if failed else 0, "failed": failed, "passed": 15 - failed, "failures": ["t::x"] if failed else [],
                "load_before": 1.0, "load_after": 2.0, "seconds": 600.0}
    rows = [run("soak", "aaa", 1, 0), run("soak", "aaa", 2, 1), run("soak", "aaa", 3, 0), run("soak", "aaa", 4, 0),
            run("soak", "bbb", 5, 0)]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    table = rt["summary"](log)
    assert "| soak | AMD EPYC | aaa | 4 | 3 | 2 | 15 | t::x |" in table  # 4 runs, 3 green, the latest 2 in a row
    assert "| soak | AMD EPYC | bbb | 1 | 1 | 1 |" in table and "- `soak`: `tests -k soak`" in table
