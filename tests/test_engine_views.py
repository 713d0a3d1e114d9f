"""The Benchmarks tab's engines section: pure functions of an engines run and a bench per engine."""

import pytest

from app import engine_views as ev


def _bench(ar_tps, seq_speedup):
    return {"summary": [{"dataset": "gsm8k", "mode": "ar", "tokens_per_s": ar_tps, "speedup": 1.0},
                        {"dataset": "gsm8k", "mode": "d3d-seq", "tokens_per_s": ar_tps * seq_speedup, "speedup": seq_speedup}]}


ENGINES = {"summary": {
    "runners": {"fast": {"tokens_per_s": 25.0, "step_ms": 38.0}, "int4": {"tokens_per_s": 60.0, "step_ms": 15.0},
                "llama-cpp": {"tokens_per_s": 100.0, "step_ms": None}},
    "pairs": [{"a": "fast", "b": "int4", "speed_ratio": 25 / 60, "shared_prefix_share": 0.9},
              {"a": "fast", "b": "llama-cpp", "speed_ratio": 0.25, "shared_prefix_share": 0.8},
              {"a": "int4", "b": "llama-cpp", "speed_ratio": 0.6, "shared_prefix_share": 0.95}]}}


def test_engines_table_inverts_pairs_against_fp32_and_llama():
    df = ev.engines_table(ENGINES).set_index("runner")
    int4 = df.loc[ev.RUNNER_NAMES["int4"]]
    assert int4["× fp32 ar"] == pytest.approx(2.4) and int4["× llama.cpp"] == pytest.approx(0.6)
    assert int4["tokens agreeing with fp32 ar"] == "90%"
    llama = df.loc[ev.RUNNER_NAMES["llama-cpp"]]
    assert llama["× fp32 ar"] == pytest.approx(4.0) and llama["× llama.cpp"] == 1.0
    assert ev.engines_table(None).empty


def test_speculation_figure_labels_each_bar_with_its_own_engines_speedup():
    fig = ev.speculation_by_engine_figure({"fast": _bench(25.0, 1.55), "int4": _bench(60.0, 1.2)}, ENGINES)
    bars = {b.name: b for b in fig.data if b.type == "bar"}
    assert set(bars) == {"fp32 engine", "int4 engine"}
    assert len(fig.layout.shapes) == 1  # llama.cpp's line
    assert list(bars["int4 engine"].text) == ["ar", "1.20× ar"] and list(bars["fp32 engine"].text) == ["ar", "1.55× ar"]
    assert bars["fp32 engine"].marker.pattern.shape == "/"
    assert any(t.name == "llama.cpp, plain: 100 tok/s" and t.mode == "lines" for t in fig.data)  # named in the legend, its line drawn
    empty = ev.speculation_by_engine_figure({})
    assert "no bench result" in empty.layout.annotations[0].text


def test_engines_text_states_the_measured_numbers():
    t = ev.engines_text(ENGINES, {"fast": _bench(25.0, 1.55), "int4": _bench(60.0, 1.2)})
    assert "25 tok/s" in t and "60 tok/s" in t and "2.40×" in t and "100 tok/s" in t
    assert "1.55× on fp32" in t and "1.20× on int4" in t
    assert ev.engines_text(None, {}) == "No engine comparison is shipped for this bundle."


def test_the_tab_reads_shipped_engine_runs_and_says_when_there_are_none():
    from app.ui import engines_views
    from d3d_core import service

    assert service.engine_runs("toy") == (None, {})
    text, table, fig, cprov, costs = engines_views("toy")
    assert text.startswith("No engine comparison") and table.empty and "no bench result" in fig.layout.annotations[0].text
    assert "no int4 cost table is shipped" in cprov and "No cost breakdown" in costs.layout.annotations[0].text


def test_the_int4_cost_breakdown_is_shown_beside_the_engines():
    from app.ui import engines_views
    from d3d_core import service

    shipped = service.cost_breakdown("smollm2-135m", "int4")
    assert shipped["engine"] == "int4" and service.cost_breakdown("smollm2-135m")["engine"] != "int4"
    *_, cprov, costs = engines_views("smollm2-135m")
    assert "int4 engine" in costs.layout.title.text and shipped["machine_info"]["cpu"].split(" (")[0] in cprov
    step = next(r for r in shipped["rows"] if r["forward"] == "step" and r["threads"] == 2)
    v8 = next(r for r in shipped["rows"] if r["forward"] == "verify(8)" and r["threads"] == 2)
    assert f"a step took **{step['wall_ms']:.1f} ms** and a verify of 8 rows **{v8['per_step']:.2f} steps**" in cprov  # read, not written
    bars = {t.name: t.x[list(t.y).index("step")] for t in costs.data if t.type == "bar"}
    assert sum(bars.values()) == __import__("pytest").approx(step["wall_ms"])


def test_engines_text_names_the_gap_between_the_benchs_ar_and_ar_alone():
    benches = {"fast": {"summary": [{"dataset": "average", "mode": "ar", "tokens_per_s": 20.0, "speedup": 1.0}]},
               "int4": {"summary": [{"dataset": "average", "mode": "ar", "tokens_per_s": 60.0, "speedup": 1.0}]}}
    text = ev.engines_text(ENGINES, benches)
    assert "20.0 tok/s on fp32 (-20% against the engines run's 25.0)" in text and "60.0 tok/s on int4 (+0% against" in text
    assert "smaller by that share" in text and "bench was" not in text
    noted = dict(benches, int4=dict(benches["int4"], note="measured at commit abc, before the engine got faster"))
    assert "The int4 bench was measured at commit abc, before the engine got faster." in ev.engines_text(ENGINES, noted)
    assert "against the engines run" not in ev.engines_text(ENGINES, {})


def test_every_benchmarks_section_names_its_run():
    """The sections are separate runs on several machines: the tab says which machine each came from beside this
    server's, each provenance line carries the run's settings, and a file's own note (a sweep made with drafters since
    replaced) is shown; the overlap sentence names the depths where overlapping paid, against d3d-seq, not ar."""
    from app import figures
    from d3d_core import service
    from d3d_core.measure.machine import cpu_model

    src = service.bench_sources("smollm2-135m")
    assert cpu_model() in src and "Measured bench" in src and "int4 step costs" in src and "Engines (run)" in src
    for section in ("Measured bench", "block-size sweep", "Where the time goes"):
        assert section in src
    line = service.provenance(service.bench_result("smollm2-135m"))
    assert "gsm8k, mt_bench, 10 prompts each, 128 new tokens, B 8" in line and "fp32 engine" in line
    sweep = service.provenance(service.block_sweep_result("smollm2-135m"))
    assert "B 4, 6, 8" in sweep and "⚠ measured 2026-12-04" in sweep and "replaced since" in sweep
    ov = figures.overlap_text(service.cost_breakdown("smollm2-135m"))
    assert "not against ar" in ov and "once a draft costs" not in ov
    rows = service.cost_breakdown("smollm2-135m")["overlap"]["rows"]
    paid = [str(r["depth"]) for r in rows if r["pays"]]
    assert ("paid only at drafter depth " + ", ".join(paid)) in ov or "every measured" in ov or "did not pay" in ov
    row = {"depth": 8, "verify_ms": 50.0, "draft_ms": 15.0, "draft_per_verify": 0.3, "seq_round_ms": 65.0, "async_round_ms": 73.0,
           "verify_1t_concurrent_ms": 72.0, "packed_1t_concurrent_ms": 30.0, "async_over_seq": 0.89, "pays": False}
    text = figures.overlap_text({"overlap": {"B": 8, "H": 1, "rows": [row]}})
    assert text.startswith("**Overlapping did not pay at any measured drafter depth**")
    assert "sharing the cores cost the verify 22.0 ms to hide a 15.0 ms draft — a loss" in text  # the cause, in ms
    deep = {**row, "depth": 30, "draft_ms": 48.0, "packed_1t_concurrent_ms": 100.0, "verify_1t_concurrent_ms": 90.0}
    assert "the packed pass outlasted the verify" in figures.overlap_text({"overlap": {"B": 8, "H": 1, "rows": [deep]}})
    for r in rows:  # the shipped probe's rows, each explained by its own figures (no share of a verify beside a share of a step)
        assert f"**{r['async_over_seq']:.2f}×** d3d-seq's speed" in ov and f"{r['draft_per_verify']:.0%}" not in ov


def test_one_fp32_run_feeds_both_the_measured_bench_and_the_engines_tab(monkeypatch):
    """Without a separate fp32 bench the Engines tab reads the Measured bench when it ran on the fp32 engine (one run,
    so the two tabs print the same figures), never an int4 one; a run's provenance tags its date and machine (commit on hover)."""
    from d3d_core import service

    files = {"toy.json": {"engine": {"target": "fast"}, "summary": [], "machine": {"cpu": "C", "date": "2026-12-07 13:00 UTC",
                                                                              "commit": "abc1234"}},
             "toy-int4.json": {"engine": "int4", "summary": []}}
    monkeypatch.setattr(service, "_asset_json", lambda *parts, schema=None: files.get(parts[-1]))
    _, benches = service.engine_runs("toy")
    assert benches["fast"] is files["toy.json"] and benches["int4"] is files["toy-int4.json"]
    # date, machine and engine in a compact tag; the commit on hover, not in the sentence
    line = service.provenance(files["toy.json"])
    assert '<span class="d3d-tag" title="measured at commit abc1234">2026-12-07 · C · fp32 engine</span> (' in line
    assert line.count("abc1234") == 1
    files["toy.json"]["engine"] = {"target": "int4"}
    assert "fast" not in service.engine_runs("toy")[1]
    files["toy-fp32.json"] = {"engine": "fast", "summary": [], "own": True}
    assert service.engine_runs("toy")[1]["fast"]["own"]


def test_two_runs_of_one_mode_are_told_apart_by_what_their_machines_charged():
    """The Measured bench and the Engines tab's fp32 bench read d3d-seq differently (two machines): the Benchmarks tab
    says why from the runs themselves — each run's forward over 8 tokens against one (its row plan) and its mean
    draft ms over the rows of its own plan (a compared plan's rows left out)."""
    from d3d_core import service

    run = {"engine": {"row_plan": {"forward_ms": {"1": 40.0, "8": 50.0}}}, "config": {"decode": {"verify": "adaptive", "drafting": "gated"}},
           "summary": [{"dataset": "gsm8k", "mode": "d3d-seq", "speedup": 1.3}],
           "rows": [{"dataset": "gsm8k", "mode": "d3d-seq", "verify": "adaptive", "drafting": "gated", "span_ms": {"draft": {"mean": 10.0, "n": 3}}},
                    {"dataset": "gsm8k", "mode": "d3d-seq", "verify": "adaptive", "drafting": "gated", "span_ms": {"draft": {"mean": 14.0, "n": 1}}},
                    {"dataset": "gsm8k", "mode": "d3d-seq", "verify": "adaptive", "drafting": "always", "span_ms": {"draft": {"mean": 99.0, "n": 50}}},
                    {"dataset": "mt_bench", "mode": "d3d-seq", "span_ms": {"draft": {"mean": 99.0, "n": 50}}}]}
    p = service.run_prices(run)
    assert p["fwd8_over_1"] == 1.25 and p["draft_ms"] == 11.0 and p["speedup"] == 1.3
    assert service.prices_text(p) == "d3d-seq 1.30× on gsm8k; a forward over 8 tokens cost 1.25× one token's (50.0 / 40.0 ms), a D3D draft 11.0 ms"
    assert service.run_prices(None) is None and service.run_prices({"rows": []}) is None and service.prices_text(None) == ""
    assert service.prices_text(service.run_prices(run, "d3d-seq", "mt_bench")) == "a forward over 8 tokens cost 1.25× one token's (50.0 / 40.0 ms)"
    src = service.bench_sources("smollm2-135m")
    measured, fp32 = service.bench_result("smollm2-135m"), service.engine_runs("smollm2-135m")[1].get("fast")
    if fp32 != measured:  # two runs shipped: the sentence quotes both, from the files
        assert "Why one mode reads differently in two runs" in src
        for r in (measured, fp32):
            assert service.prices_text(service.run_prices(r)) in src
    else:  # one run feeds both tabs (shipped so since 2026-12-07): no two prices to compare
        assert "Why one mode reads differently" not in src


def test_engines_text_sets_no_bench_against_an_engines_run_from_another_machine():
    """A bench from another VM is not read as a gap against this engines run (its ar is that machine's)."""
    eng = dict(ENGINES, machine={"platform": "Linux-A", "cpu": "AMD EPYC (AVX2)", "date": "2026-12-07 23:56 UTC"})
    here, there = ({"summary": [{"dataset": "average", "mode": "ar", "tokens_per_s": t, "speedup": 1.0}]} for t in (20.0, 60.0))
    here["machine"] = {"platform": "Linux-A", "cpu": "AMD EPYC (AVX2)"}
    there["machine"] = {"platform": "Linux-B", "cpu": "AMD EPYC (AVX2)", "date": "2026-12-07 16:57 UTC"}
    text = ev.engines_text(eng, {"fast": here, "int4": there})
    assert "20.0 tok/s on fp32 (-20% against the engines run's 25.0)" in text  # the fp32 bench: same machine
    assert "60.0 tok/s on int4 (a run on another machine, 2026-12-07 16:57 UTC: not set against this engines run)" in text
    assert ev.same_machine(here, eng) and not ev.same_machine(there, eng) and ev.same_machine({}, eng)

