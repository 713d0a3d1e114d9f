"""The class demo's recorded race: scripts/record_race.py races a preset several times and keeps the median race;
the Race tab's "📼 Recorded race" opens the shipped one in every tab; the presenter view enlarges the type."""

import json
import re
import runpy

import pytest
from conftest import ROOT

from app import lesson, ui
from d3d_core import service
from d3d_core.decoding.trace import MODES
from d3d_core.measure.reading import race_load

record_race = runpy.run_path(str(ROOT / "scripts" / "record_race.py"), run_name="record_race")


@pytest.fixture(scope="module")
def toy_record():
    """Two lesson races on the toy bundle, 24 new tokens each: the dict record_race.py writes."""
    return record_race["record"]("toy", "lesson", 2, list(MODES), max_new_tokens=24, log=lambda *_: None)


def test_record_keeps_the_median_race_and_says_where_it_ran(toy_record):
    rec = toy_record
    meta = rec["recorded"]
    trs = service.read_traces(json.dumps(rec))
    assert [t.mode for t in trs] == list(MODES)
    assert all(t.output_ids == trs[0].output_ids for t in trs)  # lossless, whatever the timings
    assert trs[0].prompt_text == lesson.LESSON_PROMPT and trs[1].config["max_new_tokens"] == 24
    assert (trs[1].config["verify"], trs[1].config["drafting"]) == ("full", "always")
    assert meta["preset"] == "lesson" and meta["bundle"] == "toy" and len(meta["runs"]) == 2
    assert meta["cpu"] and meta["commit"] and meta["date"] and "--max-new-tokens 24" in meta["command"]
    seq = [run["modes"]["d3d-seq"]["speedup"] for run in meta["runs"]]
    assert seq[meta["kept"]] == min(seq)  # of two, the lower median
    assert meta["spread"]["d3d-seq"] == pytest.approx((max(seq) - min(seq)) / (sum(seq) / 2))
    for run in meta["runs"]:
        for m, r in run["modes"].items():
            assert r["reading"] == (r["why"] == "") and m != "ar"
    table = record_race["table"](meta)
    assert table.count("\n") == 4 and "← kept" in table and "spread" in table


def test_spread_of_speedups():
    spread = record_race["spread"]
    assert spread([1.0, 1.1, 1.2]) == pytest.approx(0.2 / 1.1)
    assert spread([1.0]) is None and spread([None, 1.0]) is None


def test_the_recorded_race_opens_in_every_tab(toy_record, tmp_path, monkeypatch):
    monkeypatch.setattr(service, "RACES_DIR", tmp_path)
    state = ui.empty_state()
    out = ui.open_recorded("toy", state)
    assert "No recorded race ships with bundle `toy`" in out[0] and out[-1]["traces"] == {}
    (tmp_path / "toy-lesson.json").write_text(json.dumps(toy_record), encoding="utf-8")
    out = ui.open_recorded("toy", state)
    status, cols, st = out[0], out[1:5], out[-1]
    meta = toy_record["recorded"]
    assert status.startswith("📼 **Recorded race**") and meta["date"] in status
    # a compact tag (date, machine, engine) instead of a commit in the sentence; the commit is in the tag's hover
    tag = service.run_tag(meta["date"], meta["cpu"], meta.get("cores"), f"{meta['engine']} engine" if meta.get("engine") else None,
                     meta["commit"])
    assert tag in status and f'title="measured at commit {meta["commit"]}"' in tag and meta["date"] in tag
    assert status.count(meta["commit"]) == 1
    assert "that machine's" in status and "median of 2 identical races" in status
    # the two uncertainties, told apart in short sentences: the repeated races' spread and each speedup's own range, the
    # latter's "resampled rounds" said in plain words on hover (issue 46, the ninth reader's 3)
    assert "Nothing ran here" in status and "timing noise between runs" in status
    assert "its spread over this answer's rounds</span>" in status and "resampled" not in status
    assert "drawn at random, with repeats, from this answer&#x27;s own rounds" in status
    head = re.sub(r"<[^>]+>", "", ui.recorded_note(meta))  # the note's sentences, without the hover text
    assert max(len(s) for s in re.split(r"(?<=[.)])\s", head)) < 140, head
    assert set(st["traces"]) == set(MODES) and st["pieces"] and st["run"] is None
    assert all("d3d-col" in c for c in cols)
    load = race_load(list(st["traces"].values()))
    assert load is None or load.status().split(":")[0] in status
    views = ui.race_views(st)
    assert views[6]["value"] == 0  # Rounds opens at round 0, like after a live race
    # a race in flight is not replaced, and a file that no longer reads is said, not raised
    assert "press **■ Stop** first" in ui.open_recorded("toy", dict(st, run="x"))[0]
    (tmp_path / "toy-lesson.json").write_text('{"traces": [{"mode": "nope"}]}', encoding="utf-8")
    assert ui.open_recorded("toy", state)[0].startswith("**Could not open the recorded race:**")


def test_the_shipped_recorded_race_is_a_quiet_lesson_race_of_every_mode():
    """The home bundle ships a recorded lesson race: every mode, the lesson's settings, recorded on a quiet machine,
    every mode's tokens ar's, each drafting mode with a reading."""
    home = service.app_bundle()
    got = service.recorded_race(home, "lesson")
    assert got is not None, f"assets/races/{home}-lesson.json is missing: scripts/record_race.py --out writes it"
    trs, meta = got
    p = lesson.PRESETS["lesson"]
    assert [t.mode for t in trs] == list(MODES) and meta["preset"] == "lesson"
    for t in trs:
        assert t.prompt_text == p["prompt"] and t.output_ids == trs[0].output_ids and t.finish_reason == "eos"
        assert (t.config["block_size"], t.config["verify"], t.config["drafting"]) == (p["block_size"], p["verify"], p["drafting"])
    assert not race_load(trs).busy and not any(run["busy"] for run in meta["runs"])
    assert all(meta["runs"][meta["kept"]]["modes"][m]["reading"] for m in MODES[1:])


@pytest.mark.slow
def test_the_shipped_recorded_race_is_what_the_bundle_prints_today(smollm):
    """The recorded race is not stale: ar on today's engine prints exactly its tokens."""
    from conftest import engine

    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode

    trs, _ = service.recorded_race("smollm2-135m", "lesson")
    with engine(smollm.target, "fast"):
        tr = decode(smollm, trs[0].prompt_text, DecodeConfig(mode="ar", max_new_tokens=trs[0].config["max_new_tokens"]))
    assert tr.output_ids == trs[0].output_ids


def test_presenter_view_is_wired():
    demo = ui.build_demo()
    by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    assert by_id["presenter"].value is False and "preset-recorded" in by_id
    js = [getattr(fn, "js", None) for fn in demo.fns.values()]
    assert ui.PRESENTER_JS in js and any(j and "presenter" in j and "URLSearchParams" in j for j in js)
    from app.tokens import CSS

    assert "body.d3d-presenter .d3d-col" in CSS and "body.d3d-presenter .gradio-container" in CSS


def test_identical_output_badge_is_computed_from_the_tokens():
    """The "identical output ✓" badge and the status's verdict read the tokens themselves: the shipped recorded race
    gets the badge in every drafting column; a planted wrong token, a stopped (shorter) run and a sampled race each
    read as what they are."""
    import dataclasses

    from app.tokens import agreement, column_html

    trs, _ = service.recorded_race(service.app_bundle(), "lesson")
    by = {t.mode: t for t in trs}
    ar = by["ar"]
    n = len(ar.output_ids)
    assert ar.output_ids == [ar.first_token] + [t for r in ar.rounds for t in r.committed]  # what the badge compares
    for m in MODES[1:]:
        assert agreement(by[m], ar) == ("same", f"identical output ✓ (all {n} tokens)")
        assert "identical output ✓" in column_html(by[m], {}, m, ar=ar)
    assert agreement(ar, ar) == ("", "") and agreement(by["d3d-seq"], None) == ("", "")
    assert "identical output ✓" not in column_html(by["d3d-seq"], {}, "d3d-seq")  # no ar in the race: no badge
    state = {"traces": by}
    assert ui.output_check(state) == f" · **identical output ✓** (dflash, d3d-seq, d3d-async: ar's {n} tokens)"
    # a planted wrong token in round 5 of d3d-seq
    seq = by["d3d-seq"]
    r5 = seq.rounds[5]
    pos = 1 + sum(len(r.committed) for r in seq.rounds[:5])  # its first committed token's index in the output
    bad = dataclasses.replace(r5, committed=[r5.committed[0] + 1] + list(r5.committed[1:]))
    ids = list(seq.output_ids)
    ids[pos] += 1
    planted = dataclasses.replace(seq, rounds=seq.rounds[:5] + [bad] + seq.rounds[6:], output_ids=ids)
    kind, words = agreement(planted, ar)
    assert kind == "differs" and words == f"differs from ar at token {pos + 1} of {n}"
    assert "d3d-seq: differs from ar" in ui.output_check({"traces": dict(by, **{"d3d-seq": planted})})
    # a run cut short agrees as far as it went
    m = 1 + sum(len(r.committed) for r in seq.rounds[:10])
    short = dataclasses.replace(seq, rounds=seq.rounds[:10], output_ids=seq.output_ids[:m], finish_reason="cancelled")
    assert agreement(short, ar) == ("prefix", f"identical ✓ over the {m} tokens both printed (ar {n}, d3d-seq {m})")
    # temperature > 0: not the same tokens by design
    hot = dataclasses.replace(seq, config=dict(seq.config, temperature=0.7))
    assert agreement(hot, ar)[0] == "sampled"


def test_the_timeline_says_what_the_prefill_does_to_the_whole_run():
    """Speedups count the decode only; where d3d-async's drafter prefilled beside the target (slowing its prefill), the
    Timeline caption gives the whole run, prefill included, for ar and d3d-async, from the traces' own stats."""
    from app import figures

    trs, _ = service.recorded_race("smollm2-135m")
    by = {t.mode: t for t in trs}
    whole = {m: by[m].stats.prefill_time_s + by[m].stats.decode_time_s for m in ("ar", "d3d-async")}
    cap = figures.timeline_caption(trs)
    assert (f"prefill included, ar took {whole['ar']:.2f} s and d3d-async {whole['d3d-async']:.2f} s "
            f"({whole['ar'] / whole['d3d-async']:.2f}×)") in cap
    # the prefill sentence in plain words (issue 46, the ninth reader's 13), its numbers from the spans
    pre = {m: next(s for s in by[m].spans if s.kind == "prefill" and s.lane == "target").duration for m in ("d3d-seq", "d3d-async")}
    assert (f"sharing the cores, the target's prefill took {pre['d3d-async']:.0f} ms, against {pre['d3d-seq']:.0f} ms for "
            "d3d-seq's target, which read it alone. The decode (and the target's idle share of it) starts once both have "
            "finished") in cap
    assert "counts from the end of both" not in cap and "alone:" not in cap


def test_every_drafting_column_says_rounds_times_tau_and_why_it_is_not_the_tokens_decoded():
    """τ counts each round's a + 1 whole: every drafting column (d3d-async's too) says "N rounds × τ = M tokens", and
    where the stop cut the last round it adds the tokens printed and why; ar has no such line."""
    from app.tokens import _tau_note

    trs, _ = service.recorded_race("smollm2-135m")
    for t in trs:
        whole, decoded = sum(r.accepted + 1 for r in t.rounds), sum(len(r.committed) for r in t.rounds)
        note = _tau_note(t)
        if t.mode == "ar":
            assert note == ""
            continue
        line = f"{len(t.rounds)}&nbsp;rounds&nbsp;×&nbsp;τ&nbsp;=&nbsp;{whole}&nbsp;tokens"
        assert line in note and round(t.stats.tau * len(t.rounds)) == whole, (t.mode, note)
        if whole == decoded:
            assert "printed" not in note and "are cut" not in note
        else:
            # said plainly: the last round's tokens past the end are cut, and so per token sits above round ÷ τ
            end = {"eos": "the answer's end", "length": "the token limit"}[t.finish_reason]
            assert f"{line}, {decoded}&nbsp;printed: the last round's {whole - decoded} past {end} are cut" in note, note
            assert f"decode time ÷ {decoded}) is a little above round ÷ τ (decode time ÷ {whole})" in note
            assert decoded == len(t.output_ids) - 1
    by = {t.mode: t for t in trs}
    # the shipped race: d3d-async's last round ended exactly at the stop, and it still gets its line
    a = by["d3d-async"]
    assert sum(r.accepted + 1 for r in a.rounds) == sum(len(r.committed) for r in a.rounds)
    assert f"{len(a.rounds)}&nbsp;rounds&nbsp;×&nbsp;τ" in _tau_note(a)
    assert any("are cut" in _tau_note(t) for t in trs)


def test_the_async_column_says_its_drafts_hide_only_on_hits():
    """d3d-async shows "draft not hidden" ms although it overlaps: its column says why, with this race's hit rate."""
    from app.tokens import column_html
    from d3d_core.measure.economics import race_economics

    trs, _ = service.recorded_race("smollm2-135m")
    state = dict(ui.empty_state(), traces={t.mode: t for t in trs})
    cols = dict(zip(MODES, ui._columns(state)))
    ec = {e.mode: e for e in race_economics(trs)}
    assert f"drafts hidden on hits only: {ec['d3d-async'].hit_rate:.0%} of rounds" in cols["d3d-async"]
    assert "a miss drafts it after the verify" in cols["d3d-async"]  # the why, in its hover
    # the ninth reader's 12: its hover says the Timeline's overlap share is another number, a share of the drafter's time
    assert "overlap share is another number, a share of the drafter&#x27;s busy time" in cols["d3d-async"]
    assert all("hidden on hits only" not in cols[m] for m in MODES if m != "d3d-async")
    async_tr = next(t for t in trs if t.mode == "d3d-async")
    assert "hidden on hits only" in column_html(async_tr, {}, econ=ec["d3d-async"])


def test_the_rounds_caption_says_what_the_position_counts_and_why_round_0_was_not_drafted_ahead():
    trs, _ = service.recorded_race("smollm2-135m")
    state = dict(ui.empty_state(), traces={t.mode: t for t in trs})
    by = {t.mode: t for t in trs}
    for mode in ("d3d-async", "d3d-seq"):
        r = by[mode].rounds[1]
        prompt = len(by[mode].prompt_ids)
        cap = ui._rounds_view(state, mode, 1)[2]
        assert (f"anchor at position {r.anchor_pos} (counting from 0; before it: {prompt} prompt + "
                f"{r.anchor_pos - prompt} output tokens; the anchor is the newest committed token, the previous round's bonus)") in cap
    first = ui._rounds_view(state, "d3d-async", 0)[2]
    # round 0's anchor is output too (the prefill's token): the caption says it is not counted among the tokens before it
    r0 = by["d3d-async"].rounds[0]
    assert (f"position {r0.anchor_pos} (counting from 0; before it: {len(by['d3d-async'].prompt_ids)} prompt + 0 output tokens; "
            "the anchor is the newest committed token, the token the prefill produced)") in first
    assert "in round 0 nothing could be drafted ahead, because no verify had started yet" in first
    assert "nothing could be drafted ahead" not in ui._rounds_view(state, "d3d-seq", 0)[2]


def test_the_status_line_defines_tau_once_and_says_why_async_trails_seq():
    from d3d_core.measure.economics import race_economics

    trs, _ = service.recorded_race("smollm2-135m")
    state = dict(ui.empty_state(), traces={t.mode: t for t in trs})
    text = ui.economics_sentences(state).split("<details>")[0]
    assert text.count("(accepted drafts + the target's bonus)") == 1 and text.count(", its break-even τ;") == 1
    ec = {e.mode: e for e in race_economics(trs)}
    # a cost in steps is not set equal to a τ (issue 46, the ninth reader's 4): the round's cost, then what it must commit
    assert "(a round's cost in ar steps)" not in text
    for m in ("dflash", "d3d-seq", "d3d-async"):
        e = ec[m]
        assert (f"a round costs {e.round_steps:.2f} ar steps, so it must commit more than {e.break_even_tau:.2f} tokens"
                + (" (τ)" if m == "dflash" else "") + " to beat ar") in text and f"it committed τ = {e.tau:.2f}" in text, m
    r = ec["d3d-async"].t_verify_ms / ec["d3d-seq"].t_verify_ms
    assert r >= 1.1 and f"its verify ran {r:.2f}× as long as d3d-seq's, beside the packed pass on the same cores" in text


def test_the_rounds_header_labels_this_block_and_the_next_block_apart():
    """Issue 46, the ninth reader's 8: where a round's own block came from and whether its hypotheses had the NEXT block
    ready are two verdicts, each labelled; the grid's row marks say "next" too."""
    from app import figures

    trs, _ = service.recorded_race("smollm2-135m")
    state = dict(ui.empty_state(), traces={t.mode: t for t in trs})
    tr = next(t for t in trs if t.mode == "d3d-async")
    hit = next(i for i, r in enumerate(tr.rounds[:-1]) if r.hit and not r.skipped)
    miss = next(i for i, r in enumerate(tr.rounds[:-1]) if r.hit is False and not r.skipped)
    for i, verdict in ((hit, "**next block:** ready ✓"), (miss, "**next block:** not ready ✗")):
        cap = ui._rounds_view(state, "d3d-async", i)[2]
        assert "**this block:** " in cap and verdict in cap and "hypotheses: **" not in cap, cap
        assert cap.index("**this block:**") < cap.index("**next block:**")
    assert "**next block:** none needed" in ui._rounds_view(state, "d3d-async", len(tr.rounds) - 1)[2]
    labels = list(figures.rounds_grid_figure(tr, {}).data[0].y)
    assert labels[hit] == f"r{hit} next ✓" and labels[miss] == f"r{miss} next ✗"
