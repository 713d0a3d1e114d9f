"""The Benchmarks tab's engines section: how fast the baseline is on each engine (and llama.cpp), and what
speculative decoding is worth at each speed. Pure functions of shipped measurements, testable without a browser:

- ``engines``: ``python -m d3d_core.measure.engines`` (ar on the fp32 and int4 engines and llama.cpp, same prompts,
  one run, rotated order) -> :func:`engines_table`;
- ``benches``: ``{engine: bench result}`` (``bench --engine fast`` and ``bench --engine int4``, each one run) ->
  :func:`speculation_by_engine_figure` (every mode's tokens/s per engine, each bar labelled with its speedup over
  that engine's own ar, llama.cpp's plain and prompt-lookup tokens/s as reference lines).
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go

from d3d_core.measure.costs import forwards_at

from .figures import GREY, LAYOUT, MODE_COLOURS, _empty

ENGINE_NAMES = {"fast": "fp32", "int4": "int4"}
RUNNER_NAMES = {"fast": "ar, fp32 engine (dequantised weights, the slower ar)", "int4": "ar, int4 engine (GGUF Q4_1 blocks)", "llama-cpp": "llama.cpp, plain",
                "llama-cpp-lookup": "llama.cpp, prompt lookup", "hf-generate": "HF generate", "hf-prompt-lookup": "HF prompt lookup"}
DRAFT_MODES = ("dflash", "d3d-seq", "d3d-async")


def engines_table(engines: Optional[dict]) -> pd.DataFrame:
    """One row per runner: tokens/s (pooled over the prompts), the ar step, and against the fp32 engine's ar the speed
    ratio and the share of greedy tokens that agree (the shared prefix: where rounding first picks another token)."""
    cols = ["runner", "tokens/s", "step ms", "× fp32 ar", "× llama.cpp", "tokens agreeing with fp32 ar"]
    if not engines or not (engines.get("summary") or {}).get("runners"):
        return pd.DataFrame(columns=cols)
    s = engines["summary"]
    pairs = {(p["a"], p["b"]): p for p in s["pairs"]}

    def pair(a, b, key):
        p = pairs.get((a, b))
        if p is not None:
            return p.get(key)
        p = pairs.get((b, a))
        if p is None or p.get(key) is None:
            return None
        return 1 / p[key] if key == "speed_ratio" else p[key]

    rows = []
    for r, v in s["runners"].items():
        share = 1.0 if r == "fast" else pair(r, "fast", "shared_prefix_share")
        rows.append({"runner": RUNNER_NAMES.get(r, r), "tokens/s": v.get("tokens_per_s"), "step ms": v.get("step_ms"),
                     "× fp32 ar": 1.0 if r == "fast" else pair(r, "fast", "speed_ratio"),
                     "× llama.cpp": 1.0 if r == "llama-cpp" else pair(r, "llama-cpp", "speed_ratio"),
                     "tokens agreeing with fp32 ar": None if share is None else f"{share:.0%}"})
    return pd.DataFrame(rows, columns=cols).round(2)


def _summary_row(bench: dict, dataset: str, mode: str) -> Optional[dict]:
    for s in bench.get("summary") or []:
        if s.get("dataset") == dataset and s.get("mode") == mode:
            return s
    return None


def speculation_by_engine_figure(benches: dict, engines: Optional[dict] = None, dataset: str = "gsm8k") -> go.Figure:
    """Tokens/s of ar and each drafting mode on each engine (hatched: fp32, solid: int4), each bar labelled with its
    speedup over that engine's own ar in the same bench run; llama.cpp's tokens/s from the engines run as lines."""
    title = f"What speculation is worth at each engine's speed ({dataset})"
    have = {e: b for e, b in (benches or {}).items() if b and _summary_row(b, dataset, "ar")}
    if not have:
        return _empty(title, "no bench result per engine shipped for this bundle")
    fig = go.Figure()
    modes = ["ar", *DRAFT_MODES]
    for e, b in have.items():
        xs, ys, texts, cols = [], [], [], []
        for m in modes:
            s = _summary_row(b, dataset, m)
            if s is None or s.get("tokens_per_s") is None:
                continue
            xs.append(m)
            ys.append(s["tokens_per_s"])
            texts.append("ar" if m == "ar" else f"{s['speedup']:.2f}× ar")
            cols.append(MODE_COLOURS.get(m, GREY))
        fig.add_bar(x=xs, y=ys, name=f"{ENGINE_NAMES.get(e, e)} engine", text=texts, textposition="outside",
                    marker=dict(color=cols, pattern_shape="/" if e == "fast" else "", line=dict(color="black", width=0.5)),
                    hovertemplate="%{x}: %{y:.1f} tok/s, %{text}<extra>" + ENGINE_NAMES.get(e, e) + "</extra>")
    for r, dash in (("llama-cpp", "dash"), ("llama-cpp-lookup", "dot")):
        v = ((engines or {}).get("summary") or {}).get("runners", {}).get(r)
        if v and v.get("tokens_per_s"):
            # under the bars and their labels, named in the legend (a label on the line would sit on a bar or its label)
            line = dict(color="black", dash=dash, width=1.2)
            fig.add_hline(y=v["tokens_per_s"], line=line, layer="below")
            fig.add_scatter(x=[None], y=[None], mode="lines", line=line, name=f"{RUNNER_NAMES[r]}: {v['tokens_per_s']:.0f} tok/s")
    fig.update_layout(title=title, barmode="group", yaxis_title="tokens/s (decode, prefill excluded)", height=420,
                      legend=dict(orientation="h", y=-0.15), **LAYOUT)
    return fig


def engines_text(engines: Optional[dict], benches: dict, dataset: str = "gsm8k") -> str:
    """What the section shows, in numbers from the shipped runs (or why it is empty)."""
    if not engines and not any(benches.values()):
        return "No engine comparison is shipped for this bundle."
    parts = []
    run = (engines or {}).get("summary", {}).get("runners", {})
    f, q, l = (run.get(k, {}).get("tokens_per_s") for k in ("fast", "int4", "llama-cpp"))
    if f and q:
        parts.append(f"Plain decoding runs at **{f:.0f} tok/s** on the fp32 engine and **{q:.0f} tok/s** on the int4 engine "
                     f"({q / f:.2f}×, same prompts, one run)")
    if l:
        parts.append(f"llama.cpp on the same GGUF and threads runs at **{l:.0f} tok/s**")
    sp = []
    for e, b in benches.items():
        s = b and _summary_row(b, dataset, "d3d-seq")
        if s and s.get("speedup") is not None:
            sp.append(f"{s['speedup']:.2f}× on {ENGINE_NAMES.get(e, e)}")
    if sp:
        parts.append(f"d3d-seq's speedup over the same engine's ar on {dataset} is " + ", ".join(sp)
                     + ": the faster the baseline, the larger the share of a round the drafts and the fixed per-forward costs take")
    gaps, elsewhere = [], []
    for e, b in benches.items():  # the same ar in two runs: the bench's yardstick beside the engines run's ar alone
        s, alone = b and _summary_row(b, "average", "ar"), run.get(e, {}).get("tokens_per_s")
        if s and s.get("tokens_per_s") and alone:
            if same_machine(b, engines):
                gaps.append((ENGINE_NAMES.get(e, e), s["tokens_per_s"], alone))
            else:  # another VM or host: its ar is that machine's, no gap to read
                elsewhere.append(f"{s['tokens_per_s']:.1f} tok/s on {ENGINE_NAMES.get(e, e)} (a run on another machine, "
                                 f"{(b.get('machine') or {}).get('date', 'date unknown')}: not set against this engines run)")
    text = ". ".join(parts) + "." if parts else ""
    if gaps or elsewhere:  # a second paragraph: which ar the bars' speedups are against
        notes = [f"The {ENGINE_NAMES.get(e, e)} bench was {b['note']}." for e, b in benches.items() if b and b.get("note")]
        text += ("\n\n**Which ar the bars are against.** Each bar's speedup is against its own bench's ar, which ran beside the "
                 "drafting modes. Averaged over the bench's datasets (the bars show " + dataset + " alone) that ar read "
                 + ", ".join([f"{t:.1f} tok/s on {n} ({t / a - 1:+.0%} against the engines run's {a:.1f})" for n, t, a in gaps]
                             + elsewhere)
                 + (". Against ar as fast as the engines run's, the speedups would be smaller by that share. " if gaps else ". ")
                 + " ".join(notes))
    return text.strip()


def same_machine(a: Optional[dict], b: Optional[dict]) -> bool:
    """Did two shipped runs come from one machine? Their recorded platform strings (OS build, which names the VM image)
    and CPU agree; a run without them counts as the same (older files recorded less)."""
    ma, mb = (a or {}).get("machine") or {}, (b or {}).get("machine") or {}
    return all(ma.get(k) is None or mb.get(k) is None or ma.get(k) == mb.get(k) for k in ("platform", "cpu"))


def int4_costs_text(costs: Optional[dict]) -> str:
    """The int4 step-costs section's first paragraph, read from the shipped int4 cost table (``costs --engine int4``):
    what a step, a verify of 8 rows and a D3D draft cost on its machine, at its most threads. Pure."""
    by = forwards_at(costs)
    if not by:
        return ("**Where an int4 step's time goes**: no int4 cost table is shipped for this bundle "
                "(`python -m d3d_core.measure.costs --engine int4`).")
    step, v8 = by.get("step"), by.get("verify(8)")
    draft = next((r for f, r in by.items() if f.startswith("d3d draft(")), None)
    text = ("**Where an int4 step's time goes** (`python -m d3d_core.measure.costs --engine int4`): the 4-bit GEMMs read a fifth "
            "of fp32's bytes; around them the glue (norms, casts, RoPE, KV writes: “everything else”) and attention run in fp32.")
    if step and v8:
        text += (f" On the measured machine ({step['threads']} threads) a step took **{step['wall_ms']:.1f} ms** and a verify of 8 rows "
                 f"**{v8['per_step']:.2f} steps**")
        text += (f", a D3D draft of 8 **{draft['per_step']:.2f}** (the drafter runs in fp32 with int8 MLPs, not on the 4-bit GEMM)."
                 if draft else ".")
        text += (" Speculation pays when a verify costs about one step and a draft a small part of one; a bar's parts say which "
                 "of them grows with the rows.")
    return text
