"""The latency model on synthetic costs matches hand-computed values."""

import pytest

from d3d_core.measure.latency import PRESETS, CostProfile, async_profile, contention, per_token_ms, profile_from_breakdown, profile_from_probe, speedup, tau_from_hist, validate

P = CostProfile(name="synthetic", source="test", assumptions="round numbers", t_step_ms=10.0,
                t_verify_ms={1: 10.0, 8: 14.0, 16: 18.0}, t_draft_d3d_ms={8: 4.0, 16: 6.0}, t_draft_dflash_ms={8: 2.0, 16: 3.0},
                t_packed_ms={1: 5.0, 4: 8.0, 8: 16.0}, packed_block=8)


def test_hand_computed_values():
    assert per_token_ms(P, "ar", 8, 1.0) == 10.0
    assert per_token_ms(P, "dflash", 8, 4.0) == pytest.approx((2 + 14) / 4)
    assert per_token_ms(P, "d3d-seq", 8, 4.0) == pytest.approx((4 + 14) / 4)
    # async: max(verify 14, packed 8) + miss 25 % x draft 4 = 15 ms per round
    assert per_token_ms(P, "d3d-async", 8, 3.0, hit_rate=0.75, H=4) == pytest.approx(15 / 3)
    # packed pass longer than verify: max(14, 16) + 0 = 16
    assert per_token_ms(P, "d3d-async", 8, 2.0, hit_rate=1.0, H=8) == pytest.approx(8.0)
    assert speedup(P, "d3d-seq", 8, 4.0) == pytest.approx(10 / 4.5)


def test_interpolation_and_extrapolation():
    assert P.at(P.t_verify_ms, 4) == pytest.approx(10 + 4 * 3 / 7)
    assert P.at(P.t_verify_ms, 32) == pytest.approx(18 + 4 / 8 * 16)
    assert P.at(P.t_draft_d3d_ms, 2) == 4.0


def test_scaled_profile():
    s = P.scaled(verify=2.0)
    assert per_token_ms(s, "dflash", 8, 1.0) == 2 + 28


def test_tau_from_histogram():
    assert tau_from_hist({"0": 2, "3": 2}) == pytest.approx(2.5)


def test_presets_are_documented_and_sane():
    for name, p in PRESETS.items():
        assert p.source and p.assumptions
        assert p.t_step_ms > 0
        assert p.at(p.t_verify_ms, 8) >= p.t_step_ms * 0.99
    h200, h100 = PRESETS["qwen3-8b on H200 (derived)"], PRESETS["qwen3-8b on H100 (derived)"]
    assert h200.t_step_ms < h100.t_step_ms  # more bandwidth, faster step


def test_validate_against_a_bench_result():
    costs = {"ctx_len": 300, "threads": 2, "step_ms": 10.0, "verify_ms": {"1": 10.0, "8": 14.0}, "verify_1thread_ms": {"1": 12.0, "8": 20.0},
             "d3d_draft_ms": {"8": 4.0}, "dflash_draft_ms": {"8": 2.0}, "packed_ms": {"4": 8.0}, "packed_block_size": 8,
             "d3d_draft_1thread_ms": 6.0}
    result = {"config": {"decode": {"block_size": 8, "hypotheses": 4}}, "costs": costs, "summary": [
        {"dataset": "d", "mode": "ar", "tau": 1.0, "speedup": 1.0},
        {"dataset": "d", "mode": "d3d-seq", "tau": 3.0, "speedup": 1.5, "hit_rate": None},
        {"dataset": "d", "mode": "d3d-async", "tau": 3.0, "speedup": 1.2, "hit_rate": 0.5}]}
    rows = {r["mode"]: r for r in validate(result)}
    assert rows["d3d-seq"]["predicted_speedup"] == pytest.approx(10 / ((4 + 14) / 3))
    # async on 1 thread per lane: verify 20, draft 6: (max(20, 8) + 0.5 * 6) / 3
    assert rows["d3d-async"]["predicted_speedup"] == pytest.approx(10 / (23 / 3))
    assert rows["d3d-seq"]["error"] == pytest.approx(rows["d3d-seq"]["predicted_speedup"] / 1.5 - 1)
    assert async_profile(profile_from_probe(costs)).t_verify_ms[8] == 20.0


def test_contention_from_a_concurrent_probe():
    """verify and the packed pass measured running together: the async round uses those costs."""
    costs = {"ctx_len": 300, "threads": 2, "step_ms": 10.0, "verify_ms": {"1": 10.0, "8": 14.0}, "verify_1thread_ms": {"1": 12.0, "8": 20.0},
             "d3d_draft_ms": {"8": 4.0}, "dflash_draft_ms": {"8": 2.0}, "packed_ms": {"1": 6.0, "4": 8.0}, "packed_block_size": 8,
             "d3d_draft_1thread_ms": 6.0,
             "concurrent_ms": {"1": {"verify": 22.0, "packed": 6.0, "round": 22.5}, "4": {"verify": 25.0, "packed": 12.0, "round": 25.5}}}
    c = contention(costs)
    assert c[4] == pytest.approx({"verify": 1.25, "packed": 1.5})
    assert c[1]["packed"] == 1.0  # never below 1: running alone is the floor
    p = async_profile(profile_from_probe(costs))
    # H = 4: max(20 × 1.25, 8 × 1.5) + miss 50 % × draft 6 = 28 ms per round, τ 2
    assert per_token_ms(p, "d3d-async", 8, 2.0, hit_rate=0.5, H=4) == pytest.approx(28 / 2)
    # H = 2 interpolates the factors between H = 1 and H = 4
    cv = 1.1 + (1.25 - 1.1) / 3
    assert per_token_ms(p, "d3d-async", 8, 1.0, hit_rate=1.0, H=2) == pytest.approx(20 * cv)
    # sequential modes run alone: no contention
    assert per_token_ms(p, "d3d-seq", 8, 1.0) == pytest.approx(20 + 6)
    # a what-if scaling keeps the factors
    assert per_token_ms(p.scaled(verify=2.0), "d3d-async", 8, 1.0, hit_rate=1.0, H=4) == pytest.approx(50.0)


def test_in_run_validation_uses_the_runs_own_span_costs():
    from d3d_core.measure.latency import validate_in_run

    sp = lambda n=10, **kw: {k: {"mean": v, "n": n} for k, v in kw.items()}  # noqa: E731
    rows = [
        {"dataset": "d", "mode": "ar", "block_size": 8, "rounds": 10, "span_ms": sp(verify=80.0)},
        {"dataset": "d", "mode": "d3d-seq", "block_size": 8, "rounds": 10, "span_ms": sp(draft=40.0, verify=100.0)},
        {"dataset": "d", "mode": "d3d-async", "block_size": 8, "rounds": 10,
         "span_ms": {**sp(sync_draft=50.0, n=5), **sp(packed_draft=90.0, verify=120.0)}},
        {"dataset": "d", "mode": "d3d-seq", "block_size": 4, "rounds": 10, "span_ms": sp(draft=1.0, verify=1.0)},  # sweep row: ignored
    ]
    summary = [
        {"dataset": "d", "mode": "ar", "tau": 1.0, "speedup": 1.0},
        {"dataset": "d", "mode": "d3d-seq", "tau": 2.8, "speedup": 1.5},
        {"dataset": "d", "mode": "d3d-async", "tau": 3.0, "speedup": 1.6, "hit_rate": 0.5},
    ]
    res = {r["mode"]: r for r in validate_in_run({"config": {"decode": {"block_size": 8}}, "rows": rows, "summary": summary})}
    assert set(res) == {"d3d-seq", "d3d-async"}
    assert res["d3d-seq"]["predicted_speedup"] == pytest.approx(80 / (140 / 2.8))  # 1.6
    assert res["d3d-async"]["predicted_speedup"] == pytest.approx(80 / ((120 + 0.5 * 50) / 3.0))  # 5 misses in 10 rounds
    assert res["d3d-seq"]["error"] == pytest.approx((1.6 - 1.5) / 1.5)


def test_in_run_validation_prices_rounds_the_draft_gate_skipped_as_steps():
    from d3d_core.measure.latency import validate_in_run

    rows = [
        {"dataset": "d", "mode": "ar", "block_size": 8, "rounds": 10, "span_ms": {"verify": {"mean": 50.0, "n": 10}}},
        {"dataset": "d", "mode": "d3d-seq", "block_size": 8, "rounds": 10, "verify": "adaptive", "drafting": "gated",
         "span_ms": {"step": {"mean": 50.0, "n": 6}, "verify": {"mean": 60.0, "n": 4}, "draft": {"mean": 20.0, "n": 4}}},
        {"dataset": "d", "mode": "d3d-seq", "block_size": 8, "rounds": 10, "verify": "adaptive", "drafting": "always",  # another plan
         "span_ms": {"verify": {"mean": 1.0, "n": 10}, "draft": {"mean": 1.0, "n": 10}}},
    ]
    summary = [{"dataset": "d", "mode": "ar", "tau": 1.0, "speedup": 1.0}, {"dataset": "d", "mode": "d3d-seq", "tau": 1.8, "speedup": 1.4}]
    dec = {"block_size": 8, "verify": "adaptive", "drafting": "gated"}
    (res,) = validate_in_run({"config": {"decode": dec}, "rows": rows, "summary": summary})
    assert res["predicted_speedup"] == pytest.approx(50 / ((4 * (60 + 20) + 6 * 50) / 10 / 1.8))


def test_project_bench_uses_measured_tau_per_profile():
    from d3d_core.measure.latency import project_bench

    res = {"config": {"decode": {"block_size": 8, "hypotheses": 4}},
           "summary": [{"dataset": "average", "mode": "ar", "tau": 1.0},
                       {"dataset": "average", "mode": "d3d-seq", "tau": 3.0, "hit_rate": None}]}
    p = PRESETS["qwen3-8b on H200 (derived)"]
    rows = project_bench(res, {"h200": p})
    assert len(rows) == 1 and rows[0]["projected_speedup"] == pytest.approx(speedup(p, "d3d-seq", 8, 3.0))


def test_projection_skips_peers_without_tau():
    from d3d_core.measure.latency import project_bench

    res = {"config": {"decode": {"block_size": 8, "hypotheses": 4}},
           "summary": [{"dataset": "gsm8k", "mode": "ar", "tau": 1.0}, {"dataset": "gsm8k", "mode": "d3d-seq", "tau": 2.0},
                       {"dataset": "gsm8k", "mode": "hf-generate", "tau": None}]}
    rows = project_bench(res)
    assert rows and {r["mode"] for r in rows} == {"d3d-seq"}


def test_projection_uses_the_always_drafting_rows_of_a_gated_table():
    """A gated table's τ counts undrafted rounds as 1; the profiles model rounds that all draft, so the same run's
    drafting-always τ and hit rate are projected when the bench measured them."""
    from d3d_core.measure.latency import project_bench

    res = {"config": {"decode": {"block_size": 8, "hypotheses": 4, "verify": "adaptive", "drafting": "gated"}},
           "summary": [{"dataset": "average", "mode": "d3d-async", "tau": 1.1, "hit_rate": 0.2, "speedup": 1.0}],
           "plan_compare": {"d3d-async": {"verify adaptive, drafting always": {"tau": 1.6, "hit_rate": 0.3, "speedup": 0.7},
                                          "verify adaptive, drafting gated": {"tau": 1.1, "hit_rate": 0.2, "speedup": 1.0}}}}
    rows = project_bench(res)
    assert rows and all(r["tau"] == 1.6 and r["hit_rate"] == 0.3 for r in rows)
    del res["plan_compare"]
    assert all(r["tau"] == 1.1 for r in project_bench(res))  # no comparison measured: the table's own


def _row(forward, threads, B, ms):
    return {"forward": forward, "threads": threads, "B": B, "wall_ms": ms}


def test_profile_from_breakdown_reads_the_cost_rows():
    rows = [_row("step", 2, 1, 40.0), _row("verify(4)", 2, 4, 50.0), _row("verify(8)", 2, 8, 60.0),
            _row("d3d draft(8)", 2, 8, 18.0), _row("dflash draft(8)", 2, 8, 6.0),
            _row("d3d packed(H=1)", 2, 8, 24.0), _row("d3d packed(H=4)", 2, 8, 43.0),
            _row("step", 1, 1, 55.0), _row("verify(8)", 1, 8, 100.0), _row("d3d draft(8)", 1, 8, 28.0),
            _row("d3d packed(H=1)", 1, 8, 35.0)]
    overlap = {"B": 8, "H": 1, "rows": [{"depth": 8, "verify_1t_concurrent_ms": 110.0, "packed_1t_concurrent_ms": 42.0}]}
    p = profile_from_breakdown({"rows": rows, "overlap": overlap, "ctx_len": 300, "repeats": 5,
                                "machine_info": {"cpu": "Some CPU"}, "quiet": {"noisy": False}})
    assert p.name == "Some CPU 2-thread (measured)" and "quiet machine" in p.source
    assert p.t_step_ms == 40.0 and p.t_verify_ms == {1: 40.0, 4: 50.0, 8: 60.0}
    assert p.t_draft_d3d_ms[2] == p.t_draft_d3d_ms[16] == 18.0  # one probed width stands for every B
    assert p.t_packed_ms == {1: 24.0, 4: 43.0}
    assert p.extra["verify_1thread_ms"] == {1: 55.0, 8: 100.0} and p.extra["d3d_draft_1thread_ms"] == 28.0
    assert p.extra["contention"][1] == pytest.approx({"verify": 1.1, "packed": 1.2})
    assert profile_from_breakdown({"rows": rows[:2]}) is None  # no drafter rows: no profile
    assert profile_from_breakdown({}) is None


def test_cpu_preset_is_the_shipped_cost_breakdown():
    from d3d_core.models.bundles import asset_json

    costs = asset_json("bench", "smollm2-135m-costs.json")
    measured = [p for p in PRESETS.values() if p.measured and not p.extra.get("gpu")]  # GPU profiles from docs/gpu/ are measured too
    assert len(measured) == 1
    step = next(r["wall_ms"] for r in costs["rows"] if r["forward"] == "step" and r["threads"] == 2)
    assert measured[0].t_step_ms == pytest.approx(step)
    assert costs["machine_info"]["cpu"] in measured[0].name
