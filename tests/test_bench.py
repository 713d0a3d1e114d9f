"""The bench command: its JSON contract, table writers and dataset loaders."""

import csv
import json
from pathlib import Path

import pytest

from d3d_core.measure import bench
from d3d_core.measure.datasets import BENCHMARKS, load_benchmark, load_training_prompts

FIX = Path(__file__).parent / "fixtures" / "datasets"


def test_bench_command_on_toy(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main([
        "--bundle", "toy", "--modes", "ar,dflash,d3d-seq,d3d-async", "--data-dir", str(FIX),
        "--datasets", "gsm8k,mt_bench", "--n", "2", "--max-new-tokens", "24", "--block-size", "4",
        "--temperature", "0", "--out", str(out), "--no-progress",
    ])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res) >= {"config", "machine", "rows", "summary", "quiet", "engine"}
    assert len(res["rows"]) == 2 * 2 * (4 + 2)  # four modes and the two peers on every prompt
    assert res["engine"]["target"] == "fast" and res["machine"]["cpu"]
    assert set(res["quiet"]) >= {"load_at_start", "other_cpu_s", "other_cores", "noisy", "warning"}
    peers = [r for r in res["rows"] if r["mode"].startswith("hf-")]
    assert len(peers) == 8 and all(r["lossless"] is True and r["tau"] is None for r in peers)
    need = {"mode", "dataset", "n", "tau", "tokens_per_s", "speedup", "lossless_rate", "hit_rate", "overlap"}
    for s in res["summary"]:
        assert need <= set(s)
        if s["mode"] != "ar":
            assert s["lossless_rate"] == 1.0
    ar = [s for s in res["summary"] if s["mode"] == "ar" and s["dataset"] == "gsm8k"][0]
    assert abs(ar["speedup"] - 1.0) < 1e-9
    assert {s["dataset"] for s in res["summary"]} == {"gsm8k", "mt_bench", "average"}
    with open(tmp_path / "r.csv") as f:
        assert len(list(csv.DictReader(f))) == len(res["summary"])
    assert (tmp_path / "r.md").read_text().startswith("| dataset | mode |")
    printed = capsys.readouterr().out
    assert "d3d-async" in printed and "speedup" in printed


def test_bench_bad_arguments(tmp_path, capsys):
    assert bench.main(["--bundle", "toy", "--modes", "ar,warp", "--data-dir", str(FIX), "--out", str(tmp_path / "x.json")]) == 2
    assert "unknown mode" in capsys.readouterr().err
    assert bench.main(["--bundle", "toy", "--datasets", "gsm8k", "--data-dir", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "gsm8k/test.jsonl" in capsys.readouterr().err


def test_summary_speedup_is_time_per_token_ratio():
    rows = [
        dict(dataset="d", mode="ar", n_tokens=11, rounds=10, tau=1.0, decode_time_s=2.0, hit_rate=None, overlap=None, lossless=True),
        dict(dataset="d", mode="d3d-seq", n_tokens=11, rounds=4, tau=2.5, decode_time_s=1.0, hit_rate=None, overlap=0.0, lossless=True),
    ]
    s = {r["mode"]: r for r in bench.summarize(rows, ["d"], ["ar", "d3d-seq"])}
    assert s["d3d-seq"]["speedup"] == pytest.approx(2.0)
    assert s["d3d-seq"]["tokens_per_s"] == pytest.approx(10.0)
    assert s["d3d-seq"]["tau"] == pytest.approx(2.5)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_loads_from_fixture(name):
    items = load_benchmark(name, n=2, seed=0, root=str(FIX))
    assert 1 <= len(items) <= 2
    for it in items:
        assert it.messages[-1]["role"] == "user" and it.text.strip()
    if name in ("gsm8k", "math500", "aime25"):
        assert "\\boxed{}" in items[0].text
    if name == "mbpp":  # train (601-974) and validation (511-600) ids are never benchmark items
        assert all(int(i.id) not in range(511, 975) for i in load_benchmark(name, root=str(FIX)))


def test_selection_is_deterministic():
    a = [i.id for i in load_benchmark("gsm8k", n=3, seed=1, root=str(FIX))]
    b = [i.id for i in load_benchmark("gsm8k", n=3, seed=1, root=str(FIX))]
    assert a == b


def test_training_prompts_exclude_benchmark_files():
    items = load_training_prompts(str(FIX))
    kinds = {i.dataset for i in items}
    assert kinds == {"gsm8k-train", "mbpp-train", "alpaca"}
    assert sorted(i.id for i in items if i.dataset == "mbpp-train") == ["610", "611"]


def test_block_size_sweep_and_histograms(tmp_path):
    out = tmp_path / "s.json"
    assert bench.main(["--bundle", "toy", "--modes", "ar,d3d-seq,d3d-async", "--data-dir", str(FIX), "--datasets", "gsm8k",
                       "--n", "2", "--max-new-tokens", "16", "--block-size", "4", "--block-sizes", "2,8", "--out", str(out),
                       "--no-progress", "--peers", "none"]) == 0
    res = json.loads(out.read_text())
    assert set(res["sweep"]) == {"d3d-seq", "d3d-async"}
    assert set(res["sweep"]["d3d-seq"]) == {"2", "4", "8"}
    assert len(res["rows"]) == 2 * (1 + 2 * 3)  # ar once + 2 modes x 3 block sizes, per item
    h = res["acceptance_hist"]["gsm8k"]["d3d-seq"]
    main = [r for r in res["rows"] if r["mode"] == "d3d-seq" and r["block_size"] == 4]
    assert sum(h.values()) == sum(r["rounds"] for r in main)


def test_mt_bench_second_turn_uses_the_targets_own_first_answer(toy):
    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.measure.bench import item_ids

    it = load_benchmark("mt_bench_2turn", n=1, root=str(FIX))[0]
    assert it.meta["needs_first_answer"] and it.messages[1]["content"] == ""
    ids = item_ids(toy, it, DecodeConfig(max_new_tokens=12))
    first_only = toy.tokenizer.encode_messages(it.messages[:1])
    assert len(ids) > len(first_only)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process(tmp_path):
    import subprocess
    import sys

    args = ["--bundle", "toy", "--modes", "ar,dflash,d3d-async", "--data-dir", str(FIX), "--datasets", "gsm8k,mt_bench", "-n", "3",
            "--max-new-tokens", "20", "--block-size", "4", "--no-progress", "--peers", "none"]
    one = tmp_path / "one.json"
    two = tmp_path / "two.json"
    assert bench.main(args + ["--out", str(one)]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517", "-m", "d3d_core.measure.bench",
           *args, "--out", str(two)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(Path(__file__).resolve().parent.parent))
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["config"]["world_size"] == 2
    keys = ["dataset", "id", "mode", "n_tokens", "rounds", "tau", "hit_rate", "lossless", "accepted_hist", "block_size"]
    assert [{k: r[k] for k in keys} for r in a["rows"]] == [{k: r[k] for k in keys} for r in b["rows"]]
    assert [(s["dataset"], s["mode"], s["n"], round(s["tau"], 9)) for s in a["summary"]] == \
           [(s["dataset"], s["mode"], s["n"], round(s["tau"], 9)) for s in b["summary"]]


def test_compare_verify_runs_both_rules_in_one_run(tmp_path):
    out = tmp_path / "v.json"
    assert bench.main(["--bundle", "toy", "--modes", "ar,d3d-seq", "--data-dir", str(FIX), "--datasets", "gsm8k", "--n", "2",
                       "--max-new-tokens", "12", "--block-size", "4", "--verify", "full", "--compare-verify", "--out", str(out),
                       "--no-progress", "--peers", "none"]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["decode"]["verify"] == "full"
    assert sorted(r["verify"] for r in res["rows"] if r["mode"] == "d3d-seq") == ["adaptive", "adaptive", "full", "full"]
    assert set(res["plan_compare"]["d3d-seq"]) == {"verify adaptive, drafting gated", "verify full, drafting gated"}
    main = [r for r in res["rows"] if r["mode"] == "d3d-seq" and r["verify"] == "full"]
    s = next(s for s in res["summary"] if s["mode"] == "d3d-seq")
    assert s["n"] == len(main) == 2  # the table holds the chosen rule's rows only
    assert all(r["lossless"] for r in res["rows"])


def test_compare_drafting_runs_both_rules_and_counts_skipped_rounds(tmp_path):
    out = tmp_path / "g.json"
    assert bench.main(["--bundle", "toy", "--modes", "ar,d3d-seq,dflash", "--data-dir", str(FIX), "--datasets", "gsm8k", "--n", "2",
                       "--max-new-tokens", "12", "--block-size", "4", "--compare-drafting", "--out", str(out),
                       "--no-progress", "--peers", "none"]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["decode"]["drafting"] == "gated"
    assert sorted(r["drafting"] for r in res["rows"] if r["mode"] == "d3d-seq") == ["always", "always", "gated", "gated"]
    pc = res["plan_compare"]["dflash"]
    assert set(pc) == {"verify adaptive, drafting gated", "verify adaptive, drafting always"}
    assert all(0 <= v["skipped"] <= 1 for v in pc.values())
    assert all(r["lossless"] for r in res["rows"]) and all(isinstance(r["skipped_rounds"], int) for r in res["rows"])
    for r in res["rows"]:
        if r["mode"] not in ("hf-generate", "hf-prompt-lookup"):  # the histogram counts drafted rounds only (and ar's steps)
            assert sum(r["accepted_hist"].values()) == r["rounds"] - r["skipped_rounds"]
    assert {s["mode"]: s["skipped"] for s in res["summary"]}["ar"] is None


def test_one_prompt_timed_n_times_gives_each_modes_spread(tmp_path, capsys):
    """--prompt times one prompt (text or @file) --n times, so a race on it can be set against the bench's spread."""
    from d3d_core.measure.datasets import prompt_items

    f = tmp_path / "p.txt"
    f.write_text("How many muffins do seven bakers bake?\n")
    assert [it.text for it in prompt_items("@" + str(f), 2)] == ["How many muffins do seven bakers bake?"] * 2
    with pytest.raises(ValueError):
        prompt_items("   ")
    assert bench.main(["--bundle", "toy", "--prompt", "@" + str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.json")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    out = tmp_path / "b.json"
    assert bench.main(["--bundle", "toy", "--modes", "ar,d3d-seq", "--prompt", "@" + str(f), "--n", "3", "--max-new-tokens", "8",
                       "--peers", "none", "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    assert {r["id"] for r in res["rows"]} == {"r0", "r1", "r2"} and {r["dataset"] for r in res["rows"]} == {"prompt"}
    sp = res["speedup_spread"]["prompt"]["d3d-seq"]
    assert sp["n"] == 3 and sp["min"] <= sp["median"] <= sp["max"]
    assert "speedup per prompt" in capsys.readouterr().out
