"""The Trace: the one contract between the engine and everything that shows or measures it.

Plain dataclasses with a strict JSON round-trip. Their annotations are the schema: ``Trace.from_json``
validates untrusted input (an uploaded file) with pydantic in strict mode (``TRACE_SCHEMA``) and raises
``TraceError`` with a readable message — never a bare KeyError/TypeError — and refuses absurd sizes
before building anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError, with_config

from ..limits import MAX_TRACE_BLOCK, MAX_TRACE_BYTES, MAX_TRACE_HYPOTHESES, MAX_TRACE_ROUNDS, MAX_TRACE_SPANS, MAX_TRACE_TOKENS

TRACE_VERSION = 1
LANES = ("target", "drafter")
SPAN_KINDS = ("prefill", "verify", "draft", "packed_draft", "sync_draft")
MODES = ("ar", "dflash", "d3d-seq", "d3d-async")
FINISH_REASONS = ("length", "eos", "cancelled", "context")
Lane = Literal[LANES]
SpanKind = Literal[SPAN_KINDS]
ModeName = Literal[MODES]

# The annotations below are the trace's schema: pydantic reads them (``TRACE_SCHEMA``) to validate an
# untrusted trace in strict mode; the engine builds the same dataclasses directly, with no check.
_STRICT = ConfigDict(allow_inf_nan=False)  # a dataclass may arrive as a dict; each scalar below is strict
Int = Annotated[int, Strict()]  # 3, not "3", 3.0 or true
Float = Annotated[float, Strict()]  # finite; an int is a float
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, lt=10_000_000)]
BlockIds = Annotated[list[TokenId], Field(max_length=MAX_TRACE_BLOCK)]
BlockProbs = Annotated[list[Float], Field(max_length=MAX_TRACE_BLOCK)]


class TraceError(ValueError):
    """A trace that cannot be read; the message says what is wrong and where."""


@with_config(_STRICT)
@dataclass
class Span:
    lane: Lane
    kind: SpanKind
    round: Int  # round index (-1 for prefill)
    t_start: Float  # ms since the run started (synchronised clock)
    t_end: Float

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


@with_config(_STRICT)
@dataclass
class Hypothesis:
    accepted: Int  # a: how many drafts this hypothesis assumes verify accepts
    token: Int  # t: the bonus token it assumes
    score: Float  # P(a, t) under the drafter's own distributions
    draft_ids: BlockIds  # the successor block drafted for it: [t, d'_1..d'_{B-1}] without t
    hit: Bool = False


@with_config(_STRICT)
@dataclass
class Round:
    index: Int
    anchor_pos: Int  # position s of the anchor in the full sequence (prompt + output)
    anchor_id: Int
    draft_ids: BlockIds  # d_1..d_{B-1} (empty for ar)
    draft_probs: BlockProbs  # q_j(d_j): drafter probability of each draft
    target_ids: BlockIds  # y_1..y_B: the target's token at each block position
    accepted: Int  # a: longest prefix with d_j == y_j (or accepted by rejection sampling)
    bonus: Int  # the target's token after the accepted prefix: next anchor
    committed: BlockIds  # tokens this round appended to the output (accepted + bonus, truncated at stop)
    draft_source: Annotated[str, Strict(), Field(max_length=20)] = ""  # "", "draft", "sync_draft", "packed_draft", "skipped"
    hypotheses: Annotated[list[Hypothesis], Field(max_length=MAX_TRACE_HYPOTHESES)] = field(default_factory=list)  # d3d-async
    hit: Optional[Bool] = None  # d3d-async: did one of them equal (accepted, bonus)?
    held_back: BlockIds = field(default_factory=list)  # drafts past the verify plan's width: drafted, never verified
    gate_rate: Optional[Float] = None  # the draft gate's estimate (tokens per step when drafting) before this round; None: no gate
    # what a round without a draft earns, in tokens per step of cost (the gate's threshold: 1, ar's rate; more in
    # d3d-async, whose undrafted rounds use every core); the gate drafts while gate_rate reaches it. None: no gate
    gate_threshold: Optional[Float] = None

    @property
    def tokens(self) -> int:
        return self.accepted + 1

    @property
    def skipped(self) -> bool:
        """Did the draft gate skip this round's draft (the anchor verified alone, an ar step)?"""
        return self.draft_source == "skipped"


@with_config(_STRICT)
@dataclass
class Stats:
    tau: Float = 0.0  # mean tokens per round (accepted + bonus)
    tokens_per_s: Float = 0.0  # output tokens after the first / decode time (prefill excluded)
    target_forwards: Int = 0  # prefill + verifies
    drafter_forwards: Int = 0
    hit_rate: Optional[Float] = None  # d3d-async only
    overlap: Optional[Float] = None  # share of drafter busy time during target verify
    wall_time_s: Float = 0.0  # whole run, prefill included
    prefill_time_s: Float = 0.0
    decode_time_s: Float = 0.0
    n_rounds: Int = 0
    n_tokens: Int = 0
    target_busy_s: Float = 0.0
    drafter_busy_s: Float = 0.0


@with_config(_STRICT)
@dataclass
class MachineLoad:
    """How busy the machine was while this trace ran (``measure.machine.LoadWatch``): CPU time other processes
    took and steal time, per wall-second, and the verdict. Absent (None) in traces from before it was recorded."""
    wall_s: Float = 0.0
    other_cpu_s: Float = 0.0  # CPU seconds processes other than this one used meanwhile
    other_cores: Float = 0.0  # other_cpu_s / wall_s: mean cores they kept busy
    steal_s: Float = 0.0  # CPU seconds the hypervisor stole (0 on VMs that report none)
    cores: Int = 0  # CPUs of the machine
    load_at_start: Float = 0.0  # 1-minute load average when the mode started
    busy: Bool = False  # others or steal passed the bar: this trace's timings are unreliable
    reason: Annotated[str, Strict(), Field(max_length=500)] = ""


def _round_consistent(rd: Round) -> Round:
    if not 0 <= rd.accepted <= len(rd.draft_ids):
        raise ValueError(f"accepted={rd.accepted} must lie in [0, {len(rd.draft_ids)}] (the number of drafts)")
    if len(rd.draft_probs) not in (0, len(rd.draft_ids)):
        raise ValueError("draft_probs and draft_ids differ in length")
    return rd


def _span_ordered(sp: Span) -> Span:
    if sp.t_end < sp.t_start:
        raise ValueError("ends before it starts")
    return sp


def _config_small(config: dict) -> dict:
    if len(json.dumps(config)) > 100_000:
        raise ValueError("is too large")
    return config


@with_config(_STRICT)
@dataclass
class Trace:
    mode: ModeName
    bundle: Annotated[str, Strict(), Field(max_length=200)]
    config: Annotated[dict, Strict(), AfterValidator(_config_small)]
    prompt_text: Str
    prompt_ids: Annotated[list[TokenId], Field(max_length=1_000_000)]
    output_ids: Annotated[list[TokenId], Field(max_length=MAX_TRACE_TOKENS)] = field(default_factory=list)
    output_text: Str = ""
    first_token: Optional[Int] = None  # from prefill (not part of any round)
    rounds: Annotated[list[Annotated[Round, AfterValidator(_round_consistent)]], Field(max_length=MAX_TRACE_ROUNDS)] = field(default_factory=list)
    spans: Annotated[list[Annotated[Span, AfterValidator(_span_ordered)]], Field(max_length=MAX_TRACE_SPANS)] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish_reason: Literal[("",) + FINISH_REASONS] = ""
    device: Annotated[str, Strict(), Field(max_length=40)] = "cpu"
    verify_costs: Annotated[list[Float], Field(max_length=MAX_TRACE_BLOCK)] = field(default_factory=list)  # verify(k)/step, k = 1..B: the plan's cost model
    cost_source: Annotated[str, Strict(), Field(max_length=300)] = ""  # where those costs were measured
    drafter: Annotated[str, Strict(), Field(max_length=200)] = ""  # the drafter that ran (``describe()``), "" for ar
    load: Optional[MachineLoad] = None  # the machine's load while it ran (a race records it; None: not measured)
    engine: Annotated[str, Strict(), Field(max_length=20)] = ""  # the target's engine (fast / int4 / eager; "": not recorded)
    version: Int = TRACE_VERSION

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


TRACE_SCHEMA = TypeAdapter(Trace)


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


def _parse_trace(d, where="trace") -> Trace:
    """Untrusted parsed JSON -> Trace through ``TRACE_SCHEMA``; the first problem becomes one readable TraceError."""
    if not isinstance(d, dict):
        raise TraceError(f"{where} must be a JSON object, got {type(d).__name__}")
    version = d.get("version", TRACE_VERSION)
    if version != TRACE_VERSION or isinstance(version, bool):
        raise TraceError(f"{where}: unsupported trace version {str(version)[:20]} (this app reads version {TRACE_VERSION})")
    try:
        return TRACE_SCHEMA.validate_python(d)
    except ValidationError as e:
        raise TraceError(_explain(e.errors(include_url=False)[0], where)) from None


def _explain(err: dict, where: str) -> str:
    """One pydantic error -> ``trace.rounds[3].accepted must be an integer`` (the wording the app shows)."""
    path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"] if not str(p).startswith("function-"))
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "missing":
        parent, _, name = path.rpartition(".")
        return f"{parent}: missing field '{name}'"
    words = {
        "int_type": "must be an integer", "bool_type": "must be true or false", "string_type": "must be text",
        "float_type": "must be a finite number", "finite_number": "must be a finite number", "list_type": "must be a list",
        "dict_type": "must be an object", "dataclass_type": "must be an object", "none_required": "must be null",
    }
    if kind in words:
        return f"{path} {words[kind]}"
    if kind == "literal_error":
        return f"{path} must be one of {ctx.get('expected', '')}"
    if kind == "too_long":
        return f"{path} has {ctx.get('actual_length', 'too many')} items, limit {ctx.get('max_length')}"
    if kind in ("greater_than_equal", "less_than"):
        return f"{path} must be an integer token id in [0, 10000000)"
    if kind == "value_error":
        return f"{path} {ctx.get('error', err['msg'])}"
    return f"{path}: {err['msg']}"


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


def needed_verdicts(trace: Trace) -> list:
    """The d3d-async rounds whose hypotheses got a verdict (hit or miss): every round with one except the last of a
    finished decode, which needed no next block (a trace recorded before the engine left its verdict out still marks
    it: it is not counted here)."""
    rounds = [r for r in trace.rounds if r.hit is not None]
    if rounds and trace.finish_reason and rounds[-1] is trace.rounds[-1]:
        rounds = rounds[:-1]
    return rounds


def hit_rate_of(trace: Trace) -> Optional[float]:
    """Hits over the rounds whose next block was needed (``needed_verdicts``); None without any."""
    rs = needed_verdicts(trace)
    return sum(bool(r.hit) for r in rs) / len(rs) if rs else None
