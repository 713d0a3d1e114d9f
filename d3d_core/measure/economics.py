"""The economics of one run, from its own spans: why a mode is faster or slower than ``ar``.

Per output token, a drafting mode pays ``round / τ`` where a round is one verify plus whatever
drafting the target had to wait for. ``ar`` pays one step per token. This module splits a run's
measured decode time into three parts that add up to it exactly:

- **verify**: the target's verify spans (for ``ar``: its steps);
- **draft not hidden**: drafter time that did not overlap a target span (every draft of
  ``dflash`` / ``d3d-seq``; for ``d3d-async`` only what ran outside verify, e.g. sync drafts);
- **idle**: neither lane busy — acceptance, bookkeeping, Python, thread hand-offs.

Divided by the committed tokens they give the measured time per token, so the panel agrees with
tokens/s by construction; divided by the rounds they give the round: ``round = verify + draft not hidden + other``.

One yardstick everywhere: ``T_step`` is what ``ar`` paid per token in the same race (its decode time over its
tokens: one step's forward plus ar's own bookkeeping — ar commits one token a round, so this is also ar's round).
``break_even_tau = round / T_step`` is the τ at which this mode, with these round costs, would tie ``ar`` on this
machine, and it is the same number as "a round costs N ar steps": one denominator. ``ar_forward_ms`` (ar's mean
step span, the forward alone) is kept apart: only the implausibility check uses it, span against span (a verify of
k ≥ 2 tokens cannot be cheaper than a one-token forward). Pure functions; no model access.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from ..decoding.trace import Trace, busy_intervals, hit_rate_of, intersect_length
from ..limits import RACE_MIN_TIMED_ROUNDS
from .reading import implausible, ratio_spread, speedup_label, speedup_spread, step_spans, verify_spans, verify_width_ms


@dataclass(frozen=True)
class Economics:
    mode: str
    tau: float
    rounds: int
    tokens: int  # tokens committed by decode rounds (the first token comes from prefill)
    decode_ms: float
    per_token_ms: float  # measured: decode_ms / tokens
    round_ms: float  # decode_ms / rounds
    t_verify_ms: float  # mean verify span (for ar: a step)
    t_draft_ms: Optional[float]  # mean draft span on the critical path (draft, sync_draft)
    t_packed_ms: Optional[float]  # mean packed pass (d3d-async)
    hit_rate: Optional[float]
    verify_per_token_ms: float
    draft_visible_per_token_ms: float
    idle_per_token_ms: float
    t_step_ms: Optional[float] = None  # the yardstick: ar's time per token in the same race (its round: forward + its bookkeeping)
    ar_per_token_ms: Optional[float] = None  # the same number (kept for readers of older JSON)
    ar_forward_ms: Optional[float] = None  # ar's mean step span (the forward alone): the implausibility check's yardstick
    speedup: Optional[float] = None
    break_even_tau: Optional[float] = None
    skipped: int = 0  # rounds the draft gate skipped (no draft: each an ar step)
    speedup_lo: Optional[float] = None  # 10–90 % round-level bootstrap spread of the speedup (``reading``)
    speedup_hi: Optional[float] = None
    too_short: bool = False  # fewer than RACE_MIN_TIMED_ROUNDS rounds in ar or in this mode: no speedup is shown
    timed_rounds: int = 0  # the fewer of this mode's and ar's rounds
    flags: tuple = ()  # readings the cost model says are impossible (``reading.implausible``): timing noise
    verify_k: Optional[int] = None  # the most common verify width (tokens the target read; the verify plan may cut it below B)
    verify_k_all: bool = False  # every verify of the run read verify_k tokens (the full plan, or B − 1 always paying)
    # verify(verify_k) spans / ar's step spans in this race: (ratio, 10–90 % lo, hi) — like with like (forward with
    # forward), the quantity the implausibility rule judges; None without ar or without a verify of 2 or more
    verify_vs_step: Optional[tuple] = None

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def round_steps(self) -> Optional[float]:
        """The round in ar steps (T_step): the same number as ``break_even_tau``."""
        return self.round_ms / self.t_step_ms if self.t_step_ms else None

    def round_parts_ms(self) -> tuple:
        """(verify, draft not hidden, other) per round, ms: they sum to ``round_ms`` exactly."""
        per_round = self.tokens / self.rounds
        return (self.verify_per_token_ms * per_round, self.draft_visible_per_token_ms * per_round,
                self.idle_per_token_ms * per_round)

    def round_parts_steps(self, digits: int = 2) -> Optional[tuple]:
        """(round, verify, draft not hidden, other) in ar steps, each rounded to ``digits`` so that the three parts
        as printed add up to the round as printed (largest remainder); None without ar."""
        if not self.t_step_ms:
            return None
        return (round(self.round_steps, digits),) + _sum_preserving([x / self.t_step_ms for x in self.round_parts_ms()], digits)

    def speedup_label(self) -> str:
        """``1.55× (1.47–1.63)`` (the spread: 10–90 % of a round-level bootstrap), ``too short to time (7 rounds)``,
        or "–" without ar."""
        return speedup_label(self.speedup, self.speedup_lo, self.speedup_hi, self.too_short, self.timed_rounds)

    def headline(self, define: bool = False) -> str:
        """:meth:`sentence` without the part-by-part cost of a round (the race's status line; the full sentence
        sits under it, folded): the speedup, the round in ar steps, τ and the break-even τ. Where the full sentence
        says why no speedup is read (too short, no ar, flagged), it is the headline too."""
        if self.mode == "ar" or self.rounds == 0 or self.too_short or self.speedup is None or not self.t_step_ms or self.flags:
            return self.sentence()
        gate = f" The draft gate left {self.skipped / self.rounds:.0%} of rounds undrafted." if self.skipped else ""
        verdict = "above" if self.speedup >= 1 else "below"
        tau_is, be_is = (" a round (accepted drafts + the target's bonus)", " (a round's cost in ar steps)") if define else ("", "")
        return (f"{self.mode} is {self.speedup_label()} the speed of ar: a round costs {self.round_steps:.2f} ar steps and "
                f"commits τ = {self.tau:.2f} tokens{tau_is}, {verdict} the break-even τ = {self.break_even_tau:.2f}{be_is}.{gate}")

    def sentence(self) -> str:
        """One sentence: how fast this mode was against ar, and why (or that the race was too short to say, or that
        the reading is impossible and therefore noise)."""
        if self.mode == "ar" or self.rounds == 0:
            return ""
        if self.too_short:
            return (f"{self.mode}: too short to time ({self.timed_rounds} rounds; a speedup needs at least "
                    f"{RACE_MIN_TIMED_ROUNDS} timed rounds of ar and of {self.mode}, so none is shown) — it committed "
                    f"τ = {self.tau:.2f} tokens per round.")
        if self.speedup is None or not self.t_step_ms:
            return (f"{self.mode}: a round costs {self.round_ms:.0f} ms and commits τ = {self.tau:.2f} tokens "
                    f"({self.per_token_ms:.0f} ms per token); run ar in the same race to compare.")
        total, v, d, o = self.round_parts_steps()
        width = f" ({'all' if self.verify_k_all else 'mostly'} verify({self.verify_k}))" if self.verify_k else ""
        own = ""
        if self.ar_forward_ms:  # ar's own step split the same way, so "verify 0.97" reads against ar's forward, not its whole step
            fwd = min(round(self.ar_forward_ms / self.t_step_ms, 2), 1.0)
            own = f"; ar's own step = forward {fwd:.2f} + other {1.0 - fwd:.2f}"
        if self.verify_vs_step and self.verify_k:  # like with like: one verify forward against one ar forward
            r, lo, hi = self.verify_vs_step
            own += f"; one verify({self.verify_k}) = {r:.2f} ar forwards (10–90 % {lo:.2f}–{hi:.2f})"
            if self.mode == "d3d-async" and self.t_packed_ms:  # why its verify reads dearer than the sequential modes'
                own += ", slower than alone: the drafter's packed pass runs beside it on the same cores"
        cost = (f"a round costs {total:.2f} ar steps of {self.t_step_ms:.0f} ms (verify {v:.2f}{width} + draft not hidden {d:.2f} "
                f"+ other {o:.2f}{own})")
        gate = f" The draft gate left {self.skipped / self.rounds:.0%} of rounds undrafted (each an ar step)." if self.skipped else ""
        head = f"{self.mode} is {self.speedup_label()} the speed of ar"
        if self.flags:  # flagged, not explained: no cost story is built on a reading the cost model rules out
            return (f"{self.mode} read {self.speedup_label()} the speed of ar — ⚠ implausible: {'; '.join(self.flags)}. "
                    f"That is timing noise (the machine's speed changed during the race), not a property of {self.mode}, "
                    f"so no cost breakdown or break-even τ is given for it: re-run the race on a quiet machine. "
                    f"τ = {self.tau:.2f} stands (a token count, not a timing).{gate}")
        if self.speedup < 1:
            return (f"{head} — slower: {cost} but commits only τ = {self.tau:.2f} tokens; "
                    f"it would tie ar at break-even τ = {self.break_even_tau:.2f} (= the round in ar steps).{gate}")
        return (f"{head}: {cost} and commits τ = {self.tau:.2f} tokens, "
                f"above the break-even τ = {self.break_even_tau:.2f} (= the round in ar steps).{gate}")


def _sum_preserving(xs: list, digits: int) -> tuple:
    """``xs`` rounded to ``digits`` so that the rounded values sum to round(sum(xs), digits) (largest remainder)."""
    q = 10 ** digits
    target = round(sum(xs) * q)
    floors = [math.floor(x * q) for x in xs]
    order = sorted(range(len(xs)), key=lambda i: xs[i] * q - floors[i], reverse=True)
    for i in order[: max(0, target - sum(floors))]:
        floors[i] += 1
    return tuple(f / q for f in floors)


def _mean(xs: list) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def economics(trace: Trace, ar: Optional[Trace] = None) -> Optional[Economics]:
    """The economics of a finished trace (None while it runs or when it has no decode round);
    ``ar``: the same race's ar trace, the yardstick for speedup and break-even τ."""
    ok = ar is not None and ar is not trace and ar.mode == "ar"
    return _against(trace, _measure(ar) if ok else None, ar if ok else None)


def _against(trace: Trace, yard: Optional[dict], ar: Optional[Trace] = None) -> Optional[Economics]:
    """``trace``'s economics with ``yard`` (ar's own measurement, from the trace ``ar``) as the yardstick; ar is its own."""
    e = _measure(trace)
    if e is None:
        return None
    if trace.mode == "ar":
        yard, ar = e, trace
    if yard is not None:
        t_step = yard["per_token_ms"]  # one yardstick: what ar paid per token (= its round) in this race
        e.update(t_step_ms=t_step, ar_per_token_ms=t_step, ar_forward_ms=yard["t_verify_ms"],
                 speedup=t_step / e["per_token_ms"], break_even_tau=e["round_ms"] / t_step)
        sp = speedup_spread(trace, ar) if ar is not None else None
        if sp is not None:
            e.update(speedup_lo=sp.lo, speedup_hi=sp.hi, too_short=sp.too_short, timed_rounds=min(sp.rounds, sp.ar_rounds))
        e["flags"] = tuple(implausible(trace, ar)) if ar is not None else ()
        if ar is not None and trace.mode != "ar":
            v = verify_spans(trace)
            r = ratio_spread(v[1], step_spans(ar)) if v is not None else None
            if r is not None:
                e["verify_vs_step"] = tuple(round(x, 3) for x in r)
    return Economics(**e)


def _measure(trace: Optional[Trace]) -> Optional[dict]:
    """The fields a trace's own spans give (no yardstick), or None."""
    if trace is None or trace.stats is None or not trace.rounds:
        return None
    spans = [s for s in trace.spans if s.round >= 0]
    tokens = sum(len(r.committed) for r in trace.rounds)
    decode_ms = trace.stats.decode_time_s * 1e3
    if tokens <= 0 or decode_ms <= 0:
        return None
    target = busy_intervals(spans, "target")
    drafter = busy_intervals(spans, "drafter")
    verify_ms = sum(e - s for s, e in target)
    draft_visible = sum(e - s for s, e in drafter) - intersect_length(drafter, target)
    idle = max(decode_ms - verify_ms - draft_visible, 0.0)
    scale = decode_ms / (verify_ms + draft_visible + idle)  # 1 unless spans overrun the clock by rounding
    kinds = lambda *k: [s.duration for s in spans if s.kind in k]  # noqa: E731
    e = dict(
        mode=trace.mode, tau=trace.stats.tau, rounds=len(trace.rounds), tokens=tokens, decode_ms=decode_ms,
        per_token_ms=decode_ms / tokens, round_ms=decode_ms / len(trace.rounds),
        t_verify_ms=_mean(kinds("verify")) or 0.0, t_draft_ms=_mean(kinds("draft", "sync_draft")),
        t_packed_ms=_mean(kinds("packed_draft")), hit_rate=hit_rate_of(trace) if trace.mode == "d3d-async" else None,
        verify_per_token_ms=verify_ms * scale / tokens, draft_visible_per_token_ms=draft_visible * scale / tokens,
        idle_per_token_ms=idle * scale / tokens, skipped=sum(r.skipped for r in trace.rounds),
        verify_k=(verify_width_ms(trace) or (None,))[0] if trace.mode != "ar" else None,
        verify_k_all=trace.mode != "ar" and (v := verify_spans(trace)) is not None
        and len(v[1]) == sum(s.kind == "verify" and s.lane == "target" and s.round >= 0 for s in spans),
    )
    return e


SHARED_CORES_SLOWER = 1.1  # d3d-async's verify this many times d3d-seq's or more: the lanes' sharing of the cores shows


def verify_vs_seq(async_e: Optional["Economics"], seq_e: Optional["Economics"]) -> Optional[float]:
    """d3d-async's mean verify over d3d-seq's in one race (how much the packed pass beside it slowed it), or None."""
    if async_e is None or seq_e is None or not async_e.t_verify_ms or not seq_e.t_verify_ms:
        return None
    return async_e.t_verify_ms / seq_e.t_verify_ms


def race_economics(traces: list) -> list:
    """Economics of every finished trace of a race, ar (measured once) as everyone's yardstick."""
    ar = next((t for t in traces if t is not None and t.mode == "ar" and t.stats is not None), None)
    yard = _measure(ar)
    out = [_against(t, yard, ar) for t in traces if t is not None]
    return [e for e in out if e is not None]
