"""No measuring command loses its run (issue 32): raw results reach the disk before any summary, a failing
summary step is named, recorded in ``failed_steps`` and exits 1, and every summary copes with peers (no τ),
a mode that never drafted and an empty dataset."""

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from d3d_core.measure import bench, costs
from d3d_core.measure.latency import project_bench, validate, validate_in_run
from d3d_core.measure.rawfirst import Steps, raw_path, write_json_atomic
from d3d_core.measure.tables import table_markdown, table_text
from d3d_core.schemas import checked

FIX = Path(__file__).parent / "fixtures" / "datasets"
TINY = ["--bundle", "toy", "--data-dir", str(FIX), "--datasets", "gsm8k", "--n", "1", "--max-new-tokens", "8", "--block-size", "4",
        "--no-progress"]


# ----------------------------------------------------------------------------- the helper


def test_atomic_write_and_raw_path(tmp_path):
    assert raw_path(tmp_path / "r" / "bench.json") == tmp_path / "r" / "bench.raw.json"
    f = write_json_atomic(tmp_path / "r" / "x.json", {"a": (1, 2), "s": {3}, "p": tmp_path})
    assert json.loads(f.read_text()) == {"a": [1, 2], "s": [3], "p": str(tmp_path)}
    assert sorted(p.name for p in f.parent.iterdir()) == ["x.json"]  # no temp file left behind
    (tmp_path / "d.json").mkdir()  # a write that cannot land leaves nothing behind either
    with pytest.raises(OSError):
        write_json_atomic(tmp_path / "d.json", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "r"]


def test_steps_report_record_and_go_on(tmp_path, capsys):
    out = tmp_path / "res.json"
    steps = Steps(raw=raw_path(out))
    steps.save_raw({"rows": [1, 2]})

    def boom():
        raise RuntimeError("no τ here")

    assert steps.run("fit", boom, default=[]) == []
    with steps.step("table"):
        raise KeyError("tau")
    assert steps.run("fine", lambda: 3) == 3
    assert steps.finish(out, {"rows": [1, 2]}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: summary step 'fit' failed: RuntimeError: no τ here (at test_rawfirst.py:")
    assert err[0].endswith(f"raw results kept in {raw_path(out)}") and "step 'table' failed: KeyError: 'tau'" in err[1]
    doc = json.loads(out.read_text())
    assert [f["step"] for f in doc["failed_steps"]] == ["fit", "table"] and doc["rows"] == [1, 2]
    assert raw_path(out).is_file()  # kept when a step failed

    ok = Steps(raw=raw_path(tmp_path / "ok.json"))
    ok.save_raw({"rows": []})
    assert ok.finish(tmp_path / "ok.json", {"rows": []}) == 0
    assert not raw_path(tmp_path / "ok.json").exists() and "failed_steps" not in json.loads((tmp_path / "ok.json").read_text())


def test_a_failing_write_keeps_the_whole_result_as_raw(tmp_path, capsys):
    steps = Steps(raw=tmp_path / "r.raw.json")
    steps.save_raw({"rows": [1]})

    def refuse(o, d):
        raise ValueError("bench result: summary.0.n: missing field")

    assert steps.finish(tmp_path / "r.json", {"rows": [1], "summary": []}, write=refuse) == 1
    assert not (tmp_path / "r.json").exists()
    kept = json.loads((tmp_path / "r.raw.json").read_text())
    assert kept["summary"] == [] and kept["failed_steps"][0]["step"] == "write"
    assert "summary step 'write' failed: ValueError" in capsys.readouterr().err


# ----------------------------------------------------------------------------- summaries on awkward rows


def _row(mode, *, rounds, tau, n_tokens=9, t=1.0, skipped=0, hist=None, spans=None, hit=None, dataset="d", id_="1"):
    return {"dataset": dataset, "id": id_, "mode": mode, "n_tokens": n_tokens, "rounds": rounds, "tau": tau, "decode_time_s": t,
            "prefill_time_s": 0.1, "tokens_per_s": (n_tokens - 1) / t if t else 0.0, "target_forwards": rounds or None, "hit_rate": hit,
            "overlap": None, "lossless": True, "accepted_hist": hist or {}, "skipped_rounds": skipped, "span_ms": spans or {},
            "block_size": 4, "verify": "adaptive", "drafting": "gated"}


def _awkward_result() -> dict:
    """ar; d3d-seq drafting normally; d3d-async whose every round the draft gate skipped (τ 1, empty histogram,
    step spans only); dflash with no round at all (τ 0); both peers (τ None); and a dataset with no items."""
    rows = [
        _row("ar", rounds=8, tau=1.0, t=0.8, hist={"0": 8}, spans={"verify": {"mean": 100.0, "n": 8}}),
        _row("d3d-seq", rounds=4, tau=2.0, t=0.6, hist={"1": 4}, spans={"verify": {"mean": 120.0, "n": 4}, "draft": {"mean": 30.0, "n": 4}}),
        _row("d3d-async", rounds=8, tau=1.0, t=0.85, skipped=8, spans={"step": {"mean": 100.0, "n": 8}}),
        _row("dflash", rounds=0, tau=0.0, n_tokens=1, t=0.0),
        _row("hf-generate", rounds=0, tau=None, t=0.7),
        _row("hf-prompt-lookup", rounds=0, tau=None, t=0.5),
    ]
    datasets, modes = ["d", "empty"], ["ar", "dflash", "d3d-seq", "d3d-async", "hf-generate", "hf-prompt-lookup"]
    probe = {"ctx_len": 300, "repeats": 7, "threads": 2, "step_ms": 100.0, "verify_ms": {"1": 100.0, "4": 120.0}, "verify_1thread_ms": {"1": 150.0, "4": 190.0},
             "d3d_draft_ms": {"4": 30.0}, "dflash_draft_ms": {"4": 20.0}, "packed_ms": {"2": 60.0}, "packed_block_size": 8,
             "d3d_draft_1thread_ms": 45.0}
    return {"config": {"decode": {"block_size": 4, "hypotheses": 2, "verify": "adaptive", "drafting": "gated"}}, "rows": rows,
            "summary": bench.summarize(rows, datasets, modes), "costs": probe, "_datasets": datasets, "_modes": modes}


def test_summaries_cope_with_peers_an_undrafted_mode_and_an_empty_dataset(capsys):
    res = _awkward_result()
    datasets, modes = res.pop("_datasets"), res.pop("_modes")
    s = {(x["dataset"], x["mode"]): x for x in res["summary"]}
    assert s[("d", "hf-generate")]["tau"] is None and s[("d", "hf-generate")]["speedup"] == pytest.approx((0.8 / 8) / (0.7 / 8))
    assert s[("d", "d3d-async")]["tau"] == 1.0 and s[("d", "d3d-async")]["skipped"] == 1.0
    assert s[("d", "dflash")]["tau"] == 0.0 and s[("d", "dflash")]["speedup"] is None
    assert all(s[("empty", m)]["n"] == 0 and s[("empty", m)]["tau"] is None for m in modes)
    assert s[("average", "d3d-seq")]["n"] == 1 and s[("average", "d3d-seq")]["tau"] == 2.0  # the empty dataset adds nothing
    checked("bench result", res)

    lm = {r["mode"]: r for r in validate(res)}  # the bug of issue 32: the peers' τ None reached per_token_ms
    assert set(lm) == {"d3d-seq", "d3d-async"}  # peers and a mode with no round have nothing to model
    assert lm["d3d-seq"]["predicted_speedup"] == pytest.approx(100 / ((120 + 30) / 2))
    ir = {r["mode"]: r for r in validate_in_run(res)}
    assert set(ir) == {"d3d-seq", "d3d-async"}
    assert ir["d3d-async"]["predicted_speedup"] == pytest.approx(1.0)  # every round a step, τ 1: the model says AR's speed
    assert {r["mode"] for r in project_bench(res)} == {"d3d-seq", "d3d-async"}

    h = bench.acceptance_hists(res["rows"])
    assert h["d"]["d3d-async"] == {} and h["d"]["hf-generate"] == {} and "empty" not in h
    assert set(bench.sweep_table(res["rows"], datasets, modes[:4], [4])["d3d-seq"]) == {"4"}
    res["plan_compare"] = bench.plan_table(res["rows"], datasets, modes[:4], 4)
    res["latency_model"], res["latency_model_in_run"] = validate(res), validate_in_run(res)
    text = table_text(res["summary"])
    assert "—" in text and "hf-prompt-lookup" in text and "empty" in text
    assert "| — |" in table_markdown(res["summary"])
    res.update(machine={}, engine={})
    bench.print_result(res, 4)
    assert "latency model vs measured speedup" in capsys.readouterr().out


def test_summaries_of_a_run_with_no_rows_at_all():
    s = bench.summarize([], ["gsm8k"], ["ar", "d3d-seq", "hf-generate"])
    assert [(x["mode"], x["n"], x["tau"]) for x in s] == [("ar", 0, None), ("d3d-seq", 0, None), ("hf-generate", 0, None)]
    res = {"config": {"decode": {"block_size": 4, "hypotheses": 2, "verify": "adaptive", "drafting": "gated"}}, "rows": [], "summary": s,
           "costs": _awkward_result()["costs"]}
    assert validate(res) == [] and validate_in_run(res) == [] and project_bench(res) == [] and bench.acceptance_hists([]) == {}
    assert bench.sweep_table([], ["gsm8k"], ["ar", "d3d-seq"], [4]) == {"d3d-seq": {"4": {"tau": None, "speedup": None}}}
    assert table_text(s).count("—") >= 9


# ----------------------------------------------------------------------------- the commands


def test_bench_cost_probe_with_the_peers_finishes(tmp_path, monkeypatch):
    """Issue 32: ``--cost-probe`` with the default peers crashed in latency.validate after all its measurements."""
    monkeypatch.setattr(bench, "probe_costs", functools.partial(costs.probe_costs, repeats=1))  # the real probe, one repeat
    out = tmp_path / "b.json"
    assert bench.main(TINY + ["--modes", "ar,d3d-seq", "--cost-probe", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {r["mode"] for r in res["rows"]} == {"ar", "d3d-seq", "hf-generate", "hf-prompt-lookup"}
    assert [r["mode"] for r in res["latency_model"]] == ["d3d-seq"] and res["costs"]["step_ms"] > 0
    assert "failed_steps" not in res and not raw_path(out).exists()  # all went well: the result holds the raw rows


def test_bench_on_an_empty_dataset(tmp_path):
    out = tmp_path / "e.json"
    assert bench.main(TINY + ["--n", "0", "--modes", "ar,d3d-seq", "--peers", "none", "--out", str(out)]) == 0  # the last --n wins
    res = json.loads(out.read_text())
    assert res["rows"] == [] and [(s["mode"], s["n"]) for s in res["summary"]] == [("ar", 0), ("d3d-seq", 0)]


def test_bench_keeps_its_rows_when_a_summary_step_fails(tmp_path, monkeypatch, capsys):
    def broken(result):
        raise TypeError("'<=' not supported between instances of 'NoneType' and 'int'")

    monkeypatch.setattr(bench, "validate_in_run", broken)
    out = tmp_path / "k.json"
    assert bench.main(TINY + ["--modes", "ar,d3d-seq", "--peers", "none", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "error: summary step 'latency_model_in_run' failed: TypeError: '<=' not supported" in err
    assert f"raw results kept in {raw_path(out)}" in err
    raw = json.loads(raw_path(out).read_text())
    assert len(raw["rows"]) == 2 and raw["config"]["decode"]["block_size"] == 4 and "summary" not in raw
    res = json.loads(out.read_text())  # everything else still written
    assert [f["step"] for f in res["failed_steps"]] == ["latency_model_in_run"] and res["latency_model_in_run"] == []
    assert len(res["summary"]) == 2 and (tmp_path / "k.csv").is_file() and (tmp_path / "k.md").is_file()


def test_costs_keeps_its_rows_when_a_summary_step_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(costs, "machine_limits", lambda th, mb=256: {"threads": th, "read_gb_s": 10.0, "gemm_gflop_s": 100.0})

    def broken():
        raise OSError("/proc/cpuinfo: gone")

    monkeypatch.setattr(costs, "machine_info", broken)
    out = tmp_path / "c.json"
    assert costs.main(["--bundle", "toy", "--threads", "1", "--repeats", "1", "--widths", "2", "--crossover", "", "--out", str(out)]) == 1
    assert "error: summary step 'machine_info' failed: OSError: /proc/cpuinfo: gone" in capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["failed_steps"][0]["step"] == "machine_info" and res["machine_info"] == {} and "noisy" in res["quiet"]
    assert {r["forward"] for r in res["rows"]} >= {"step", "verify(2)"}
    assert json.loads(raw_path(out).read_text())["rows"] == res["rows"]


def test_prune_keeps_its_curve_when_a_summary_step_fails(tmp_path, monkeypatch, capsys):
    from d3d_core.training import prune

    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))  # no distill data: the built-in prompts' continuations (shorter here)
    real = prune.greedy_continuations
    monkeypatch.setattr(prune, "greedy_continuations", lambda bundle, prompts, n: real(bundle, prompts, 16))

    def broken(curve, **kw):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(prune, "best_within", broken)
    out = tmp_path / "p.json"
    assert prune.main(["--bundle", "toy", "--block-size", "4", "--stride", "4", "--out", str(out), "--calib-out", str(tmp_path / "cal.json")]) == 1
    err = capsys.readouterr().err
    assert "error: summary step 'best_99' failed: ZeroDivisionError" in err and "best within 99 %: none" in err
    raw, res = json.loads(raw_path(out).read_text()), json.loads(out.read_text())
    assert raw["curve"] == res["curve"] and res["curve"][0]["removed"] == 0 and len(res["curve"]) >= 2
    assert res["best_99"] is None and res["failed_steps"][0]["step"] == "best_99"
    assert json.loads((tmp_path / "cal.json").read_text())["seqs"]


def test_offline_tau_keeps_each_score_when_the_comparison_fails(toy, tmp_path, monkeypatch, capsys):
    from d3d_core.training import offline_tau as ot

    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    seqs = ot.greedy_continuations(toy, ["what is two plus two?", "count to ten"], 24)
    f = tmp_path / "cache" / "eval" / "toy-n2-t24.json"
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps([{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for s in seqs]))
    d = toy.drafter("d3d")
    d.save(tmp_path / "full")
    d.pruned([0]).save(tmp_path / "pruned")

    def broken(num, den, **kw):
        raise ValueError("paired_ratio_ci needs per-sequence τ of two drafters on the same sequences")

    monkeypatch.setattr(ot, "paired_ratio_ci", broken)
    out = tmp_path / "o.json"
    args = ["--bundle", "toy", "--n", "2", "--tokens", "24", "--block-size", "4", "--stride", "2", "--out", str(out)]
    assert ot.main([str(tmp_path / "full"), str(tmp_path / "pruned")] + args) == 1
    cap = capsys.readouterr()
    assert f"error: summary step 'paired interval ({tmp_path / 'pruned'})' failed: ValueError" in cap.err
    assert len(cap.out.strip().splitlines()) == 3 and "of the first)" in cap.out  # both scores printed, the ratio without its interval
    res = json.loads(out.read_text())
    assert [r["tau"] for r in res["drafters"]] == pytest.approx([ot.offline_tau(d, seqs, B=4, stride=2), ot.offline_tau(d.pruned([0]), seqs, B=4, stride=2)])
    assert res["drafters"][1]["ratio_ci95"] is None and res["failed_steps"][0]["step"].startswith("paired interval")


def test_train_keeps_its_checkpoint_when_an_evaluation_fails(toy, tmp_path, monkeypatch):
    from d3d_core.training import train as tr
    from d3d_core.training.offline_tau import greedy_continuations

    seqs = greedy_continuations(toy, ["count to ten", "say hi", "hello there"], 24)
    ex = [{"id": f"toy/{i}", "prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for i, s in enumerate(seqs)]
    real, calls = tr.offline_tau, []

    def flaky(*a, **kw):  # the evaluation before step 0 works; the ones after training steps fail
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("held-out set went missing")
        return real(*a, **kw)

    monkeypatch.setattr(tr, "offline_tau", flaky)
    cfg = replace(tr.PRESETS["toy"], steps=4, eval_every=2, ckpt_every=2)
    res = tr.train(toy, ex, cfg, tmp_path / "run", progress=False)
    assert [h["offline_tau"] is None for h in res["history"]] == [False, True, True]
    assert [f["step"] for f in res["failed_steps"]] == ["evaluate (step 2)", "evaluate (step 4)"]
    assert (tmp_path / "run" / "ckpt" / "state.json").is_file() and (tmp_path / "run" / "final" / "config.json").is_file()
    assert json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())["step"] == 4
