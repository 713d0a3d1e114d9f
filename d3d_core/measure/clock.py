"""A hardware clock: re-time a run under a cost profile of the latency model.

Same rounds, same accepted lengths, same hits and misses; only the span lengths change, laid
out by the latency model's round rules:

- ``ar``: one step per round;
- ``dflash`` / ``d3d-seq``: draft, then verify (sequential);
- ``d3d-async``: verify and the packed pass start together, the round ends when both have (each
  slowed by the profile's contention factors, if any); after a miss, a synchronous draft runs
  before the next verify; the first round drafts synchronously as in the real run.

Prefill is one step on the target (and, for D3D, a draft-sized pass on the drafter: in parallel
for d3d-async, before decoding for d3d-seq). The result is a new Trace; the figures that draw it
are told the profile's name and label everything as projected. Nothing here is a measurement.
"""

from __future__ import annotations

import copy
from typing import Optional

from ..decoding.trace import Span, Trace
from .latency import CostProfile, async_costs, async_profile, draft_ms


def retime(trace: Trace, profile: CostProfile) -> Trace:
    """A copy of ``trace`` whose spans and speed follow ``profile`` (see the module docstring)."""
    mode = trace.mode
    cfg = trace.config or {}
    B = 1 if mode == "ar" else int(cfg.get("block_size", 8))
    H = int(cfg.get("hypotheses", 4))
    p = async_profile(profile) if mode == "d3d-async" else profile
    step = p.t_step_ms
    spans = [Span("target", "prefill", -1, 0.0, step)]
    if mode in ("d3d-seq", "d3d-async"):
        spans.append(Span("drafter", "prefill", -1, 0.0, draft_ms(p, mode, max(B, 2))))
    t = max(s.t_end for s in spans) if mode == "d3d-seq" else step
    t_decode0 = t
    prev_hit = False
    for r in trace.rounds:
        i = r.index
        if mode == "ar":
            spans.append(Span("target", "verify", i, t, t + step))
            t += step
            continue
        if mode != "d3d-async" or not prev_hit:
            kind = "sync_draft" if (mode == "d3d-async" and i > 0) else "draft"
            d = draft_ms(p, mode, B)
            spans.append(Span("drafter", kind, i, t, t + d))
            t += d
        if mode == "d3d-async":
            v, pk = async_costs(p, B, H)
            spans += [Span("target", "verify", i, t, t + v), Span("drafter", "packed_draft", i, t, t + pk)]
            t += max(v, pk)
            prev_hit = bool(r.hit)
        else:
            v = p.at(p.t_verify_ms, B)
            spans.append(Span("target", "verify", i, t, t + v))
            t += v
    out = copy.copy(trace)
    out.spans = sorted(spans, key=lambda s: (s.t_start, s.lane))
    decode_s = (t - t_decode0) / 1e3
    n = len(trace.output_ids)
    if trace.stats is not None:
        st = copy.copy(trace.stats)
        st.decode_time_s, st.prefill_time_s, st.wall_time_s = decode_s, t_decode0 / 1e3, t / 1e3
        st.tokens_per_s = (n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0
        st.target_busy_s = sum(s.duration for s in spans if s.lane == "target") / 1e3
        st.drafter_busy_s = sum(s.duration for s in spans if s.lane == "drafter") / 1e3
        out.stats = st
    return out


def retime_all(traces: list, profile: Optional[CostProfile]) -> list:
    """``traces`` as measured (profile None) or re-timed under ``profile``."""
    return [t if profile is None or t is None else retime(t, profile) for t in traces]

