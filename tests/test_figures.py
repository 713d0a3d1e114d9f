"""Every figure builder is a pure function of stored traces (no browser, no model)."""

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from app import figures
from app.tokens import column_html, legend_html
from d3d_core.decoding.trace import traces_from_json

FIX = Path(__file__).parent / "fixtures" / "toy_traces.json"


@pytest.fixture(scope="module")
def traces():
    return traces_from_json(FIX.read_text())


@pytest.fixture(scope="module")
def pieces(traces):
    from d3d_core.models.tokenizer import CharTokenizer

    tok = CharTokenizer()
    return {i: s for i, s in enumerate(tok.itos)}


def test_timeline_has_bars_with_base_for_every_span(traces):
    fig = figures.timeline_figure(traces)
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert sum(len(b.x) for b in bars) == sum(len(t.spans) for t in traces)
    for b in bars:
        assert b.orientation == "h" and b.base is not None
    names = {b.name for b in bars}
    assert {"verify (target)", "packed draft (during verify)", "prefill"} <= names
    marks = [t for t in fig.data if isinstance(t, go.Scatter)]
    async_tr = [t for t in traces if t.mode == "d3d-async"][0]
    assert sum(len(m.x) for m in marks) == len(async_tr.rounds) - 1  # one ✓ or ✗ per round but the last (no next block needed)
    assert fig.layout.xaxis.type != "date"
    lanes = set(fig.layout.yaxis.categoryarray)
    assert "ar · target" in lanes and "ar · drafter" not in lanes and "d3d-async · drafter" in lanes


def test_timeline_summary(traces):
    df = figures.timeline_summary(traces)
    assert isinstance(df, pd.DataFrame) and list(df["mode"]) == ["ar", "dflash", "d3d-seq", "d3d-async"]
    row = df[df["mode"] == "d3d-async"].iloc[0]
    assert row["overlap share"].endswith("%")


def test_acceptance_histogram(traces):
    fig = figures.acceptance_figure(traces)
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert len(bars) == 3  # ar is never drafted
    for b, t in zip(bars, traces[1:]):
        assert abs(sum(b.y) - 1.0) < 1e-9
        assert f"{t.stats.tau:.2f}" in b.name
    assert len(fig.layout.shapes) == 3  # τ lines


def test_rounds_grid_states(traces, pieces):
    tr = traces[3]
    fig = figures.rounds_grid_figure(tr, pieces)
    hm = fig.data[0]
    assert len(hm.z) == len(tr.rounds)
    B = 4
    for r, row in zip(tr.rounds, hm.z):
        assert len(row) == B + 1
        assert row[0] == figures.STATE_ANCHOR and row[-1] == figures.STATE_BONUS
        assert list(row[1 : 1 + r.accepted]) == [figures.STATE_ACCEPTED] * r.accepted
        if r.accepted < B - 1:
            assert row[1 + r.accepted] == figures.STATE_MISMATCH
    part = figures.rounds_grid_figure(tr, pieces, upto=2)
    assert len(part.data[0].z) == 3


def test_rounds_grid_marks_rounds_the_draft_gate_skipped(pieces):
    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode
    from d3d_core.decoding.plan import CostModel
    from d3d_core.models.bundles import get_bundle

    costly = CostModel(widths=(1, 8), verify=(1.0, 2.0), draft=(("d3d", 2.0),), source="test")
    tr = decode(get_bundle("toy"), "the cat", DecodeConfig(mode="d3d-seq", block_size=4, max_new_tokens=30, stop_at_eos=False), costs=costly)
    hm = figures.rounds_grid_figure(tr, pieces).data[0]
    skipped = [i for i, r in enumerate(tr.rounds) if r.draft_source == "skipped"]
    assert skipped
    for i in skipped:
        assert list(hm.z[i][:2]) == [figures.STATE_ANCHOR, figures.STATE_SKIPPED] and hm.text[i][1] == "no draft"
        assert "draft gate" in hm.hovertext[i][1] and f"{tr.rounds[i].gate_rate:.2f}" in hm.hovertext[i][1]
    assert all(row[1] != figures.STATE_SKIPPED for i, row in enumerate(hm.z) if i not in skipped)


def test_hypotheses_table(traces, pieces):
    tr = traces[3]
    df = figures.hypotheses_table(tr, 0, pieces)
    assert len(df) == len(tr.rounds[0].hypotheses) == 8
    assert figures.hypotheses_table(traces[1], 0, pieces).empty


def test_pruning_figures():
    curve = {"layers": 3, "order": [2, 0], "curve": [
        {"removed": 0, "kept": [0, 1, 2], "tau": 3.0, "tau_rel": 1.0},
        {"removed": 1, "kept": [0, 1], "tau": 2.98, "tau_rel": 0.993},
        {"removed": 2, "kept": [1], "tau": 2.0, "tau_rel": 0.667}],
        "marginal_cost": {"0": 0.5, "1": 1.0, "2": 0.02}}
    f = figures.pruning_curve_figure(curve, live=(1, 2.9))
    assert list(f.data[0].y) == [3.0, 2.98, 2.0] and f.data[1].name == "your selection"
    m = figures.marginal_cost_figure(curve)
    assert list(m.data[0].x) == ["L0", "L1", "L2"]
    assert figures.pruning_curve_figure(None).layout.annotations  # a message instead of an empty plot


def test_pruning_curve_shows_held_out_and_healed_points():
    pts = [{"removed": k, "kept": list(range(k, 3)), "tau": t, "tau_rel": t / 3.0, "tau_eval": e, "tau_eval_rel": e / 2.5}
           for k, t, e in ((0, 3.0, 2.5), (1, 2.7, 2.2), (2, 2.0, 1.6))]
    pts[1]["healed"] = {"steps": 150, "lr": 1e-4, "tau": 3.05, "tau_rel": 0.98, "tau_eval": 2.6, "tau_eval_rel": 0.991}
    curve = {"layers": 3, "order": [0, 1], "curve": pts, "marginal_cost": {"0": 0.3, "1": 0.5, "2": 0.6},
             "heal_control": {"steps": 150, "tau": 3.1, "tau_eval": 2.62}, "heal_reference": "heal_control"}
    f = figures.pruning_curve_figure(curve)
    names = [d.name for d in f.data]
    assert names == ["greedy pruning", "held-out prompts", "healed, held-out (150 fine-tune steps)", "unpruned + same fine-tune (control), held-out"]
    assert list(f.data[1].y) == [2.5, 2.2, 1.6] and list(f.data[2].y) == [2.6] and list(f.data[2].customdata[0]) == [0.991, ""]
    assert list(f.data[3].y) == [2.62] and f.data[2].error_y.array is None  # no interval measured: no bars
    # the dotted line the healed point must reach: 99 % of the control's held-out τ
    assert any(abs(s.y0 - 0.99 * 2.62) < 1e-9 for s in f.layout.shapes)
    # held-out intervals become error bars in τ units (interval of τ/ref × ref) and enter the hover text
    for p, ci in zip(pts, ([1.0, 1.0], [0.85, 0.91], [0.6, 0.7])):
        p["tau_eval_rel_ci"] = ci
    pts[1]["healed"]["tau_eval_rel_ci"] = [0.97, 1.01]
    f = figures.pruning_curve_figure(curve)
    assert f.data[1].name == "held-out prompts (bars: 95 % CI)"
    assert abs(f.data[1].error_y.array[1] - (0.91 - 2.2 / 2.5) * 2.5) < 1e-9
    assert abs(f.data[1].error_y.arrayminus[1] - (2.2 / 2.5 - 0.85) * 2.5) < 1e-9
    assert abs(f.data[2].error_y.array[0] - (1.01 - 0.991) * 2.62) < 1e-9  # the healed bar is relative to the control
    assert f.data[2].customdata[0][1] == "; 95 % CI 97.0%–101.0%"
    pts[1]["healed"]["kd_alpha"] = 0.5  # healed by distilling the unpruned drafter: the legend says so
    assert figures.pruning_curve_figure(curve).data[2].name == \
        "healed, held-out (150 fine-tune steps; α = 0.5 distillation from the unpruned drafter)"


def test_empty_figures_say_what_to_do():
    for f in (figures.timeline_figure([]), figures.acceptance_figure([]), figures.rounds_grid_figure(None, {}),
              figures.speedup_vs_block_figure(None)):
        assert f.layout.annotations and len(f.data) == 0


def test_diagrams_render():
    for f in (figures.diagram_ar(), figures.diagram_draft_verify(), figures.diagram_dflash(), figures.diagram_d3d_async(), figures.diagram_pruning()):
        assert f.layout.shapes


def test_column_html_states_and_labels(traces, pieces):
    tr = traces[3]
    h = column_html(tr, pieces, ar_time_per_token=1 / traces[0].stats.tokens_per_s)
    n_acc = sum(min(r.accepted, len(r.committed)) for r in tr.rounds)
    assert h.count('class="tok acc"') == n_acc
    assert h.count('class="tok rej"') == sum(1 for r in tr.rounds if r.accepted < len(r.draft_ids))
    assert "τ <b>1.44</b>" in h and "speedup" in h and "done:" in h
    assert 'title="' in h  # every token carries a text label
    legend = legend_html()
    for word in ("accepted", "bonus", "rejected", "pending"):
        assert word in legend


def test_column_html_replay_shows_pending(traces, pieces):
    tr = traces[2]
    v = [s for s in tr.spans if s.kind == "verify"][3]
    h = column_html(tr, pieces, t_ms=(v.t_start + v.t_end) / 2)
    assert 'class="tok pend"' in h
    before = column_html(tr, pieces, t_ms=0.0)
    assert 'class="tok' not in before.split("</style>")[1].replace('class="tok pend"', "")


def test_spaces_duration_is_sized_from_the_request():
    from app.spaces_gpu import maybe_gpu, race_duration

    assert race_duration("p", "b", ["ar"], 8, 0, 100) < race_duration("p", "b", ["ar", "dflash", "d3d-seq", "d3d-async"], 8, 0, 100)
    assert race_duration("p", "b", ["ar"], 8, 0, 10_000) == 150  # capped: the race stops at APP_RACE_SECONDS (120 s) + 30 s to start
    f = lambda: 1  # noqa: E731
    assert maybe_gpu(f) is f  # `spaces` is not installed here: the handler is left as it is


def test_bench_and_latency_check_tables():
    res = {
        "summary": [{"dataset": "gsm8k", "mode": "d3d-seq", "n": 2, "tau": 2.5, "tokens_per_s": 15.0, "speedup": 1.2,
                     "lossless_rate": 1.0, "hit_rate": None, "overlap": 0.0}],
        "latency_model": [{"dataset": "gsm8k", "mode": "d3d-seq", "measured_speedup": 1.2, "predicted_speedup": 1.5, "error": 0.25}],
        "latency_model_in_run": [{"dataset": "gsm8k", "mode": "d3d-seq", "measured_speedup": 1.2, "predicted_speedup": 1.26, "error": 0.05}],
    }
    assert list(figures.bench_table(res)["speedup"]) == [1.2]
    t = figures.latency_check_table(res)
    assert t.iloc[0]["error (probe)"] == 0.25 and t.iloc[0]["error (run)"] == 0.05
    assert figures.latency_check_table(None).empty and figures.bench_table(None).empty
    res["config"] = {"decode": {"verify": "adaptive"}}
    res["verify_compare"] = {"d3d-seq": {"adaptive": {"tau": 2.5, "speedup": 1.2, "tokens_per_s": 15.0},
                                         "full": {"tau": 2.6, "speedup": 1.05, "tokens_per_s": 13.1}}}
    t = figures.bench_table(res)
    assert list(t["mode"]) == ["d3d-seq", "d3d-seq (verify: full)"] and list(t["speedup"]) == [1.2, 1.05]  # a file from before the gate
    del res["verify_compare"]
    res["config"] = {"decode": {"verify": "adaptive", "drafting": "gated"}}
    res["plan_compare"] = {"d3d-seq": {"verify adaptive, drafting gated": {"tau": 2.5, "speedup": 1.2, "tokens_per_s": 15.0, "skipped": 0.3},
                                       "verify adaptive, drafting always": {"tau": 2.4, "speedup": 0.9, "tokens_per_s": 11.0, "skipped": 0.0}}}
    t = figures.bench_table(res)
    assert list(t["mode"]) == ["d3d-seq", "d3d-seq (verify adaptive, drafting always)"] and list(t["speedup"]) == [1.2, 0.9]


def test_block_sweep_figure_has_tau_and_speedup_panels():
    sweep = {"d3d-seq": {"2": {"tau": 1.5, "speedup": 0.9}, "8": {"tau": 2.0, "speedup": 1.1}},
             "d3d-async": {2: {"tau": 1.5, "speedup": 0.8}, 8: {"tau": 2.0, "speedup": 1.2}}}
    f = figures.speedup_vs_block_figure(sweep)
    assert [(d.name, d.xaxis) for d in f.data] == [("d3d-seq", "x"), ("d3d-seq", "x2"), ("d3d-async", "x"), ("d3d-async", "x2")]
    assert list(f.data[0].y) == [1.5, 2.0] and list(f.data[3].y) == [0.8, 1.2]


def test_bench_acceptance_figure_pools_or_picks_a_dataset():
    result = {"acceptance_hist": {"gsm8k": {"ar": {"0": 50}, "d3d-seq": {"0": 2, "3": 2}},
                                  "mbpp": {"d3d-seq": {"1": 4}, "dflash": {"0": 1}}}}
    f = figures.bench_acceptance_figure(result)
    seq = next(d for d in f.data if d.name.startswith("d3d-seq"))
    assert list(seq.y) == [0.25, 0.5, 0.0, 0.25] and "τ = 2.25" in seq.name  # pooled 8 rounds: (2·1 + 4·2 + 2·4) / 8
    assert len(f.data) == 2  # ar has no drafted tokens
    g = figures.bench_acceptance_figure(result, "gsm8k")
    assert [d.name.split(" ")[0] for d in g.data] == ["d3d-seq"] and list(g.data[0].y) == [0.5, 0, 0, 0.5]
    assert figures.bench_acceptance_figure(None).layout.annotations
    assert figures.bench_acceptance_figure(result, "aime25").layout.annotations


def test_cost_breakdown_figure_names_the_row_plan_and_the_int8_drafter():
    from d3d_core.models.bundles import asset_json

    costs = asset_json("bench", "smollm2-135m-costs.json")
    fig = figures.cost_breakdown_figure(costs)
    rows = [r for r in costs["rows"] if r["threads"] == 2]
    assert len(fig.data) == 5 and list(fig.data[0].y) == [r["forward"] for r in rows]
    plan = costs["row_plan"]["plan"]
    text = fig.layout.title.text
    assert ("int8" in text) == (costs["drafter_int8"] == "on")
    assert all(f"{m} as {p}" in text for m, p in enumerate(plan) if m and p != m)
    assert figures.row_plan_text(list(range(9))) == "" and figures.row_plan_text(None) == ""
    assert figures.row_plan_text([0, 1, 6, 3, 4, 5, 6, 7, 8]).endswith("GEMMs of 2 as 6 rows (padding that ran faster)")
