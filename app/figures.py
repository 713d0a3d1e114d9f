"""Every plot is a pure function of Traces (or of a pruning curve / bench result) -> plotly Figure.

No Gradio here, no model access: testable without a browser. Every state also has a text label or symbol.

Colour: one meaning per colour, across every plot, the race columns (``app.tokens``) and the texts that name a colour
(``PALETTE`` below is the list; ``tests/test_figures.py`` holds the figures to it). Okabe-Ito for the work and the
verdicts, Paul Tol's muted scheme for the modes, the pruning plots and the cost breakdown, so that no colour is
reused with another meaning (both colour-blind safe).
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go

from d3d_core.decoding.plan import plan_label, plan_of
from d3d_core.decoding.trace import Trace, hit_rate_of, idle_time, needed_verdicts, overlap_share
from d3d_core.measure.costs import forwards_at
from d3d_core.measure.economics import SHARED_CORES_SLOWER, race_economics, verify_vs_seq

from .tokens import whole_ms

# Okabe-Ito: the work (what a lane does) and its verdicts
BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, YELLOW, GREY = (
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#999999",
)
PALE_YELLOW, PALE_BLUE, PALE_GREY = "#FBEFB0", "#D5DEEA", "#DDDDDD"
# Paul Tol (muted): the modes, the pruning plots and the cost breakdown
INDIGO, CYAN, TEAL, OLIVE, SAND, ROSE, WINE, DARK = (
    "#332288", "#88CCEE", "#44AA99", "#999933", "#DDCC77", "#CC6677", "#882255", "#4D4D4D",
)
PALETTE = {  # colour -> its one meaning (the legend of every plot uses these words)
    BLUE: "the target: verify (its forward), its bonus / corrected token",
    ORANGE: "a draft's time, paid in the open: draft after verify, draft not hidden, draft time saved by pruning",
    GREEN: "drafting hidden behind verify and what it buys: packed draft, accepted draft, hit ✓",
    VERMILLION: "a miss and what it costs: sync draft after a miss, miss ✗, first mismatch, rejected draft",
    PURPLE: "prefill: the prompt's forward and the first token",
    GREY: "other / neutral: neither lane busy, idle, reference lines, a layer cheap to remove",
    PALE_YELLOW: "held back: drafted, not verified (verify plan)",
    PALE_BLUE: "no draft: the draft gate skipped the round",
    PALE_GREY: "the anchor (already committed)",
    DARK: "mode ar",
    WINE: "mode dflash",
    TEAL: "mode d3d-seq",
    INDIGO: "mode d3d-async",
    CYAN: "pruning: calibration τ (chosen on), a drafter layer · cost breakdown: layer GEMMs",
    OLIVE: "pruning: held-out τ · cost breakdown: attention",
    SAND: "pruning: healed points and their control · cost breakdown: LM head",
    ROSE: "pruning: a layer whose removal costs > 0.05 τ",
    "black": "a marker you placed or a bound: your selection (pruning), the machine's bound (cost breakdown)",
}
KIND_COLOURS = {"prefill": PURPLE, "verify": BLUE, "draft": ORANGE, "packed_draft": GREEN, "sync_draft": VERMILLION}
KIND_LABELS = {
    "prefill": "prefill",
    "verify": "verify (target)",
    "draft": "draft (after verify)",
    "packed_draft": "packed draft (during verify)",
    "sync_draft": "sync draft (after a miss)",
}
MODE_COLOURS = {"ar": DARK, "dflash": WINE, "d3d-seq": TEAL, "d3d-async": INDIGO}
LAYOUT = dict(template="plotly_white", margin=dict(l=10, r=10, t=50, b=40), font=dict(size=13))


def _empty(title: str, msg: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=msg, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font=dict(size=15, color=GREY))
    fig.update_layout(title=title, xaxis=dict(visible=False), yaxis=dict(visible=False), height=260, **LAYOUT)
    return fig


# ----------------------------------------------------------------------------- timeline


def timeline_figure(traces: list, projected: Optional[str] = None) -> go.Figure:
    """Gantt chart in ms: lanes target / drafter per mode, spans coloured by kind, hits ✓ and
    misses ✗ marked at the end of each d3d-async verify, all modes on one time axis
    (each measured from its own start). ``projected``: the cost profile the traces were re-timed
    with (d3d_core.measure.clock) — then the title, the legend and every hover say so."""
    traces = [t for t in traces if t is not None]
    tag = " (projected)" if projected else ""
    if not traces:
        return _empty("Draft / verify timeline", "Run a race to see when the target and the drafter are busy.")
    fig = go.Figure()
    lanes = []
    for tr in traces:
        for lane in ("target", "drafter"):
            if lane == "drafter" and tr.mode == "ar":
                continue
            lanes.append(f"{tr.mode} · {lane}")
    seen = set()
    for kind in KIND_COLOURS:
        xs, bases, ys, hover = [], [], [], []
        for tr in traces:
            for s in tr.spans:
                if s.kind != kind:
                    continue
                xs.append(max(s.duration, 0.05))
                bases.append(s.t_start)
                ys.append(f"{tr.mode} · {s.lane}")
                r = "prefill" if s.round < 0 else f"round {s.round}"
                hover.append(f"{tr.mode} {s.lane}: {KIND_LABELS[kind]}<br>{r}<br>{s.t_start:.1f} → {s.t_end:.1f} ms ({s.duration:.1f} ms)"
                             + (f"<br>PROJECTED under {projected}, not measured" if projected else ""))
        if not xs:
            continue
        seen.add(kind)
        fig.add_trace(go.Bar(
            x=xs, base=bases, y=ys, orientation="h", name=KIND_LABELS[kind] + tag, marker_color=KIND_COLOURS[kind],
            marker_line=dict(color="white", width=0.5), hovertext=hover, hoverinfo="text", width=0.7,
        ))
    # hits / misses at the end of each async verify
    for tr in traces:
        if tr.mode != "d3d-async":
            continue
        ends = {s.round: s.t_end for s in tr.spans if s.kind == "verify"}
        for hit, sym, col, name in ((True, "triangle-up", GREEN, "hit ✓"), (False, "x", VERMILLION, "miss ✗")):
            xs = [ends[r.index] for r in needed_verdicts(tr) if r.hit is hit and r.index in ends]
            if xs:
                fig.add_trace(go.Scatter(
                    x=xs, y=[f"{tr.mode} · target"] * len(xs), mode="markers", name=name,
                    marker=dict(symbol=sym, size=9, color=col, line=dict(color="black", width=1)),
                    hovertemplate=name + " at %{x:.1f} ms<extra></extra>",
                ))
    title = ("Draft / verify timeline (ms since each run started; gaps = idle)" if not projected else
             f"PROJECTED timeline under “{projected}” — this run's rounds, hits and misses; span lengths from the "
             "latency model, not measured")
    fig.update_layout(
        title=dict(text=title, font=dict(size=14 if projected else 16)), barmode="overlay",
        xaxis=dict(title="time (ms)", rangemode="tozero"),
        yaxis=dict(categoryorder="array", categoryarray=list(reversed(lanes)), title=None),
        legend=dict(orientation="h", y=-0.25), height=max(300, 70 * len(lanes) + 140), **LAYOUT,
    )
    return fig


def decode_window(tr: Trace) -> tuple:
    """(start, end) ms of a trace's decode on its own clock: from the end of the last prefill (the target's, and a
    drafter's own where it runs after the target's: d3d-seq's and dflash's) for the decode time the trace records
    (``stats.decode_time_s``, the Race tab's "decode … s"), so every screen's decode is one number and one window."""
    t0 = max((s.t_end for s in tr.spans if s.kind == "prefill"), default=0.0)
    dec = tr.stats.decode_time_s * 1e3 if tr.stats is not None and tr.stats.decode_time_s > 0 else \
        max((s.t_end for s in tr.spans), default=t0) - t0
    return t0, t0 + dec


def target_idle(tr: Trace) -> tuple:
    """(idle ms, share of the decode) of the target lane during the decode (``decode_window``): the one accounting
    the Timeline's table and its caption both print."""
    t0, t1 = decode_window(tr)
    idle = idle_time([s for s in tr.spans if s.round >= 0], "target", t0, t1)
    return idle, idle / max(t1 - t0, 1e-9)


def timeline_summary(traces: list) -> pd.DataFrame:
    """Per mode, over its decode (the prefill left out, as in every speed on the Race tab): the decode time, how
    long the target and the drafter sat idle (and the target's share, the caption's number), the overlap share and
    the hit rate."""
    rows = []
    for tr in traces:
        if tr is None:
            continue
        t0, t1 = decode_window(tr)
        ov = overlap_share([s for s in tr.spans if s.round >= 0])
        idle, share = target_idle(tr)
        rows.append({
            "mode": tr.mode,
            "decode (ms)": round(t1 - t0, 1),
            "target idle (ms)": round(idle, 1),
            "target idle (% of decode)": f"{share:.0%}",
            "drafter idle (ms)": "-" if tr.mode == "ar" else round(idle_time([s for s in tr.spans if s.round >= 0], "drafter", t0, t1), 1),
            "overlap share (% of drafter busy time)": "-" if tr.mode != "d3d-async" or ov is None else f"{ov:.0%}",
            "hit rate": "-" if (hr := hit_rate_of(tr)) is None else f"{hr:.0%}",
        })
    return pd.DataFrame(rows, columns=TIMELINE_COLUMNS)


TIMELINE_COLUMNS = ["mode", "decode (ms)", "target idle (ms)", "target idle (% of decode)", "drafter idle (ms)",
                    "overlap share (% of drafter busy time)", "hit rate"]


def timeline_caption(traces: list, projected: Optional[str] = None) -> str:
    """Why each drafting mode's target waited, read from the traces' own numbers (no fixed sentence): the share of
    the decode the target sat idle, and for d3d-async whether verify or the packed pass was the longer, its miss rate
    (each miss a sync draft the target waits for) and how much longer its verify ran than d3d-seq's (the two lanes
    share the cores). "" without a finished drafting mode."""
    ec = {e.mode: e for e in race_economics([t for t in traces if t is not None])}
    by_mode = {t.mode: t for t in traces if t is not None}
    out = []
    for mode in ("dflash", "d3d-seq", "d3d-async"):
        e, tr = ec.get(mode), by_mode.get(mode)
        if e is None or tr is None:
            continue
        idle, waited = target_idle(tr)  # the table's numbers: idle ms over the decode's ms
        head = f"**{mode}**: the target sat idle {waited:.0%} of the decode ({idle:.0f} ms)"
        if mode != "d3d-async":
            draft = f"{e.t_draft_ms:.0f} ms" if e.t_draft_ms is not None else "–"
            out.append(f"{head} — it waits for every draft ({draft} each, after each verify of {e.t_verify_ms:.0f} ms): "
                       "nothing here overlaps.")
            continue
        parts = []
        if e.t_packed_ms is not None:
            if e.t_packed_ms > e.t_verify_ms:
                parts.append(f"the packed pass ({e.t_packed_ms:.0f} ms) outlasts verify ({e.t_verify_ms:.0f} ms), so even a hit "
                             f"waits about {e.t_packed_ms - e.t_verify_ms:.0f} ms for it")
            else:
                parts.append(f"verify ({e.t_verify_ms:.0f} ms) outlasts the packed pass ({e.t_packed_ms:.0f} ms), so a hit's "
                             "next block is ready when verify returns")
        hr = hit_rate_of(tr)
        n_sync = sum(1 for s in tr.spans if s.kind == "sync_draft")
        if hr is not None:
            sync = [s.duration for s in tr.spans if s.kind == "sync_draft"]
            cost = f", each followed by a sync draft of {sum(sync) / len(sync):.0f} ms the target waits for" if sync else ""
            parts.append(f"{1 - hr:.0%} of the rounds that needed a next block missed{cost} ({n_sync} sync drafts)")
        seq = ec.get("d3d-seq")
        if (r := verify_vs_seq(e, seq)) is not None and not projected:
            if r >= SHARED_CORES_SLOWER:
                parts.append(f"its verify ran {r:.2f}× as long as d3d-seq's ({e.t_verify_ms:.0f} vs {seq.t_verify_ms:.0f} ms): "
                             "the two lanes share the cores and the memory bus")
            elif r <= 0.9:
                parts.append(f"⚠ its verify read shorter than d3d-seq's ({e.t_verify_ms:.0f} vs {seq.t_verify_ms:.0f} ms), which "
                             "sharing the cores cannot do: the machine's speed changed between the modes (timing noise)")
            else:
                parts.append(f"its verify ran about as long as d3d-seq's ({e.t_verify_ms:.0f} vs {seq.t_verify_ms:.0f} ms)")
        pre = {s.lane: s for s in tr.spans if s.kind == "prefill"}
        seq_tr = by_mode.get("d3d-seq")
        seq_pre = next((s for s in seq_tr.spans if s.kind == "prefill" and s.lane == "target"), None) if seq_tr else None
        if "drafter" in pre and "target" in pre and pre["drafter"].t_start < pre["target"].t_end and not projected:
            than = (f", against {seq_pre.duration:.0f} ms for d3d-seq's target, which read it alone" if seq_pre is not None else "")
            e2e = ""
            ar_tr = by_mode.get("ar")
            if ar_tr is not None and ar_tr.stats is not None and tr.stats is not None:
                a_s = ar_tr.stats.prefill_time_s + ar_tr.stats.decode_time_s
                m_s = tr.stats.prefill_time_s + tr.stats.decode_time_s
                if a_s > 0 and m_s > 0:  # the speedups count decode only; say what the prefill does to the whole run
                    e2e = (f". Speedups and tokens/s count the decode only, as for every mode; prefill included, ar took "
                           f"{a_s:.2f} s and d3d-async {m_s:.2f} s ({a_s / m_s:.2f}×)")
            parts.append(f"before the decode, its drafter read the prompt at the same time as the target did (it needs nothing "
                         f"from the target); sharing the cores, the target's prefill took {pre['target'].duration:.0f} ms{than}. "
                         "The decode (and the target's idle share of it) starts once both have finished" + e2e)
        out.append(f"{head}: " + "; ".join(parts) + "." if parts else head + ".")
    if not out:
        return ""
    tag = f" (projected under “{projected}”)" if projected else " (measured)"
    return f"**Why the target waited{tag}** — from this run's spans:\n" + "\n".join(f"- {x}" for x in out)


# ----------------------------------------------------------------------------- acceptance


ECON_PARTS = (("verify_per_token_ms", "verify (target)", BLUE),
              ("draft_visible_per_token_ms", "draft not hidden", ORANGE),
              ("idle_per_token_ms", "other (neither lane busy)", GREY))


def economics_figure(traces: list, projected: Optional[str] = None) -> go.Figure:
    """ms per output token = verify + draft not hidden + other, per mode, from each run's own spans
    (the bars' lengths are the measured time per token); ar's time per token as a dotted line.
    ``projected``: the traces were re-timed under that cost profile (labelled as such)."""
    title = ("What one output token cost (ms), from this run's spans" if not projected else
             f"PROJECTED cost per output token under “{projected}” (latency model, not measured)")
    ec = race_economics(traces)
    if not ec:
        return _empty(title, "Run a race to see what each mode paid per token.")
    fig = go.Figure()
    names = [e.mode for e in ec]
    for key, label, col in ECON_PARTS:
        fig.add_trace(go.Bar(y=names, x=[getattr(e, key) for e in ec], name=label, orientation="h", marker_color=col,
                             hovertemplate="%{y}: " + label + " %{x:.1f} ms per token<extra></extra>"))
    text = []
    for e in ec:
        t = f"{e.per_token_ms:.{0 if e.per_token_ms >= 10 else 1}f} ms/token · τ {e.tau:.2f}"
        if e.flags:
            t += " · ⚠ implausible (timing noise)"
        elif e.mode != "ar" and e.break_even_tau is not None:
            t += f" · break-even τ {e.break_even_tau:.2f}"
        text.append(t)
    fig.add_trace(go.Scatter(y=names, x=[e.per_token_ms for e in ec], mode="text", text=text, textposition="middle right",
                             showlegend=False, hoverinfo="skip"))
    ar = next((e for e in ec if e.mode == "ar"), None)
    if ar is not None:
        fig.add_vline(x=ar.per_token_ms, line=dict(color=GREY, dash="dot"),
                      annotation_text="ar", annotation_position="top")
    xmax = max(e.per_token_ms for e in ec) * 1.9
    fig.update_layout(barmode="stack", title=title, xaxis=dict(title="ms per output token", range=[0, xmax]),
                      yaxis=dict(autorange="reversed"), height=120 + 45 * len(ec), legend=dict(orientation="h", y=-0.3), **LAYOUT)
    return fig


def economics_table(traces: list, projected: Optional[str] = None) -> pd.DataFrame:
    """The numbers behind economics_figure: one row per quantity, one column per mode (a column per quantity broke
    the headers mid-word on a narrow page). Cells are written as the Race tab writes them: ms to
    0.1 (the round's three parts rounded so that they still add up to it), τ and break-even τ to 0.01, the hit rate
    as a percentage, the speedup as "1.10×". The clock row says whether the times were measured or projected."""
    ec = race_economics(traces)
    if not ec:
        return pd.DataFrame(columns=["quantity"])

    def ms(x):
        return "–" if x is None else f"{x:.1f}"

    def parts(e):  # round = verify + draft not hidden + other, in tenths of a ms that add up as printed
        t, p = whole_ms(e.round_ms * 10, [x * 10 for x in e.round_parts_ms()])
        return [f"{x / 10:.1f}" for x in (t, *p)]

    def spread(e):
        return e.speedup_label() if e.too_short else (f"{e.speedup_lo:.2f}–{e.speedup_hi:.2f}" if e.speedup_lo is not None else "–")

    split = {e.mode: parts(e) for e in ec}
    rows = [
        ("clock", lambda e: "projected" if projected else "measured"),
        ("τ: tokens per round", lambda e: f"{e.tau:.2f}"),
        ("T_step: what ar paid per token (ms)", lambda e: ms(e.t_step_ms)),
        ("ar forward: one ar step's forward (ms)", lambda e: ms(e.ar_forward_ms)),
        ("T_verify(B): one verify of B tokens (ms)",  # ar verifies nothing: its entry is its own one-token step
         lambda e: f"{ms(e.t_verify_ms)} (its step, B = 1)" if e.mode == "ar" and e.t_verify_ms is not None else ms(e.t_verify_ms)),
        ("T_draft: one draft (ms)", lambda e: ms(e.t_draft_ms)),
        ("T_packed: one packed pass (ms)", lambda e: ms(e.t_packed_ms)),
        ("hit rate", lambda e: "–" if e.hit_rate is None else f"{e.hit_rate:.0%}"),
        ("round (ms)", lambda e: split[e.mode][0]),
        ("= verify", lambda e: split[e.mode][1]),
        ("+ draft not hidden", lambda e: split[e.mode][2]),
        ("+ other", lambda e: split[e.mode][3]),
        ("time per token (ms)", lambda e: ms(e.per_token_ms)),
        ("speedup vs ar", lambda e: "–" if e.too_short or e.speedup is None else f"{e.speedup:.2f}×"),
        ("speedup 10–90 %", spread),
        ("break-even τ = round / T_step", lambda e: "–" if e.break_even_tau is None else f"{e.break_even_tau:.2f}"),
    ]
    if any(e.flags for e in ec):  # the flags row only when a ratio was flagged (an always-empty row reads as something unexplained)
        rows.append(("flags", lambda e: short_flags(e.flags)))
    return pd.DataFrame([[label] + [cell(e) for e in ec] for label, cell in rows], columns=["quantity"] + [e.mode for e in ec])


def short_flags(flags) -> str:
    """The implausibility flags in a few words for a table cell (the status line has them in full)."""
    if not flags:
        return ""
    short = [f.split(" read ")[0].replace("a round (which holds a verify)", "round") + " < ar step" for f in flags]
    return "⚠ timing noise: " + "; ".join(short)


def acceptance_figure(traces: list) -> go.Figure:
    """Histogram of tokens per round (accepted + bonus) per mode, τ marked."""
    traces = [t for t in traces if t is not None and t.rounds and t.mode != "ar"]
    if not traces:
        return _empty("Tokens per round", "Run a race with a drafting mode to see acceptance lengths.")
    B = max(int(t.config.get("block_size", 8)) for t in traces)
    fig = go.Figure()
    for tr in traces:
        counts = [0] * (B + 1)
        for r in tr.rounds:
            counts[min(r.accepted + 1, B)] += 1
        n = len(tr.rounds)
        fig.add_trace(go.Bar(
            x=list(range(1, B + 1)), y=[c / n for c in counts[1:]],
            name=f"{tr.mode} (τ = {tr.stats.tau:.2f})" + (f"; {k} rounds undrafted by the draft gate" if (k := sum(r.skipped for r in tr.rounds)) else ""),
            marker_color=MODE_COLOURS.get(tr.mode, GREY),
            hovertemplate=tr.mode + ": %{y:.0%} of rounds gave %{x} tokens<extra></extra>",
        ))
        fig.add_vline(x=tr.stats.tau, line=dict(color=MODE_COLOURS.get(tr.mode, GREY), dash="dash", width=2))
    fig.update_layout(
        title="This race: tokens committed per round, a + 1 (1 … B); dashed line = τ", barmode="group",
        xaxis=dict(title="tokens committed in the round: accepted drafts a + the bonus (a round without a draft counts as a + 1 = 1)",
                   dtick=1),
        yaxis=dict(title="share of rounds", tickformat=".0%"),
        legend=dict(orientation="h", y=-0.25), height=380, **LAYOUT,
    )
    return fig


def speedup_vs_block_figure(sweep: Optional[dict], datasets: str = "", stale: bool = False) -> go.Figure:
    """Measured τ and speedup per block size from a bench sweep {mode: {B: {"speedup", "tau"}}}:
    two panels side by side, because a longer block raises τ but also the verify cost. d3d-seq and
    d3d-async run the same drafter but need not reach the same τ: the draft gate and the verify plan
    weigh each mode's own round cost (a skipped round counts τ 1)."""
    if not sweep:
        return _empty("Speedup vs block size", "No block-size sweep measured for this bundle yet (python -m d3d_core.measure.bench --block-sizes …).")
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("τ (tokens per round)", "speedup vs ar (same run)"), horizontal_spacing=0.12)
    for mode, pts in sweep.items():
        pts = {int(b): v for b, v in pts.items()}
        bs = sorted(pts)
        col = MODE_COLOURS.get(mode, GREY)
        fig.add_trace(go.Scatter(x=bs, y=[pts[b]["tau"] for b in bs], mode="lines+markers", name=mode, legendgroup=mode,
                                 marker=dict(color=col, size=8), line=dict(color=col, width=2),
                                 hovertemplate=mode + ", B = %{x}: τ = %{y:.2f}<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=bs, y=[pts[b]["speedup"] for b in bs], mode="lines+markers", name=mode, legendgroup=mode,
                                 showlegend=False, marker_color=col,
                                 hovertemplate=mode + ", B = %{x}: %{y:.2f}× ar<extra></extra>"), row=1, col=2)
    fig.add_hline(y=1.0, line=dict(color=GREY, dash="dot"), row=1, col=2)
    ticks = sorted({int(b) for pts in sweep.values() for b in pts})  # a tick at every measured B (6 too, not only powers of 2)
    for c in (1, 2):
        fig.update_xaxes(title_text="block size B", type="log", tickvals=ticks, ticktext=[str(b) for b in ticks], row=1, col=c)
    on = f" · {datasets.replace(',', ', ')}" if datasets else ""
    # a stale sweep: what its shape still teaches, then that its values are not today's drafters' (two short lines)
    sub = ("<br><sup>What it still shows: a longer block can raise τ, but each round costs more, so the speedup need not "
           "follow τ.<br>Its numbers are earlier drafters' (replaced since), not today's: the Measured bench has those.</sup>") if stale else ""
    fig.update_layout(title=dict(text=f"Block-size sweep (bench){on}{sub}", font=dict(size=15)), height=400,
                      legend=dict(orientation="h", y=-0.25), margin=dict(l=10, r=10, t=95 if stale else 80, b=40),
                      **{k: v for k, v in LAYOUT.items() if k != "margin"})
    return fig


def bench_acceptance_figure(result: Optional[dict], dataset: str = "all") -> go.Figure:
    """Accepted-draft-length distribution per drafting mode from a bench result's
    ``acceptance_hist`` {dataset: {mode: {accepted: rounds}}}, one dataset or all pooled."""
    hists = (result or {}).get("acceptance_hist") or {}
    if not hists:
        return _empty("Accepted length per round", "No bench result with acceptance histograms for this bundle.")
    pooled: dict = {}
    per_ds: dict = {}  # {mode: {dataset: drafted rounds}}: what the pool is made of
    for ds, modes in hists.items():
        if dataset not in ("all", ds):
            continue
        for mode, h in modes.items():
            if mode == "ar":
                continue
            per_ds.setdefault(mode, {})[ds] = sum(h.values())
            for a, c in h.items():
                pooled.setdefault(mode, {}).setdefault(int(a), 0)
                pooled[mode][int(a)] += c
    if not pooled:
        return _empty("Accepted length per round", f"No drafting-mode rounds for {dataset!r} in this bench result.")
    top = max(a for h in pooled.values() for a in h)
    fig = go.Figure()
    for mode, h in pooled.items():
        n = sum(h.values())
        tau = sum((a + 1) * c for a, c in h.items()) / n
        # the same convention as the Acceptance tab: tokens committed, a + 1 (the bench records a, the accepted drafts)
        fig.add_trace(go.Bar(x=list(range(1, top + 2)), y=[h.get(a, 0) / n for a in range(top + 1)], name=f"{mode} (τ = {tau:.2f} over {n} drafted rounds)",
                             marker_color=MODE_COLOURS.get(mode, GREY),
                             hovertemplate=mode + ": %{y:.1%} of drafted rounds committed %{x} tokens<extra></extra>"))
    label = "all datasets" if dataset == "all" else dataset
    if len({ds for m in per_ds.values() for ds in m}) > 1:  # a pool of datasets: say what each mode's pool holds
        pools = [f"{m}: " + ", ".join(f"{ds} {c}" for ds, c in sorted(d.items())) for m, d in per_ds.items() if sum(d.values())]
        lines = ["; ".join(pools[i:i + 2]) for i in range(0, len(pools), 2)] or [""]  # two modes a line: fits a half-width chart
        mix = "<br>".join(["drafted rounds pooled — " + lines[0]] + lines[1:] +
                          ["a mode whose draft gate skipped most of a hard dataset's rounds pools mostly easy ones,",
                           "so pooled τ can rank modes unlike the table's per-dataset τ"])
    else:
        mix = ""
    fig.update_layout(title=f"Bench · {label}: tokens committed per drafted round, a + 1" + (f"<br><sup>{mix}</sup>" if mix else ""),
                      barmode="group",
                      xaxis=dict(title="tokens committed: accepted drafts a + the bonus (drafted rounds only)", dtick=1),
                      yaxis=dict(title="share of drafted rounds", tickformat=".0%"),
                      legend=dict(orientation="h", y=-0.25), height=380, **LAYOUT)
    if mix:
        n = mix.count("<br>") + 1
        fig.update_layout(margin=dict(l=10, r=10, t=60 + 24 * n, b=40), height=380 + 24 * n)  # a subtitle line ≈ 22 px
    return fig


# ----------------------------------------------------------------------------- rounds grid

# how a token is written in the Rounds grid, its hypotheses table and hover texts (the lesson's sentences write ⏎ and ∅
# the same way; they drop the space a word-token starts with), and the legend under them
GLYPH_LEGEND = ("In the grid and the hypotheses table, tokens are written as the tokenizer cut them: **␣** = a space (a token "
                "that starts a word begins with one, “␣cost”; the sentences leave it out), **⏎** = a newline, **∅** = a token "
                "with no text of its own.")


def glyph(piece) -> str:
    """A token's text made visible: spaces as ␣, newlines as ⏎, a token without text as ∅ (never a blank cell)."""
    s = str(piece)
    return "∅" if s == "" else s.replace("\n", "⏎").replace(" ", "␣")


STATE_ANCHOR, STATE_ACCEPTED, STATE_MISMATCH, STATE_UNVERIFIED, STATE_BONUS, STATE_HELD, STATE_SKIPPED = range(7)
# the bonus gets a column of its own at the right; in the text it stands where the first mismatch was drawn (the legend says so)
STATE_NAMES = ["anchor", "accepted", "first mismatch", "after the mismatch (checked, discarded)",
               "bonus (drawn last; in the text it takes the first mismatch's place)", "held back (not verified)", "no draft (draft gate)"]
STATE_COLOURS = [PALE_GREY, GREEN, VERMILLION, "#F2F2F2", BLUE, PALE_YELLOW, PALE_BLUE]  # "#F2F2F2": a draft past the first mismatch (near-white: checked, but it cannot count)


def rounds_grid_figure(trace: Optional[Trace], pieces: dict, upto: Optional[int] = None) -> go.Figure:
    """One row per round, one column per block position (anchor, d_1..d_{B-1}) plus the
    bonus. Cell text = the token, colour + hover = its state, q(d) and the target's token.
    ``pieces``: token id -> readable text. ``upto``: show rounds 0..upto (replay)."""
    if trace is None or not trace.rounds:
        return _empty("Rounds", "Run a race, then pick a mode to inspect its rounds.")
    rounds = trace.rounds if upto is None else trace.rounds[: max(0, upto) + 1]
    B = max(len(r.draft_ids) + len(r.held_back) for r in trace.rounds) + 1
    cols = ["anchor"] + [f"d{j}" for j in range(1, B)] + ["bonus"]
    z, text, hover = [], [], []

    def show(t):  # whole up to 12 characters (every word-token of the bundled tokenizer); the hover has the rest
        s = glyph(pieces.get(t, str(t)))
        return s if len(s) <= 12 else s[:11] + "…"

    def said(t):
        return f"“{glyph(pieces.get(t, t))}”"

    for r in rounds:
        zr = [STATE_ANCHOR]
        tr_ = [show(r.anchor_id)]
        hr = [f"round {r.index} · anchor at position {r.anchor_pos} (tokens before it: prompt + output): {said(r.anchor_id)}"]
        for j in range(1, B):
            if r.skipped and j == 1:
                zr.append(STATE_SKIPPED)
                tr_.append("no draft")
                est = f"{r.gate_rate:.2f}" if r.gate_rate is not None else "?"
                if r.gate_threshold is not None:  # the threshold this round was judged by, as recorded
                    bar = (f"below the {r.gate_threshold:.2f} tokens per step a round without a draft earns here"
                           + (" (ar's 1, raised because d3d-async's undrafted rounds use every core)" if r.gate_threshold > 1.0 + 1e-9 else ""))
                else:  # a trace recorded before the threshold was
                    bar = "below what a round without a draft earns (1; more in d3d-async, whose undrafted rounds use every core)"
                hr.append(f"round {r.index} · no draft: the draft gate skipped it — drafting had lately earned {est} tokens per "
                          f"step of cost, {bar}")
            elif j - 1 < len(r.draft_ids):
                d = r.draft_ids[j - 1]
                if j <= r.accepted:
                    st = STATE_ACCEPTED
                elif j == r.accepted + 1:
                    st = STATE_MISMATCH
                else:
                    st = STATE_UNVERIFIED
                q = r.draft_probs[j - 1] if j - 1 < len(r.draft_probs) else float("nan")
                y = r.target_ids[j - 1] if j - 1 < len(r.target_ids) else None
                zr.append(st)
                tr_.append(show(d))
                hr.append(
                    f"round {r.index} · d{j} = {said(d)} ({STATE_NAMES[st]})<br>drafter q(d) = {q:.3f}"
                    + (f"<br>target's token: {said(y)}" if y is not None else "")
                )
            elif j - 1 - len(r.draft_ids) < len(r.held_back):
                d = r.held_back[j - 1 - len(r.draft_ids)]
                zr.append(STATE_HELD)
                tr_.append(show(d))
                hr.append(f"round {r.index} · d{j} = {said(d)} (held back)<br>drafted but not verified: the verify plan "
                          f"expected a verify of {len(r.draft_ids) + 1} tokens to earn more per unit of cost than a wider one")
            else:
                zr.append(None)
                tr_.append("")
                hr.append("")
        zr.append(STATE_BONUS)
        tr_.append(show(r.bonus))
        at = f", in d{r.accepted + 1}'s place" if r.accepted < len(r.draft_ids) else ""  # a mismatch's place, or after every draft
        hr.append(f"round {r.index} · bonus {said(r.bonus)} (target's token after {r.accepted} accepted; in the text it "
                  f"comes right after them{at})")
        z.append(zr)
        text.append(tr_)
        hover.append(hr)
    n = len(STATE_NAMES)
    scale = []
    for i, c in enumerate(STATE_COLOURS):
        scale += [[i / n, c], [(i + 1) / n, c]]
    fig = go.Figure(go.Heatmap(
        z=z, x=cols, y=[f"r{r.index}" + _verdict_mark(trace, r) for r in rounds],
        text=text, texttemplate="%{text}", hovertext=hover, hoverinfo="text", colorscale=scale, zmin=0, zmax=n,
        xgap=2, ygap=2, showscale=False, textfont=dict(size=12),
    ))
    for i, (name, c) in enumerate(zip(STATE_NAMES, STATE_COLOURS)):  # legend with text labels
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=dict(size=12, color=c, symbol="square"), name=name))
    fig.update_layout(
        title=(f"{trace.mode}: rounds (next ✓ / next ✗: this round's hypotheses had / had not drafted the next round's block; · = last round)"
               if trace.mode == "d3d-async" else f"{trace.mode}: rounds"),
        yaxis=dict(autorange="reversed", title=None), xaxis=dict(side="top"), showlegend=True,
        legend=dict(orientation="h", y=-0.05), height=min(2400, max(320, 140 + 26 * len(rounds))), **LAYOUT,
    )
    return fig


def _verdict_mark(trace: Trace, r) -> str:
    if trace.mode != "d3d-async" or not r.hypotheses:
        return ""
    if r is trace.rounds[-1] and trace.finish_reason:
        return " ·"  # last round: its hypotheses were drafted, no next block was needed
    return "" if r.hit is None else (" next ✓" if r.hit else " next ✗")  # about the NEXT round's block, not this one's


HYPOTHESES_NOTE = ("**score P(a,t)**: the drafter's own estimate that the verify accepts `a` drafts and its bonus is `t`. "
                   "Only the H likeliest outcomes are drafted and listed, so the scores need not add up to 1, and the hit "
                   "can be a low-scored one: the drafter is often unsure.")


def hypotheses_table(trace: Optional[Trace], index: int, pieces: dict) -> pd.DataFrame:
    """The hypotheses drafted during round `index` (d3d-async), best first; tokens written with ``glyph``."""
    cols = ["a (accepted)", "t (bonus)", "score P(a,t)", "drafted successor block", "hit"]
    if trace is None or trace.mode != "d3d-async" or not 0 <= index < len(trace.rounds):
        return pd.DataFrame(columns=cols)
    r = trace.rounds[index]
    last = index == len(trace.rounds) - 1
    verdict = lambda h: ("not needed (the decode ended)" if last or r.hit is None else "✓ hit" if h.hit else "✗ miss")  # noqa: E731
    rows = [{
        cols[0]: h.accepted, cols[1]: glyph(pieces.get(h.token, str(h.token))), cols[2]: round(h.score, 4),
        cols[3]: " | ".join(glyph(pieces.get(t, "?")) for t in h.draft_ids), cols[4]: verdict(h),
    } for h in r.hypotheses]
    return pd.DataFrame(rows, columns=cols)


# ----------------------------------------------------------------------------- pruning


def _heal_label(h: dict) -> str:
    kd = f"; α = {h['kd_alpha']:g} distillation from the unpruned drafter" if h.get("kd_alpha") else ""
    return f"healed, held-out ({h['steps']} fine-tune steps{kd})"


def _ci_bars(points: list, ref: Optional[float], color: str, thickness: float = 1.5, width: int = 5) -> Optional[dict]:
    """Asymmetric error bars (in τ) from each point's held-out interval of τ / ref."""
    if not ref or not all("tau_eval_rel_ci" in p for p in points):
        return None
    return dict(type="data", symmetric=False, color=color, thickness=thickness, width=width,
                array=[(p["tau_eval_rel_ci"][1] - p["tau_eval_rel"]) * ref for p in points],
                arrayminus=[(p["tau_eval_rel"] - p["tau_eval_rel_ci"][0]) * ref for p in points])


def _ci_text(p: dict) -> str:
    ci = p.get("tau_eval_rel_ci")
    return f"; 95 % CI {ci[0]:.1%}–{ci[1]:.1%}" if ci else ""


def _held_out_label(pts: list) -> str:
    return "held-out prompts (bars: 95 % CI)" if all("tau_eval_rel_ci" in p for p in pts) else "held-out prompts"


def pruning_curve_figure(curve: Optional[dict], live: Optional[tuple] = None, layer_ms: Optional[float] = None) -> go.Figure:
    """τ vs layers removed (greedy progressive pruning); `live` = (removed, tau[, legend name]) marks the
    user's current toggle choice; ``layer_ms``: what one drafter layer costs per draft on this machine (the cost
    breakdown), drawn as the draft time saved (right axis). The subtitle says whether the curve has healed points."""
    if not curve or not curve.get("curve"):
        return _empty("Progressive pruning", "No pruning curve for this bundle yet (python -m d3d_core.training.prune …).")
    pts = curve["curve"]
    fig = go.Figure(go.Scatter(
        x=[p["removed"] for p in pts], y=[p["tau"] for p in pts], mode="lines+markers", name="greedy pruning",
        marker_color=CYAN, line=dict(color=CYAN, width=3), customdata=[[", ".join(map(str, p["kept"])), p.get("tau_rel", 1.0)] for p in pts],
        hovertemplate="%{x} removed: τ = %{y:.3f} (%{customdata[1]:.1%} of full)<br>kept layers: %{customdata[0]}<extra></extra>",
    ))
    if all("tau_eval" in p for p in pts):  # held-out prompts never used to choose layers
        full_eval = pts[0]["tau_eval"]
        fig.add_trace(go.Scatter(
            x=[p["removed"] for p in pts], y=[p["tau_eval"] for p in pts], mode="lines+markers", name=_held_out_label(pts),
            line=dict(color=OLIVE, dash="dot"), marker_color=OLIVE, error_y=_ci_bars(pts, full_eval, OLIVE),
            customdata=[[p.get("tau_eval_rel", 1.0), _ci_text(p)] for p in pts],
            hovertemplate="%{x} removed: held-out τ = %{y:.3f} (%{customdata[0]:.1%} of full%{customdata[1]})<extra></extra>",
        ))
        # the line a held-out point's bar must clear: 99 % of the full drafter's own held-out τ (calibration τ is higher)
        fig.add_hline(y=0.99 * full_eval, line=dict(color=OLIVE, dash="dot", width=1.5),
                      annotation_text="99 % of this drafter's held-out τ", annotation_position="bottom right")
    healed = [p for p in pts if "healed" in p]
    if healed:
        ctl = curve.get("heal_control")
        ref = "the unpruned drafter fine-tuned as long" if curve.get("heal_reference") == "heal_control" else "full"
        ref_eval = (ctl.get("tau_eval") if ctl else None) or pts[0].get("tau_eval")
        hs = [p["healed"] for p in healed]
        fig.add_trace(go.Scatter(
            x=[p["removed"] for p in healed], y=[h.get("tau_eval", h["tau"]) for h in hs],
            # a short interval: thick, wide bars and a smaller diamond keep it visible around the marker
            mode="markers", name=_heal_label(hs[0]), error_y=_ci_bars(hs, ref_eval, "black", thickness=2.5, width=12),
            marker=dict(size=9, symbol="diamond", color=SAND, line=dict(color="black", width=1)),
            customdata=[[h.get("tau_eval_rel", h["tau_rel"]), _ci_text(h)] for h in hs],
            hovertemplate="%{x} removed, healed: τ = %{y:.3f} (%{customdata[0]:.1%} of " + ref + "%{customdata[1]})<extra></extra>",
        ))
        if ctl:
            fig.add_trace(go.Scatter(
                x=[0], y=[ctl.get("tau_eval") or ctl["tau"]], mode="markers", name="unpruned + same fine-tune (control), held-out",
                marker=dict(size=11, symbol="diamond-open", color=SAND, line=dict(width=2)),
                hovertemplate="control: the unpruned drafter fine-tuned the same steps, τ = %{y:.3f}<extra></extra>",
            ))
            if ctl.get("tau_eval"):  # the line the healed diamond has to reach
                fig.add_hline(y=0.99 * ctl["tau_eval"], line=dict(color=SAND, dash="dot", width=1),
                              annotation_text="99 % of the control (held-out)", annotation_position="bottom right")
    t0 = pts[0]["tau"]
    fig.add_hline(y=0.99 * t0, line=dict(color=GREY, dash="dash"), annotation_text="99 % of this drafter's calibration τ")
    if live is not None:
        fig.add_trace(go.Scatter(x=[live[0]], y=[live[1]], mode="markers", name=live[2] if len(live) > 2 else "your selection",
                                 marker=dict(size=14, symbol="star", color="black", line=dict(color="white", width=1))))
    if layer_ms:
        xs = [p["removed"] for p in pts]
        fig.add_trace(go.Scatter(x=xs, y=[x * layer_ms for x in xs], mode="lines+markers", yaxis="y2",
                                 name=f"draft time saved (ms per draft, right axis; {layer_ms:.1f} ms a layer here)",
                                 line=dict(color=ORANGE, dash="dash"), marker=dict(color=ORANGE, size=6),
                                 hovertemplate="%{x} removed: saves %{y:.1f} ms per draft (cost breakdown)<extra></extra>"))
    sub = ("healed points: diamonds" if healed else "no healed points: this curve was made without --heal")
    fig.update_layout(title=dict(text=f"Offline τ vs drafter layers removed<br><sup>{sub}</sup>", font=dict(size=15)),
                      xaxis=dict(title="layers removed", dtick=1), yaxis=dict(title="offline τ"),
                      yaxis2=dict(title="draft ms saved", overlaying="y", side="right", rangemode="tozero", showgrid=False),
                      height=440, legend=dict(orientation="h", y=-0.25), **LAYOUT)
    return fig


def marginal_cost_figure(curve: Optional[dict]) -> go.Figure:
    if not curve or not curve.get("marginal_cost"):
        return _empty("Marginal cost per layer", "No pruning curve for this bundle yet.")
    mc = curve["marginal_cost"]
    layers = sorted(mc, key=lambda k: int(k))
    fig = go.Figure(go.Bar(
        x=[f"L{k}" for k in layers], y=[mc[k] for k in layers], marker_color=[ROSE if mc[k] > 0.05 else GREY for k in layers],
        hovertemplate="removing %{x} alone costs Δτ = %{y:.3f}<extra></extra>",
    ))
    fig.update_layout(title="Δτ when one layer is removed from the full drafter", xaxis=dict(title="drafter layer"),
                      yaxis=dict(title="τ lost"), height=320, **LAYOUT)
    return fig


# ----------------------------------------------------------------------------- explainer diagrams


def _blocks_diagram(rows: list, title: str, height: int = 230) -> go.Figure:
    """rows: [(label, [(x0, x1, colour, text)])] drawn as labelled rectangles on a time axis."""
    fig = go.Figure()
    for yi, (label, boxes) in enumerate(rows):
        for x0, x1, col, txt in boxes:
            fig.add_shape(type="rect", x0=x0, x1=x1, y0=yi - 0.35, y1=yi + 0.35, fillcolor=col, line=dict(color="white", width=1))
            fig.add_annotation(x=(x0 + x1) / 2, y=yi, text=txt, showarrow=False, font=dict(color="white", size=12))
    fig.update_layout(
        title=title, height=height, showlegend=False,
        xaxis=dict(title="time →", showticklabels=False, range=[0, max(x1 for _, b in rows for _, x1, _, _ in b) + 0.2]),
        yaxis=dict(tickvals=list(range(len(rows))), ticktext=[r[0] for r in rows], autorange="reversed", range=[-0.6, len(rows) - 0.4]),
        **LAYOUT,
    )
    return fig


def diagram_ar() -> go.Figure:
    return _blocks_diagram([("target", [(i, i + 0.95, BLUE, f"tok {i + 1}") for i in range(6)])],
                           "Autoregressive: one target forward per token", 170)


def diagram_draft_verify() -> go.Figure:
    return _blocks_diagram([
        ("drafter", [(0, 0.6, ORANGE, "draft B"), (2.1, 2.7, ORANGE, "draft B")]),
        ("target", [(0.6, 2.1, BLUE, "verify block → a+1 tokens"), (2.7, 4.2, BLUE, "verify → a+1")]),
    ], "Draft then verify: one target forward commits accepted drafts + a bonus token")


def diagram_dflash() -> go.Figure:
    return _blocks_diagram([
        ("drafter", [(0, 0.5, ORANGE, "draft"), (2.0, 2.5, ORANGE, "draft"), (4.0, 4.5, ORANGE, "draft")]),
        ("target", [(0.5, 2.0, BLUE, "verify + hidden states"), (2.5, 4.0, BLUE, "verify + hidden states")]),
    ], "DFlash: the next draft needs this verify's hidden states, so the lanes take turns")


def diagram_d3d_async(costs: Optional[dict] = None) -> go.Figure:
    """D3D async against d3d-seq, two rounds each, every hypothesis a hit. With the shipped cost breakdown's overlap
    probe (``costs["overlap"]``, the 8-layer row) the boxes are this CPU's measured times: verify alone vs verify
    beside the packed pass (one thread each). Without it the diagram is the ideal case and says so: verify as long
    with overlap as without (a GPU with bandwidth to spare)."""
    row = next((r for r in ((costs or {}).get("overlap") or {}).get("rows") or [] if r.get("depth") == 8), None)
    if row is None:
        return _blocks_diagram([
            ("drafter", [(0, 0.6, ORANGE, "draft"), (0.6, 1.9, GREEN, "packed: H successors"), (2.1, 3.4, GREEN, "packed: H successors"),
                         (3.6, 4.2, VERMILLION, "miss: sync draft")]),
            ("target", [(0.6, 2.1, BLUE, "verify k  ✓ hit"), (2.1, 3.6, BLUE, "verify k+1  ✗ miss"), (4.2, 5.7, BLUE, "verify k+2")]),
        ], "D3D async, IDEAL case: a hit starts the next verify at once<br><sup>verify drawn as long with overlap as without "
           "(a GPU with bandwidth to spare) — not measured on this CPU</sup>")
    v, d = row["verify_ms"], row["draft_ms"]
    vc, pc = row["verify_1t_concurrent_ms"], row["packed_1t_concurrent_ms"]
    seq_d = [(0, d, ORANGE, f"draft {d:.0f}"), (d + v, 2 * d + v, ORANGE, f"draft {d:.0f}")]
    seq_t = [(d, d + v, BLUE, f"verify {v:.0f} ms"), (2 * d + v, 2 * d + 2 * v, BLUE, f"verify {v:.0f} ms")]
    r2 = d + max(vc, pc)
    asy_d = [(0, d, ORANGE, f"draft {d:.0f}"), (d, d + pc, GREEN, f"packed {pc:.0f}"), (r2, r2 + pc, GREEN, f"packed {pc:.0f}")]
    asy_t = [(d, d + vc, BLUE, f"verify {vc:.0f} ms (shared cores)"), (r2, r2 + vc, BLUE, f"verify {vc:.0f} ms ✓ hit")]
    fig = _blocks_diagram([("d3d-seq · drafter", seq_d), ("d3d-seq · target", seq_t),
                           ("d3d-async · drafter", asy_d), ("d3d-async · target", asy_t)],
                          f"D3D async vs d3d-seq, measured on the cost breakdown's machine: verify takes {vc:.0f} ms beside the packed pass (one thread each), {v:.0f} alone (every thread)"
                          f"<br><sup>cost breakdown's overlap probe: B = {costs['overlap'].get('B', 8)}, H = {costs['overlap'].get('H', 1)}, "
                          f"every hypothesis a hit, one thread per lane while both run; an untrained fp32 8-layer drafter ({d:.0f} ms a draft, "
                          "the shipped int8 one is cheaper: Benchmarks › Where the time goes)</sup>", 320)
    fig.update_xaxes(title="time (ms) →", showticklabels=True)
    return fig


def diagram_pruning(curve: Optional[dict] = None) -> go.Figure:
    """The 8-layer D3D drafter with layers skipped. With the shipped pruning curve (``service.pruning_curve``) the
    skipped layers are the two its greedy order removes first, named as such; without one the picture is generic and
    says so."""
    order = [int(i) for i in (curve or {}).get("order") or []]
    n = int((curve or {}).get("layers") or 8)
    first = order[:2] if len(order) >= 2 and all(0 <= i < n for i in order[:2]) else []
    skip = first or [2, 5]
    fig = go.Figure()
    for i in range(n):
        skipped = i in skip
        fig.add_shape(type="rect", x0=i, x1=i + 0.85, y0=0, y1=1, fillcolor="#EEEEEE" if skipped else CYAN,
                      line=dict(color=GREY, dash="dot" if skipped else "solid"))
        fig.add_annotation(x=i + 0.42, y=0.5, text=(f"L{i}<br>skipped" if skipped else f"L{i}"), showarrow=False,
                           font=dict(color=GREY if skipped else "black"))
    fig.add_annotation(x=n / 2, y=1.35, text="residual stream passes through a skipped layer: cheaper draft, maybe lower τ",
                       showarrow=False)
    title = (f"Pruning, an example: the shipped pruning curve removes L{first[0]} first, then L{first[1]}, drawn skipped (a race keeps "
              "every layer unless you race the drafter pruned)"
             if first else "Pruning drafter layers (a generic picture: which layers go is what the Pruning tab measures)")
    fig.update_layout(title=title, height=230, xaxis=dict(visible=False, range=[-0.2, n]),
                      yaxis=dict(visible=False, range=[-0.2, 1.6]), **LAYOUT)
    return fig


# ----------------------------------------------------------------------------- benchmarks / projections


PART_COLOURS = {"layer_gemm": CYAN, "attention": OLIVE, "lm_head": SAND, "other": GREY}
PART_LABELS = {"layer_gemm": "layer GEMMs", "attention": "attention", "lm_head": "LM head", "other": "everything else"}


def cost_breakdown_figure(costs: Optional[dict], threads: Optional[int] = None) -> go.Figure:
    """Stacked bars: where each forward's wall time goes (python -m d3d_core.measure.costs), with the
    machine's bound (bytes / bandwidth or FLOPs / GEMM rate) as a diamond — the gap between a bar
    and its diamond is what a faster engine could still win."""
    title = "Cost of each forward on the measured machine" + (", int4 engine" if (costs or {}).get("engine") == "int4" else "")
    if not costs or not costs.get("rows"):
        return _empty(title, "No cost breakdown shipped for this bundle yet (python -m d3d_core.measure.costs).")
    th = threads or max(r["threads"] for r in costs["rows"])
    rows = [r for r in costs["rows"] if r["threads"] == th]
    names = [r["forward"] for r in rows]
    fig = go.Figure()
    for part, label in PART_LABELS.items():
        fig.add_trace(go.Bar(y=names, x=[r["parts"][part]["ms"] for r in rows], name=label, orientation="h",
                             marker_color=PART_COLOURS[part],
                             customdata=[[r["parts"][part]["share"], r["wall_ms"], r["per_step"]] for r in rows],
                             hovertemplate="%{y}: " + label + " %{x:.1f} ms (%{customdata[0]:.0%} of %{customdata[1]:.1f} ms, "
                                           "%{customdata[2]:.2f}× a step)<extra></extra>"))
    fig.add_trace(go.Scatter(y=names, x=[r["bound_ms"] for r in rows], mode="markers", name="machine bound",
                             marker=dict(symbol="diamond", size=10, color="black"),
                             customdata=[[r["bound"], r["bytes"] / 1e6, r["flops"] / 1e9] for r in rows],
                             hovertemplate="%{y}: bound %{x:.1f} ms (%{customdata[0]}: %{customdata[1]:.0f} MB read, "
                                           "%{customdata[2]:.2f} GFLOP)<extra></extra>"))
    m = (costs.get("machine") or {}).get(str(th), {})
    sub = f"{th} thread(s), {costs.get('engine', '?')} engine"
    if m:
        sub += f"; in this run the machine read {m['read_gb_s']:.0f} GB/s and multiplied at {m['gemm_gflop_s']:.0f} GFLOP/s"
    pads = row_plan_text((costs.get("row_plan") or {}).get("plan"), (costs.get("row_plan") or {}).get("blas"))
    if pads or costs.get("drafter_int8") == "on":
        sub += "<br>" + "; ".join(x for x in (pads, "D3D drafter MLPs and head in int8" if costs.get("drafter_int8") == "on" else "") if x)
    fig.update_layout(barmode="stack", title=f"{title}<br><sup>{sub}</sup>", xaxis_title="ms per forward",
                      yaxis=dict(autorange="reversed"), height=90 + 32 * len(rows),
                      legend=dict(orientation="h", y=-0.18), **LAYOUT)
    return fig


def row_plan_text(plan, blas=None) -> str:
    """"GEMMs of 2 rows run as 6, ..." and "GEMMs of 1–4 rows on plain BLAS" for the target's measured row plan
    (Target.row_plan; fastops.RowPlan), "" when it changes nothing."""
    if not isinstance(plan, (list, tuple)):
        return ""
    blas = [m for m in (blas or []) if isinstance(m, int)]
    pads = [f"{m} as {p}" for m, p in enumerate(plan) if m and isinstance(p, int) and p != m and m not in blas]
    parts = []
    if blas:
        runs = []  # consecutive row counts as "a–b"
        for m in sorted(blas):
            if runs and m == runs[-1][1] + 1:
                runs[-1][1] = m
            else:
                runs.append([m, m])
        parts.append("GEMMs of " + ", ".join(f"{a}–{b}" if b > a else f"{a}" for a, b in runs) + " rows on plain BLAS (faster than oneDNN here)")
    if pads:
        parts.append("GEMMs of " + ", ".join(pads) + " rows (padding that ran faster)")
    return ("row plan measured here: " + "; ".join(parts)) if parts else ""


def overlap_text(costs: Optional[dict]) -> str:
    """When overlapping pays in the shipped cost breakdown (d3d-async's round against d3d-seq's at each measured
    drafter depth), in one or two sentences. It compares the two D3D modes, not either with ar, and names the depths
    where it paid instead of a threshold (the measured ratio need not rise with depth)."""
    ov = (costs or {}).get("overlap")
    if not ov or not ov.get("rows"):
        return ""
    parts = [overlap_row_text(r, ov["B"]) for r in ov["rows"]]
    paid = [r for r in ov["rows"] if r["pays"]]
    if not paid:
        head = "**Overlapping did not pay at any measured drafter depth**"
    elif len(paid) == len(ov["rows"]):
        head = "**Overlapping paid at every measured drafter depth**"
    else:
        head = ("**Overlapping paid only at drafter depth " + ", ".join(str(r["depth"]) for r in paid) + "** of "
                + ", ".join(str(r["depth"]) for r in ov["rows"]))
    shipped = max((r for r in costs.get("rows") or [] if str(r.get("forward", "")).startswith("d3d draft(")),
                  key=lambda r: r.get("threads") or 0, default=None)
    probe8 = next((r for r in ov["rows"] if r["depth"] == 8 and r.get("draft_ms")), None)
    vs = (f" — the shipped 8-layer drafter, its MLPs in int8, drafts in {shipped['wall_ms']:.1f} ms on every thread in the cost "
          f"table, against this probe's {probe8['draft_ms']:.1f} ms at depth 8") if shipped and probe8 else ""
    vs_ = [r["verify_ms"] for r in ov["rows"]]
    bar = forwards_at(costs).get(f"verify({ov['B']})", {}).get("wall_ms")
    spread = (f"\n\nEach depth timed its own verify({ov['B']}) alone again: {min(vs_):.1f}–{max(vs_):.1f} ms"
              + (f" (the chart's verify({ov['B']}) bar: {bar:.1f} ms)" if bar else "")
              + " — the spread of one timing on this machine, not the drafter's doing; each row compares its own two rounds."
              ) if len(vs_) > 1 else ""
    return (f"{head}: d3d-async's round against d3d-seq's (not against ar), on the machine named above.\n\n" + "\n".join(parts) + spread
            + "\n\nSo overlap pays only while hiding the draft saves more than sharing the cores costs the verify, and only while "
            "the packed pass, on its one core, still ends before the verify: it need not improve steadily with depth."
            + f"\n\nHow it was probed: B = {ov['B']}, H = {ov['H']}, every hypothesis a hit; untrained fp32 drafters of each "
            f"depth (cost depends on depth, not training{vs}). Beating ar still takes a τ above the round's break-even.")


def overlap_row_text(r: dict, B: int) -> str:
    """One depth of the overlap probe in milliseconds: d3d-seq's round (draft, then verify, each on every core) against
    d3d-async's (the two lanes at once, one core each), and which of the two effects decided it."""
    head = (f"- depth {r['depth']}: d3d-seq's round {r['seq_round_ms']:.1f} ms (a draft {r['draft_ms']:.1f} + a verify({B}) "
            f"{r['verify_ms']:.1f}, each on both cores); d3d-async's round {r['async_round_ms']:.1f} ms (the verify "
            f"{r['verify_1t_concurrent_ms']:.1f} beside the packed pass {r['packed_1t_concurrent_ms']:.1f}, one core each): "
            f"**{r['async_over_seq']:.2f}×** d3d-seq's speed")
    if r["packed_1t_concurrent_ms"] > r["verify_1t_concurrent_ms"]:
        why = "the packed pass outlasted the verify, so the target waited for the drafter"
    else:
        lost = r["verify_1t_concurrent_ms"] - r["verify_ms"]
        why = (f"sharing the cores cost the verify {lost:.1f} ms to hide a {r['draft_ms']:.1f} ms draft"
               + (" — a gain" if r["pays"] else " — a loss"))
    return f"{head}; {why}."


def bench_table(result: Optional[dict]) -> pd.DataFrame:
    cols = ["dataset", "mode", "n", "tau", "tokens_per_s", "speedup", "lossless_rate", "hit_rate", "overlap", "skipped"]
    if not result or not result.get("summary"):
        return pd.DataFrame(columns=cols)
    summary = list(result["summary"])
    dec = (result.get("config") or {}).get("decode") or {}
    main = plan_label(plan_of(dec))
    for mode, plans in (result.get("plan_compare") or {}).items():  # bench --compare-verify / --compare-drafting, same run
        for label, v in plans.items():
            if label != main:
                summary.append({"dataset": "average", "mode": f"{mode} ({label})", **v})
    for mode, rules in (result.get("verify_compare") or {}).items():  # a result from before the draft gate
        for rule, v in rules.items():
            if rule != dec.get("verify"):
                summary.append({"dataset": "average", "mode": f"{mode} (verify: {rule})", **v})
    df = pd.DataFrame(summary)
    df = df[[c for c in cols if c in df.columns]]
    return df.round(3)


def latency_check_table(result: Optional[dict]) -> pd.DataFrame:
    """Latency model vs the bench's measured speedup, per dataset x mode: predicted from the
    cost probe (a priori) and from the costs the run itself paid (span means)."""
    cols = ["dataset", "mode", "measured_speedup", "predicted (cost probe)", "error (probe)",
            "predicted (run's own costs)", "error (run)"]
    if not result:
        return pd.DataFrame(columns=cols)
    key = lambda r: (r["dataset"], r["mode"])  # noqa: E731
    probe = {key(r): r for r in result.get("latency_model") or []}
    run = {key(r): r for r in result.get("latency_model_in_run") or []}
    rows = []
    for k in list(probe) + [k for k in run if k not in probe]:
        a, b = probe.get(k, {}), run.get(k, {})
        rows.append({"dataset": k[0], "mode": k[1], "measured_speedup": (a or b).get("measured_speedup"),
                     "predicted (cost probe)": a.get("predicted_speedup"), "error (probe)": a.get("error"),
                     "predicted (run's own costs)": b.get("predicted_speedup"), "error (run)": b.get("error")})
    df = pd.DataFrame(rows, columns=cols)
    if rows:  # a bench without --cost-probe has no a-priori prediction: leave those columns out rather than empty
        df = df[[c for c in cols if c in ("dataset", "mode") or df[c].notna().any()]].copy()
    for c in ("error (probe)", "error (run)"):  # (predicted − measured) / measured, as a signed percentage
        if c in df.columns:
            df[c] = [None if pd.isna(x) else f"{x:+.1%}" for x in df[c]]
    return df.round(3)


def projection_figure(rows: list, profile_name: str, tau_scale: float, hit_rate: float, B: int, H: int) -> go.Figure:
    """Predicted speedup per mode — a model, always labelled as such. Each row carries its mode's own τ (its measured
    τ times ``tau_scale``), shown on its bar: no mode is projected at another mode's τ."""
    if not rows:
        return _empty("Projected speedup", "Pick a cost profile.")
    fig = go.Figure(go.Bar(
        x=[r["mode"] for r in rows], y=[r["speedup"] for r in rows], marker_color=[MODE_COLOURS.get(r["mode"], GREY) for r in rows],
        text=[f"{r['speedup']:.2f}× · τ {r.get('tau', 1.0):.2f} · {r['ms_per_token']:.1f} ms/token" for r in rows], textposition="outside",
        hovertemplate="%{x}: %{y:.2f}× (model)<extra></extra>",
    ))
    fig.add_hline(y=1.0, line=dict(color=GREY, dash="dot"))
    scale = "each mode at its measured τ" if abs(tau_scale - 1.0) < 1e-9 else f"each mode at {tau_scale:.2f}× its measured τ"
    fig.update_layout(
        title=dict(text=f"MODEL-BASED projection · {profile_name}<br><sup>B = {B}, {scale}, hit rate {hit_rate:.0%}, H = {H}</sup>",
                   font=dict(size=15)),
        yaxis=dict(title="projected speedup vs ar", range=[0, max(r["speedup"] for r in rows) * 1.2]), height=400, **LAYOUT,
    )
    return fig
