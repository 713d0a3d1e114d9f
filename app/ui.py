"""The Gradio Blocks app. Layout and event wiring only: every picture comes from
``app.figures`` / ``app.tokens`` (pure functions of Traces); every computation from
``d3d_core.service``. Per-user data lives in ``gr.State`` and is plain, picklable data (a race
in flight is named by a run id; its cancel flag lives in ``app.runs``); models are loaded once per
process, outside any GPU window, and shared read-only. The GPU work of a race is ``race_stream``
(``@spaces.GPU`` on ZeroGPU, see ``app.spaces_gpu``)."""

from __future__ import annotations

import html
import json
import os
import re
import sys
import time
import traceback

import gradio as gr

from d3d_core import service
from d3d_core.decoding.trace import MODES
from d3d_core.limits import APP_CONCURRENCY, APP_QUEUE_MAX, APP_RACE_SECONDS, APP_SESSION_TTL_S, APP_TEMP_MAX_AGE_S
from d3d_core.measure.economics import SHARED_CORES_SLOWER, race_economics, verify_vs_seq
from d3d_core.measure.latency import measured_taus, project_modes
from d3d_core.measure.reading import race_load

from . import engine_views, explain, figures, health, lesson, runs
from .export import race_html, traces_json_of
from .spaces_gpu import (
    MARGIN_S,
    PRUNING_SECONDS,
    gpu_budget,
    gpu_error_status,
    max_duration,
    maybe_gpu,
    merge_delta,
    on_zerogpu,
    quota_seconds,
    stream_duration,
    stream_is_remote,
    trace_delta,
    zerogpu_concurrency,
)
from .tokens import agreement, ar_time_per_token, column_html, drafter_confound, legend_html

# Picked by measured τ on the shipped bundle (d3d-seq, B = 8, 96 new tokens, drafting every round, the drafter as the
# app runs it: int8 MLPs and head where available; tests/test_shipped.py holds the labels to it within 0.1):
# the drafters were trained on the target's own answers to gsm8k-style questions, so step-by-step
# arithmetic is where they shine; the chat prompt stays, labelled as the hard case.
EXAMPLES = [
    ("A bakery sells muffins for $3 each and cookies for $2 each. Maya buys 4 muffins and 6 cookies. How much does she spend? "
     "Please reason step by step.", "🎓 lesson · τ ≈ 2.8"),
    ("Tom has 5 boxes with 12 pencils in each box. He gives away 17 pencils. How many pencils does he have left? "
     "Please reason step by step.", "math · τ ≈ 2.6"),
    ("Sara earns $15 per hour. She works 6 hours on Monday and 4 hours on Tuesday. How much does she earn in total? "
     "Please reason step by step.", "math · τ ≈ 1.9"),
    ("Write a Python function `is_palindrome(s)` that ignores case and spaces, with two examples.", "code · τ ≈ 1.3"),
    ("What are three good habits for learning a new language? Answer briefly.", "chat · τ ≈ 1.2"),
]
# what the chips' τ counts (a lesson race runs to the end of its answer, so it reads another τ)
EXAMPLES_LABEL = "Examples · τ, tokens per target pass: d3d-seq's, first 96 new tokens, not this race's (How it works › Which τ is which)"
# the first screen's info lines in plain words (each technical term once, in parentheses, where the app uses it elsewhere)
ENGINE_INFO = ("int4: the weights stored in 4 bits (the GGUF file's format); after an int4 race the Status line names its "
               "kernel (“int4 GEMM: …”). fp32: the same weights as 32-bit floats (dequantised). They round differently, so "
               "their answers can differ.")
D3D_DRAFTER_INFO = ("default: a small drafter of its own. d3d-deep: the target's own layers plus small trained add-ons "
                    "(adapters): better guesses, but each runs all those layers, as a check does. Race both.")
BLOCK_INFO = "a block: the last kept token (the anchor) + B − 1 guesses"
HYPS_INFO = "d3d-async: during a check, draft the next block for H likely outcomes"


def drafter_choice_label(label: str) -> str:
    """A D3D drafter's name for the first screen's picker: its adapters' rank (a training detail) said in plain words."""
    return re.sub(r"trained rank-\d+ adapters", "small trained add-ons", label)
# the first screen: speculative decoding in plain words before any of the app's own terms, then the four modes, each
# named once with what sets it apart; DFlash and D3D are papers' names (How it works › Words says which)
HEADER = ("# D3D Studio\n**Speculative decoding in one sentence:** a small, fast *drafter* model guesses the next few tokens, "
          "and the big *target* model checks all the guesses in one pass and keeps those it would have written itself — so the "
          "output is identical to plain decoding (**ar**: one target pass per token), from fewer target passes. Raced here "
          "against `ar`: **dflash** (a DFlash-style drafter that reads the target's internal states, so it waits for every "
          "check) and the standalone **D3D** drafter, taking turns with the target (**d3d-seq**) or guessing the next block "
          "while the target checks this one (**d3d-async**). DFlash and D3D are named after their papers (*How it works › "
          "Words*); identical means on the same engine (the ✓ under each column checks).")
# each preset button's hover text (lesson.PRESET_TIPS), set as its title once the page has loaded
PRESET_TIPS_JS = ("() => { const tips = " + json.dumps(lesson.PRESET_TIPS) + "; for (const [id, tip] of Object.entries(tips)) "
                  "{ const el = document.getElementById(id); if (el) el.title = tip; } return []; }")
# the presenter view: larger type everywhere (tokens.CSS holds the rules under body.d3d-presenter); ?presenter opens in it
PRESENTER_JS = "(on) => { document.body.classList.toggle('d3d-presenter', !!on); return []; }"
STREAM_EVERY_S = 0.25  # redraw the race columns at most this often (no flicker)


def empty_state() -> dict:
    """A session's state: plain data only (strings, lists, dicts, Traces), so it pickles. ``run`` is the id of the
    race in flight (``app.runs`` holds its cancel flag), None between races."""
    return {"bundle": service.app_bundle(), "traces": {}, "pieces": {}, "skips": {}, "run": None, "clock": service.MEASURED_CLOCK}


def empty_pruning() -> dict:
    """The Pruning tab's own state: ``skips``, {drafter: layers unticked}. Kept apart from the race's state because its
    handlers return the whole dict: the page-load refresh of the Pruning tab, returning the race state it was given, would
    otherwise overwrite a race or a recorded race opened while it ran (found by opening 📼 just after the page loaded)."""
    return {"skips": {}}


def _traces(state) -> list:
    return [state["traces"].get(m) for m in MODES if state["traces"].get(m) is not None]


def _columns(state, running=()) -> list:
    """The race columns; ``running``: the modes still decoding (a race runs them all at once, taking turns)."""
    trs = _traces(state)
    tpt = ar_time_per_token(trs)
    econ = {e.mode: e for e in race_economics(trs)}
    load = race_load(trs) if not running else None
    return [
        column_html(state["traces"].get(m), state["pieces"], m, ar_time_per_token=tpt, running=(m in running),
                    econ=econ.get(m) if m not in running else None, busy=bool(load and load.busy), ar=state["traces"].get("ar"))
        for m in MODES
    ]


def _clocked(state) -> tuple:
    """(traces on the chosen clock, projected profile name or None)."""
    return service.retimed(_traces(state), state.get("clock") or service.MEASURED_CLOCK)


def _plots(state):
    trs = _traces(state)
    timed, projected = _clocked(state)
    return (
        figures.timeline_figure(timed, projected),
        figures.timeline_summary(timed),
        figures.acceptance_figure(trs),
        figures.economics_figure(timed, projected),
        figures.economics_table(timed, projected),
    )


def set_clock(clock, state):
    """Re-time the Timeline (and the replay) under a cost profile, or back to the measured clock."""
    state = dict(state or empty_state())
    try:
        service.retimed([], clock)
    except ValueError as e:
        gr.Warning(str(e))
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), state, gr.skip()
    state["clock"] = clock
    tl, summ, _, econ_fig, econ_tab = _plots(state)
    return tl, summ, econ_fig, econ_tab, service.clock_assumptions(clock), state, _caption(state)


def apply_preset(name: str) -> tuple:
    """The Race tab's settings for one of ``lesson.PRESETS`` (every mode, the default D3D drafter unpruned) and its note."""
    p = lesson.PRESETS[name]
    return (p["prompt"], p["block_size"], p["hypotheses"], p["max_new_tokens"], p["temperature"], p["sampling"], p["seed"],
            p["verify"], p["drafting"], p["engine"], list(MODES), False, lesson.PRESET_NOTES[name])


def output_check(state) -> str:
    """The status's verdict on the tokens, computed from them (``tokens.agreement``): every drafting mode printed
    exactly ar's tokens, or which did not. "" without ar or without a finished drafting mode."""
    ar = state["traces"].get("ar")
    got = {m: agreement(state["traces"].get(m), ar) for m in MODES if m != "ar"}
    got = {m: g for m, g in got.items() if g[0]}
    if not got:
        return ""
    if all(k == "same" for k, _ in got.values()):
        return f" · **identical output ✓** ({', '.join(got)}: ar's {len(ar.output_ids)} tokens)"
    if all(k == "sampled" for k, _ in got.values()):
        return " · sampled (temperature > 0): the modes' tokens differ from ar's by design"
    return " · " + "; ".join(f"{m}: {w}" for m, (_, w) in got.items())


def status_headline(e, define: bool = False) -> str:
    """A mode's line on the status: ``EconomicsRow.headline`` with the break-even said as what a round must commit
    (a round costs N ar steps, so it must commit more than N tokens, τ, to beat ar). Where the headline says why no
    speedup is read (too short, no ar, flagged), that text is kept."""
    if e.headline() == e.sentence():  # no speedup to explain: the reason, as the engine words it
        return e.headline()
    gate = f" The draft gate left {e.skipped / e.rounds:.0%} of rounds undrafted." if e.skipped else ""
    tau_is, tau_as, be_is = (" (accepted drafts + the target's bonus)", " (τ)", ", its break-even τ") if define else ("", "", "")
    return (f"{e.mode} is {e.speedup_label()} the speed of ar: a round costs {e.round_steps:.2f} ar steps, so it must commit "
            f"more than {e.break_even_tau:.2f} tokens{tau_as} to beat ar{be_is}; it committed τ = {e.tau:.2f}{tau_is}.{gate}")


def economics_sentences(state) -> str:
    """One sentence per drafting mode of the race: how fast it was against ar, and why; where dflash and a d3d mode
    both ran, the drafter-size confound between them."""
    trs = _traces(state)
    load = race_load(trs)
    if load is not None and load.busy:  # a busy race's ratios are noise: greyed, no cost story, no mode named faster
        lines = [f"- <span style='color:#888'>{e.mode}: read {e.speedup_label()} the speed of ar (10–90 % spread over its rounds) — not a reading "
                 f"(the machine was busy); τ = {e.tau:.2f} stands (a token count, not a timing)</span>"
                 for e in race_economics(trs) if e.mode != "ar" and e.rounds]
        return "\n".join(lines)
    econ = [e for e in race_economics(trs) if e.sentence()]
    lines = [f"- {status_headline(e, define=i == 0)}" for i, e in enumerate(econ)]  # the first says what τ and break-even τ are
    by = {e.mode: e for e in econ}
    a, r = by.get("d3d-async"), verify_vs_seq(by.get("d3d-async"), by.get("d3d-seq"))
    if r is not None and r >= SHARED_CORES_SLOWER and not a.flags and a.speedup is not None:
        i = econ.index(a)  # why the overlapping mode can lose to the sequential one, where it can be seen
        lines[i] = (lines[i].rstrip(".") + f"; its verify ran {r:.2f}× as long as d3d-seq's, beside the "
                    "packed pass on the same cores.")
    note = drafter_confound(trs)
    out = "\n".join(lines)
    full = [e.sentence() for e in econ if e.sentence() != e.headline()] + ([note] if note and lines else [])
    if full:  # the part-by-part cost of each round and the drafter-size confound, folded (the Timeline draws the costs)
        out += ("\n\n<details><summary>What each round cost, part by part (and why dflash vs d3d is not a clean comparison)"
                "</summary>\n\n" + "\n".join(f"- {x}" for x in full) + "\n\n</details>")
    return out


def _caption(state) -> str:
    """The Timeline's caption: why each mode's target waited, from the run's own numbers (on the chosen clock)."""
    timed, projected = _clocked(state or empty_state()) if _traces(state or empty_state()) else ([], None)
    return figures.timeline_caption(timed, projected)


# where a round's block came from, in words (Round.draft_source)
SOURCE_WORDS = {
    "draft": "drafted after the previous verify (the drafter and the target took turns)",
    "packed_draft": "drafted during the previous verify, in d3d-async's packed pass (a hit: ready when the verify returned)",
    "sync_draft": "drafted after the previous verify because no packed hypothesis matched it (a miss: the target waited)",
}


def _source_words(r, mode: str = "") -> str:
    """Where round ``r``'s block came from, in words. Round 0's comes after the prefill, not a verify: in d3d-async
    nothing could be drafted ahead, since no verify had started yet to draft beside."""
    if r.index == 0 and r.draft_source == "draft":
        if mode == "d3d-async":
            return ("drafted after the prefill: in round 0 nothing could be drafted ahead, because no verify had started yet "
                    "(from round 1 on, blocks are drafted during the previous verify)")
        return "drafted after the prefill, then verified (the drafter and the target take turns, as in every round of this mode)"
    return SOURCE_WORDS.get(r.draft_source, r.draft_source)


def _position_words(tr, r) -> str:
    """What round ``r``'s anchor position counts: positions count from 0, so it is the number of tokens before the anchor,
    the prompt's and the output's so far; the anchor itself is the newest committed output token."""
    prompt = len(tr.prompt_ids or [])
    which = "the token the prefill produced" if r.index == 0 else "the previous round's bonus"
    if not prompt or r.anchor_pos < prompt:
        return f"position {r.anchor_pos} (counting from 0: the tokens before it, the prompt's and the output's so far)"
    return (f"position {r.anchor_pos} (counting from 0; before it: {prompt} prompt + {r.anchor_pos - prompt} output tokens; "
            f"the anchor is the newest committed token, {which})")


def _rounds_view(state, mode, idx):
    tr = state["traces"].get(mode)
    if tr is None:
        return figures.rounds_grid_figure(None, {}), figures.hypotheses_table(None, 0, {}), "Run a race first."
    n = len(tr.rounds)
    idx = int(min(max(0, idx or 0), max(0, n - 1)))
    fig = figures.rounds_grid_figure(tr, state["pieces"], upto=idx)
    if n == 0:
        return fig, figures.hypotheses_table(None, 0, {}), "No rounds."
    r = tr.rounds[idx]
    held = f" ({len(r.held_back)} more held back by the verify plan)" if r.held_back else ""
    if r.skipped:
        return fig, figures.hypotheses_table(tr, idx, state["pieces"]), (
            f"**Round {idx}** of {n}: 1 token committed\n\n" + lesson.round_sentence(r, state["pieces"], mode))
    cap = (f"**Round {idx}** of {n}: anchor at {_position_words(tr, r)}, {len(r.draft_ids)} drafts verified{held}, "
           f"**{r.accepted} accepted** + bonus → {len(r.committed)} tokens committed"
           + (f" · **this block:** {_source_words(r, mode)}" if r.draft_source else ""))
    if idx == n - 1 and r.hypotheses:
        cap += (" · **next block:** none needed, the decode ended here (this round's hypotheses get no verdict "
                "and do not count in the hit rate)")
    elif r.hit is not None:
        cap += " · **next block:** " + ("ready ✓ (one of this round's hypotheses had drafted it during this verify)" if r.hit else
                                       "not ready ✗ (no hypothesis matched this verify: drafted after it, while the target waited)")
        if r.hit and r.accepted == 0:
            cap += " — a hit with a = 0: no draft was accepted, but the hypothesis (0, bonus) guessed the target's token, so the next block was still ready"
    cap += "\n\n" + lesson.round_sentence(r, state["pieces"], mode)
    return fig, figures.hypotheses_table(tr, idx, state["pieces"]), cap


# ----------------------------------------------------------------------------- handlers


def d3d_picker(bundle):
    """The Race tab's D3D-drafter choice for ``bundle``: shown only when it ships more than the default."""
    try:
        names = service.d3d_drafters(bundle)
    except (ValueError, OSError):
        names = {"d3d": "default"}
    return gr.update(choices=[(lab, n) for n, lab in names.items()], value="d3d", visible=len(names) > 1)


def _race_stream(prompt, bundle, modes, base, skip, run_id, d3d_drafter, engine=None, seconds=None):
    """The GPU part of a race: decode every mode, streaming ``(mode, update, done, info)``. Its arguments and what it
    yields are plain, picklable data; on ZeroGPU it runs in the GPU worker (``race_stream``), where the CUDA streams
    and events of each decode are created. ``update`` holds only what is new since the mode's previous one
    (``spaces_gpu.trace_delta``; ``merge_delta`` rebuilds the Trace); ``info``: ``timed_out`` (the race's time
    limit has passed), and on the first item ``warm_s`` (seconds this race spent warming up; 0: already warm).

    It stops before the next round once the race is cancelled (``app.runs``: in a worker, through the stop mark) or
    its time is up: ``seconds`` is the GPU time reserved for it (ZeroGPU), and the worker stops ``MARGIN_S`` before
    that reservation ends, counted from the moment it starts here; without ``seconds``, the race's clock is the
    handler's (``APP_RACE_SECONDS`` from the bundle's load)."""
    deadline = APP_RACE_SECONDS if seconds is None else max(1.0, float(seconds) - MARGIN_S)
    flag = runs.flag(run_id, deadline)  # in the handler's process its own flag; in a GPU worker a fresh one, clock from now
    stats, sent = {}, {}
    # served locally, the race's time limit starts after its warm-up (a process's first race on an engine packs and
    # warms every shape first); a GPU worker's limit is its reservation, which the warm-up spends like the rest
    after_warm = (lambda warm_s: flag.start_clock(APP_RACE_SECONDS) if warm_s > 0 else None) if seconds is None else None
    for mode, tr, done in service.race(bundle, prompt, modes, base, skip_layers=skip, cancel=flag, d3d_drafter=d3d_drafter,
                                       engine=engine, stats=stats, after_warm=after_warm):
        if tr.finish_reason and not done:
            continue  # the finished trace comes again at once, marked done and with its machine load: its spans cross once
        update, sent[mode] = trace_delta(tr, sent.get(mode))
        info = {"timed_out": flag.timed_out()}
        if "warm_s" in stats:
            info["warm_s"] = stats.pop("warm_s")
        yield mode, update, done, info


race_stream = maybe_gpu(_race_stream, duration=stream_duration)  # at import: ZeroGPU registers GPU functions before launch


def _stream_is_remote() -> bool:
    """Whether race_stream runs in another process (ZeroGPU's worker), where only the stop mark reaches it."""
    return stream_is_remote()


def _rounds(state) -> int:
    return sum(len(t.rounds) for t in _traces(state))


def run_race(prompt, bundle, modes, block_size, temperature, max_new_tokens, hypotheses, sampling, seed, verify, drafting, use_pruned, state,
             d3d_drafter="d3d", engine=None, pruning=None):
    """Stream the race: columns after every round (throttled), plots at the end. The bundle is loaded here, before
    the GPU part (``race_stream``) is entered (on ZeroGPU it was loaded at start-up, and a request never loads one).
    On ZeroGPU the race is sized to the GPU time a visitor may reserve (``spaces_gpu.gpu_budget``: fewer new tokens
    where the request does not fit, said in the status line), and a failed GPU call (ZeroGPU's quota, queue and
    worker errors) ends in the status line with the rounds that had arrived. ``pruning``: the Pruning tab's own state
    (``empty_pruning``), whose ``skips`` the pruned-drafter switch races."""
    state = dict(state or empty_state())
    no = gr.skip()
    try:
        prompt = service.check_prompt(prompt)
        modes = service.check_modes(modes)
        base = service.settings(modes[0], block_size, temperature, max_new_tokens, hypotheses, sampling, seed, verify, drafting)
        bundle = service.check_bundle(bundle)
        engine = service.check_engine(engine)
    except ValueError as e:
        gr.Warning(str(e))
        yield (f"**Error:** {e}", *[no] * 4, state)
        return
    zerogpu = on_zerogpu()
    budget = gpu_budget(len(modes), base.max_new_tokens) if zerogpu else None
    if budget is not None and budget.tokens < base.max_new_tokens:
        base = base.with_(max_new_tokens=budget.tokens)
    seconds = budget.seconds if budget is not None else None
    run_id = runs.start()
    flag = runs.get(run_id)
    state.update(bundle=bundle, traces={}, pieces={}, run=run_id)
    gen = None
    finished = False
    try:
        yield (f"Loading bundle `{bundle}` (first use converts the weights once; later loads take seconds)…",
               *_columns(state), state)
        d3d_drafter = d3d_drafter or "d3d"
        # the layers chosen for this drafter in the Pruning tab; None: the drafter as shipped
        skips = (pruning or {}).get("skips") or state.get("skips") or {}
        skip = list(skips.get(d3d_drafter) or []) if use_pruned and d3d_drafter in skips else None
        try:
            info = service.bundle_summary(bundle)  # loads the bundle: once per process, outside any GPU window
            service.check_race_drafter(bundle, d3d_drafter, skip)
            engine, why = service.resolve_engine(bundle, engine)
            if why:
                gr.Info(why)
        except (FileNotFoundError, ValueError, OSError) as e:
            gr.Warning(str(e))
            finished = True
            yield (f"**Error:** {e}", *[no] * 4, state | {"run": None})
            return
        note = f" with D3D layers {skip} skipped" if skip else (" with every D3D layer" if skip is not None else "")
        if d3d_drafter != "d3d":
            note += f" with the `{d3d_drafter}` D3D drafter"
        gpu_note = ""
        if budget is not None:
            gpu_note = f" · reserving {budget.seconds} s of GPU" + (f" · {budget.note}" if budget.note else "")
        last = 0.0
        remote = _stream_is_remote()
        if not remote:
            flag.start_clock(APP_RACE_SECONDS)  # a shared server: nobody holds the decode lane for long
        gen = race_stream(prompt, bundle, modes, base, skip, run_id, d3d_drafter, engine, seconds)
        live = set(modes)
        warm_s, worker_timed_out = None, False
        try:
            for mode, update, done, item in gen:
                # The modes take turns round by round (service.race); every mode's clock is stopped while this
                # handler runs, so building and sending an update never counts in a mode's time. Updates are
                # throttled (STREAM_EVERY_S) and the last one comes with the final status below. After a Stop the
                # updates are still read to the end: the race stops at its next round, and every round is kept.
                state["traces"][mode] = merge_delta(state["traces"].get(mode), update)
                warm_s = item.get("warm_s", warm_s)
                worker_timed_out = worker_timed_out or bool(item.get("timed_out"))
                if done:
                    live.discard(mode)
                now = time.perf_counter()
                if live and now - last >= STREAM_EVERY_S:
                    last = now
                    state["pieces"].update(service.pieces(bundle, _traces(state), known=state["pieces"]))
                    kernel = f", GEMM: {info['int4_kernel']}" if engine == "int4" else ""
                    yield (f"Running {', '.join(f'`{m}`' for m in modes)}{note}, taking turns round by round, on {info['description']} "
                           f"({engine} engine{kernel}, target attention: {info['attention']}){gpu_note} …",
                           *_columns(state, live), state)
        except Exception as e:  # noqa: BLE001 - a failed GPU call (ZeroGPU's gr.Error / RuntimeError) ends here, not in a traceback
            health.count("failed")
            finished = True
            if isinstance(e, ValueError) and not isinstance(e, gr.Error):  # a request the engine refused (gr.Error is a ValueError too)
                gr.Warning(str(e))
                yield (f"**Error:** {e}", *_columns(state), state | {"run": None})
                return
            if not isinstance(e, gr.Error) or getattr(e, "print_exception", True):
                traceback.print_exc(file=sys.stderr)  # the Space's log keeps the details
            try:
                state["pieces"].update(service.pieces(bundle, _traces(state), known=state["pieces"]))
            except (ValueError, OSError):
                pass
            status = gpu_error_status(e, _rounds(state))
            gr.Warning(status.replace("**", ""))
            yield (status, *_columns(state), state | {"run": None})
            return
        finished = True
        # read as the loop ends, not after the teardown below; on ZeroGPU the worker's clock decides
        timed_out, cancelled = flag.timed_out() or worker_timed_out, flag.is_set()
    finally:
        if not finished:  # the visitor left mid-race (Gradio closed this generator): free the lane now
            runs.cancel(run_id)  # also marks the race stopped for a GPU worker in another process
        if gen is not None:
            gen.close()
        runs.finish(run_id)
    state["run"] = None
    state["pieces"].update(service.pieces(bundle, _traces(state), known=state["pieces"]))  # the rounds since the last update
    ran = [m for m in MODES if m in state["traces"]]
    stopped = cancelled or any(state["traces"][m].finish_reason == "cancelled" for m in ran)
    health.count("stopped" if stopped else "races")
    health.trim()
    health.sweep()
    status = ("**Stopped**" if stopped else "**Done**") + f": {', '.join(ran)}{note} · bundle `{bundle}`"
    if engine == "int4":
        status += f" · int4 GEMM: {info['int4_kernel']}"
    status += output_check(state)
    if timed_out and budget is not None:
        status += (f" · stopped at the end of the GPU time reserved for this race ({budget.seconds} s, less {MARGIN_S} s kept "
                   "for starting the GPU worker and sending the last update); fewer modes or fewer new tokens fit inside it")
    elif timed_out:
        status += (f" · stopped at this server's time limit ({APP_RACE_SECONDS} s per race, so that the queue keeps moving); "
                   "fewer modes or fewer new tokens fit inside it")
    if budget is not None and budget.note:
        status += f" · {budget.note}"
    if remote and warm_s:
        status += (f" · warm-up in this GPU worker: {warm_s:.1f} s (its first race; later races on the same worker skip it)")
    untrained = [k for k, v in info["drafters"].items() if str(v).startswith("untrained")]
    if untrained and any(m != "ar" for m in ran):
        status += (f" · note: the {' and '.join(untrained)} drafter(s) of this bundle are untrained (initialised from "
                   "target layers), so drafts are rarely accepted and drafting modes run slower than ar; "
                   "the tokens are still exactly ar's")
    shared = [k for k, v in info["drafters"].items() if str(v).startswith("shared-weight adapter")]
    if shared and any(m.startswith("d3d") for m in ran):
        status += (" · note: this bundle's D3D drafter is the target's own layers (shared, no copy) with untrained adapters: "
                   "draft 1 is always the target's own token (τ ≥ 2 at temperature 0), the later drafts are rarely right, "
                   "and each draft costs about one target forward")
    load = race_load(_traces(state))
    if load is not None and (load.busy or not stopped):
        status += "\n\n" + load.status()
    why = economics_sentences(state)
    if why and not stopped:
        status += "\n\n" + why
    yield (status, *_columns(state), state)


def race_views(state):
    """The plots and the Rounds tab's controls for the race in ``state`` — a chained event after the
    race, so the streaming event never sends a no-change update to a plot (Gradio builds a new
    component per such update and kept one per race: +0.7 MiB a race, found by the soak)."""
    state = state or empty_state()
    tl, summ, acc, econ_fig, econ_tab = _plots(state)
    ran = [m for m in MODES if m in state["traces"]]
    pick = "d3d-async" if "d3d-async" in ran else (ran[-1] if ran else "d3d-async")
    return (tl, summ, acc, econ_fig, econ_tab, gr.update(choices=ran or list(MODES), value=pick),
            gr.update(maximum=max(1, _nrounds(state, pick) - 1), value=0), _caption(state))  # the lesson: step from round 0


def _nrounds(state, mode):
    tr = state["traces"].get(mode) if mode else None
    return len(tr.rounds) if tr else 1


def stop_race(state):
    runs.cancel((state or {}).get("run"))  # the server's flag for the race this session runs (none: nothing to do)
    return "Stopping after the current round…"


def replay_race(state):
    """Replay every mode's run side by side on its own real clock (the race, made visible)."""
    state = state or {}
    trs, projected = _clocked(state) if _traces(state) else ([], None)
    if not trs:
        yield ("Run a race first, then replay it.", *[gr.skip()] * 4)
        return
    by_mode = {t.mode: t for t in trs}
    end = max((s.t_end for t in trs for s in t.spans), default=0.0)
    tpt = ar_time_per_token(trs)
    # a projected clock can be far faster than real time: stretch it to last at least 4 s on screen
    slow = max(1.0, 4000.0 / end) if projected and end > 0 else 1.0
    clock = f"PROJECTED under “{projected}”, slowed {slow:.0f}× to watch" if projected else "real speed"
    t0 = time.perf_counter()
    while True:
        t_ms = (time.perf_counter() - t0) * 1e3 / slow
        cols = [column_html(by_mode.get(m), state["pieces"], m, t_ms=min(t_ms, end), ar_time_per_token=tpt)
                for m in MODES]
        yield (f"Replay ({clock}): {min(t_ms, end):.0f} ms / {end:.0f} ms of decoding", *cols)
        if t_ms >= end:
            break
        time.sleep(0.1)
    yield ("Replay finished", *_columns(state))


def show_rounds(mode, idx, state):
    return _rounds_view(state or empty_state(), mode, idx)


def step_round(mode, idx, delta, state):
    n = _nrounds(state or empty_state(), mode)
    idx = int(min(max(0, (idx or 0) + delta), max(0, n - 1)))
    return (gr.update(value=idx), *_rounds_view(state, mode, idx))


def layer_choices(bundle, drafter="d3d"):
    return service.pruning_layers(service.check_bundle(bundle), drafter or "d3d")


def pruning_drafters(bundle) -> list:
    """The Pruning tab's drafter picker: (label, name) for each of the bundle's D3D drafters."""
    return [(lab, n) for n, lab in service.d3d_drafters(bundle).items()]


def _economics_note(bundle, drafter, skip, per_layer) -> str:
    """What removing these layers saves per draft and does to d3d-seq's round on the machine of the shipped cost
    breakdown (``explain.pruning_round``); "" where the breakdown has no figure for this drafter."""
    costs = service.cost_breakdown(bundle)
    if not skip or not costs:
        return ""
    layers = len(layer_choices(bundle, drafter))
    if per_layer:  # the default drafter: its own draft row
        draft = (service.draft_cost_row(bundle) or {}).get("wall_ms")
        what = "a draft"
    else:  # d3d-deep: the overlap probe's draft of the same depth (an untrained fp32 drafter of as many layers)
        row = next((r for r in ((costs.get("overlap") or {}).get("rows") or []) if r.get("depth") == layers), None)
        draft = row["draft_ms"] if row else None
        per_layer = draft / layers if draft else None
        what = f"the cost table's {layers}-layer probe draft"
    return explain.pruning_round(costs, draft, per_layer, len(skip), what)


def load_pruning(bundle, state, drafter="d3d"):
    """The Pruning tab for ``drafter``: its layer toggles (the shipped default ticked), hint, curve and marginal costs;
    ``state``: the Pruning tab's own (``empty_pruning``), its ``skips`` reset to the default for this drafter."""
    state = dict(state or empty_pruning())
    drafter = drafter or "d3d"
    try:
        choices = layer_choices(bundle, drafter)
        default_skip = service.default_skip(bundle, drafter)
    except (ValueError, FileNotFoundError, OSError) as e:
        return gr.skip(), f"**Error:** {e}", gr.skip(), gr.skip(), state
    curve = service.pruning_curve(bundle, drafter)
    skips = dict(state.get("skips") or {})
    skips[drafter] = list(default_skip)
    state["skips"] = skips
    per_layer = service.drafter_layer_ms(bundle, drafter)
    hint = (f"`{drafter}` has {len(choices)} layers (L0–L{len(choices) - 1}). Untick one and its offline τ is measured "
            "at once, live, on the calibration anchors (positions in the calibration prompts where a block is drafted and "
            "scored against the target's own next tokens): the figure appears here and as a point on the curve.")
    if per_layer:
        hint += (f" Each removed layer saves about {per_layer:.1f} ms per draft on the machine of the shipped cost breakdown (Benchmarks › Where the time goes; the orange "
                 "dashed line, right axis).")
    if curve is None:
        hint += f" No pruning curve is shipped for `{drafter}` yet (`python -m d3d_core.training.prune --drafter {drafter}`)."
    elif not any("healed" in p for p in curve.get("curve") or []):
        hint += (" This curve was made without healing (a short re-training of the layers kept, after pruning), so it has no "
                 "healed points.")
    if default_skip:
        hint += (f" This drafter is shipped pruned: layer(s) {default_skip} are skipped "
                 "(the greedy pruning kept ≥ 99 % of τ on held-out prompts without them).")
    return (gr.update(choices=choices, value=[c for i, c in enumerate(choices) if i not in default_skip]), hint,
            figures.pruning_curve_figure(curve, layer_ms=per_layer), figures.marginal_cost_figure(curve), state)


def raced_view(bundle, drafter="d3d") -> str:
    """The Pruning tab's raced section: d3d-deep whole and pruned in the shipped benches, with their machine; "" for the
    8-layer drafter (the Measured bench races it whole)."""
    if drafter != "d3d-deep":
        return ""
    benches = service.deep_benches(bundle)
    if not benches:
        return ("No bench of `d3d-deep` is shipped for this bundle (`python -m d3d_core.measure.bench --d3d-drafter d3d-deep "
                "[--skip-layers 3]`).")
    return explain.deep_race_text(benches, service.provenance(benches[0]))


def _pruned_tau(bundle, skip, drafter="d3d") -> tuple:
    """(offline τ with ``skip``, τ with every layer, calibration anchors): the GPU part of the Pruning tab (it runs the
    drafter, and on a bundle without a shipped calibration set the target too)."""
    tau, full = service.offline_tau_live(bundle, skip, drafter)
    return tau, full, service.calibration_size(bundle, drafter)


pruned_tau = maybe_gpu(_pruned_tau, duration=PRUNING_SECONDS)


def measure_pruned(bundle, active, state, drafter="d3d"):
    """τ of ``drafter`` with only the ``active`` layers, measured live; ``state``: the Pruning tab's own (``empty_pruning``)."""
    state = dict(state or empty_pruning())
    drafter = drafter or "d3d"
    try:
        choices = layer_choices(bundle, drafter)
        keep = {int(str(a).split(" ")[0][1:]) for a in (active or [])}
        skip = [i for i in range(len(choices)) if i not in keep]
        if len(skip) == len(choices):
            raise ValueError("keep at least one drafter layer")
        t0 = time.perf_counter()
        tau, full, n_anchors = pruned_tau(bundle, skip, drafter)
    except Exception as e:  # noqa: BLE001 - a failed GPU call (ZeroGPU's gr.Error / RuntimeError): said, not a traceback
        if isinstance(e, (ValueError, FileNotFoundError, OSError)) and not isinstance(e, gr.Error):
            gr.Warning(str(e))
            return f"**Error:** {e}", gr.skip(), state
        if not isinstance(e, gr.Error) or getattr(e, "print_exception", True):
            traceback.print_exc(file=sys.stderr)
        status = gpu_error_status(e, 0).split(" · ")[0]
        gr.Warning(status.replace("**", ""))
        return status, gr.skip(), state
    state["skips"] = {**(state.get("skips") or {}), drafter: skip}
    curve = service.pruning_curve(bundle, drafter)
    per_layer = service.drafter_layer_ms(bundle, drafter)
    keep99 = "✓ within the 99 % line" if tau >= 0.99 * full else "below the 99 % line"
    msg = (f"**offline τ = {tau:.3f}** with {len(skip)} of {len(choices)} layers removed "
           f"({tau / full:.1%} of the full drafter's {full:.3f}, {keep99})"
           f"{_economics_note(bundle, drafter, skip, per_layer)} · measured in {time.perf_counter() - t0:.1f} s "
           f"on {n_anchors} calibration anchors. To race it: in the Race tab pick the `{drafter}` D3D drafter and tick "
           "*race the D3D drafter pruned as in the Pruning tab*.")
    on_axis = tau / full * _curve_full(curve, full)
    same_set = abs(on_axis - tau) < 1e-9
    live = (len(skip), on_axis, "your selection" if same_set else
            f"your selection: {tau / full:.1%} of full τ on the live set, drawn at that share of the curve's τ")
    return msg, figures.pruning_curve_figure(curve, live=live, layer_ms=per_layer), state


def _curve_full(curve, live_full: float) -> float:
    """The curve's unpruned τ (its first point), so a live point measured on the live calibration set is drawn at the
    same relative height on the curve's axis; the live set's own τ when no curve is shipped."""
    pts = (curve or {}).get("curve") or []
    return pts[0]["tau"] if pts else live_full


def engines_views(bundle) -> tuple:
    """The Benchmarks tab's engines section for ``bundle``: (text, table, figure, int4 cost provenance, int4 cost figure)
    from its shipped engines run, per-engine benches (``service.engine_runs``) and the int4 engine's cost breakdown."""
    engines, benches = service.engine_runs(bundle)
    prov = service.provenance({**engines, "engine": "fp32, int4 and llama.cpp"}) if engines else ""
    costs4 = service.cost_breakdown(bundle, "int4")
    return (engine_views.engines_text(engines, benches) + (("\n\n" + prov) if prov else ""),
            engine_views.engines_table(engines), engine_views.speculation_by_engine_figure(benches, engines),
            engine_views.int4_costs_text(costs4) + "\n\n" + service.provenance(costs4), figures.cost_breakdown_figure(costs4))


def bench_views(bundle) -> tuple:
    """The Benchmarks tab's views of a bundle's shipped bench result, sweep and cost breakdown, each
    read once: (provenance, measured table, model check, dataset choices, acceptance figure, sweep
    figure, cost provenance, cost figure, overlap sentence)."""
    res = service.bench_result(bundle)
    costs = service.cost_breakdown(bundle)
    datasets = ["all"] + list(((res or {}).get("acceptance_hist") or {}).keys())
    return (service.provenance(res), figures.bench_table(res), figures.latency_check_table(res), datasets,
            figures.bench_acceptance_figure(res), figures.speedup_vs_block_figure(service.block_sweep(bundle), service.block_sweep_datasets(bundle), service.block_sweep_stale(bundle)),
            service.provenance(costs), figures.cost_breakdown_figure(costs), figures.overlap_text(costs))


def project_speedups(profile, B, tau_scale, hit, H, vx, dx, px):
    """The model's speedups, every drafting mode at its own τ as the bench measured it (``latency.measured_taus``)
    times ``tau_scale`` — never one τ for all modes."""
    try:
        B, H, scale, hit = int(B), int(H), float(tau_scale), float(hit)
        profiles = service.cost_profiles()
        if profile not in profiles:
            raise ValueError(f"unknown cost profile {profile!r}; choose one of {', '.join(profiles)}")
        if scale <= 0 or not 0.0 <= hit <= 1.0:
            raise ValueError("the τ scale must be positive and the hit rate between 0 and 1")
        taus, _, where = measured_taus(service.bench_result(service.app_bundle()))
        if not taus:
            taus, where = {m: 2.0 for m in MODES if m != "ar"}, "no bench result for this bundle: τ 2.0 assumed for every mode"
        p = profiles[profile].scaled(verify=float(vx), draft=float(dx), packed=float(px))
        rows = project_modes(p, B, {m: t * scale for m, t in taus.items()}, hit, H)
    except (ValueError, TypeError) as e:
        return figures.projection_figure([], str(profile), 1.0, 0.0, 2, 1), f"**Error:** {e}"
    src = (f"**{p.name}** — source: {p.source}. Assumptions: {p.assumptions}. T_step = {p.t_step_ms:.2f} ms. "
           f"τ per mode, as measured: {where}; the slider scales each mode's own τ (capped to [1, B]). These τ come from "
           "this bundle's drafters, whose sizes differ (DFlash 2 drafter layers, D3D 8): a drafter-size confound, not only "
           "a difference of method." + service.gpu_profile_note())
    return figures.projection_figure(rows, profile, scale, hit, B, H), src


def download_traces(state):
    trs = _traces(state or {})
    if not trs:
        raise gr.Error("Nothing to download yet: run a race first.")
    path = health.temp_path("d3d-traces-", ".json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(service.traces_json(trs))
    return path


def export_race(state):
    """The current race as one self-contained HTML file (opens offline; the Traces tab reads it back)."""
    state = state or {}
    try:
        page = race_html(_traces(state), state.get("pieces") or {})
    except ValueError as e:
        raise gr.Error(str(e)) from None
    path = health.temp_path("d3d-race-", ".html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def upload_traces(file, state):
    state = dict(state or empty_state())
    no = gr.skip()
    if file is None:
        return "Choose a trace JSON file to view.", no, no, no, no, no, no, state, no
    path = file if isinstance(file, str) else getattr(file, "name", None)
    try:
        if not path or not os.path.isfile(path):
            raise ValueError("the uploaded file could not be read")
        size = os.path.getsize(path)
        if size > service.APP_LIMITS["upload_bytes_max"]:
            raise ValueError(f"file is too large ({size:,} bytes, limit {service.APP_LIMITS['upload_bytes_max']:,})")
        with open(path, "rb") as f:
            data = f.read()
        if data.lstrip()[:15].lower().startswith(b"<!doctype html"):  # an exported race page
            data = traces_json_of(data.decode("utf-8", errors="replace"))
        trs = service.read_traces(data)
        del data
        health.trim()
        health.sweep()
        bundle = trs[0].bundle
        state["traces"] = {t.mode: t for t in trs}
        try:
            state["pieces"] = service.pieces(bundle, trs)
        except ValueError:  # a bundle this server doesn't have: show ids
            state["pieces"] = {}
    except ValueError as e:
        return f"**Could not read that trace:** {e}", no, no, no, no, no, no, state, no
    tl, summ, acc, econ_fig, econ_tab = _plots(state)
    ran = [m for m in MODES if m in state["traces"]]
    return (f"**Loaded** {len(trs)} trace(s) from bundle `{trs[0].bundle}`: {', '.join(ran)}{output_check(state)} — see the Race, Rounds, Timeline and Acceptance tabs.",
            tl, summ, acc, econ_fig, econ_tab, gr.update(choices=ran, value=ran[-1]), state, gr.update(maximum=max(1, _nrounds(state, ran[-1]) - 1), value=max(0, _nrounds(state, ran[-1]) - 1)))


# the recorded race's per-speedup range, in plain words on hover (the status line names it only as the rounds' spread)
RESAMPLED_TIP = ("Each speedup's range is 10–90 % of that speedup recomputed many times over rounds drawn at random, with "
                 "repeats, from this answer's own rounds (the mode's and ar's: a bootstrap): how much it hangs on which rounds "
                 "this answer happened to have. Repeating the identical race varies only the timing, so its spread is narrower.")


def recorded_note(meta: dict) -> str:
    """Where and when the recorded race ran, in short sentences (nothing ran here: its times are that machine's), and the
    two uncertainties a reader sees: the spread of the repeated races and each speedup's own range (explained on hover)."""
    spread = (meta.get("spread") or {}).get("d3d-seq")
    seq = [r["modes"].get("d3d-seq", {}).get("speedup") for r in meta.get("runs") or []]
    seq = [x for x in seq if x is not None]
    runs_note = (f" It is the median of {len(meta['runs'])} identical races: d3d-seq read {min(seq):.2f}–{max(seq):.2f}× "
                 f"across them (within {spread:.0%}: timing noise between runs). The wider range after each speedup below is "
                 f"<span class='term' title='{html.escape(RESAMPLED_TIP)}'>its spread over this answer's rounds</span>."
                 ) if len(seq) > 1 and spread is not None else ""
    tag = service.run_tag(meta.get("date"), meta.get("cpu"), meta.get("cores"), meta.get("engine") and f"{meta['engine']} engine",
                  meta.get("commit"))
    return (f"📼 **Recorded race** {tag}, the {meta.get('preset', 'lesson')} preset. Nothing ran here: its times are that "
            f"machine's, and **▶ Run race** races here.{runs_note}")


def open_recorded(bundle, state):
    """The class demo: show the race shipped for ``bundle`` (``service.recorded_race``) in every tab, as if just run."""
    state = dict(state or empty_state())
    no = gr.skip()
    if state.get("run"):
        return ("A race is running: press **■ Stop** first, then open the recorded race.", *[no] * 4, state)
    try:
        got = service.recorded_race(service.check_bundle(bundle), "lesson")
    except ValueError as e:
        gr.Warning(str(e))
        return (f"**Could not open the recorded race:** {e}", *[no] * 4, state)
    if got is None:
        return (f"No recorded race ships with bundle `{bundle}`: press **▶ Run race** to race it live.", *[no] * 4, state)
    trs, meta = got
    state.update(bundle=trs[0].bundle, traces={t.mode: t for t in trs}, run=None)
    state["pieces"] = service.pieces(trs[0].bundle, trs)
    status = recorded_note(meta) + output_check(state)
    load = race_load(trs)
    if load is not None:  # a quiet machine is a note on the same line; a busy one a warning of its own
        status += ("\n\n" if load.busy else " · ") + load.status()
    why = economics_sentences(state)
    if why:
        status += "\n\n" + why
    return (status, *_columns(state), state)


# ----------------------------------------------------------------------------- layout


CLOCK_TAGS = {  # what a tag in a clock's name means, said only where an offered clock carries it
    "(derived)": "(derived): costs computed from a GPU's datasheet (memory bandwidth, FLOP/s) and the model's size, not "
                 "measured on that GPU",
    "(measured": "(measured, …): costs timed on that GPU by scripts/gpu_check.py",
    "(scaled)": "(scaled): a profile whose costs the what-if sliders of Benchmarks › Projections multiplied",
}


# the Measured bench table's caption: what its rate columns are shares of (bench.summarize: hit_rate is the mean over
# prompts of each trace's Stats.hit_rate, hits over the rounds with a packed pass, which a skipped round never has)
BENCH_TABLE_LABEL = ("Measured (bench command: its own τ and times, not this race's — How it works › Which τ is which; scroll "
                     "for the 'average' rows at the end). hit_rate (d3d-async): share of its "
                     "drafted rounds whose next block one of its guesses had already drafted during the check, per prompt, "
                     "then averaged; rounds the draft gate skipped make no guesses and do not count. skipped: share of all "
                     "rounds the gate skipped. Rows marked (verify …, drafting …): the same run with another rule, averaged "
                     "over the datasets")


PRUNING_INTRO = ("Untick drafter layers to skip them: a skipped layer adds nothing, and its input passes on to the next layer "
                 "unchanged (the *residual stream*: the running sum every layer adds its output to). The offline τ is "
                 "re-measured live on a small calibration set (fixed prompts, no decoding); the curve shows the precomputed "
                 "greedy progression (at each step, drop the layer whose removal costs the least τ). The dashed grey line marks "
                 "**99 % of this drafter's calibration τ**, the bar a removed layer must stay above (the dotted olive line: the "
                 "same for its held-out τ). For scale, the D3D preprint (the paper this app's D3D method comes from) kept 99 % "
                 "with 5 of a **36-layer** drafter's layers removed; an 8-layer drafter has no spare layers (How it works › "
                 "*What pruning trades* says why).")


# the Traces tab: what a trace file holds (d3d_core.decoding.trace.Trace) and what it is for (upload_traces reads it back)
TRACES_INTRO = ("**A trace** is the whole record of a race, one per mode: the prompt and settings; every round's anchor, drafts "
                "(with the drafter's probabilities), the target's tokens, accepted count and bonus (d3d-async: its hypotheses "
                "too); each forward's start and end on the target and drafter lanes; the stats and the machine's load. The race's "
                "columns, Timeline, Acceptance and Rounds are drawn from it alone.\n\n**What for:** keep or share a race. "
                "*Prepare download* writes this session's race to one JSON file; uploading one (or a race exported as HTML "
                "on the Race tab) shows that race again in those tabs, with nothing run.")


# the Timeline's Economics of this run: what its bars, column lines and table mean
ECONOMICS_NOTE = ("**Economics of this run.** Per output token a drafting mode pays its decode time ÷ the tokens it printed "
                  "(about one round ÷ τ: a round commits a + 1 tokens, `a` accepted drafts + the bonus; the last round's tokens past "
                  "the answer's end or the token limit are cut, and τ counts them while the output does not, so per "
                  "token is then a little above round ÷ τ); a round is a "
                  "verify plus any drafting the target had to wait for. The bars split each mode's measured time per token "
                  "into verify, draft not hidden behind verify, and other (neither lane busy); they add up to the measured "
                  "time per token, and per round they add up to the round. *T_step* is what `ar` paid per token in this race; "
                  "*break-even τ* = round ÷ T_step, the τ at which the mode, with these round costs, would tie `ar` here "
                  "(the same number as \"a round costs N ar steps\"). This T_step differs from the "
                  "Benchmarks tab's *step* (one forward alone, at a fixed context, on a quiet machine, in another run), and can "
                  "come out above or below it: it adds ar's own bookkeeping (more), but its forwards read this prompt's context, "
                  "often shorter than the fixed one (less), on this run's machine, which may have been faster or slower then. "
                  "The table has one column per mode; its times are means over the run (*T_packed*: d3d-async's drafts for "
                  "all H hypotheses in one forward, run during verify).")


def hit_slider_label(hit: float, where: str) -> str:
    """The Projections hit-rate slider's label: its starting value (``service.measured_point``) and where it was
    measured (``service.measured_point_and_source``)."""
    return f"hit rate (d3d-async); starts at {hit:.2f}: {where}"


def clock_info(names) -> str:
    """The Timeline clock's help text: what a projected clock keeps, and what each tag in the offered clocks' names
    means — only the tags some offered clock carries."""
    tags = [w for t, w in CLOCK_TAGS.items() if any(t in str(n) for n in names)]
    return ("A projected clock keeps this run's rounds (its τ, accepts and hits) and changes only what each forward costs."
            + (" " + "; ".join(tags) + "." if tags else ""))


def decode_concurrency() -> int:
    """Decodes at once (races and Pruning measurements share the ``decode`` lane): one where they share this machine's
    cores or its one GPU; on ZeroGPU each runs in its own GPU worker on its own lent GPU, so several
    (``spaces_gpu.zerogpu_concurrency``)."""
    return zerogpu_concurrency() if on_zerogpu() else 1


def zerogpu_note() -> str:
    """What a visitor of a ZeroGPU Space is told under the Run button: races at once, GPU time per race, longest wait."""
    n, cap = decode_concurrency(), max_duration()
    wait_min = -(-APP_QUEUE_MAX // n) * cap / 60
    return (f"On this ZeroGPU Space each race borrows a GPU for at most {cap} s (a visitor without an account has "
            f"{quota_seconds()} s of ZeroGPU a day; a longer request would be refused), so tokens × modes are capped and the "
            f"Status line above the tabs says so; {n} races run at once, each on its own GPU, and with a full queue ({APP_QUEUE_MAX}) a wait can "
            f"reach about {wait_min:.0f} min. Stop ends the GPU work at its next round.")


def build_demo() -> gr.Blocks:
    health.tune_malloc()
    lim = service.APP_LIMITS
    home = service.app_bundle()  # the bundle the page opens on (D3D_BUNDLE on a GPU Space), one this host can run
    # delete_cache: Gradio's copies of served files (downloads, exports, uploads) go once past the app's temp-file age
    with gr.Blocks(title="D3D Studio", fill_width=True, delete_cache=(max(10, APP_TEMP_MAX_AGE_S // 3), APP_TEMP_MAX_AGE_S)) as demo:
        state = gr.State(empty_state(), time_to_live=APP_SESSION_TTL_S)
        pstate = gr.State(empty_pruning(), time_to_live=APP_SESSION_TTL_S)
        gr.Markdown(HEADER, elem_id="header")
        status = gr.Markdown("Pick a prompt and press **Run race**.", elem_id="status")
        with gr.Tabs():
            with gr.Tab("Race", id="race"):
                # the page fits a 1000 px screen: the prompt, engine and D3D drafter on the left, the bundle, modes, sizes
                # and the pruned-drafter switch on the right (two columns of about equal height), the rules a first race
                # leaves as they are folded below
                with gr.Row():
                    with gr.Column(scale=3):
                        with gr.Row(elem_id="presets"):
                            pre_lesson = gr.Button("🎓 Lesson", size="sm", elem_id="preset-lesson", min_width=110)
                            pre_gate = gr.Button("+ draft gate", size="sm", elem_id="preset-gate", min_width=110)
                            pre_adapt = gr.Button("+ adaptive verify", size="sm", elem_id="preset-adaptive", min_width=110)
                            pre_fair = gr.Button("⚖ fair race (int4)", size="sm", elem_id="preset-fair", min_width=110)
                            recorded_btn = gr.Button("📼 Recorded race", size="sm", elem_id="preset-recorded", min_width=110)
                            presenter = gr.Checkbox(False, label="🖥 Presenter", elem_id="presenter", container=False, min_width=130)
                        gr.Markdown(lesson.PRESET_BUTTONS, elem_id="preset-buttons")
                        preset_note = gr.Markdown(lesson.PRESET_NOTES["lesson"], elem_id="preset-note")
                        prompt = gr.Textbox(label="Prompt", lines=3, max_lines=12, value=lesson.PRESETS["lesson"]["prompt"], elem_id="prompt")
                        engine = gr.Radio([("int4 (4-bit weights, faster ar)", "int4"), ("fp32 (32-bit weights, slower ar)", "fp32")],
                                          value=lesson.PRESETS["lesson"]["engine"], label="Engine (every mode, ar included)", elem_id="engine",
                                          info=ENGINE_INFO)
                        d3d_names = service.d3d_drafters(home)
                        d3d_pick = gr.Radio([(drafter_choice_label(lab), n) for n, lab in d3d_names.items()], value="d3d", visible=len(d3d_names) > 1,
                                            label="D3D drafter (d3d-seq, d3d-async)", elem_id="d3d-drafter",
                                            info=D3D_DRAFTER_INFO)
                    with gr.Column(scale=2):
                        bundle = gr.Dropdown(service.bundle_names(), value=home, elem_id="bundle",
                                             label="Bundle: a target model + its drafters (smollm2-135m: from its GGUF file)")
                        modes = gr.CheckboxGroup(list(MODES), value=list(MODES), label="Modes to run")
                        gr.Examples([[p] for p, _ in EXAMPLES], inputs=[prompt], example_labels=[lab for _, lab in EXAMPLES],
                                    label=EXAMPLES_LABEL)
                        block = gr.Slider(lim["block_min"], lim["block_max"], value=service.default_block(home), step=1,
                                          label="Block size B (this bundle's default: its trained block size)",
                                          info=BLOCK_INFO)
                        hyps = gr.Slider(lim["h_min"], lim["h_max"], value=4, step=1, label="Hypotheses H (d3d-async)",
                                         info=HYPS_INFO)
                        max_new = gr.Slider(8, lim["max_new_max"], value=lesson.PRESETS["lesson"]["max_new_tokens"], step=8, label="Max new tokens")
                        use_pruned = gr.Checkbox(value=False, label="race the D3D drafter pruned as in the Pruning tab",
                                                 info="on: only the layers ticked there; off: the drafter as shipped")
                with gr.Accordion("Verify plan, drafting and sampling (set by the presets above: the lesson verifies every draft of every round)", open=False,
                                  elem_id="race-rules"):
                    with gr.Row():
                        verify = gr.Radio(["adaptive", "full"], value=lesson.PRESETS["lesson"]["verify"], label="Verify plan",
                                          info="adaptive: verify only the drafts likely to pay (the rest are held back: pale yellow in Rounds). "
                                               "full: all B − 1 drafts. verify(k) (in the Status line above the tabs, "
                                               "its folded *What each round cost* part) = one target forward over k tokens.")
                        drafting = gr.Radio(["gated", "always"], value=lesson.PRESETS["lesson"]["drafting"], label="Drafting",
                                            info="gated: skip the draft while drafting has lately not paid (pale blue 'no draft' rows in "
                                                 "Rounds). always: draft every round.")
                    with gr.Row():
                        temp = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature")
                        sampling = gr.Radio(["match", "rejection"], value="match", label="Verify rule (temperature > 0)")
                        seed = gr.Number(value=0, precision=0, label="Seed", minimum=0)
                with gr.Row():
                    run_btn = gr.Button("▶ Run race", variant="primary", elem_id="run")
                    stop_btn = gr.Button("■ Stop", variant="stop", elem_id="stop")
                    replay_btn = gr.Button("↻ Replay side by side (real time)", elem_id="replay")
                    export_btn = gr.Button("⬇ Export race as HTML", elem_id="export")
                if on_zerogpu():
                    gr.Markdown(zerogpu_note(), elem_id="zerogpu-note")
                export_file = gr.File(label="Race as one HTML file (opens offline; the Traces tab can load it back)", interactive=False,
                                      elem_id="export-file", visible=False)
                gr.HTML(legend_html())
                with gr.Row(equal_height=False):
                    cols = [gr.HTML(column_html(None, {}, m), elem_id=f"col-{m}") for m in MODES]
            with gr.Tab("Rounds", id="rounds"):
                gr.Markdown("One row per round, one column per block position: the **anchor** (the last committed token, where the block starts), "
                            "the drafts d1 … d(B−1), and the bonus (the target's own token after the accepted drafts). Hover a cell for the "
                            "drafter's probability and the target's token. Step through the decode round by round. A row of rejected drafts can read as "
                            "nonsense: they are the drafter's wrong guesses, thrown away — only the target's tokens are kept.\n\n"
                            + figures.GLYPH_LEGEND, elem_id="rounds-intro")
                with gr.Row():
                    r_mode = gr.Radio(list(MODES), value="d3d-async", label="Mode")
                    r_idx = gr.Slider(0, 1, value=0, step=1, label="Show rounds up to")
                with gr.Row():
                    prev_btn = gr.Button("◀ previous round")
                    next_btn = gr.Button("next round ▶")
                r_caption = gr.Markdown()
                r_grid = gr.Plot(figures.rounds_grid_figure(None, {}), label="Rounds")
                r_hyps = gr.Dataframe(figures.hypotheses_table(None, 0, {}), interactive=False,
                                      label="Hypotheses (a, t) drafted during this round's verify (d3d-async): \"a drafts will be accepted and the bonus will be t\"; "
                                            "a hit means the next block was ready")
                gr.Markdown(figures.HYPOTHESES_NOTE, elem_id="hypotheses-note")
            with gr.Tab("Timeline", id="timeline"):
                with gr.Row():
                    clock = gr.Radio([("as measured (the race's own clock)" if n == service.MEASURED_CLOCK else n, n) for n in service.clock_names()],
                                     value=service.MEASURED_CLOCK, elem_id="clock",
                                     label="Clock: as measured (the race's own), or this run re-timed on other hardware (latency model, projected)",
                                     info=clock_info(service.clock_names()))
                with gr.Accordion("What this clock assumes", open=False):
                    clock_src = gr.Markdown(service.clock_assumptions(service.MEASURED_CLOCK), elem_id="clock-assumptions")
                # two short sections, one at a time (the page fits a 1000 px screen): both lanes, then what a token cost
                with gr.Tabs(elem_id="timeline-sections"):
                    with gr.Tab("Both lanes, in ms", id="timeline-lanes"):
                        tl_plot = gr.Plot(figures.timeline_figure([]), label="Timeline")
                        tl_cap = gr.Markdown(elem_id="timeline-caption")
                        tl_summary = gr.Dataframe(figures.timeline_summary([]), interactive=False,
                                                  label="Overlap and idle time — overlap share: the part of the drafter's busy time that ran while the "
                                                        "target verified (hidden work); target idle: time the target waited (for drafts, a miss's sync "
                                                        "draft, bookkeeping); hit rate: share of d3d-async rounds whose next block was already drafted "
                                                        "— why, for this run, is written above the table")
                        gr.Markdown("Next: **Economics of this run** (the tab beside this one) splits what one output token cost.",
                                    elem_id="timeline-next")
                    with gr.Tab("Economics of this run", id="timeline-economics"):
                        gr.Markdown(ECONOMICS_NOTE, elem_id="economics-note")
                        econ_plot = gr.Plot(figures.economics_figure([]), label="ms per output token", elem_id="economics")
                        econ_table = gr.Dataframe(figures.economics_table([]), label="Costs of this run (ms; measured, or projected under the chosen clock)",
                                                  interactive=False, wrap=True)
            with gr.Tab("Acceptance", id="acceptance"):
                acc_plot = gr.Plot(figures.acceptance_figure([]), label="Acceptance")
                gr.Markdown("This race's acceptance. d3d-seq and d3d-async share one drafter, yet their τ can differ: on either "
                            "engine the drafter runs its MLPs and head in int8 (the Engine choice — fp32 or int4 — is the target's), "
                            "int8 scales each batch of rows as a whole, and the two modes draft in different batches, so where the "
                            "drafter is unsure they guess differently (a server started with `D3D_DRAFTER_INT8=off`, a setting of "
                            "the server and not of this page, drafts in fp32, and there their τ agree). How τ and speed "
                            "change with the block size B: **Benchmarks › Acceptance and block "
                            "size** (a bench sweep). The app shows several τ (this race's, the bench's, offline, calibration, held-out): "
                            "**How it works › Which τ is which** says how each is measured and why they differ.", elem_id="which-tau")
            with gr.Tab("Pruning", id="pruning"):
                gr.Markdown(PRUNING_INTRO, elem_id="pruning-intro")
                p_drafter = gr.Radio(pruning_drafters(home), value="d3d", label="Drafter to prune", elem_id="prune-drafter",
                                     info="d3d: the 8-layer D3D drafter. d3d-deep: the target's own 30 layers (shared, not copied) "
                                          "+ trained rank-64 adapters (small weights added to those layers) that act on the MASK "
                                          "slots (the positions still to be guessed) — the paper's deep-drafter setting in small.")
                p_layers = gr.CheckboxGroup([], label="Active D3D drafter layers", elem_id="prune-layers")
                p_msg = gr.Markdown()
                with gr.Row():
                    p_curve = gr.Plot(figures.pruning_curve_figure(None), label="Pruning curve")
                    p_marg = gr.Plot(figures.marginal_cost_figure(None), label="Marginal cost")
                p_raced = gr.Markdown(elem_id="prune-raced")
                p_load = gr.Button("Reload layers and curve")
            with gr.Tab("Benchmarks", id="benchmarks"):
                # short sections, one at a time (the page fits a 1000 px screen); the first says what the others hold
                with gr.Tabs(elem_id="bench-sections"):
                    with gr.Tab("Measured bench", id="bench-measured"):
                        gr.Markdown("**Measured** by `python -m d3d_core.measure.bench` (shipped with the bundle; τ, speedup vs ar in the same run, "
                                    "lossless rate = same tokens as ar, hit rate, overlap). `hf-generate` and `hf-prompt-lookup` are the peers a user "
                                    "would run instead: Hugging Face `generate` (greedy) and its prompt-lookup speculative decoding, same target and prompts.\n\n"
                                    "The other sections, left to right: **Acceptance and block size** · **Where the time goes** (each forward "
                                    "against the measured machine's bound) · **Engines** (fp32, int4 and llama.cpp) · **int4 step costs** · "
                                    "**Model check** (the latency model against this bench) · **Projections** (other hardware, model-based).",
                                    elem_id="bench-intro")
                        gr.Markdown(service.bench_sources(home), elem_id="bench-sources")
                        v_prov, v_table, v_check, v_ds, v_acc, v_sweep, v_cprov, v_costs, v_overlap = bench_views(home)
                        b_prov = gr.Markdown(v_prov, elem_id="bench-provenance")
                        b_table = gr.Dataframe(v_table, label=BENCH_TABLE_LABEL, interactive=False)
                    with gr.Tab("Acceptance and block size", id="bench-acceptance"):
                        with gr.Row():
                            with gr.Column():
                                b_ds = gr.Dropdown(v_ds, value="all", label="Acceptance histogram of dataset")
                                b_acc = gr.Plot(v_acc, label="Accepted length per round (bench)")
                            with gr.Column():
                                b_sweep = gr.Plot(v_sweep, label="Block-size sweep (bench --block-sizes)")
                                gr.Markdown(service.provenance(service.block_sweep_result(home)), elem_id="sweep-provenance")
                    with gr.Tab("Where the time goes", id="bench-costs"):
                        gr.Markdown("**Where the time goes** (`python -m d3d_core.measure.costs`): each forward's wall time split into the layer GEMMs, "
                                    "attention, the LM head and everything else. The black diamond is a yardstick, not a floor: the forward's bytes at the read speed a plain "
                                    "copy reached in the same run (or its FLOPs at the measured GEMM rate, whichever is longer). GEMMs that stream their weights faster than a plain copy "
                                    "finish inside it; a bar far beyond it is time a faster engine could still win. The machine is named in the line below. "
                                    "Speculation pays when verify(B) (one target forward over B tokens) costs about one step and a draft a small "
                                    "fraction of one.")
                        b_cprov = gr.Markdown(v_cprov)
                        b_costs = gr.Plot(v_costs, label="Cost breakdown")
                        b_overlap = gr.Markdown(v_overlap, elem_id="overlap-crossover")
                    with gr.Tab("Engines", id="bench-engines"):
                        gr.Markdown("**Engines: how fast is the baseline, and what is speculation worth at each speed?** "
                                    "`python -m d3d_core.measure.engines` times plain decoding on the fp32 and int4 engines and llama.cpp "
                                    "(`--peers llama-cpp`, an optional install) on the same prompts and threads in one run; a bench per engine "
                                    "(`bench --engine fast|int4`) times every mode against that engine's own ar. The Race tab races on either engine.")
                        e_text, e_table, e_fig, e_cprov, e_costs = engines_views(home)
                        b_etext = gr.Markdown(e_text, elem_id="engines-text")
                        b_etable = gr.Dataframe(e_table, label=("ar per engine and llama.cpp (engines command, one run); step ms: ar's mean decode step over these "
                                                      "prompts at their own context lengths, not the cost breakdown's one forward at a 300-token context; "
                                                      "llama.cpp's prompt lookup is not lossless against its own plain decoding — its verify of several "
                                                      "tokens rounds differently — so the two agree with fp32 ar differently"),
                                               interactive=False)
                        b_efig = gr.Plot(e_fig, label="Speculation per engine (a bench per engine)")
                    with gr.Tab("int4 step costs", id="bench-int4-costs"):
                        b_ecprov = gr.Markdown(e_cprov)
                        b_ecosts = gr.Plot(e_costs, label="Cost breakdown, int4 engine")
                    with gr.Tab("Model check", id="bench-model-check"):
                        gr.Markdown("**Latency model check** on the same run: the speedup the model (the *Projections* section) predicts from the "
                                    "measured τ and hit rate, with the costs the run itself paid (mean span times) and, where the bench ran with "
                                    "`--cost-probe`, with separately probed costs (those columns appear only when measured). "
                                    "The error is (predicted − measured) / measured.\n\n"
                                    "**What it checks, and what not.** With the run's own costs it tests the model's *form* — that a round costs "
                                    "T_draft + T_verify (sequential) or max(T_verify, T_packed) + misses × T_draft (async), and that τ and the "
                                    "hit rate turn that into a speedup — not any cost figure: a small error says the formula the Projections use "
                                    "accounts for where this run's time went. The GPU profiles' costs are datasheet-derived and unchecked here.")
                        b_check = gr.Dataframe(v_check, label="Model vs measured speedup", interactive=False)
                    with gr.Tab("Projections", id="bench-projections"):
                        gr.Markdown("**Projected** with the latency model (`d3d_core/measure/latency.py`): sequential round = T_draft + T_verify, async round = "
                                    "max(T_verify, T_packed) + miss rate × T_draft (verify and packed pass each slowed by the contention the probe "
                                    "measured when they run together, where a profile has it), per-token time = round / τ. These are model-based numbers, "
                                    "not measurements; each cost profile states its source and assumptions. The τ and hit rate are this "
                                    "bundle's (135 M target, its small drafters): a projection answers *what would these rounds cost on that "
                                    "hardware*, not *what speedup would that model get* — an 8B target with its own drafters has its own τ.")
                        with gr.Row():
                            pj_profile = gr.Dropdown(list(service.cost_profiles()), value=list(service.cost_profiles())[1],
                                                     label="Cost profile (“measured”: timed on that machine, a GPU by scripts/gpu_check.py; "
                                                           "“derived”: assumed from datasheets)")
                            m_tau, m_hit, m_B, m_where = service.measured_point_and_source(home)
                            pj_B = gr.Slider(2, 16, value=m_B, step=1, label="Block size B")
                            pj_H = gr.Slider(1, 32, value=4, step=1, label="Hypotheses H")
                        with gr.Row():
                            pj_tau = gr.Slider(0.5, 3.0, value=1.0, step=0.01,
                                               label="τ scale: × each mode's own measured τ (1 = as the bench measured each mode; capped to [1, B])")
                            pj_hit = gr.Slider(0.0, 1.0, value=m_hit, step=0.01, label=hit_slider_label(m_hit, m_where))
                        with gr.Row():
                            pj_v = gr.Slider(0.25, 4.0, value=1.0, step=0.05, label="× verify cost")
                            pj_d = gr.Slider(0.25, 4.0, value=1.0, step=0.05, label="× draft cost")
                            pj_p = gr.Slider(0.25, 4.0, value=1.0, step=0.05, label="× packed-pass cost")
                        pj_plot = gr.Plot(label="Projected speedup (model)")
                        pj_src = gr.Markdown()
            with gr.Tab("How it works", id="explain"):
                # one short section at a time (the page fits a 1000 px screen); the first says in which order to read them
                with gr.Tabs(elem_id="explain-sections"):
                    with gr.Tab("Start here", id="explain-start"):
                        gr.Markdown(explain.START, elem_id="explain-start-text")
                        gr.Markdown(explain.QUESTIONS, elem_id="questions")
                    with gr.Tab("1 · Draft, then verify", id="explain-draft-verify"):
                        gr.Markdown(explain.intro(service.cost_breakdown(home)), elem_id="intro")
                        gr.Plot(figures.diagram_ar(), label="AR")
                        gr.Markdown(explain.DRAFT_VERIFY)
                        gr.Plot(figures.diagram_draft_verify(), label="Draft then verify")
                    with gr.Tab("2 · Verify plan, draft gate", id="explain-plan-gate"):
                        gr.Markdown(explain.VERIFY_PLAN)
                        gr.Markdown(explain.DRAFT_GATE)
                    with gr.Tab("3 · DFlash", id="explain-dflash"):
                        gr.Markdown(explain.DFLASH)
                        gr.Plot(figures.diagram_dflash(), label="DFlash")
                    with gr.Tab("4 · D3D during verify", id="explain-d3d"):
                        gr.Markdown(explain.D3D)
                        gr.Plot(figures.diagram_d3d_async(service.cost_breakdown(home)), label="D3D async")
                        gr.Markdown(explain.MISS)
                    with gr.Tab("5 · A deeper drafter", id="explain-depth"):
                        deep = service.deep_benches(home)
                        deep_engine = str(((deep[0].get("config") or {}).get("engine")) or "") if deep else ""
                        gr.Markdown(explain.depth(service.cost_breakdown(home), deep, service.engine_runs(home)[1].get(deep_engine)))
                    with gr.Tab("6 · Skipping drafter layers", id="explain-pruning"):
                        gr.Markdown(explain.PRUNING)
                        gr.Markdown(explain.pruning_story(service.pruning_curve(home), service.pruning_curve(home, "d3d-deep"),
                                                          service.deep_benches(home)),
                                    elem_id="pruning-story")
                        gr.Plot(figures.diagram_pruning(service.pruning_curve(home)), label="Pruning")
                    with gr.Tab("Which τ is which", id="explain-which-tau"):
                        gr.Markdown(explain.WHICH_TAU)
                    with gr.Tab("Glossary", id="explain-glossary"):
                        gr.Markdown(explain.GLOSSARY)
                    with gr.Tab("Words", id="explain-words"):
                        gr.Markdown(explain.WORDS)
            with gr.Tab("Traces", id="traces"):
                gr.Markdown(TRACES_INTRO)
                dl_btn = gr.Button("Prepare download")
                dl_file = gr.File(label="Traces JSON", interactive=False)
                up_file = gr.File(label="Upload a trace JSON (or an exported race HTML)", file_types=[".json", ".html"], type="filepath")
                up_msg = gr.Markdown()

        health_md = gr.Markdown(elem_id="health")
        health_json = gr.JSON(visible=False)
        race_outputs = [status, *cols, state]
        view_outputs = [tl_plot, tl_summary, acc_plot, econ_plot, econ_table, r_mode, r_idx, tl_cap]
        preset_out = [prompt, block, hyps, max_new, temp, sampling, seed, verify, drafting, engine, modes, use_pruned, preset_note]
        for btn, name in ((pre_lesson, "lesson"), (pre_gate, "gate"), (pre_adapt, "adaptive"), (pre_fair, "fair")):
            btn.click(lambda n=name: apply_preset(n), None, preset_out, api_name=f"preset_{name}", queue=False)
        # the class demo: the lesson's settings, then the race recorded with them, shown in every tab
        rec_ev = recorded_btn.click(lambda: apply_preset("lesson"), None, preset_out, api_name=False, queue=False)
        rec_ev = rec_ev.then(open_recorded, [bundle, state], race_outputs, api_name="recorded_race")
        rec_ev = rec_ev.then(race_views, [state], view_outputs, api_name=False)
        rec_ev.then(show_rounds, [r_mode, r_idx, state], [r_grid, r_hyps, r_caption], api_name=False)
        rec_ev.then(lambda: health.line(health.snapshot(demo)), None, [health_md], api_name=False, queue=False)
        presenter.change(None, [presenter], None, js=PRESENTER_JS, api_name=False, queue=False)
        demo.load(None, None, [presenter], js="() => new URLSearchParams(window.location.search).has('presenter')", api_name=False)
        demo.load(None, None, None, js=PRESET_TIPS_JS, api_name=False)  # each preset button's hover text
        run_ev = run_btn.click(
            run_race, [prompt, bundle, modes, block, temp, max_new, hyps, sampling, seed, verify, drafting, use_pruned, state, d3d_pick, engine, pstate],
            race_outputs,
            api_name="race", concurrency_limit=decode_concurrency(), concurrency_id="decode",
        )
        run_ev = run_ev.then(race_views, [state], view_outputs, api_name="race_views")
        run_ev.then(show_rounds, [r_mode, r_idx, state], [r_grid, r_hyps, r_caption], api_name=False)
        run_ev.then(lambda: health.line(health.snapshot(demo)), None, [health_md], api_name=False, queue=False)
        # outside the queue, so it answers while the queue is full
        gr.Button("health", visible=False).click(lambda: health.snapshot(demo), None, [health_json], api_name="health", queue=False)
        demo.load(lambda: health.line(health.snapshot(demo)), None, [health_md], api_name=False, queue=False)
        stop_btn.click(stop_race, [state], [status], api_name="stop", queue=False)
        replay_btn.click(replay_race, [state], [status, *cols], api_name="replay", concurrency_limit=4)
        r_mode.change(show_rounds, [r_mode, r_idx, state], [r_grid, r_hyps, r_caption], api_name="rounds")
        r_idx.release(show_rounds, [r_mode, r_idx, state], [r_grid, r_hyps, r_caption], api_name=False)
        prev_btn.click(lambda m, i, s: step_round(m, i, -1, s), [r_mode, r_idx, state], [r_idx, r_grid, r_hyps, r_caption], api_name=False)
        next_btn.click(lambda m, i, s: step_round(m, i, +1, s), [r_mode, r_idx, state], [r_idx, r_grid, r_hyps, r_caption], api_name=False)
        p_evt = dict(concurrency_limit=decode_concurrency(), concurrency_id="decode")
        p_load.click(load_pruning, [bundle, pstate, p_drafter], [p_layers, p_msg, p_curve, p_marg, pstate], api_name="pruning_curve")
        p_drafter.change(load_pruning, [bundle, pstate, p_drafter], [p_layers, p_msg, p_curve, p_marg, pstate], api_name=False)
        p_drafter.change(raced_view, [bundle, p_drafter], [p_raced], api_name=False)
        demo.load(raced_view, [bundle, p_drafter], [p_raced], api_name=False)
        p_layers.input(measure_pruned, [bundle, p_layers, pstate, p_drafter], [p_msg, p_curve, pstate], api_name="measure_pruned", **p_evt)
        bundle.change(load_pruning, [bundle, pstate, p_drafter], [p_layers, p_msg, p_curve, p_marg, pstate], api_name=False)
        bundle.change(raced_view, [bundle, p_drafter], [p_raced], api_name=False)
        dl_btn.click(download_traces, [state], [dl_file], api_name="download_traces")
        export_btn.click(export_race, [state], [export_file], api_name="export_html").then(
            lambda: gr.update(visible=True), None, [export_file], api_name=False, queue=False)
        clock.change(set_clock, [clock, state], [tl_plot, tl_summary, econ_plot, econ_table, clock_src, state, tl_cap], api_name="clock")
        up_file.upload(upload_traces, [up_file, state], [up_msg, tl_plot, tl_summary, acc_plot, econ_plot, econ_table, r_mode, state, r_idx],
                       api_name="upload_trace").then(lambda s: _columns(s), [state], cols, api_name=False).then(
                       _caption, [state], [tl_cap], api_name=False)
        demo.load(load_pruning, [bundle, pstate, p_drafter], [p_layers, p_msg, p_curve, p_marg, pstate], api_name=False)
        pj_inputs = [pj_profile, pj_B, pj_tau, pj_hit, pj_H, pj_v, pj_d, pj_p]
        for comp in pj_inputs:
            comp.change(project_speedups, pj_inputs, [pj_plot, pj_src], api_name=False, queue=False)
        gr.Button("Project", visible=False).click(project_speedups, pj_inputs, [pj_plot, pj_src], api_name="project")
        demo.load(project_speedups, pj_inputs, [pj_plot, pj_src], api_name=False)
        def on_bundle_bench(b):
            prov, table, check, ds, acc, sweep, cprov, costs, overlap = bench_views(b)
            return prov, table, check, gr.update(choices=ds, value="all"), acc, sweep, cprov, costs, overlap

        bundle.change(on_bundle_bench, [bundle], [b_prov, b_table, b_check, b_ds, b_acc, b_sweep, b_cprov, b_costs, b_overlap], api_name=False)
        bundle.change(engines_views, [bundle], [b_etext, b_etable, b_efig, b_ecprov, b_ecosts], api_name=False)
        bundle.change(lambda b: gr.update(value=service.default_block(b)), [bundle], [block], api_name=False, queue=False)
        bundle.change(d3d_picker, [bundle], [d3d_pick], api_name=False, queue=False)
        b_ds.change(lambda b, ds: figures.bench_acceptance_figure(service.bench_result(b), ds or "all"), [bundle, b_ds], [b_acc],
                    api_name=False, queue=False)
    demo.queue(max_size=APP_QUEUE_MAX, default_concurrency_limit=APP_CONCURRENCY)
    return demo
