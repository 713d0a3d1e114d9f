"""How far one race's reading can be trusted, from the race itself: pure functions of Traces.

- **Spread.** A mode's speedup over ``ar`` is (ar's time per token) / (the mode's time per token). Its spread is
  a round-level bootstrap: the mode's rounds (time and committed tokens of each) and ar's rounds are resampled
  with replacement (``RACE_SPREAD_RESAMPLES`` times, a fixed seed, so the same trace always reads the same), the
  ratio recomputed each time, and its 10th–90th percentile reported: ``1.55× (1.47–1.63)``. It measures how much
  the reading depends on which rounds happened to be slow (a context switch, a page fault, a cache miss), not
  drift of the machine over the whole race; the busy flag (``race_load``) covers that.
- **Too short.** With fewer than ``RACE_MIN_TIMED_ROUNDS`` rounds in ar or in the mode there is no ratio, only
  "too short to time (N rounds)".
- **Busy.** Each trace of a race carries the machine's load while it ran (``Trace.load``); ``race_load`` sums them.

A round's time: from the first span of that round (its draft, or its verify when the draft was already made) to
the first span of the next; the last round ends at the last span. The times are then scaled to sum to the
trace's decode time, so the full-sample ratio is exactly ``economics``' speedup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..decoding.trace import Trace
from ..limits import RACE_MIN_TIMED_ROUNDS, RACE_SPREAD_RESAMPLES
from .machine import busy_verdict

SPREAD_PERCENTILES = (10.0, 90.0)


def speedup_label(speedup, lo, hi, too_short: bool, rounds: int) -> str:
    """How a speedup reads everywhere: ``1.55× (1.47–1.63)`` with its spread, ``1.55×`` without one,
    ``too short to time (7 rounds)``, or "–" without a reading."""
    if too_short:
        return f"too short to time ({rounds} rounds)"
    if speedup is None:
        return "–"
    if lo is None:
        return f"{speedup:.2f}×"
    return f"{speedup:.2f}× ({lo:.2f}–{hi:.2f})"


def round_times(trace: Optional[Trace]) -> tuple:
    """(ms of each decode round, tokens each committed) as two lists, times summing to the decode time; ([], [])
    when the trace has no round or no decode time."""
    if trace is None or not trace.rounds or trace.stats.decode_time_s <= 0:
        return [], []
    tokens = [len(r.committed) for r in trace.rounds]
    decode_ms = trace.stats.decode_time_s * 1e3
    start: dict = {}
    end = None
    for s in trace.spans:
        if s.round < 0:
            continue
        start[s.round] = min(start.get(s.round, s.t_start), s.t_start)
        end = s.t_end if end is None else max(end, s.t_end)
    idx = [r.index for r in trace.rounds]
    if end is None or any(i not in start for i in idx):
        ms = [decode_ms / len(idx)] * len(idx)  # no spans to split by: every round alike (no spread)
    else:
        bounds = [start[i] for i in idx] + [end]
        ms = [max(0.0, b - a) for a, b in zip(bounds, bounds[1:])]
    total = sum(ms)
    if total <= 0:
        ms, total = [1.0] * len(idx), float(len(idx))
    return [m * decode_ms / total for m in ms], tokens


@dataclass(frozen=True)
class Spread:
    """A mode's speedup over ar in one race with its round-level bootstrap spread."""
    mode: str
    speedup: Optional[float]  # point estimate (None when too short or no ar)
    lo: Optional[float]  # 10th percentile of the resampled speedups
    hi: Optional[float]  # 90th percentile
    rounds: int  # the mode's timed rounds
    ar_rounds: int
    too_short: bool

    def label(self) -> str:
        """``1.55× (1.47–1.63)``, or ``too short to time (7 rounds)``."""
        return speedup_label(self.speedup, self.lo, self.hi, self.too_short, min(self.rounds, self.ar_rounds))


def speedup_spread(trace: Trace, ar: Optional[Trace], resamples: int = RACE_SPREAD_RESAMPLES, seed: int = 0,
                   min_rounds: int = RACE_MIN_TIMED_ROUNDS) -> Optional[Spread]:
    """``trace``'s speedup over ``ar`` (the same race's ar run) with its 10–90 % bootstrap spread; None without ar
    or rounds. Too few rounds in either (< ``min_rounds``) gives ``too_short`` and no number at all."""
    ms, tok = round_times(trace)
    ar_ms, ar_tok = round_times(ar)
    if not ms or not ar_ms or sum(tok) <= 0 or sum(ar_tok) <= 0:
        return None
    if min(len(ms), len(ar_ms)) < min_rounds:
        return Spread(trace.mode, None, None, None, len(ms), len(ar_ms), True)
    point = (sum(ar_ms) / sum(ar_tok)) / (sum(ms) / sum(tok))
    if trace is ar or trace.mode == "ar":
        return Spread(trace.mode, 1.0, None, None, len(ms), len(ar_ms), False)
    rng = np.random.default_rng(seed)
    ms, tok, ar_ms, ar_tok = map(np.asarray, (ms, tok, ar_ms, ar_tok))
    i = rng.integers(0, len(ms), size=(resamples, len(ms)))
    j = rng.integers(0, len(ar_ms), size=(resamples, len(ar_ms)))
    mode_pt = ms[i].sum(1) / np.maximum(tok[i].sum(1), 1)
    ar_pt = ar_ms[j].sum(1) / np.maximum(ar_tok[j].sum(1), 1)
    lo, hi = np.percentile(ar_pt / mode_pt, SPREAD_PERCENTILES)
    return Spread(trace.mode, float(point), float(lo), float(hi), len(ms), len(ar_ms), False)


def race_spreads(traces: list) -> dict:
    """{mode: Spread} for every trace of a race with rounds, the race's ar run as the yardstick."""
    ar = next((t for t in traces if t is not None and t.mode == "ar"), None)
    out = {}
    for t in traces:
        s = speedup_spread(t, ar) if t is not None else None
        if s is not None:
            out[t.mode] = s
    return out


def verify_spans(trace: Trace) -> Optional[tuple]:
    """(k, [ms of each verify span]) at the trace's most common verify width k ≥ 2 (tokens the target read,
    ``len(target_ids)``), or None when it never verified more than one token."""
    width = {r.index: len(r.target_ids) for r in trace.rounds}
    by_k: dict = {}
    for s in trace.spans:
        if s.kind == "verify" and s.lane == "target" and width.get(s.round, 0) >= 2:
            by_k.setdefault(width[s.round], []).append(s.duration)
    if not by_k:
        return None
    k = max(by_k, key=lambda k: (len(by_k[k]), k))
    return k, by_k[k]


def verify_width_ms(trace: Trace) -> Optional[tuple]:
    """(k, mean ms) of the trace's verify spans at its most common verify width k ≥ 2, or None (``verify_spans``)."""
    v = verify_spans(trace)
    return None if v is None else (v[0], sum(v[1]) / len(v[1]))


def step_spans(ar: Trace) -> list:
    """ms of each of ar's decode steps (its verify spans: the forward alone)."""
    return [s.duration for s in ar.spans if s.kind == "verify" and s.lane == "target" and s.round >= 0]


def ratio_spread(num: list, den: list, resamples: int = RACE_SPREAD_RESAMPLES, seed: int = 0) -> Optional[tuple]:
    """(point, lo, hi): mean(num) / mean(den) and its 10–90 % bootstrap spread (both samples resampled, a fixed
    seed); None with fewer than 2 samples on either side (no spread to judge by)."""
    if len(num) < 2 or len(den) < 2:
        return None
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if a.mean() <= 0 or b.mean() <= 0:
        return None
    rng = np.random.default_rng(seed)
    r = a[rng.integers(0, len(a), size=(resamples, len(a)))].mean(1) / b[rng.integers(0, len(b), size=(resamples, len(b)))].mean(1)
    lo, hi = np.percentile(r, SPREAD_PERCENTILES)
    return float(a.mean() / b.mean()), float(lo), float(hi)


def implausible(trace: Trace, ar: Optional[Trace]) -> list:
    """Readings the cost model says cannot happen, as sentences — **one rule for every mode**: a physical lower
    bound, judged against the race's own noise. A verify of k ≥ 2 tokens costs at least one ar step (it reads the
    same weights and more tokens), and a round holds at least one verify, so neither can cost less than one of ar's.
    Each is a ratio of means over this race's own spans (verify(k) spans / ar's step spans; this mode's rounds /
    ar's rounds, ``round_times``), bootstrapped like the speedup's spread; it is flagged only when even the top of
    its 10–90 % spread is below 1 — noise within the race's measured spread is not "implausible". When flagged,
    the timing was noise beyond that spread (the machine's speed changed between ar and this mode)."""
    if trace.mode == "ar" or ar is None:
        return []
    out = []
    v, steps = verify_spans(trace), step_spans(ar)
    if v is not None:
        r = ratio_spread(v[1], steps)
        if r is not None and r[2] < 1.0:
            out.append(f"verify({v[0]}) read cheaper than one ar step ({sum(v[1]) / len(v[1]):.0f} vs "
                       f"{sum(steps) / len(steps):.0f} ms: {r[0]:.2f}×, 10–90 % {r[1]:.2f}–{r[2]:.2f}, all below 1)")
    ms, _ = round_times(trace)
    ar_ms, _ = round_times(ar)
    r = ratio_spread(ms, ar_ms)
    if r is not None and r[2] < 1.0:
        out.append(f"a round (which holds a verify) read cheaper than one ar round ({sum(ms) / len(ms):.0f} vs "
                   f"{sum(ar_ms) / len(ar_ms):.0f} ms: {r[0]:.2f}×, 10–90 % {r[1]:.2f}–{r[2]:.2f}, all below 1)")
    return out


@dataclass(frozen=True)
class RaceLoad:
    """The machine's load over a whole race (the modes' ``Trace.load`` summed)."""
    wall_s: float
    other_cores: float
    steal_cores: float
    cores: int
    busy: bool
    reason: str
    busiest: str  # the mode that ran while others used most

    def status(self) -> str:
        """The status line's sentence: a warning when busy, else a short note."""
        if self.busy:
            return f"⚠ **machine busy: {self.reason}** (most during `{self.busiest}`) — the ratios below are unreliable"
        return f"machine quiet: other processes used {self.other_cores:.2f} of {self.cores} cores during this race"


def race_load(traces: list) -> Optional[RaceLoad]:
    """The race's machine load from its traces' ``load`` records; None when no trace carries one (an older trace).
    Busy when the whole race passes the bar (``machine.busy_verdict``) or any one mode did."""
    loads = [(t.mode, t.load) for t in traces if t is not None and t.load is not None]
    if not loads:
        return None
    wall = sum(ld.wall_s for _, ld in loads)
    if wall <= 0:
        return None
    other = sum(ld.other_cpu_s for _, ld in loads) / wall
    steal = sum(ld.steal_s for _, ld in loads) / wall
    cores = max(ld.cores for _, ld in loads)
    busy, why = busy_verdict(other, steal, cores)
    flagged = [p for p in loads if p[1].busy] or loads  # name a mode that was itself flagged, when one was
    busiest, worst = max(flagged, key=lambda p: p[1].other_cores + p[1].steal_s / max(p[1].wall_s, 1e-9))
    if not busy and any(ld.busy for _, ld in loads):
        busy, why = True, f"{worst.reason} (while `{busiest}` ran)"
    return RaceLoad(round(wall, 2), round(other, 3), round(steal, 3), cores, busy, why, busiest)
