"""Share a run: one self-contained HTML file of a race (pure function of its Traces).

The file holds every mode's tokens with their states and counters, the economics of the run,
the timeline, the rounds grid and the traces themselves (JSON, so the app can read them back).
plotly.js is inlined: the file opens offline, on a projector, in any browser.
"""

from __future__ import annotations

import datetime as _dt
import html

from d3d_core.decoding.trace import MODES, traces_to_json
from d3d_core.measure.economics import race_economics
from d3d_core.measure.reading import race_load

from . import figures
from .tokens import ar_time_per_token, column_html, drafter_confound, legend_html

PAGE_CSS = """
<style>
body {font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1400px; color: #222; padding: 0 16px;}
h1 {font-size: 24px; margin-bottom: 4px;} h2 {font-size: 18px; margin-top: 28px;}
.meta {color: #555; font-size: 13px;} .prompt {background: #f6f6f6; border-radius: 6px; padding: 8px 12px; white-space: pre-wrap;}
.cols {display: grid; grid-template-columns: repeat(auto-fit, minmax(300px, 1fr)); gap: 12px; align-items: start;}
.why {background: #fff8e6; border-left: 4px solid #E69F00; padding: 8px 12px; font-size: 14px;}
.busy {background: #fde8e8; border-left: 4px solid #D55E00; padding: 8px 12px; font-size: 15px; font-weight: 600;}
</style>
"""


def race_html(traces: list, pieces: dict, rounds_mode: str = "d3d-async") -> str:
    """The whole race as one HTML document (str)."""
    traces = [t for t in traces if t is not None]
    if not traces:
        raise ValueError("nothing to export yet: run a race first")
    by_mode = {t.mode: t for t in traces}
    econ = {e.mode: e for e in race_economics(traces)}
    tpt = ar_time_per_token(traces)
    cols = "".join(column_html(by_mode.get(m), pieces, m, ar_time_per_token=tpt, econ=econ.get(m)) for m in MODES if m in by_mode)
    first = traces[0]
    cfg = first.config or {}
    settings = ", ".join(f"{k} = {cfg[k]}" for k in ("block_size", "hypotheses", "max_new_tokens", "temperature", "sampling", "seed") if k in cfg)
    why = " ".join(e.sentence() for e in econ.values() if e.sentence())
    if why and drafter_confound(traces):
        why += " " + drafter_confound(traces)
    load = race_load(traces)
    if load is None:
        machine = "<div class='meta' id='d3d-machine'>machine load not recorded (a trace from before it was measured)</div>"
    elif load.busy:
        machine = (f"<div class='busy' id='d3d-machine'>⚠ machine busy: {html.escape(load.reason.replace('`', ''))} — the speedups below are "
                   "unreliable</div>")
    else:
        machine = f"<div class='meta' id='d3d-machine'>{html.escape(load.status())}</div>"
    pick = rounds_mode if rounds_mode in by_mode else traces[-1].mode
    figs = [
        ("Timeline: who worked when", figures.timeline_figure(traces)),
        ("Economics: what one output token cost", figures.economics_figure(traces)),
        (f"Rounds of {pick}", figures.rounds_grid_figure(by_mode[pick], pieces)),
        ("Acceptance", figures.acceptance_figure(traces)),
    ]
    parts = []
    for i, (title, fig) in enumerate(figs):
        # plotly.js inlined once, in the first figure: the page needs no network
        parts.append(f"<h2>{html.escape(title)}</h2>" + fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False))
        if i == 0 and (cap := figures.timeline_caption(traces)):  # why the target waited, from this race's numbers
            parts.append("<div class='why'>" + "<br>".join(html.escape(x.replace("**", "")) for x in cap.splitlines()) + "</div>")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = traces_to_json(traces).replace("</", "<\\/")  # keep the JSON inside its script element
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>D3D Studio race</title>" + PAGE_CSS + "</head><body>"
        f"<h1>D3D Studio race</h1><div class='meta'>bundle <b>{html.escape(first.bundle)}</b> · device {html.escape(first.device)} · "
        f"{html.escape(settings)} · exported {stamp}</div>" + machine
        + f"<h2>Prompt</h2><div class='prompt'>{html.escape(first.prompt_text)}</div>"
        + (f"<h2>Why these speeds</h2><div class='meta'>Each speedup reads <i>ratio× (low–high)</i>: the ratio and its 10–90 % spread "
           f"from resampling this race's rounds.</div><div class='why'>{html.escape(why)}</div>" if why else "")
        + f"<h2>Race</h2>{legend_html()}<div class='cols'>{cols}</div>" + "".join(parts)
        + f"<script type='application/json' id='d3d-traces'>{data}</script></body></html>"
    )


def traces_json_of(html_text: str) -> str:
    """The trace JSON embedded in an exported page (so an export can be loaded back)."""
    start = html_text.find("<script type='application/json' id='d3d-traces'>")
    if start < 0:
        raise ValueError("no D3D Studio traces in this HTML file")
    start = html_text.index(">", start) + 1
    end = html_text.index("</script>", start)
    return html_text[start:end].replace("<\\/", "</")

