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
    assert row["overlap share (% of drafter busy time)"].endswith("%")


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


def test_rounds_grid_says_where_the_drawn_last_bonus_really_goes(traces, pieces):
    """The ninth reader's 9: the bonus is drawn in a last column of its own, but in the text it takes the first
    mismatch's place; the legend says so, and each bonus cell's hover names the draft it replaces (or none)."""
    tr = traces[3]
    fig = figures.rounds_grid_figure(tr, pieces)
    names = [d.name for d in fig.data[1:]]
    assert any(n.startswith("bonus") and "first mismatch's place" in n for n in names)
    for r, hov in zip(tr.rounds, fig.data[0].hovertext):
        if r.accepted < len(r.draft_ids):
            assert f"in d{r.accepted + 1}'s place" in hov[-1]
        else:
            assert "place" not in hov[-1] and "right after them" in hov[-1]


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
        # the bar it fell below is the threshold recorded with the round, never a number it exceeds
        r = tr.rounds[i]
        assert r.gate_threshold is not None and r.gate_rate < r.gate_threshold
        assert f"below the {r.gate_threshold:.2f} tokens per step a round without a draft earns here" in hm.hovertext[i][1]
    assert all(row[1] != figures.STATE_SKIPPED for i, row in enumerate(hm.z) if i not in skipped)
    # d3d-async's raised bar is named as such (a rate of 1.10 skipped beside a bar of 1.25 reads consistently)
    import dataclasses

    rounds = list(tr.rounds)
    rounds[skipped[0]] = dataclasses.replace(rounds[skipped[0]], gate_rate=1.10, gate_threshold=1.25)
    hover = figures.rounds_grid_figure(dataclasses.replace(tr, rounds=rounds), pieces).data[0].hovertext[skipped[0]][1]
    assert "lately earned 1.10 tokens per step of cost, below the 1.25 tokens per step" in hover and "raised" in hover


def test_hypotheses_table(traces, pieces):
    tr = traces[3]
    df = figures.hypotheses_table(tr, 0, pieces)
    assert len(df) == len(tr.rounds[0].hypotheses) == 8
    assert figures.hypotheses_table(traces[1], 0, pieces).empty


def test_tokens_are_written_one_way_in_the_grid_the_table_and_the_sentences(traces):
    """A space is ␣, a newline ⏎ (never "\\n"), a token without text ∅ (never a blank cell), in the Rounds grid and the
    hypotheses table alike, with a legend naming all three; a word-token of up to 12 characters is never cut with …"""
    import dataclasses

    from app import lesson

    assert figures.glyph(" cost") == "␣cost" and figures.glyph("\n") == "⏎" and figures.glyph("") == "∅"
    assert all(g in figures.GLYPH_LEGEND for g in ("␣", "⏎", "∅"))
    from d3d_core.decoding.trace import Hypothesis

    tr = traces[3]
    r = tr.rounds[0]
    word, nl, empty = 901, 902, 903  # ids the toy vocabulary does not use
    pieces = {word: " calculate", nl: "\n", empty: ""}
    r = dataclasses.replace(r, hypotheses=[Hypothesis(1, word, 0.1, [nl, empty, word], hit=False)])
    row = figures.hypotheses_table(dataclasses.replace(tr, rounds=[r, *tr.rounds[1:]]), 0, pieces).iloc[0]
    assert row["t (bonus)"] == "␣calculate"
    assert row["drafted successor block"] == "⏎ | ∅ | ␣calculate"  # no "\\n", no blank
    one = dataclasses.replace(tr, rounds=[dataclasses.replace(r, bonus=word)])
    grid = figures.rounds_grid_figure(one, pieces).data[0]
    assert grid.text[0][-1] == "␣calculate"  # the bonus cell, whole
    assert "“␣calculate”" in grid.hovertext[0][-1]
    said = lesson._show({1: " calculate", 2: "", 3: "\n", 4: " "}, [1, 2, 3, 4])
    assert said == "“calculate · ∅ · ⏎ · ␣”"  # the sentences drop a word's leading space, write ∅ and ⏎ alike
    assert "H likeliest" in figures.HYPOTHESES_NOTE and "need not add up to 1" in figures.HYPOTHESES_NOTE


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
    # and the line a held-out bar must clear is 99 % of the full drafter's held-out τ, not of its calibration τ
    lines = {a.text: s.y0 for a, s in zip(f.layout.annotations, f.layout.shapes)}
    # each says whose τ it is 99 % of: this drafter's (not the preprint's)
    assert abs(lines["99 % of this drafter's held-out τ"] - 0.99 * 2.5) < 1e-9
    assert abs(lines["99 % of this drafter's calibration τ"] - 0.99 * 3.0) < 1e-9
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


def test_the_pruning_picture_skips_what_the_shipped_curve_removes_first():
    """With a curve, the picture skips the two layers its greedy order removes first and says so; without, it says it is
    a generic picture."""
    from d3d_core import service

    def skipped(f):
        return [a.text.split("<br>")[0] for a in f.layout.annotations if a.text.endswith("<br>skipped")]

    curve = service.pruning_curve("smollm2-135m")
    f = figures.diagram_pruning(curve)
    first = [f"L{i}" for i in curve["order"][:2]]
    assert skipped(f) == sorted(first, key=lambda x: int(x[1:])) and f"removes {first[0]} first, then {first[1]}" in f.layout.title.text
    # an example of what skipping looks like, not this race's drafter (the Pruning tab starts with every layer ticked)
    assert "an example" in f.layout.title.text and "skipped here" not in f.layout.title.text
    assert "a race keeps every layer unless you race the drafter pruned" in f.layout.title.text
    g = figures.diagram_pruning({"layers": 8, "order": [6, 1]})
    assert skipped(g) == ["L1", "L6"]
    assert "generic picture" in figures.diagram_pruning().layout.title.text and len(skipped(figures.diagram_pruning())) == 2


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
    # the counters' words a screenshot cannot hover: what a hit is, and why the other modes read "–"
    assert "hit rate</b> (d3d-async)" in legend and "(a, t)" in legend and "drafted during the verify" in legend
    assert "no guessing ahead" in legend
    # the ninth reader's 7: the coloured boxes mix rejected guesses into the text; the legend points to the plain answer
    assert "plain text: the ar box" in legend and "reads as the plain answer" in legend


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
    # capped: 80 s, which times spaces' duration factor (1.5 at most) is the 120 s quota of a visitor without an account
    assert race_duration("p", "b", ["ar"], 8, 0, 10_000) == 80
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
    assert t.iloc[0]["error (probe)"] == "+25.0%" and t.iloc[0]["error (run)"] == "+5.0%"  # percentages, signed
    res["latency_model_in_run"][0]["error"] = -0.007
    assert figures.latency_check_table(res).iloc[0]["error (run)"] == "-0.7%"
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
    # a pool of datasets says what each mode's pool holds (a gate that skipped a hard dataset's rounds skews it)
    mix = f.layout.title.text
    assert "d3d-seq: gsm8k 4, mbpp 4" in mix and "dflash: mbpp 1" in mix and "pooled" not in g.layout.title.text
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
    blas = costs["row_plan"].get("blas") or []
    assert all(f"{m} as {p}" in text for m, p in enumerate(plan) if m and p != m and m not in blas)
    assert ("plain BLAS" in text) == bool(blas)
    assert figures.row_plan_text(list(range(9))) == "" and figures.row_plan_text(None) == ""
    assert figures.row_plan_text([0, 1, 6, 3, 4, 5, 6, 7, 8]).endswith("GEMMs of 2 as 6 rows (padding that ran faster)")
    assert figures.row_plan_text(list(range(9)), [1, 2, 3, 5]) == (
        "row plan measured here: GEMMs of 1–3, 5 rows on plain BLAS (faster than oneDNN here)")
    assert "2 as 6" not in figures.row_plan_text([0, 1, 6, 3, 4, 5, 6, 7, 8], [2])


# ----------------------------------------------------------------------------- issue 33, item 4: one accounting, one palette


def _colours(fig) -> set:
    """Every colour a figure paints: bar / marker / line colours of its traces and its shapes' fills."""
    out = set()

    def add(c):
        if isinstance(c, str):
            out.add(c)
        elif isinstance(c, (list, tuple)):
            for x in c:
                add(x)

    for d in fig.data:
        m = getattr(d, "marker", None)
        if m is not None:
            add(m.color)
        ln = getattr(d, "line", None)
        if ln is not None and getattr(ln, "color", None) is not None:
            add(ln.color)
        if getattr(d, "colorscale", None):
            add([c for _, c in d.colorscale])
    for sh in fig.layout.shapes or ():
        add(sh.fillcolor)
    return out


def test_one_meaning_per_colour_across_plots(traces, pieces):
    """Every colour a figure uses is in the palette (figures.PALETTE); orange only ever marks drafting the target paid
    for in the open, vermillion only a miss / rejection, and the modes own colours no work kind or verdict uses."""
    from d3d_core.models.bundles import asset_json

    costs = asset_json("bench", "smollm2-135m-costs.json")
    curve = {"curve": [{"removed": 0, "tau": 2.0, "kept": [0, 1]}, {"removed": 1, "tau": 1.9, "kept": [0]}],
             "marginal_cost": {"0": 0.2, "1": 0.01}}
    figs = {
        "timeline": figures.timeline_figure(traces), "economics": figures.economics_figure(traces),
        "acceptance": figures.acceptance_figure(traces), "rounds": figures.rounds_grid_figure(traces[3], pieces),
        "sweep": figures.speedup_vs_block_figure({"d3d-seq": {"2": {"tau": 1.5, "speedup": 0.9}}}),
        "bench_acc": figures.bench_acceptance_figure({"acceptance_hist": {"g": {"dflash": {"0": 2}, "d3d-seq": {"1": 1}}}}),
        "pruning": figures.pruning_curve_figure(curve, live=(1, 1.9), layer_ms=1.5), "marginal": figures.marginal_cost_figure(curve),
        "costs": figures.cost_breakdown_figure(costs), "d3d_async": figures.diagram_d3d_async(costs),
        "d3d_async_ideal": figures.diagram_d3d_async(None), "dflash": figures.diagram_dflash(),
        "draft_verify": figures.diagram_draft_verify(), "pruning_diagram": figures.diagram_pruning(),
        "projection": figures.projection_figure([{"mode": m, "tau": 2.0, "speedup": 1.0, "ms_per_token": 1.0}
                                                 for m in ("ar", "dflash", "d3d-seq", "d3d-async")], "p", 1.0, 0.5, 8, 4),
    }
    allowed = set(figures.PALETTE) | {"white", "#F2F2F2", "#EEEEEE", "#ffffff"}
    for name, f in figs.items():
        stray = _colours(f) - allowed
        assert not stray, f"{name} paints colours outside the palette: {stray}"
    work = {figures.BLUE, figures.ORANGE, figures.GREEN, figures.VERMILLION, figures.PURPLE}
    assert not work & set(figures.MODE_COLOURS.values())  # a mode never borrows a work kind's colour
    orange_users = [n for n, f in figs.items() if figures.ORANGE in _colours(f)]
    assert set(orange_users) <= {"timeline", "economics", "d3d_async", "d3d_async_ideal", "dflash", "draft_verify", "pruning"}
    for n in ("acceptance", "bench_acc", "sweep", "projection", "costs", "marginal"):
        assert figures.ORANGE not in _colours(figs[n]) and figures.VERMILLION not in _colours(figs[n]), n
    assert figures.KIND_COLOURS["sync_draft"] == figures.VERMILLION and "miss" in figures.PALETTE[figures.VERMILLION]


def test_texts_name_the_colours_the_plots_paint():
    from app import explain

    text = explain.QUESTIONS + "".join(explain.SECTIONS) + explain.GLOSSARY
    assert "red *sync draft*" not in text and "vermillion (red-orange) *sync draft*" in text
    assert "pale yellow" in text and figures.STATE_COLOURS[figures.STATE_HELD] == figures.PALE_YELLOW
    assert "pale blue" in text and figures.STATE_COLOURS[figures.STATE_SKIPPED] == figures.PALE_BLUE


def test_both_acceptance_histograms_count_committed_tokens(traces):
    """One convention: tokens committed per round, a + 1 (1 … B), in the race's and the bench's histogram."""
    race = figures.acceptance_figure(traces)
    assert min(race.data[0].x) == 1 and "a + 1" in race.layout.title.text
    # a round without a draft is said to count as a + 1 = 1 (not "(undrafted rounds: 1)", which read as a count)
    assert "a round without a draft counts as a + 1 = 1" in race.layout.xaxis.title.text
    assert "undrafted rounds: 1" not in race.layout.xaxis.title.text
    bench = figures.bench_acceptance_figure({"acceptance_hist": {"g": {"d3d-seq": {"0": 1, "2": 3}}}})
    assert list(bench.data[0].x) == [1, 2, 3] and list(bench.data[0].y) == [0.25, 0.0, 0.75]
    assert "a + 1" in bench.layout.title.text and "drafted rounds" in bench.layout.xaxis.title.text


def test_sweep_title_claims_nothing_its_chart_contradicts():
    f = figures.speedup_vs_block_figure({"d3d-seq": {"8": {"tau": 2.2, "speedup": 1.5}}, "d3d-async": {"8": {"tau": 2.1, "speedup": 1.1}}},
                                        "gsm8k,mt_bench")
    title = f.layout.title.text
    assert "same τ" not in title and len(title) < 60 and "gsm8k, mt_bench" in title


def test_model_vs_measured_has_no_empty_columns():
    res = {"latency_model_in_run": [{"dataset": "gsm8k", "mode": "d3d-seq", "measured_speedup": 1.2, "predicted_speedup": 1.26,
                                     "error": 0.05}]}
    t = figures.latency_check_table(res)
    assert list(t.columns) == ["dataset", "mode", "measured_speedup", "predicted (run's own costs)", "error (run)"]
    assert not t.isna().all().any()


def test_economics_table_shows_the_identities_and_short_flags(traces):
    """One column per mode (short headers: a page of seventeen quantity columns broke them mid-word), one row per
    quantity; the round's parts add up as printed, break-even τ = round / T_step, the hit rate is a percentage and
    the speedup is written as on the Race tab."""
    from d3d_core.measure import economics

    t = figures.economics_table(traces).set_index("quantity")
    assert list(t.columns) == [tr.mode for tr in traces] and all(len(c) <= 9 for c in t.columns)
    num = lambda row, m: float(t.loc[row, m])  # noqa: E731
    for m in t.columns:
        parts = num("= verify", m) + num("+ draft not hidden", m) + num("+ other", m)
        assert abs(parts - num("round (ms)", m)) < 1e-9, m  # tenths of a ms that add up as printed
        assert abs(num("round (ms)", m) / num("T_step: what ar paid per token (ms)", m) - num("break-even τ = round / T_step", m)) <= 0.011
    for e in economics.race_economics(traces):
        assert t.loc["hit rate", e.mode] == ("–" if e.hit_rate is None else f"{e.hit_rate:.0%}")
        if e.speedup is not None and not e.too_short:
            assert t.loc["speedup vs ar", e.mode] == f"{e.speedup:.2f}×"
    assert t.loc["hit rate", "d3d-async"].endswith("%")
    # ar verifies no block: its T_verify entry says it is ar's one-token step; a drafting mode's is a plain number
    verify = t.loc["T_verify(B): one verify of B tokens (ms)"]
    assert verify["ar"].endswith("(its step, B = 1)") and float(verify["d3d-seq"]) > 0
    flags = t.loc["flags", "d3d-async"]
    assert flags.startswith("⚠ timing noise") and len(flags) < 70  # the cell stays short (no truncated cell)
    clean = [tr for tr in traces if tr.mode != "d3d-async"]
    assert not any(e.flags for e in economics.race_economics(clean))
    assert "flags" not in set(figures.economics_table(clean)["quantity"])  # no flag: no always-empty row


def test_timeline_caption_states_the_cause_from_the_numbers(traces):
    cap = figures.timeline_caption(traces)
    from d3d_core.measure.economics import race_economics

    a = next(e for e in race_economics(traces) if e.mode == "d3d-async")
    # the recorded race: verify (9 ms) outlasts the packed pass (7 ms), so the caption must not blame the packed pass
    assert a.t_verify_ms > a.t_packed_ms
    assert f"verify ({a.t_verify_ms:.0f} ms) outlasts the packed pass ({a.t_packed_ms:.0f} ms)" in cap
    assert "the packed pass" in cap and "outlasts verify" not in cap
    miss = 1 - figures.hit_rate_of(next(t for t in traces if t.mode == "d3d-async"))
    assert f"{miss:.0%} of the rounds that needed a next block missed" in cap
    # and the other way round: a packed pass longer than verify is named as the cause
    import copy

    slow = copy.deepcopy(traces)
    tr = next(t for t in slow if t.mode == "d3d-async")
    for s in tr.spans:
        if s.kind == "packed_draft":
            s.t_end = s.t_start + 5 * a.t_verify_ms
    assert "outlasts verify" in figures.timeline_caption(slow)
    assert figures.timeline_caption([traces[0]]) == ""


def test_last_round_hypotheses_are_not_misses(traces, pieces):
    tr = next(t for t in traces if t.mode == "d3d-async")  # recorded before the engine left the verdict out
    last = len(tr.rounds) - 1
    assert tr.rounds[last].hit is False and tr.rounds[last].hypotheses  # as recorded
    table = figures.hypotheses_table(tr, last, pieces)
    assert set(table["hit"]) == {"not needed (the decode ended)"}
    assert figures.rounds_grid_figure(tr, pieces).data[0].y[-1].endswith(" ·")
    counted = figures.needed_verdicts(tr)
    assert len(counted) == len(tr.rounds) - 1
    assert figures.hit_rate_of(tr) == sum(bool(r.hit) for r in tr.rounds[:-1]) / (len(tr.rounds) - 1)
    assert f"{figures.hit_rate_of(tr):.0%}" in figures.timeline_summary(traces).set_index("mode").loc["d3d-async", "hit rate"]


def test_engine_gives_the_last_round_no_verdict(toy):
    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode

    tr = decode(toy, "count: 1, 2, 3", DecodeConfig(mode="d3d-async", max_new_tokens=24, block_size=4, hypotheses=4))
    assert tr.rounds[-1].hit is None and tr.rounds[-1].hypotheses  # drafted, but no next block was needed
    judged = [r for r in tr.rounds[:-1] if r.hit is not None]
    assert judged and tr.stats.hit_rate == pytest.approx(sum(r.hit for r in judged) / len(judged))


def test_rejected_newline_drafts_do_not_break_the_line():
    from d3d_core.decoding.trace import Round, Stats, Trace

    nl, a, b = 10, 1, 2
    pieces = {nl: "\n", a: "a", b: "b"}
    rounds = [Round(0, 3, a, [nl, nl], [0.5, 0.5], [b, a, a], 0, b, [b])]  # both newline drafts rejected
    tr = Trace("d3d-seq", "toy", {"block_size": 3}, "p", [1], output_ids=[a, b], first_token=a, rounds=rounds,
               stats=Stats(tau=1.0, n_rounds=1, n_tokens=2), finish_reason="length")
    body = column_html(tr, pieces).split("</style>")[1]
    assert "<br>" not in body and "⏎" in body
    committed = Trace("d3d-seq", "toy", {"block_size": 3}, "p", [1], output_ids=[a, nl], first_token=a,
                      rounds=[Round(0, 3, a, [nl], [0.5], [nl, b], 1, b, [nl, b])], stats=Stats(tau=2.0), finish_reason="length")
    assert "⏎<br>" in column_html(committed, pieces)  # a newline the output really has still breaks the line


def test_d3d_async_diagram_is_measured_or_says_ideal():
    from d3d_core.models.bundles import asset_json

    costs = asset_json("bench", "smollm2-135m-costs.json")
    row = next(r for r in costs["overlap"]["rows"] if r["depth"] == 8)
    f = figures.diagram_d3d_async(costs)
    verify = [s for s in f.layout.shapes if s.fillcolor == figures.BLUE]
    lengths = sorted({round(s.x1 - s.x0, 3) for s in verify})
    assert lengths == sorted({round(row["verify_ms"], 3), round(row["verify_1t_concurrent_ms"], 3)})  # alone vs beside the packed pass
    assert f"{row['verify_1t_concurrent_ms']:.0f} ms" in f.layout.title.text
    assert "IDEAL" in figures.diagram_d3d_async(None).layout.title.text


def test_pruning_tab_draws_what_how_it_works_promises():
    curve = {"curve": [{"removed": 0, "tau": 2.0, "kept": [0, 1]}, {"removed": 1, "tau": 1.9, "kept": [0]}]}
    f = figures.pruning_curve_figure(curve, layer_ms=1.5)
    saved = next(d for d in f.data if d.name.startswith("draft time saved"))
    assert list(saved.y) == [0.0, 1.5] and saved.yaxis == "y2"
    assert "no healed points" in f.layout.title.text
    healed = dict(curve, curve=[curve["curve"][0], dict(curve["curve"][1], healed={"tau": 1.95, "tau_rel": 0.97, "steps": 10})])
    assert "healed points: diamonds" in figures.pruning_curve_figure(healed).layout.title.text


def test_projection_puts_every_mode_at_its_own_measured_tau():
    from app.ui import project_speedups
    from d3d_core import service
    from d3d_core.measure.latency import measured_taus

    res = service.bench_result(service.app_bundle())
    taus, B, _ = measured_taus(res)
    fig, src = project_speedups("qwen3-8b on H200 (derived)", 8, 1.0, 0.4, 4, 1.0, 1.0, 1.0)
    shown = dict(zip(fig.data[0].x, fig.data[0].text))
    expect = taus or {m: 2.0 for m in ("dflash", "d3d-seq", "d3d-async")}
    for m, tau in expect.items():
        assert f"τ {min(max(tau, 1.0), 8):.2f}" in shown[m], shown
    if len(set(round(t, 2) for t in expect.values())) > 1:  # measured per mode: not one τ for all
        assert len({shown[m].split("τ ")[1].split(" ")[0] for m in expect}) > 1
    fig2, _ = project_speedups("qwen3-8b on H200 (derived)", 8, 1.2, 0.4, 4, 1.0, 1.0, 1.0)
    for m, tau in expect.items():
        assert f"τ {min(max(1.2 * tau, 1.0), 8):.2f}" in dict(zip(fig2.data[0].x, fig2.data[0].text))[m]
    assert "confound" in src


def test_dflash_layers_are_named_and_the_confound_said():
    from app import explain
    from app.tokens import drafter_confound, drafter_line, drafter_tip
    from d3d_core.decoding.trace import Trace

    dfl = Trace("dflash", "b", {}, "p", [1], drafter="DFlash drafter, 2 layers")
    d3d = Trace("d3d-seq", "b", {}, "p", [1], drafter="D3D drafter, 8 layers")
    assert drafter_line(dfl).startswith("DFlash, 2 drafter layers") and "hidden states" in drafter_line(dfl)
    assert "feature layers" in drafter_tip(dfl)  # its hover names the target layers it reads, a different count
    note = drafter_confound([dfl, d3d])
    assert "2 drafter layers" in note and "8" in note and "not a clean comparison" in note
    assert drafter_confound([d3d]) == ""
    assert "feature layers" in explain.DFLASH and "drafter layers" in explain.DFLASH and "confound" in explain.DFLASH
    from d3d_core.measure.latency import PRESETS

    assert all("DFlash 5 drafter layers" in p.assumptions for p in PRESETS.values() if "derived" in p.source)


def test_how_it_works_makes_no_unsupported_gpu_claim():
    from app import explain

    assert "costs a fraction of a verify" not in explain.DEPTH and "about one verify" in explain.DEPTH
    from d3d_core import service

    costs = service.cost_breakdown("smollm2-135m")  # the deep drafter's draft cost, from the shipped probe, not a phrase
    row = next(r for r in costs["overlap"]["rows"] if r["depth"] == 30)
    step = next(r for r in costs["rows"] if r["forward"] == "step" and r["threads"] == max(x["threads"] for x in costs["rows"]))
    assert (f"a 30-layer draft takes {row['draft_ms']:.0f} ms, {row['draft_ms'] / step['wall_ms']:.1f} one-token steps of "
            f"{step['wall_ms']:.0f} ms, a verify(8) {row['verify_ms']:.0f} ms") in explain.depth(costs)
    assert "@" not in explain.depth(costs) + explain.depth(None) and "Where the time goes" not in explain.depth(None)
    assert "Which τ is which" in explain.WHICH_TAU and "T_step" in explain.WHICH_TAU
    for term in ("**D3D**", "**DFlash**", "**block diffusion**", "MASK slots", "**teacher forcing**", "**healing**", "Q4_1", "HBM"):
        assert term in explain.WORDS, term  # the method's words, each explained once


def test_economics_bars_add_up_and_flag_instead_of_break_even(traces):
    f = figures.economics_figure(traces)
    bars = [d for d in f.data if isinstance(d, go.Bar)]
    assert [b.name for b in bars] == ["verify (target)", "draft not hidden", "other (neither lane busy)"]
    from d3d_core.measure.economics import race_economics

    for i, e in enumerate(race_economics(traces)):
        assert sum(b.x[i] for b in bars) == pytest.approx(e.per_token_ms, rel=1e-9)
    text = dict(zip(f.data[-1].y, f.data[-1].text))
    assert "⚠ implausible" in text["d3d-async"] and "break-even" not in text["d3d-async"]
    assert "break-even τ" in text["d3d-seq"]


def test_one_accounting_across_screens(traces, pieces):
    """A recorded race: every number that two screens both show is the same number — the Timeline table's target
    idle share and its caption's, the table's decode time and the Race column's "decode … s", the table's hit rate
    and the column's, and the undrafted rounds the Rounds grid marks and the economics count."""
    import re

    from app.tokens import column_html
    from d3d_core.measure.economics import race_economics

    df = figures.timeline_summary(traces).set_index("mode")
    cap = figures.timeline_caption(traces)
    ec = {e.mode: e for e in race_economics(traces)}
    for tr in traces:
        row = df.loc[tr.mode]
        if tr.mode != "ar":
            m = re.search(rf"\*\*{re.escape(tr.mode)}\*\*: the target sat idle (\d+)% of the decode \((\d+) ms\)", cap)
            assert m and f"{m.group(1)}%" == row["target idle (% of decode)"], (tr.mode, cap)
            assert abs(int(m.group(2)) - row["target idle (ms)"]) <= 0.5 + 1e-9
        col = column_html(tr, pieces, tr.mode, econ=ec.get(tr.mode))
        assert f"in {row['decode (ms)'] / 1e3:.2f} s of decode" in col, tr.mode  # the footer's "… in 8.90 s of decode"
        if row["hit rate"] != "-":
            assert f"hit rate <b>{row['hit rate']}</b>" in col, tr.mode
        grid = figures.rounds_grid_figure(tr, pieces).data[0]
        if tr.mode != "ar":
            assert sum(1 for z in grid.z if z[1] == figures.STATE_SKIPPED) == ec[tr.mode].skipped


def test_the_timelines_idle_is_the_economics_draft_not_hidden_plus_other():
    """The shipped recorded race (a real bundle's four modes, 163 tokens): the Timeline's target idle is exactly what
    the Economics section splits as draft not hidden + other, round for round. The decode window starts after the last
    prefill: d3d-seq's drafter reads the prompt after the target does (35 ms in this race), and a window that started
    at the target's prefill counted that as idle and dropped the last verify (a fresh reader found 1418.5 against
    1383.2 ms)."""
    from d3d_core import service
    from d3d_core.measure.economics import race_economics

    trs, _ = service.recorded_race("smollm2-135m")
    df = figures.timeline_summary(trs).set_index("mode")
    for e in race_economics(trs):
        v, d, o = e.round_parts_ms()
        assert abs(df.loc[e.mode]["target idle (ms)"] - (d + o) * e.rounds) <= 0.2, e.mode
        assert abs(df.loc[e.mode]["decode (ms)"] - e.decode_ms) <= 0.1, e.mode
    seq = next(t for t in trs if t.mode == "d3d-seq")
    t0, t1 = figures.decode_window(seq)
    assert abs(t1 - max(s.t_end for s in seq.spans if s.round >= 0)) < 0.5  # the window ends where the last round does


def test_the_pruning_story_is_told_with_the_curves_own_figures():
    """How it works' pruning story reads its numbers from the curves it is given (no fixed figure), says when a curve
    is missing, and gives the deep drafter's why-not only when no layer stays within 99 %."""
    from app.explain import pruning_story

    def curve(L, order, rels):
        pts = [{"removed": k, "kept": [], "tau": 2.0 * r, "tau_rel": r, "tau_eval": 1.5 * r, "tau_eval_rel": r,
                "tau_eval_rel_ci": [r - 0.02, min(1.0, r + 0.02)]} for k, r in enumerate(rels)]
        return {"layers": L, "order": order, "curve": pts}

    shallow = curve(8, [3, 4], [1.0, 0.8, 0.6])
    deep = curve(30, [3, 4], [1.0, 0.93, 0.88]) | {"draft_ms": {"ms": [40.0, 38.6, 37.2], "threads": 1}}
    s = pruning_story(shallow, deep)
    assert "layer 3, 1 of 8" in s and "keeps 80.0% of τ" in s and "layer 3, 1 of 30" in s and "93.0% held-out" in s
    assert "**0** layers can go within 99 %" in s and "Why the deep drafter" in s
    kept = curve(30, [3, 4], [1.0, 0.995, 0.97])
    s2 = pruning_story(shallow, kept)
    assert "**1** layer can go within 99 %" in s2 and "Why the deep drafter" not in s2 and "1 of 30 go within 99 %" in s2
    assert "no pruning curve is shipped (`python -m d3d_core.training.prune --drafter d3d-deep`)" in pruning_story(shallow, None)
    assert "not run on this curve" in s  # no healed point: says so
    healed = curve(30, [3, 4], [1.0, 0.93, 0.88]) | {"heal_reference": "heal_control"}
    healed["curve"][1]["healed"] = {"steps": 200, "lr": 5e-4, "kd_alpha": 0.5, "tau": 3.0, "tau_rel": 0.96, "tau_eval": 2.8,
                                    "tau_eval_rel": 0.955, "tau_eval_rel_ci": [0.93, 0.98]}
    s3 = pruning_story(shallow, healed)
    assert ("with 1 removed, 200 steps, distilling from the unpruned drafter α 0.5: 95.5% of the unpruned drafter fine-tuned "
            "alike (95 % interval 93.0%–98.0%), from 93.0% before") in s3 and "not run on this curve" not in s3


def test_column_costs_add_up_as_printed(traces, pieces):
    """The column's "per token 40 ms = verify 31 + draft not hidden 8 + other 0" must add up as printed (a student checks
    it by hand): whole ms by largest-remainder rounding, on every mode of a recorded race."""
    import re

    from app.tokens import column_html, whole_ms
    from d3d_core.measure.economics import race_economics

    assert whole_ms(39.6, [30.6, 8.6, 0.4]) == (40, [31, 9, 0])  # each rounded alone: 31 + 9 + 0 = 40 too; 30.6+8.4 cases below
    assert whole_ms(39.5, [30.5, 8.5, 0.5]) == (40, [31, 9, 0])  # alone: 30 + 8 + 0 (half to even) = 38
    assert whole_ms(100.83, [79.22, 21.46, 0.15]) == (101, [79, 22, 0])
    assert whole_ms(10.0, [3.0, 3.0, 3.0]) == (10, [3, 3, 3])  # parts that do not sum to the total: rounded alone
    ec = {e.mode: e for e in race_economics(traces)}
    for tr in traces:
        col = re.sub(r"<[^>]+>", "", column_html(tr, pieces, tr.mode, econ=ec.get(tr.mode)))
        sums = re.findall(r"(?:per token|round) (\d+) ms = verify (\d+) \+ draft(?: not hidden)? (\d+) \+ other (\d+)", col)
        assert sums, (tr.mode, col[-400:])
        # "not hidden" only where a draft can be hidden (issue 46, the ninth reader's 6): a mode that never overlaps says "draft"
        assert ("draft not hidden" in col) == (tr.mode == "d3d-async"), (tr.mode, col[-400:])
        for total, *parts in sums:
            assert int(total) == sum(map(int, parts)), (tr.mode, total, parts)


def test_a_sweep_made_with_replaced_drafters_says_what_it_is_still_good_for():
    from d3d_core import service

    sweep = {"d3d-seq": {"4": {"tau": 1.9, "speedup": 1.4}, "8": {"tau": 2.2, "speedup": 1.5}}}
    title = figures.speedup_vs_block_figure(sweep, "gsm8k", stale=True).layout.title.text
    assert "earlier drafters" in title
    # the ninth reader's 17: what the chart still shows (τ against each round's cost as B grows), then that its numbers are not today's
    assert "What it still shows" in title and "each round costs more" in title and "not today's" in title
    assert title.index("What it still shows") < title.index("earlier drafters")
    assert "earlier drafters" not in figures.speedup_vs_block_figure(sweep, "gsm8k").layout.title.text
    assert service.block_sweep_stale("smollm2-135m") == ("replaced since" in service.block_sweep_result("smollm2-135m")["note"])
    assert not service.block_sweep_stale("toy")


def test_the_how_it_works_tables_render_every_row_with_the_header_s_cells():
    """A `|` inside a cell (``<|im_end|>``) splits a Markdown table row, code span or not (a renderer then drops the
    cells past the header's): every row has as many cells as its table's header, and the end-of-answer token's row
    renders as one term and its meaning."""
    import html
    import re

    from markdown_it import MarkdownIt

    from app import explain

    for name in ("GLOSSARY", "WORDS", "QUESTIONS", "WHICH_TAU"):
        width = None
        for line in getattr(explain, name).splitlines():
            if not line.startswith("|"):
                width = None  # a table ends at its first line that is not a row
                continue
            cells = len(re.split(r"(?<!\\)\|", line.strip().strip("|")))
            width = width or cells
            assert cells == width, (name, line)
    page = MarkdownIt("commonmark").enable("table").render(explain.WORDS)
    row = next(r for r in re.findall(r"<tr>(.*?)</tr>", page, flags=re.S) if "im_end" in r)
    cells = [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
    assert len(cells) == 2 and cells[0] == "<|im_end|>", cells
    assert "end-of-answer token" in cells[1]


def test_how_it_works_says_where_its_break_even_comes_from_and_the_glossary_covers_the_bench_columns():
    from app import explain
    from d3d_core import service
    from d3d_core.measure.costs import forwards_at

    costs = service.cost_breakdown("smollm2-135m")
    by = forwards_at(costs)
    v8 = round(by["verify(8)"]["per_step"], 2)
    draft = round(next(r for r in by.values() if r["forward"].startswith("d3d draft"))["per_step"], 2)
    text = explain.intro(costs)
    assert f"{v8:.2f} + {draft:.2f} = {v8 + draft:.2f} steps" in text and f"more than {v8 + draft:.2f} tokens" in text
    assert "about" not in text.split("steps:")[1].split("tie")[0]  # the same number as the sum, not a rounded one
    assert "fp32 engine" in text and "Where the time goes" in text and "A race's own" in text
    for term in ("**skipped**", "**lossless_rate**", "**overlap share**", "the Benchmarks table's *overlap*",
                 "**machine bound**", "**score P(a,t)**"):
        assert term in explain.GLOSSARY, term
    row = next(line for line in explain.WHICH_TAU.splitlines() if line.startswith("| **d3d-seq's τ vs d3d-async's**"))
    assert "on either engine" in row and "a setting of the server" in row
