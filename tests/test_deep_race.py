"""The Pruning tab's raced section for d3d-deep: whole and pruned benches read into one table (pure; no model)."""

from app import explain


def _bench(skip: str, tau: float, speed: float, draft: float, lossless: float = 1.0) -> dict:
    span = {"draft": {"mean": draft, "n": 10}, "verify": {"mean": 40.0, "n": 10}}
    rows = [{"mode": "ar", "dataset": "gsm8k", "span_ms": {"step": {"mean": 25.0, "n": 100}}},
            {"mode": "d3d-seq", "dataset": "gsm8k", "span_ms": span}, {"mode": "d3d-async", "dataset": "gsm8k", "span_ms": span}]
    summary = [{"dataset": "average", "mode": m, "tau": tau, "speedup": speed, "lossless_rate": lossless} for m in ("d3d-seq", "d3d-async")]
    return {"config": {"skip_layers": skip}, "rows": rows, "summary": summary}


def test_deep_race_table_names_the_pruned_layers_and_what_removing_them_bought():
    text = explain.deep_race_text([_bench("", 3.0, 1.10, 50.0), _bench("3", 2.8, 1.15, 48.0)], "Measured on X")
    assert "| all 30 layers | d3d-seq | 3.00 | 1.10× | 50.0 | 40.0 | 100% |" in text
    assert "| without L3 | d3d-async | 2.80 | 1.15× | 48.0 | 40.0 | 100% |" in text
    assert "d3d-seq: a draft 50.0 → 48.0 ms (4% less), τ 3.00 → 2.80, speed 1.10× → 1.15× ar" in text
    assert text.endswith("Measured on X")
    several = explain.deep_race_text([_bench("", 3.0, 1.1, 50.0), _bench("3,27", 2.5, 1.0, 46.0, 0.95)])
    assert "| without L3, L27 | d3d-seq | 2.50 | 1.00× | 46.0 | 40.0 | 95% |" in several


def test_no_deep_bench_says_nothing_and_a_mode_missing_is_left_out():
    assert explain.deep_race_text([]) == ""
    b = _bench("", 3.0, 1.1, 50.0)
    b["summary"] = [s for s in b["summary"] if s["mode"] == "d3d-seq"]
    rows = explain.deep_race([b])
    assert [r["mode"] for r in rows] == ["d3d-seq"] and rows[0]["step_ms"] == 25.0


def test_how_it_works_tells_what_racing_the_pruned_deep_drafter_changed():
    curve = {"layers": 30, "order": [3], "curve": [{"removed": 0, "tau": 3.3, "tau_rel": 1.0, "tau_eval": 2.9, "tau_eval_rel": 1.0},
                                                  {"removed": 1, "tau": 3.1, "tau_rel": 0.94, "tau_eval": 2.7, "tau_eval_rel": 0.92}]}
    s = explain.pruning_story(None, curve, [_bench("3", 2.8, 0.90, 48.0), _bench("", 3.0, 0.85, 50.0)])
    assert "`d3d-seq` 0.85× → **0.90×** `ar` (τ 3.00 → 2.80, a draft 50.0 → 48.0 ms)" in s and "without layer(s) 3" in s
    assert "**Raced**" not in explain.pruning_story(None, curve)


def test_the_deeper_drafter_section_quotes_the_shipped_deep_bench_beside_the_same_engines_bench():
    whole = _bench("", 2.9, 0.80, 50.0) | {"machine": {"cpu": "AMD EPYC (AVX2)", "date": "2026-12-07 16:00 UTC"}}
    whole["config"]["engine"] = "int4"
    eight = {"summary": [{"dataset": "average", "mode": "d3d-seq", "tau": 1.1, "speedup": 0.91}]}
    s = explain.depth(None, [_bench("3", 2.7, 0.82, 48.0), whole], eight)
    assert "AMD EPYC (AVX2), int4 engine, 2026-12-07) `d3d-seq` with it reached τ **2.90** (the mean over its datasets)" in s
    assert "ran at **0.80×** `ar`, `d3d-async` 0.80×" in s and "the 8-layer drafter's `d3d-seq` reached τ 1.10 and 0.91×" in s
    assert "(also the mean over its datasets)" in s  # both τ compared are the same kind of average
    assert "@" not in s and "In its bench" not in explain.depth(None)
    # the probe's depth-30 ratio is quoted as measured (a reader compared it with the Benchmarks tab's), or not at all
    assert "overlap probe reads" not in s
    probe = {"overlap": {"B": 8, "rows": [{"depth": 30, "draft_ms": 77.0, "verify_ms": 105.0, "async_over_seq": 1.126}]}}
    assert "a 30-layer async round at 1.13× d3d-seq's speed" in explain.depth(probe, [whole], eight)
    # "one draft of 8" read as 8 tokens or 8 layers (the ninth reader's 21): the probe's draft is of a block of B tokens
    slow = _bench("", 2.9, 0.80, 168.0)
    assert "a draft in that bench took 168 ms, more than the probe's one draft of a block of 8 tokens (77 ms)" in explain.depth(probe, [slow])
    assert "draft of 8," not in explain.depth(probe, [slow])


def test_a_pruned_draft_that_read_slower_is_not_called_a_saving():
    text = explain.deep_race_text([_bench("", 3.0, 1.0, 50.0), _bench("3", 2.9, 1.0, 55.0)])
    assert "a draft 50.0 → 55.0 ms (10% more, although layers were removed)" in text and "-10%" not in text


def test_pruning_says_what_the_saved_ms_do_to_the_rounds_break_even_tau():
    costs = {"rows": [{"forward": "step", "threads": 2, "wall_ms": 50.0}, {"forward": "verify(8)", "threads": 2, "wall_ms": 75.0},
                      {"forward": "step", "threads": 1, "wall_ms": 90.0}]}
    s = explain.pruning_round(costs, 25.0, 2.5, 2, "a draft")
    # round 25 + 75 = 100 ms = 2.00 steps; without 2 layers 95 ms = 1.90 steps: break-even τ 5.0 % lower
    assert "saves about **5.0 ms per draft** (20% of a draft's 25 ms, 2.5 ms a layer)" in s
    assert "goes from 2.00 to 1.90 steps of 50 ms, its **break-even τ** falls 5.0%" in s
    assert explain.pruning_round(costs, 25.0, 2.5, 0) == "" and explain.pruning_round(None, 25.0, 2.5, 1) == ""


def test_the_gate_explains_why_the_pruned_deep_drafters_tau_fell_more_than_its_speed():
    """The eighth reader's 18: τ fell 12 % but speed 1 %. The rows say why: the gate skipped more rounds (each counts 1 in
    τ and is an ar step), while τ per drafted round fell less; said from the bench's own per-prompt rows."""
    def rows(skipped, tau_drafted):  # one prompt's d3d-seq row: 100 rounds, `skipped` of them undrafted
        tau = (skipped + (100 - skipped) * tau_drafted) / 100
        return {"mode": "d3d-seq", "dataset": "gsm8k", "rounds": 100, "skipped_rounds": skipped, "tau": tau, "span_ms": {}}

    whole, pruned = _bench("", 1.5, 0.93, 168.0), _bench("3", 1.35, 0.92, 166.0)
    whole["rows"].append(rows(75, 3.0))
    pruned["rows"].append(rows(82, 2.9))
    text = explain.deep_race_text([whole, pruned])
    assert "the draft gate skipped 75% → 82% of `d3d-seq`'s rounds" in text and "τ went only 3.00 → 2.90" in text
    assert "the mean of its datasets' rows" in text and "pooled over its prompts" not in text
    curve = {"layers": 30, "order": [3], "curve": [{"removed": 0, "tau": 3.3, "tau_rel": 1.0, "tau_eval": 2.9, "tau_eval_rel": 1.0},
                                                  {"removed": 1, "tau": 3.1, "tau_rel": 0.94, "tau_eval": 2.7, "tau_eval_rel": 0.92}]}
    assert "skipped 75% → 82%" in explain.pruning_story(None, curve, [whole, pruned])
    # without the per-prompt rows nothing is claimed
    assert "Why τ fell" not in explain.deep_race_text([_bench("", 3.0, 1.1, 50.0), _bench("3", 2.8, 1.15, 48.0)])
