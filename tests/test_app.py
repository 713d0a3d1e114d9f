"""The app through gradio_client against a launched `demo` (toy bundle: fast and exact)."""

import json
from pathlib import Path

import pytest
from conftest import ROOT, api_message


@pytest.fixture(scope="module")
def client(app_server):
    from d3d_core.measure.client import app_client

    return app_client(app_server[1])


RACE = dict(prompt="what is two plus two?", bundle="toy", modes=["ar", "dflash", "d3d-seq", "d3d-async"], block_size=4,
            temperature=0, max_new_tokens=32, hypotheses=8, sampling="match", seed=0, verify="adaptive", drafting="gated", use_pruned=False)


def test_named_endpoints(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/race", "/stop", "/replay", "/rounds", "/pruning_curve", "/measure_pruned", "/download_traces", "/upload_trace", "/project",
            "/clock", "/export_html"} <= names


def test_projection_endpoint(client):
    fig, src = client.predict("qwen3-8b on H200 (derived)", 16, 1.0, 0.7, 4, 1.0, 1.0, 1.0, api_name="/project")
    assert "derived" in src and "Assumptions" in src
    from d3d_core import service

    with pytest.raises(ValueError, match="hit rate must lie between 0 and 1"):
        service.project("qwen3-8b on H200 (derived)", 16, 6.0, 2.0, 4)
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="not in the list of choices"):
        client.predict("no such profile", 16, 6.0, 0.5, 4, 1.0, 1.0, 1.0, api_name="/project")


def test_race_streams_and_finishes(client):
    job = client.submit(*RACE.values(), api_name="/race")
    res = job.result()
    assert len(job.outputs()) >= 3  # loading message, streamed rounds, final
    status, *cols = res[:5]
    assert status.startswith("**Done**")
    for c in cols:
        assert "done: 32 tokens" in c


def test_race_status_gives_each_speedup_its_spread_and_the_machine_state(client):
    """Issue 33: every speedup in the status line carries its spread (or says the race was too short to time), and
    the status says whether the machine was quiet or busy while the race ran."""
    import re

    status = client.predict(*RACE.values(), api_name="/race")[0]
    assert re.search(r"\d\.\d\d× \(\d\.\d\d–\d\.\d\d\) the speed of ar|too short to time \(\d+ rounds\)", status), status
    assert "machine quiet: other processes used" in status or "⚠ **machine busy:" in status, status
    short = client.predict(*dict(RACE, max_new_tokens=8, modes=["ar", "d3d-seq"]).values(), api_name="/race")[0]
    assert "too short to time" in short and "×" not in short, short


def test_race_bad_input_gives_message(client):
    for key, bad, msg in [("prompt", "   ", "prompt is empty"), ("prompt", "x" * 5000, "prompt is too long"),
                          ("block_size", 40, "greater than maximum value 16"), ("hypotheses", 99, "greater than maximum value 32"),
                          ("modes", [], "at least one mode"), ("temperature", -1, "less than minimum value 0"),
                          ("drafting", "sometimes", "not in the list of choices: ['gated', 'always']")]:
        m = api_message(client, "/race", *dict(RACE, **{key: bad}).values())
        assert msg in m, (key, m)
        assert "Traceback" not in m
    # the smollm2 bundle ships d3d-deep (the picker offers it); the toy bundle has no such drafter
    m = api_message(client, "/race", *RACE.values(), "d3d-deep")
    assert "bundle 'toy' has no D3D drafter 'd3d-deep'; it has: d3d" in m and "Traceback" not in m, m
    # the engine's own validation backs up the widgets' bounds (API callers can bypass widgets)
    from d3d_core import service

    with pytest.raises(ValueError, match="block size must be between 2 and 16"):
        service.settings(block_size=40)
    with pytest.raises(ValueError, match="temperature"):
        service.settings(temperature="warm")


def test_gpu_only_bundle_is_neither_offered_nor_loaded_on_this_cpu_host(app_server, client, monkeypatch):
    """No CUDA here: the bundle dropdown leaves qwen3-8b out, and an API call naming it gets a sentence, not a load."""
    import gradio as gr

    from d3d_core.models import bundles

    dropdown = next(b for b in app_server[0].blocks.values() if isinstance(b, gr.Dropdown) and str(b.label).startswith("Bundle"))
    assert "qwen3-8b" not in [v for _, v in dropdown.choices] and "smollm2-135m" in [v for _, v in dropdown.choices]

    def no_load(*a, **k):
        raise AssertionError("a GPU-only bundle started loading on a CPU host")

    monkeypatch.setattr(bundles, "load_qwen3_bundle", no_load)
    for endpoint, args in (("/race", dict(RACE, bundle="qwen3-8b").values()), ("/pruning_curve", ["qwen3-8b"])):
        m = api_message(client, endpoint, *args)
        assert "qwen3-8b" in m and "not in the list of choices" in m and "Traceback" not in m, (endpoint, m)


def test_download_rounds_and_upload_round_trip(client, tmp_path):
    client.predict(*RACE.values(), api_name="/race")
    client.predict(api_name="/race_views")  # what the page runs after a race: plots, and the Rounds slider's range
    path = client.predict(api_name="/download_traces")
    data = json.loads(Path(path).read_text())
    assert [t["mode"] for t in data["traces"]] == RACE["modes"]
    grid, table, caption = client.predict("d3d-async", 2, api_name="/rounds")
    assert "Round 2" in caption
    from gradio_client import handle_file

    msg = client.predict(handle_file(path), api_name="/upload_trace")[0]
    assert msg.startswith("**Loaded** 4 trace(s)")
    bad = tmp_path / "bad.json"
    bad.write_text('{"traces": [{"mode": "ar"}]}')
    msg = client.predict(handle_file(str(bad)), api_name="/upload_trace")[0]
    assert "Could not read that trace" in msg and "missing field" in msg
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\xff\xfe not json")
    assert "Could not read that trace" in client.predict(handle_file(str(junk)), api_name="/upload_trace")[0]


def test_pruning_endpoints(client):
    client.predict("toy", api_name="/pruning_curve")
    msg, fig = client.predict("toy", ["L1 (initialised from target layer 3)"], api_name="/measure_pruned")
    assert "offline τ" in msg and "1 of 2 layers removed" in msg
    msg, _ = client.predict("toy", [], api_name="/measure_pruned")
    assert "keep at least one" in msg


def test_stop_endpoint(client):
    assert "Stopping" in client.predict(api_name="/stop")


@pytest.mark.slow
def test_stop_ends_a_real_run_within_a_round_and_the_next_run_works(client):
    import time

    job = client.submit("Write a long story about a dragon.", "smollm2-135m", ["ar", "d3d-async"], 8, 0, 256, 4, "match", 0, "adaptive", "gated", False,
                        api_name="/race")
    # a process's first race on an engine warms every shape first: minutes on a loaded 2-core machine (a 120 s wait
    # stopped the race before it ran, once, with two test loops beside it), so wait for the rounds, not for a time
    deadline = time.time() + 900
    while time.time() < deadline and not any("Running" in str(o[0]) for o in job.outputs()):
        time.sleep(0.2)
    assert any("Running" in str(o[0]) for o in job.outputs()), [str(o[0])[:120] for o in job.outputs()]
    time.sleep(2.0)
    t = time.perf_counter()
    client.predict(api_name="/stop")
    res = job.result()
    assert time.perf_counter() - t < 10  # one round of a 135M model is well under a second
    assert res[0].startswith("**Stopped**") and "finish = cancelled" in res[1]
    again = client.predict(*RACE.values(), api_name="/race")
    assert again[0].startswith("**Done**")


def test_clock_export_and_upload_of_the_export(client):
    from gradio_client import handle_file

    client.predict(*RACE.values(), api_name="/race")
    tl, summ, econ, table, src, *_ = client.predict("smollm2-135m on H200 (derived)", api_name="/clock")
    assert "Projected" in src and "Assumptions" in src
    assert "PROJECTED" in json.dumps(tl)
    tl, summ, econ, table, src, *_ = client.predict("measured here", api_name="/clock")
    assert "PROJECTED" not in json.dumps(tl) and "measured" in src
    path = client.predict(api_name="/export_html")
    page = Path(path).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "d3d-traces" in page
    msg = client.predict(handle_file(path), api_name="/upload_trace")[0]
    assert msg.startswith("**Loaded** 4 trace(s)"), msg


@pytest.mark.slow
def test_pruning_tab_offers_the_deep_drafters_thirty_layers(smollm):
    """The Pruning tab on the real bundle's d3d-deep: 30 toggles (the target's own layers, shared), its shipped curve,
    a live τ for a choice, and the choice kept for the Race under that drafter's name (the 8-layer one's untouched)."""
    from app import ui

    state = ui.empty_state()
    upd, hint, fig, _, state = ui.load_pruning("smollm2-135m", state, "d3d-deep")
    assert len(upd["choices"]) == 30 and upd["choices"][29] == "L29 (target layer 29, shared)" and len(upd["value"]) == 30
    assert "30 layers" in hint and "No pruning curve" not in hint, hint  # its curve is shipped
    assert any(tr.name == "greedy pruning" for tr in fig.data)
    msg, fig, state = ui.measure_pruned("smollm2-135m", upd["choices"][:-1], state, "d3d-deep")
    assert "1 of 30 layers removed" in msg and state["skips"]["d3d-deep"] == [29], msg
    assert "d3d" not in state["skips"] or state["skips"]["d3d"] == []


def test_the_race_time_limit_starts_after_the_warm_up(monkeypatch):
    """A process's first race on an engine warms every shape first; served locally, that must not spend the race's
    time limit (a first visit's lesson race on a busy CPU stopped at the limit after a long warm-up)."""
    import time

    from app import runs, ui
    from d3d_core import service

    monkeypatch.setattr(ui, "APP_RACE_SECONDS", 0.6)
    real_warm = service._warm
    monkeypatch.setattr(service, "_warm", lambda *a, **k: (real_warm(*a, **k), time.sleep(1.0), 1.0)[-1])
    run_id = runs.start()
    runs.get(run_id).start_clock(0.6)  # the handler starts it once the bundle is loaded
    base = service.settings("ar", 4, 0.0, 8, 2, "match", 0, "full", "always")
    items = list(ui._race_stream("the cat sat", "toy", ["ar"], base, None, run_id, "d3d"))
    runs.finish(run_id)
    tr = ui.merge_delta(None, items[0][1])
    for _, upd, _, _ in items[1:]:
        tr = ui.merge_delta(tr, upd)
    assert len(tr.rounds) >= 1 and items[0][3].get("warm_s") == 1.0, (len(tr.rounds), items[0][3])


def test_the_pruning_tab_keeps_its_own_state(toy):
    """The Pruning tab's handlers read and return their own state (``empty_pruning``), never the race's: the page-load
    refresh of the tab would otherwise overwrite a race opened while it ran. The race reads the layers from it."""
    from app import ui

    demo = ui.build_demo()
    race_state = next(b for b in demo.blocks.values() if type(b).__name__ == "State" and isinstance(b.value, dict) and "traces" in b.value)
    for fn in demo.fns.values():
        name = getattr(fn.fn, "__name__", "")
        if name in ("load_pruning", "measure_pruned"):
            assert race_state._id not in [b._id for b in fn.outputs], name
    pstate = ui.load_pruning("toy", ui.empty_pruning())[-1]
    assert set(pstate) == {"skips"}
    choices = ui.layer_choices("toy")
    _, _, pstate = ui.measure_pruned("toy", choices[1:], pstate)
    assert pstate["skips"]["d3d"] == [0]
    args = dict(RACE, modes=["ar", "d3d-seq"], max_new_tokens=12, use_pruned=True)
    status = list(ui.run_race(*args.values(), ui.empty_state(), "d3d", "fp32", pstate))[-1][0]
    assert "with D3D layers [0] skipped" in status, status


def test_sweep_removes_old_copies_of_the_apps_own_files_and_nothing_else(tmp_path, monkeypatch):
    """Gradio's served copies of the app's downloads and exports (``<gradio temp>/<hash>/d3d-…``) go once past the
    temp-file age even if Gradio's own delete_cache stops (it did once in ten soaks); another app's files stay."""
    import os
    import time

    from app import health

    g = tmp_path / "gradio"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(g))
    monkeypatch.setattr(health, "APP_TEMP_MAX_AGE_S", 60)
    old = time.time() - 120
    files = {"ours_old": g / "h1" / "d3d-traces-a.json", "race_old": g / "h2" / "d3d-race-b.html", "other_old": g / "h3" / "notes.json",
             "ours_new": g / "h4" / "d3d-traces-c.json", "stray_old": g / "tmpupload"}
    for name, f in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x")
        if name.endswith("old"):
            os.utime(f, (old, old))
    assert health.sweep() >= 3
    assert not files["ours_old"].exists() and not files["race_old"].exists() and not files["stray_old"].exists()
    assert not (g / "h1").exists() and not (g / "h2").exists()  # their emptied hash directories too
    assert files["other_old"].exists() and files["ours_new"].exists()


def test_the_clock_text_names_only_the_tags_an_offered_clock_carries():
    """"(scaled)" is explained only where a scaled clock is offered (the Timeline offers none by default), and so for
    each tag; what a projected clock keeps is always said."""
    from app import ui
    from d3d_core import service

    names = service.clock_names()
    info = ui.clock_info(names)
    assert "keeps this run's rounds" in info
    assert ("(scaled)" in info) == any("(scaled)" in n for n in names)
    assert ("(derived)" in info) == any("(derived)" in n for n in names)
    assert "(scaled)" in ui.clock_info(names + ["smollm2-135m on H200 (derived) (scaled)"])
    plain = ui.clock_info(["measured here"])
    assert "(scaled)" not in plain and "(derived)" not in plain and "(measured" not in plain


def test_the_projection_hit_slider_says_which_measurement_it_starts_at():
    from app import ui
    from d3d_core import service

    tau, hit, B, where = service.measured_point_and_source("smollm2-135m")
    assert (tau, hit, B) == service.measured_point("smollm2-135m")
    label = ui.hit_slider_label(hit, where)
    assert f"starts at {hit:.2f}" in label and "Measured bench's d3d-async on gsm8k" in label and "prompts" in label
    # a figure no row of the visible table shows names where it is read from, and the visible row it differs from
    gated = next(s["hit_rate"] for s in service.bench_result("smollm2-135m")["summary"]
                 if (s["mode"], s["dataset"]) == ("d3d-async", "gsm8k"))
    assert "assets/bench/smollm2-135m.json" in label and f"gated run, {gated:.3f}" in label and "not a row of" in label
    # the table's caption says what hit_rate is a share of, and that rounds the gate skipped do not count in it
    assert "hit_rate (d3d-async): share of its drafted rounds" in ui.BENCH_TABLE_LABEL
    assert "skipped make no guesses and do not count" in ui.BENCH_TABLE_LABEL
    assert "assumed" in ui.hit_slider_label(*service.measured_point_and_source("toy")[1::2])


def test_the_race_tab_says_where_the_status_names_things_and_what_the_lesson_chip_counts():
    from app import ui
    from app.tokens import CSS

    # the text's name for the line above the tabs is written on it (a label drawn before its first paragraph), and the
    # int4 kernel is promised only where it is shown: after an int4 race (the status adds "int4 GEMM: …" for int4 only)
    assert 'content: "Status line' in CSS and "#status .md > p:first-child::before" in CSS
    assert "after an int4 race the Status line names" in ui.ENGINE_INFO and "int4 GEMM" in ui.ENGINE_INFO
    src = (ROOT / "app" / "ui.py").read_text(encoding="utf-8")
    assert 'if engine == "int4":\n        status += f" · int4 GEMM: ' in src
    assert any("lesson · τ ≈" in lab for _, lab in ui.EXAMPLES)
    assert "first 96 new tokens" in ui.EXAMPLES_LABEL  # the chips' τ is not the lesson race's, which runs to the end
    assert "not this race's (How it works › Which τ is which)" in ui.EXAMPLES_LABEL  # the first τ not the race's points there


def test_the_race_tabs_info_lines_use_no_term_before_it_is_explained():
    """Issue 46, the ninth reader's 1: the info lines under the first screen's controls say what a thing is in plain
    words, each technical term at most once and in parentheses after them; no MASK slots, ranks or (a, t) there, and
    the chips' τ is said in words on their label before any chip shows a number."""
    from app import ui

    infos = {"engine": ui.ENGINE_INFO, "drafter": ui.D3D_DRAFTER_INFO, "block": ui.BLOCK_INFO, "hyps": ui.HYPS_INFO}
    for name, text in infos.items():
        for jargon in ("MASK", "rank", "(a, t)", "committed", "dequantised weights", "GGUF's", "likeliest ends"):
            assert jargon not in text, (name, jargon)
    assert "4 bits (the GGUF file's format)" in ui.ENGINE_INFO and "32-bit floats (dequantised)" in ui.ENGINE_INFO
    assert "answers can differ" in ui.ENGINE_INFO  # the ninth reader's 26: int4 and fp32 round differently
    assert "plus small trained add-ons (adapters)" in ui.D3D_DRAFTER_INFO
    assert "the last kept token (the anchor)" in ui.BLOCK_INFO
    # shorter than before: the Race tab after a race has 26 px to spare of its 2,000
    assert len(ui.D3D_DRAFTER_INFO) < 200 and len(ui.BLOCK_INFO) < 62 and len(ui.HYPS_INFO) < 71 and len(ui.ENGINE_INFO) < 240
    assert ui.EXAMPLES_LABEL.startswith("Examples · τ, tokens per target pass:")
    # the picker's own labels (the drafters' configs name the adapters' rank) say it in words too
    deep = "D3D shared-weight adapter drafter, 30 layers (the target's own, + trained rank-64 adapters)"
    assert ui.drafter_choice_label(deep) == "D3D shared-weight adapter drafter, 30 layers (the target's own, + small trained add-ons)"
    assert "(drafter_choice_label(lab), n)" in (ROOT / "app" / "ui.py").read_text(encoding="utf-8")
    src = (ROOT / "app" / "ui.py").read_text(encoding="utf-8")
    for name in ("ENGINE_INFO", "D3D_DRAFTER_INFO", "BLOCK_INFO", "HYPS_INFO"):
        assert f"info={name})" in src or f"info={name}," in src or f"info={name}\n" in src, name


def test_the_first_screen_says_what_speculative_decoding_is_before_any_jargon():
    """Issue 46, the eighth reader's 1 and 2: the header's first sentence explains speculative decoding with words of
    its own (drafter guesses, target checks in one pass, keeps what it would have written, output identical), before
    any of the app's terms; the four modes follow, DFlash and D3D pointed to; the legend's τ needs no word not yet met."""
    from app import ui
    from app.tokens import LEGEND_TAU, legend_html

    h = ui.HEADER
    first = h.index("Speculative decoding in one sentence")
    for word in ("drafter", "guesses the next few tokens", "target", "checks all the guesses in one pass",
                 "keeps those it would have written itself", "identical to plain decoding"):
        assert h.index(word, first) > first, word
    for jargon in ("block-diffusion", "round", "bonus", "anchor", "verify", "τ", "hypothes"):
        assert jargon not in h[:h.index("Raced here")], jargon
    assert all(m in h for m in ("**ar**", "**dflash**", "**d3d-seq**", "**d3d-async**")) and "How it works › " in h
    assert "Words" in h and "same engine" in h
    # τ in one line, with no round/draft/bonus/accepted left undefined
    assert LEGEND_TAU in legend_html() and "one target pass" in LEGEND_TAU
    assert not any(w in LEGEND_TAU for w in ("bonus", "accepted", "draft"))


def test_the_pruning_tab_says_whose_tau_the_dashed_line_is_99_percent_of():
    """The eighth reader's 23: the dashed grey line is 99 % of this drafter's calibration τ, said as its own sentence,
    apart from the preprint's result (which is a reference for scale, not the line)."""
    from app import ui

    t = ui.PRUNING_INTRO
    line = t[t.index("The dashed grey line"):]
    assert line.startswith("The dashed grey line marks **99 % of this drafter's calibration τ**")
    assert "preprint" not in line[:line.index(". ")] and "preprint" in t


def test_the_economics_note_says_the_last_rounds_cut_tokens_make_per_token_exceed_round_over_tau():
    """The eighth reader's 13: τ counts the last round whole, the output only up to the stop; said where per token and
    round ÷ τ are compared, and the Benchmarks table points to the τ it is not (this race's)."""
    from app import ui

    n = ui.ECONOMICS_NOTE
    assert "decode time ÷ the tokens it printed" in n and "past the answer's end or the token limit are cut" in n
    assert "a little above round ÷ τ" in n and "commits fewer" not in n
    assert "Which τ is which" in ui.BENCH_TABLE_LABEL
    # the ninth reader's 14: T_step against the Benchmarks step can go either way, and the note says why each way
    assert "can come out above or below it" in n and "bookkeeping (more)" in n and "shorter than the fixed one (less)" in n


def test_the_traces_tab_says_what_a_trace_holds_and_what_it_is_for():
    """Issue 46, the ninth reader's 25: the Traces tab said only "Prepare download"; its text names what the file holds
    (each named part is a field of the Trace) and that uploading one shows that race again without running anything."""
    import dataclasses

    from app import ui
    from d3d_core.decoding.trace import Round, Trace

    fields = {f.name for f in dataclasses.fields(Trace)} | {f.name for f in dataclasses.fields(Round)}
    for said, field in (("every round's anchor", "anchor_id"), ("drafts", "draft_ids"), ("drafter's probabilities", "draft_probs"),
                        ("the target's tokens", "target_ids"), ("accepted count", "accepted"), ("bonus", "bonus"),
                        ("hypotheses", "hypotheses"), ("each forward's start and end", "spans"), ("the stats", "stats"),
                        ("machine's load", "load"), ("settings", "config")):
        assert said in ui.TRACES_INTRO and field in fields, (said, field)
    assert "with nothing run" in ui.TRACES_INTRO and "exported as HTML" in ui.TRACES_INTRO
    src = (ROOT / "app" / "ui.py").read_text(encoding="utf-8")
    assert 'with gr.Tab("Traces", id="traces"):\n                gr.Markdown(TRACES_INTRO)' in src
