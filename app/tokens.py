"""Token colouring: a Trace -> HTML for one race column. Pure functions, no Gradio.

States (colour + a text style + a tooltip, never colour alone):
accepted draft (green, underlined) · bonus / corrected token (blue, bold, boxed) ·
rejected draft (vermillion, struck through, shown in the round it was rejected) ·
pending = drafted, not yet verified (grey, italic, dashed).
"""

from __future__ import annotations

import html
import re
from typing import Optional

from d3d_core.decoding.trace import Trace, hit_rate_of

CSS = """
<style>
.d3d-col {font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13.5px; line-height: 1.9;
          border: 1px solid #ddd; border-radius: 8px; padding: 8px 10px; min-height: 120px; background: #fff; color: #222;}
.d3d-head {font-family: system-ui, sans-serif; font-weight: 700; font-size: 15px; margin-bottom: 4px;}
.d3d-drafter {font-family: system-ui, sans-serif; font-size: 12.5px; color: #333; margin: -2px 0 4px 0;}
.d3d-stats {font-family: system-ui, sans-serif; font-size: 12.5px; color: #333; margin-bottom: 6px;
            display: grid; grid-template-columns: repeat(3, auto); gap: 2px 10px;}
.d3d-stats b {font-variant-numeric: tabular-nums;}
/* a term with a hover explanation */
.d3d-stats span[title], .d3d-drafter[title], .term {cursor: help;}
.term, .d3d-drafter[title] {text-decoration: underline dotted #999;}
.tok {white-space: pre-wrap; border-radius: 3px; padding: 0 1px;}
/* a long answer scrolls inside its column, so the Race tab stays within two screens (counters and economics stay in
   view); column-reverse keeps the newest tokens in view while it streams and the answer's end in view when it is done */
.d3d-text {max-height: 186px; overflow-y: auto; display: flex; flex-direction: column-reverse;}
.tok.acc {background: #009E7326; border-bottom: 2px solid #009E73;}
.tok.bonus {background: #0072B226; border: 1px solid #0072B2; font-weight: 700;}
.tok.first {background: #CC79A726; border: 1px solid #CC79A7;}
.tok.rej {color: #D55E00; text-decoration: line-through; text-decoration-thickness: 2px; font-size: 12px;}
.tok.pend {color: #666; font-style: italic; border-bottom: 1px dashed #999;}
.tok.ar {background: none;}
.d3d-legend {font-family: system-ui, sans-serif; font-size: 13px; display: flex; flex-wrap: wrap; gap: 14px; align-items: center;}
.d3d-counters {margin-top: 4px; color: #333;}
.d3d-done {font-family: system-ui, sans-serif; font-size: 13px; color: #333; margin-top: 6px;}
/* a figure from another run than the one on screen: its date and machine, compact (the commit on hover) */
.d3d-tag {font-size: 0.9em; background: #f1f1f1; border: 1px solid #ccc; border-radius: 4px; padding: 0 5px; color: #333;
          white-space: nowrap; cursor: help;}
/* the line above the tabs that the app's texts call the Status line, labelled so it can be found */
#status .md > p:first-child::before {content: "Status line ▸ "; font-weight: 700;
          font-size: 0.85em; color: #0072B2; letter-spacing: 0.02em;}
.d3d-badge {font-family: system-ui, sans-serif; font-size: 13px; font-weight: 600; margin-top: 6px; cursor: help;}
/* the help text under the Race controls: Gradio's default is small and light grey; make it readable */
.info-text {font-size: 14px !important; color: #333 !important; line-height: 1.4 !important;}
/* what each preset button does: one compact line under them, set close to them */
#preset-buttons {margin: -6px 0 -6px 0;} #preset-buttons p {font-size: 13px; line-height: 1.35; margin: 0; color: #333;}
/* the presenter view (the 🖥 checkbox, or ?presenter in the address): type a back row can read on a projector */
body.d3d-presenter .gradio-container {--text-xxs: 13px; --text-xs: 15px; --text-sm: 17px; --text-md: 19px; --text-lg: 21px;
    --text-xl: 26px; --text-xxl: 30px; --block-label-text-size: 17px; --block-info-text-size: 16px; --body-text-size: 19px;
    --prose-text-size: 19px; --section-header-text-size: 19px; --input-text-size: 18px; --button-small-text-size: 16px;}
body.d3d-presenter .prose, body.d3d-presenter .md {font-size: 19px !important; line-height: 1.5 !important;}
body.d3d-presenter .d3d-col {font-size: 20px; line-height: 1.8;}
body.d3d-presenter .d3d-head {font-size: 22px;}
body.d3d-presenter .d3d-stats, body.d3d-presenter .d3d-drafter, body.d3d-presenter .d3d-done, body.d3d-presenter .d3d-legend {font-size: 17px;}
body.d3d-presenter .tok.rej {font-size: 17px;}
body.d3d-presenter .d3d-text {max-height: 520px;}
body.d3d-presenter .info-text {font-size: 17px !important;}
</style>
"""


# τ defined without any term the page has not yet explained (round, draft, bonus): what one round does, in a line
LEGEND_TAU = "<b>τ</b>: tokens per round (one target pass keeps the right guesses + one token of its own)"


# the coloured boxes mix rejected guesses into the text; where the answer reads as plain text (the legend's hover)
PLAIN_TEXT_TIP = ("Each box shows the end of its answer; scroll it up for the start. The ar box holds no guesses, so it reads "
                  "as the plain answer. In the others, struck-through tokens are rejected guesses, not part of the answer; "
                  "at temperature 0 the kept tokens spell the ar box's answer.")


def legend_html() -> str:
    return CSS + (
        '<div class="d3d-legend"><span>Legend:</span>'
        '<span><span class="tok acc">accepted</span> accepted draft</span>'
        '<span><span class="tok bonus">bonus</span> the target\'s own token</span>'
        '<span><span class="tok rej">rejected</span> rejected draft</span>'
        '<span><span class="tok pend">pending</span> drafted, not yet verified</span>'
        '<span><span class="tok first">first</span> first token (from prefill)</span>'
        f'<span title="{html.escape(PLAIN_TEXT_TIP)}">↕ scroll up for the start · plain text: the ar box</span>'
        "</div>"
        f'<div class="d3d-legend d3d-counters"><span>{LEGEND_TAU}</span>'
        f'<span class="term" title="{html.escape(TIPS["hit rate"])}"><b>hit rate</b> (d3d-async): next block drafted during '
        "the check; “–”: no guessing ahead</span><span>hover a term for more</span></div>"
    )


def ar_time_per_token(traces) -> Optional[float]:
    """Seconds per token of the finished ar trace among ``traces`` (the speedup counters' yardstick), or None."""
    ar = next((t for t in traces if t is not None and t.mode == "ar"), None)
    if ar is None or not ar.finish_reason or ar.stats.tokens_per_s <= 0:
        return None
    return 1.0 / ar.stats.tokens_per_s


def _tok(text: str, cls: str, tip: str) -> str:
    """One token. A newline in committed text (accepted, bonus, first, ar) shows as ⏎ and breaks the line, as in
    ar's column; in a rejected or pending draft it shows as ⏎ only, so drafts that never entered the output do not
    lay the column out differently from ar's."""
    t = html.escape(text)
    t = t.replace("\n", "⏎") if cls in ("rej", "pend") else t.replace("\n", "⏎<br>")
    return f'<span class="tok {cls}" title="{html.escape(tip)}">{t}</span>'


def drafter_line(trace: Trace) -> str:
    """The column's drafter line: its *drafter* layers named as such (a DFlash drafter also reads the target's hidden
    states at a few *feature* layers of the target — a different count, see How it works)."""
    text = re.sub(r"\b(\d+) layer(s?)\b", r"\1 drafter layer\2", trace.drafter, count=1)
    if trace.mode == "dflash":  # one line in a column: "DFlash, 2 drafter layers + target hidden states"
        text = text.replace("DFlash drafter, ", "DFlash, ") + " + target hidden states"
    return text


def drafter_tip(trace: Trace) -> str:
    """Hover text for the drafter line, where it names something a newcomer cannot guess (adapters, feature layers)."""
    tips = []
    if "adapters" in (trace.drafter or ""):
        m = re.search(r"rank-(\d+)", trace.drafter)
        tips.append(f"{'rank-' + m.group(1) + ' ' if m else ''}adapters: small trained low-rank weight matrices added to the "
                    "target's own frozen layers; they act only on the MASK slots, so draft 1 (read at the anchor) is the "
                    "target's own token")
    if trace.mode.startswith("d3d") and "adapters" not in (trace.drafter or ""):
        tips.append("on either engine this drafter runs its MLPs and head in int8 (the Engine choice is the target's): a draft "
                    "only proposes and the target checks every token, so this cannot change the output")
    if trace.mode == "dflash":
        tips.append("drafter layers: the DFlash drafter's own small stack; feature layers: the target layers whose hidden "
                    "states it reads, available only after each verify")
    return f' title="{html.escape("; ".join(tips))}"' if tips else ""


def _drafter_layers(trace) -> Optional[int]:
    m = re.search(r"\b(\d+) layers?\b", trace.drafter or "")
    return int(m.group(1)) if m else None


def drafter_confound(traces) -> str:
    """Where a race ran dflash and a d3d mode: their drafters' sizes, which differ, so the comparison is not one of
    methods alone; "" otherwise (or when the sizes are equal or unknown)."""
    by = {t.mode: t for t in traces if t is not None}
    dfl = _drafter_layers(by["dflash"]) if "dflash" in by else None
    d3d = next((_drafter_layers(by[m]) for m in ("d3d-seq", "d3d-async") if m in by and _drafter_layers(by[m])), None)
    if not dfl or not d3d or dfl == d3d:
        return ""
    return (f"dflash vs d3d is not a clean comparison of methods: the DFlash drafter has {dfl} drafter layers (plus the "
            f"target's hidden states), the D3D drafter {d3d}, so τ and draft cost differ by drafter size too.")


def agreement(trace: Optional[Trace], ar: Optional[Trace]) -> tuple[str, str]:
    """The "identical output" badge of a finished drafting mode, computed from the tokens: ``(kind, words)`` with kind
    "same" (every token ar printed, in order), "prefix" (the same over the tokens both printed: one was stopped or
    cut earlier), "differs" (a different token at some position — never expected at temperature 0 on one engine),
    "sampled" (temperature > 0: outputs differ by design), or "" where there is nothing to compare. The tokens are each
    trace's ``output_ids`` (the prefill's token, then every round's committed ones)."""
    if (trace is None or ar is None or trace.mode == "ar" or not trace.finish_reason or not ar.finish_reason
            or not trace.output_ids or not ar.output_ids):
        return "", ""
    if float(trace.config.get("temperature", 0.0)) > 0 or float(ar.config.get("temperature", 0.0)) > 0:
        return "sampled", "sampled (temperature > 0): not the same tokens as ar by design, the same distribution"
    mine, theirs = trace.output_ids, ar.output_ids
    n = min(len(mine), len(theirs))
    diff = next((i for i in range(n) if mine[i] != theirs[i]), None)
    if diff is not None:
        return "differs", f"differs from ar at token {diff + 1} of {n}"
    if len(mine) == len(theirs):
        return "same", f"identical output ✓ (all {n} tokens)"
    return "prefix", f"identical ✓ over the {n} tokens both printed (ar {len(theirs)}, {trace.mode} {len(mine)})"


def _badge(kind: str, words: str) -> str:
    colour = {"same": "#117733", "prefix": "#117733", "differs": "#b2182b", "sampled": "#666"}[kind]
    tip = {"same": "computed from the tokens: this mode printed exactly the tokens ar printed in this race",
           "prefix": "computed from the tokens: equal as far as both went (a stopped run or a cut ends earlier)",
           "differs": "computed from the tokens: at temperature 0 on one engine this must not happen",
           "sampled": "at temperature > 0 each mode samples; the method keeps the target's distribution, not its tokens"}[kind]
    return f'<div class="d3d-badge" style="color:{colour}" title="{html.escape(tip)}">{html.escape(words)}</div>'


def _fmt(v, fmt="{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def column_html(trace: Optional[Trace], pieces: dict, mode: str = "", t_ms: Optional[float] = None,
                ar_time_per_token: Optional[float] = None, running: bool = False, econ=None, busy: bool = False,
                ar: Optional[Trace] = None) -> str:
    """HTML of one race column. ``t_ms``: show the state at that time of the run (replay);
    ``ar_time_per_token``: seconds per token of the ar run, for the speedup counter;
    ``econ``: the run's ``Economics`` (shown under the counters once it has finished); ``busy``: the race ran on a busy
    machine (``reading.race_load``), so the finished speedup is greyed and struck through, not read; ``ar``: the race's ar
    trace, for the "identical output" badge (``agreement``)."""
    if trace is None:
        return CSS + f'<div class="d3d-col"><div class="d3d-head">{html.escape(mode)}</div><i>waiting…</i></div>'
    mode = trace.mode
    P = lambda t: pieces.get(t, f"<{t}>")  # noqa: E731
    verify_end = {s.round: s.t_end for s in trace.spans if s.kind == "verify"}
    verify_start = {s.round: s.t_start for s in trace.spans if s.kind == "verify"}
    prefill_end = max((s.t_end for s in trace.spans if s.kind == "prefill" and s.lane == "target"), default=0.0)
    parts = []
    n_tok, rounds_done, acc_sum, hits, hyp_rounds = 0, 0, 0, 0, 0
    if trace.first_token is not None and (t_ms is None or t_ms >= prefill_end):
        parts.append(_tok(P(trace.first_token), "first", "first token, sampled from the prefill logits"))
        n_tok = 1
    pending = None
    for r in trace.rounds:
        if t_ms is not None and r.index in verify_end and verify_end[r.index] > t_ms:
            if r.index in verify_start and verify_start[r.index] <= t_ms:
                pending = r
            break
        for j, d in enumerate(r.committed[:-1] if len(r.committed) == r.accepted + 1 else r.committed[: r.accepted]):
            q = r.draft_probs[j] if j < len(r.draft_probs) else None
            parts.append(_tok(P(d), "acc", f"accepted draft d{j + 1} (round {r.index}, drafter q = {_fmt(q)})"))
        if r.accepted < len(r.draft_ids):
            rej = r.draft_ids[r.accepted]
            rest = "".join(P(x) for x in r.draft_ids[r.accepted + 1 :])
            parts.append(_tok(P(rej), "rej", f"rejected draft d{r.accepted + 1} (round {r.index}); the drafts after it were discarded too: {rest!r}"))
        if len(r.committed) == r.accepted + 1:
            cls = "ar" if mode == "ar" else "bonus"
            tip = "target token (autoregressive step)" if mode == "ar" else f"bonus token from the target (round {r.index}, {r.accepted} drafts accepted)"
            parts.append(_tok(P(r.bonus), cls, tip))
        n_tok += len(r.committed)
        rounds_done += 1
        acc_sum += r.accepted + 1
        if r.hit is not None:
            hyp_rounds += 1
            hits += int(r.hit)
    if pending is not None:
        for j, d in enumerate(pending.draft_ids):
            parts.append(_tok(P(d), "pend", f"drafted d{j + 1}, being verified (round {pending.index})"))
    elif running and trace.rounds and trace.rounds[-1].hit:
        # d3d-async: the hit hypothesis's block is already drafted and waits for verify
        h = next(h for h in trace.rounds[-1].hypotheses if h.hit)
        for j, d in enumerate(h.draft_ids):
            parts.append(_tok(P(d), "pend", f"drafted during the last verify (hypothesis hit), not yet verified: d{j + 1}"))
    st = trace.stats
    final = bool(trace.finish_reason) and t_ms is None
    if final:
        tps = st.tokens_per_s
        tau = st.tau
        hr = hit_rate_of(trace)  # the last round's hypotheses needed no verdict: not counted
    else:
        elapsed = ((t_ms if t_ms is not None else (max((s.t_end for s in trace.spans), default=0.0))) - prefill_end) / 1e3
        tps = (n_tok - 1) / elapsed if elapsed > 0 and n_tok > 1 else None
        tau = acc_sum / rounds_done if rounds_done else None
        hr = hits / hyp_rounds if hyp_rounds else None
    speed = None
    if ar_time_per_token and tps:
        speed = ar_time_per_token * tps  # (ar s/token) / (this mode's s/token)
    speed_txt = _fmt(speed, '{:.2f}×')
    if final and econ is not None and econ.speedup is not None:
        speed_txt = econ.speedup_label()  # with its spread, or "too short to time (N rounds)"
    fwd = (1 + rounds_done) if not final else st.target_forwards
    stats = (
        f"<span{_tip('tokens/s')}>tokens/s <b>{_fmt(tps, '{:.1f}')}</b></span><span{_tip('τ')}>τ <b>{_fmt(tau)}</b></span>"
        f"<span{_tip('rounds')}>rounds <b>{rounds_done}</b></span><span{_tip('target fwd')}>target fwd <b>{fwd}</b></span>"
        f"<span{_tip('hit rate')}>hit rate <b>{_fmt(hr, '{:.0%}')}</b></span>"
        + (f"<span style='color:#999' title='the machine was busy during this race: the ratio is not a reading'>speedup "
           f"<s>{html.escape(speed_txt)}</s> (busy)</span>" if busy and final and trace.mode != "ar" else
           f"<span{_tip('speedup')}>speedup <b>{html.escape(speed_txt)}</b></span>")
    )
    foot = ""
    if final:
        foot = (f'<div class="d3d-done">done: {n_tok} tokens = 1 (prefill) + {max(n_tok - 1, 0)} in {st.decode_time_s:.2f} s '
                f'of decode, <span class="term" title="{html.escape(FINISH_WORDS.get(trace.finish_reason, ""))}">'
                f'finish = {html.escape(trace.finish_reason)}</span>{_tau_note(trace)}</div>')
        kind, words = agreement(trace, ar)
        if kind:
            foot = _badge(kind, words) + foot
        if econ is not None:
            foot += _econ_html(econ)
    elif running:
        foot = '<div class="d3d-done">running…</div>'
    return (
        CSS + f'<div class="d3d-col" aria-label="{html.escape(mode)} output"><div class="d3d-head">{html.escape(mode)}</div>'
        + (f'<div class="d3d-drafter"{drafter_tip(trace)}>{html.escape(drafter_line(trace))}</div>' if trace.drafter else "") +
        f'<div class="d3d-stats">{stats}</div><div class="d3d-text" title="the newest tokens stay in view; scroll up for the start">'
        f'<div>{"".join(parts)}</div></div>{foot}</div>'
    )


def _tau_note(trace: Trace) -> str:
    """Every drafting mode's "N rounds × τ = M tokens" (τ counts each round's a + 1 whole), and where that is not the
    tokens decoded, why: the answer's end (or the token limit) cut the last round short. "" for ar and without rounds."""
    rounds = trace.rounds
    if trace.mode == "ar" or not rounds:
        return ""
    whole, decoded = sum(r.accepted + 1 for r in rounds), sum(len(r.committed) for r in rounds)
    n = f"{len(rounds)}&nbsp;rounds&nbsp;×&nbsp;τ&nbsp;=&nbsp;{whole}&nbsp;tokens"
    if whole == decoded:
        return f'; <span class="term" title="τ is the mean of a + 1 over the rounds: rounds × τ = the tokens the rounds committed">{n}</span>'
    end = {"eos": "the answer's end", "length": "the token limit"}.get(trace.finish_reason, "the stop")
    return (f'; <span class="term" title="τ is the mean of a + 1 over the rounds and counts the last round whole; the output '
            f'does not, so per token (decode time ÷ {decoded}) is a little above round ÷ τ (decode time ÷ {whole})">{n}, '
            f"{decoded}&nbsp;printed: the last round's {whole - decoded} past {end} are cut</span>")


# why a run ended, in words beside its code (the Trace's finish_reason)
FINISH_WORDS = {"eos": "eos (the model ended its answer)", "length": "length (the token limit)",
                "cancelled": "cancelled (stopped)", "context": "context (the context window is full)"}


# what each number under a column means, shown on hover (the glossary of How it works has the long form)
TIPS = {
    "tokens/s": "output tokens after the first, divided by decode time (prefill excluded)",
    "τ": "acceptance length: tokens committed per round (accepted drafts + the bonus token), averaged over rounds",
    "rounds": "rounds so far: one draft (or none, when the draft gate skips it) + one target verify",
    "target fwd": "target forward passes: the prefill plus one verify per round",
    "hit rate": "d3d-async: share of rounds whose next block was already drafted during the verify: one of its guesses "
                "(a, t) — a drafts accepted, bonus token t — was the verify's actual outcome; the other rounds (misses) drafted "
                "after the verify, while the target waited. –: ar, dflash and d3d-seq do not guess ahead, so they have no hits "
                "(and d3d-async reads – until a round has its verdict)",
    "speedup": "ar's time per token ÷ this mode's, in this race; in brackets the 10–90 % spread over resampled rounds",
    "per token": "this mode's measured time per output token = decode time ÷ tokens printed (about one round ÷ τ; a little "
                 "more where the last round's tokens past the answer's end or the token limit were cut: τ counts them, the "
                 "output does not)",
    "round": "decode time ÷ rounds",
    "verify": "the target's verify forwards (verify(k): one forward over k tokens, the anchor + k − 1 drafts)",
    "draft not hidden": "drafting the target had to wait for (d3d-async hides a hit's draft, which ran during the verify; after a "
                        "miss it drafts after the verify, in the open)",
    "draft": "drafting time: this mode drafts, then verifies, so the target waits for every draft (it never drafts during a "
             "verify; ar has no drafter)",
    "other": "time neither lane was busy: bookkeeping between forwards",
    "T_verify": "mean time of one verify",
    "T_draft": "mean time of one draft",
    "T_packed": "mean time of one packed pass: d3d-async's drafts for all H hypotheses in one forward, run during verify",
    "T_step": "what ar paid per token in this race",
    "break-even τ": "round ÷ T_step: the τ at which this mode, with these round costs, would tie ar here",
}


ASYNC_HIDDEN_TIP = ("a hit's next block was drafted in the packed pass beside the verify, hidden; a miss drafts it after "
                    "the verify while the target waits (draft not hidden). Where the two lanes share the CPU cores, the packed "
                    "pass also slows the verify it runs beside, which shows in its verify time. This share counts rounds (those "
                    "that made guesses and needed a next block). The Timeline's overlap share is another number, a share of the "
                    "drafter's busy time (the part that ran during a verify): the packed pass runs beside every verify, hit or "
                    "miss, so it is high even where few rounds hit")


def _tip(term: str) -> str:
    """A title attribute (hover text) for a term of the column."""
    return f' title="{html.escape(TIPS[term])}"'


def _term(term: str, shown: str = "") -> str:
    """The term as shown, with its hover text."""
    return f'<span class="term"{_tip(term)}>{html.escape(shown or term)}</span>'


def whole_ms(total: float, parts) -> tuple:
    """``total`` and its ``parts`` in whole ms that still add up: the total rounded, each part floored, and the ms
    left over given to the parts with the largest remainders (largest-remainder rounding), so "40 = 31 + 8 + 0"
    never reads 39 on screen. Parts that do not sum to ``total`` (beyond float noise) are rounded each on its own."""
    t = round(total)
    floors = [int(p // 1) for p in parts]
    left = t - sum(floors)
    if abs(sum(parts) - total) > 1e-6 * max(1.0, abs(total)) or not 0 <= left <= len(parts):
        return t, [round(p) for p in parts]
    order = sorted(range(len(parts)), key=lambda i: parts[i] - floors[i], reverse=True)
    for i in order[:left]:
        floors[i] += 1
    return t, floors


def _econ_html(e) -> str:
    """The run's economics in three short lines (ms from its own spans): per token and per round, each the sum of
    verify + draft not hidden + other, and break-even τ = round / T_step (T_step: ar's time per token in this race).
    "draft not hidden" only where drafting can overlap a verify (d3d-async); a mode that never overlaps shows "draft".
    Each term carries its meaning as hover text."""
    draft = _term("draft not hidden") if e.mode == "d3d-async" else _term("draft")
    parts = f"{_term('verify')} {{}} + {draft} {{}} + {_term('other')} {{}}"
    t, p = whole_ms(e.per_token_ms, [e.verify_per_token_ms, e.draft_visible_per_token_ms, e.idle_per_token_ms])
    lines = [f"{_term('per token')} <b>{t} ms</b> = " + parts.format(*p)]
    if e.mode != "ar":
        t, p = whole_ms(e.round_ms, list(e.round_parts_ms()))
        lines.append(f"{_term('round')} {t} ms = " + parts.format(*p))
        c = f"{_term('T_verify')} {e.t_verify_ms:.1f} ms"
        if e.t_draft_ms is not None:
            c += f" · {_term('T_draft')} {e.t_draft_ms:.1f}"
        if e.t_packed_ms is not None:
            c += f" · {_term('T_packed')} {e.t_packed_ms:.1f}"
        lines.append(c)
        if e.mode == "d3d-async" and e.hit_rate is not None:  # why an overlapping mode still shows drafting in the open
            lines.append(f'<span class="term" title="{html.escape(ASYNC_HIDDEN_TIP)}">drafts hidden on hits only: '
                         f"{e.hit_rate:.0%} of rounds</span>")
        if e.flags:
            # the first reason in the column; every reason in the hover (the banner above the tabs repeats them per mode)
            why = e.flags[0].split(":")[0]
            lines.append(f'<span class="term" title="{html.escape("; ".join(e.flags))}">⚠ <b>implausible reading</b> '
                         f"(timing noise): {html.escape(why)}{' …' if len(e.flags) > 1 or ':' in e.flags[0] else ''}</span>")
        elif e.break_even_tau is not None:
            lines.append(f"{_term('break-even τ')} = round {e.round_ms:.1f} / {_term('T_step')} {e.t_step_ms:.1f} ms = "
                         f"<b>{e.break_even_tau:.2f}</b> (τ here {e.tau:.2f})")
    return '<div class="d3d-done d3d-econ">' + "<br>".join(lines) + "</div>"
