"""The Trace: the one contract between the engine and everything that shows or measures it.

Plain dataclasses with a strict JSON round-trip. ``Trace.from_json`` validates untrusted
input (an uploaded file) and raises ``TraceError`` with a readable message — never a
bare KeyError/TypeError — and refuses absurd sizes before building anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

TRACE_VERSION = 1
LANES = ("target", "drafter")
SPAN_KINDS = ("prefill", "verify", "draft", "packed_draft", "sync_draft")
MODES = ("ar", "dflash", "d3d-seq", "d3d-async")
FINISH_REASONS = ("length", "eos", "cancelled", "context")

# limits for untrusted traces: d3d_core/limits.py
from .limits import MAX_TRACE_BLOCK as MAX_BLOCK  # noqa: E402
from .limits import MAX_TRACE_BYTES  # noqa: E402, F401
from .limits import MAX_TRACE_HYPOTHESES as MAX_HYPOTHESES  # noqa: E402
from .limits import MAX_TRACE_ROUNDS as MAX_ROUNDS  # noqa: E402
from .limits import MAX_TRACE_SPANS as MAX_SPANS  # noqa: E402
from .limits import MAX_TRACE_TOKENS as MAX_TOKENS  # noqa: E402


class TraceError(ValueError):
    """A trace that cannot be read; the message says what is wrong and where."""


@dataclass
class Span:
    lane: str  # "target" | "drafter"
    kind: str  # one of SPAN_KINDS
    round: int  # round index (-1 for prefill)
    t_start: float  # ms since the run started (synchronised clock)
    t_end: float

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


@dataclass
class Hypothesis:
    accepted: int  # a: how many drafts this hypothesis assumes verify accepts
    token: int  # t: the bonus token it assumes
    score: float  # P(a, t) under the drafter's own distributions
    draft_ids: list  # the successor block drafted for it: [t, d'_1..d'_{B-1}] without t
    hit: bool = False


@dataclass
class Round:
    index: int
    anchor_pos: int  # position s of the anchor in the full sequence (prompt + output)
    anchor_id: int
    draft_ids: list  # d_1..d_{B-1} (empty for ar)
    draft_probs: list  # q_j(d_j): drafter probability of each draft
    target_ids: list  # y_1..y_B: the target's token at each block position
    accepted: int  # a: longest prefix with d_j == y_j (or accepted by rejection sampling)
    bonus: int  # the target's token after the accepted prefix: next anchor
    committed: list  # tokens this round appended to the output (accepted + bonus, truncated at stop)
    draft_source: str = ""  # how this round's block was drafted: "", "draft", "sync_draft", "packed_draft"
    hypotheses: list = field(default_factory=list)  # d3d-async: hypotheses drafted during this verify
    hit: Optional[bool] = None  # d3d-async: did one of them equal (accepted, bonus)?

    @property
    def tokens(self) -> int:
        return self.accepted + 1


@dataclass
class Stats:
    tau: float = 0.0  # mean tokens per round (accepted + bonus)
    tokens_per_s: float = 0.0  # output tokens after the first / decode time (prefill excluded)
    target_forwards: int = 0  # prefill + verifies
    drafter_forwards: int = 0
    hit_rate: Optional[float] = None  # d3d-async only
    overlap: Optional[float] = None  # share of drafter busy time during target verify
    wall_time_s: float = 0.0  # whole run, prefill included
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    n_rounds: int = 0
    n_tokens: int = 0
    target_busy_s: float = 0.0
    drafter_busy_s: float = 0.0


@dataclass
class Trace:
    mode: str
    bundle: str
    config: dict
    prompt_text: str
    prompt_ids: list
    output_ids: list = field(default_factory=list)
    output_text: str = ""
    first_token: Optional[int] = None  # from prefill (not part of any round)
    rounds: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish_reason: str = ""
    device: str = "cpu"
    version: int = TRACE_VERSION

    # ---- serialisation
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    @classmethod
    def from_dict(cls, d) -> "Trace":
        return _parse_trace(d)

    @classmethod
    def from_json(cls, text) -> "Trace":
        return _parse_trace(_read_json(text))


def traces_to_json(traces: list, indent: Optional[int] = None) -> str:
    return json.dumps({"traces": [t.to_dict() for t in traces]}, indent=indent, ensure_ascii=False)


def _read_json(text):
    """Untrusted bytes / text -> parsed JSON, refusing oversize, non-UTF-8 and too-deep input."""
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_TRACE_BYTES:
            raise TraceError(f"trace file is too large ({len(text)} bytes, limit {MAX_TRACE_BYTES})")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"trace file is not UTF-8 text: {e}") from None
    if not isinstance(text, str):
        raise TraceError("trace must be JSON text")
    if len(text) > MAX_TRACE_BYTES:
        raise TraceError(f"trace file is too large ({len(text)} characters, limit {MAX_TRACE_BYTES})")
    try:
        return json.loads(text)
    except RecursionError:
        raise TraceError("trace JSON is nested too deeply") from None
    except ValueError as e:
        raise TraceError(f"not valid JSON: {e}") from None


def traces_from_json(text) -> list:
    """Read either one trace or {"traces": [...]} (what the app downloads)."""
    d = _read_json(text)
    if isinstance(d, dict) and "traces" in d:
        items = d["traces"]
        if not isinstance(items, list) or not items:
            raise TraceError("'traces' must be a non-empty list")
        if len(items) > 16:
            raise TraceError(f"too many traces in one file ({len(items)}, limit 16)")
        return [_parse_trace(t, where=f"traces[{i}]") for i, t in enumerate(items)]
    return [_parse_trace(d)]


# ----------------------------------------------------------------------------- validation


def _need(d, key, types, where, optional=False, default=None):
    if not isinstance(d, dict):
        raise TraceError(f"{where} must be an object")
    if key not in d:
        if optional:
            return default
        raise TraceError(f"{where}: missing field '{key}'")
    v = d[key]
    if optional and v is None:
        return default
    if types is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TraceError(f"{where}.{key} must be a finite number")
        return float(v)
    if types is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TraceError(f"{where}.{key} must be an integer")
        return v
    if not isinstance(v, types):
        name = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise TraceError(f"{where}.{key} must be of type {name}")
    return v


def _int_list(d, key, where, limit, optional=False, lo=0, hi=10_000_000):
    v = _need(d, key, list, where, optional=optional, default=[])
    if len(v) > limit:
        raise TraceError(f"{where}.{key} has {len(v)} items, limit {limit}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x < hi:
            raise TraceError(f"{where}.{key}[{i}] must be an integer token id in [{lo}, {hi})")
    return list(v)


def _float_list(d, key, where, limit, optional=False):
    v = _need(d, key, list, where, optional=optional, default=[])
    if len(v) > limit:
        raise TraceError(f"{where}.{key} has {len(v)} items, limit {limit}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise TraceError(f"{where}.{key}[{i}] must be a finite number")
    return [float(x) for x in v]


def _parse_trace(d, where="trace") -> Trace:
    if not isinstance(d, dict):
        raise TraceError(f"{where} must be a JSON object, got {type(d).__name__}")
    version = _need(d, "version", int, where, optional=True, default=TRACE_VERSION)
    if version != TRACE_VERSION:
        raise TraceError(f"{where}: unsupported trace version {version} (this app reads version {TRACE_VERSION})")
    mode = _need(d, "mode", str, where)
    if mode not in MODES:
        raise TraceError(f"{where}.mode {mode[:40]!r} is not one of {', '.join(MODES)}")
    bundle = _need(d, "bundle", str, where)[:200]
    config = _need(d, "config", dict, where)
    if len(json.dumps(config)) > 100_000:
        raise TraceError(f"{where}.config is too large")
    prompt_text = _need(d, "prompt_text", str, where)
    prompt_ids = _int_list(d, "prompt_ids", where, 1_000_000)
    output_ids = _int_list(d, "output_ids", where, MAX_TOKENS)
    output_text = _need(d, "output_text", str, where, optional=True, default="")
    first_token = _need(d, "first_token", int, where, optional=True, default=None)
    raw_rounds = _need(d, "rounds", list, where)
    if len(raw_rounds) > MAX_ROUNDS:
        raise TraceError(f"{where}.rounds has {len(raw_rounds)} items, limit {MAX_ROUNDS}")
    rounds = []
    for i, r in enumerate(raw_rounds):
        w = f"{where}.rounds[{i}]"
        if not isinstance(r, dict):
            raise TraceError(f"{w} must be an object")
        hyps = []
        raw_h = _need(r, "hypotheses", list, w, optional=True, default=[])
        if len(raw_h) > MAX_HYPOTHESES:
            raise TraceError(f"{w}.hypotheses has {len(raw_h)} items, limit {MAX_HYPOTHESES}")
        for j, h in enumerate(raw_h):
            wh = f"{w}.hypotheses[{j}]"
            hyps.append(
                Hypothesis(
                    accepted=_need(h, "accepted", int, wh),
                    token=_need(h, "token", int, wh),
                    score=_need(h, "score", float, wh),
                    draft_ids=_int_list(h, "draft_ids", wh, MAX_BLOCK),
                    hit=bool(_need(h, "hit", bool, wh, optional=True, default=False)),
                )
            )
        rd = Round(
            index=_need(r, "index", int, w),
            anchor_pos=_need(r, "anchor_pos", int, w),
            anchor_id=_need(r, "anchor_id", int, w),
            draft_ids=_int_list(r, "draft_ids", w, MAX_BLOCK),
            draft_probs=_float_list(r, "draft_probs", w, MAX_BLOCK),
            target_ids=_int_list(r, "target_ids", w, MAX_BLOCK),
            accepted=_need(r, "accepted", int, w),
            bonus=_need(r, "bonus", int, w),
            committed=_int_list(r, "committed", w, MAX_BLOCK),
            draft_source=_need(r, "draft_source", str, w, optional=True, default="")[:20],
            hypotheses=hyps,
            hit=_need(r, "hit", bool, w, optional=True, default=None),
        )
        if not 0 <= rd.accepted <= len(rd.draft_ids):
            raise TraceError(f"{w}.accepted={rd.accepted} must lie in [0, {len(rd.draft_ids)}] (the number of drafts)")
        if len(rd.draft_probs) not in (0, len(rd.draft_ids)):
            raise TraceError(f"{w}: draft_probs and draft_ids differ in length")
        rounds.append(rd)
    raw_spans = _need(d, "spans", list, where)
    if len(raw_spans) > MAX_SPANS:
        raise TraceError(f"{where}.spans has {len(raw_spans)} items, limit {MAX_SPANS}")
    spans = []
    for i, s in enumerate(raw_spans):
        w = f"{where}.spans[{i}]"
        sp = Span(
            lane=_need(s, "lane", str, w),
            kind=_need(s, "kind", str, w),
            round=_need(s, "round", int, w),
            t_start=_need(s, "t_start", float, w),
            t_end=_need(s, "t_end", float, w),
        )
        if sp.lane not in LANES:
            raise TraceError(f"{w}.lane must be one of {', '.join(LANES)}")
        if sp.kind not in SPAN_KINDS:
            raise TraceError(f"{w}.kind must be one of {', '.join(SPAN_KINDS)}")
        if sp.t_end < sp.t_start:
            raise TraceError(f"{w} ends before it starts")
        spans.append(sp)
    raw_stats = _need(d, "stats", dict, where)
    st = Stats()
    for k, v in asdict(Stats()).items():
        if k in raw_stats and raw_stats[k] is not None:
            if isinstance(v, int) and not isinstance(v, bool) and k not in ("hit_rate", "overlap"):
                setattr(st, k, _need(raw_stats, k, int, f"{where}.stats"))
            else:
                setattr(st, k, _need(raw_stats, k, float, f"{where}.stats"))
    finish = _need(d, "finish_reason", str, where, optional=True, default="")
    if finish and finish not in FINISH_REASONS:
        raise TraceError(f"{where}.finish_reason must be one of {', '.join(FINISH_REASONS)}")
    return Trace(
        mode=mode,
        bundle=bundle,
        config=config,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        output_text=output_text,
        first_token=first_token,
        rounds=rounds,
        spans=spans,
        stats=st,
        finish_reason=finish,
        device=_need(d, "device", str, where, optional=True, default="cpu")[:40],
        version=version,
    )


# ----------------------------------------------------------------------------- derived numbers


def busy_intervals(spans, lane, kinds=None):
    return sorted((s.t_start, s.t_end) for s in spans if s.lane == lane and (kinds is None or s.kind in kinds))


def intersect_length(a: list, b: list) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_share(spans) -> Optional[float]:
    """Share of drafter busy time that ran while the target was verifying."""
    d = busy_intervals(spans, "drafter")
    busy = sum(e - s for s, e in d)
    if busy <= 0:
        return None
    v = busy_intervals(spans, "target", kinds=("verify",))
    return intersect_length(d, v) / busy


def idle_time(spans, lane, t0: float, t1: float) -> float:
    """Time in [t0, t1] when the lane had no span (ms)."""
    busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in busy_intervals(spans, lane))
    return max(0.0, (t1 - t0) - busy)
