"""Declared shapes for what crosses a boundary besides the Trace (``trace.py``): the app's settings,
the pruning curve and the bench result.

Pydantic models: the app's settings are validated from loosely typed widget values; a pruning
curve or bench result is validated when the CLI writes it and when the app reads a shipped file,
so a renamed or missing field fails there with one readable message instead of a KeyError deep in
a plot. The files stay plain JSON (``model_dump``); later additions ride along as extra fields.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .decoding.config import SAMPLING_RULES, DecodeConfig
from .decoding.plan import DRAFTING_RULES, VERIFY_RULES
from .decoding.trace import MODES
from .limits import APP_BLOCK_MAX, BLOCK_MIN, MAX_HYPOTHESES, MAX_NEW_TOKENS, TEMPERATURE_MAX


def explain(e: ValidationError, what: str, titles: Optional[dict] = None) -> str:
    """The first problem of a ValidationError as one sentence: ``block size must be between 2 and 16, got 17``,
    ``pruning curve: curve.0.tau: missing field``. ``titles`` names fields the way the UI does."""
    err = e.errors(include_url=False)[0]
    path = ".".join(str(p) for p in err["loc"])
    name = (titles or {}).get(path, path.replace("_", " ") if titles is not None else path)
    kind, ctx = err["type"], err.get("ctx", {})
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than") and titles is not None:
        lo, hi = _RANGES[path]
        bound = f"{lo:g} or more" if hi >= 2**62 else f"between {lo:g} and {hi:g}"
        return f"{name} must be {bound}, got {err['input']:g}"
    if kind == "value_error":
        return f"{name} {ctx.get('error', err['msg'])}"
    if kind == "literal_error":
        return f"{name} must be one of {ctx.get('expected')}, got {str(err['input'])[:30]!r}"
    if kind == "missing":
        return f"{what}: missing field '{path}'"
    return f"{what}: {path}: {err['msg'].lower()}"


# ----------------------------------------------------------------------------- the app's settings


def _number(v, whole: bool = False):
    """A widget value -> float (or int when ``whole``): 8, 8.0 and "8" are 8; "eight", True and NaN are
    refused, and so is 8.5 where a whole number is wanted."""
    kind = "whole number" if whole else "number"
    if isinstance(v, bool):
        raise ValueError(f"must be a {kind}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"must be a number, got {str(v)[:30]!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"must be a finite {kind}, got {str(v)[:30]}")
    if whole and f != int(f):
        raise ValueError(f"must be a whole number, got {str(v)[:30]}")
    return int(f) if whole else f


# the app's ranges (smaller than the engine's DecodeConfig.validated ones): d3d_core/limits.py
_RANGES = {"block_size": (BLOCK_MIN, APP_BLOCK_MAX), "temperature": (0.0, TEMPERATURE_MAX), "max_new_tokens": (1, MAX_NEW_TOKENS),
           "hypotheses": (1, MAX_HYPOTHESES), "seed": (0, 2**63 - 1)}
_TITLES = {"block_size": "block size", "max_new_tokens": "max new tokens", "hypotheses": "hypotheses H"}


def _ranged(name, default):
    lo, hi = _RANGES[name]
    return Field(default=default, ge=lo, le=hi)


class AppSettings(BaseModel):
    """One race's settings as the app (and its API) offers them."""

    model_config = ConfigDict(frozen=True)
    mode: Literal[MODES] = "d3d-async"
    block_size: int = _ranged("block_size", 8)
    temperature: float = _ranged("temperature", 0.0)
    max_new_tokens: int = _ranged("max_new_tokens", 128)
    hypotheses: int = _ranged("hypotheses", 4)
    sampling: Literal[SAMPLING_RULES] = "match"
    seed: int = _ranged("seed", 0)
    verify: Literal[VERIFY_RULES] = "adaptive"
    drafting: Literal[DRAFTING_RULES] = "gated"

    @field_validator("block_size", "max_new_tokens", "hypotheses", "seed", mode="before")
    @classmethod
    def _ints(cls, v):
        return _number(v, whole=True)

    @field_validator("temperature", mode="before")
    @classmethod
    def _floats(cls, v):
        return _number(v)

    @classmethod
    def parse(cls, **values) -> "AppSettings":
        """ValueError with one readable sentence instead of pydantic's report."""
        try:
            return cls(**values)
        except ValidationError as e:
            raise ValueError(explain(e, "settings", _TITLES)) from None

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(**self.model_dump()).validated()


# ----------------------------------------------------------------------------- the pruning curve


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields added later (heal records, provenance) ride along


class HealedPoint(_Open):
    tau: float
    tau_eval: Optional[float] = None
    tau_eval_rel: Optional[float] = None
    tau_eval_rel_ci: Optional[tuple[float, float]] = None


class CurvePoint(_Open):
    removed: int = Field(ge=0)  # layers removed so far
    kept: list[int]  # the layers still run
    tau: float  # offline τ on the calibration sequences
    tau_rel: float  # ... relative to the unpruned drafter
    tau_eval: Optional[float] = None  # the same on held-out prompts
    tau_eval_rel: Optional[float] = None
    tau_eval_rel_ci: Optional[tuple[float, float]] = None  # 95 % paired bootstrap interval of tau_eval_rel
    healed: Optional[HealedPoint] = None  # after a short healing fine-tune, when one was run


class PruneCurve(_Open):
    """``python -m d3d_core.training.prune``: greedy least-harm layer removal, one point per removed layer."""

    layers: int = Field(ge=1)
    block_size: int
    order: list[int]  # layers in the order they were removed
    curve: list[CurvePoint] = Field(min_length=1)
    marginal_cost: dict[str, float]  # τ lost by removing each layer alone (from the full drafter)
    calib_seqs: int
    eval_seqs: int = 0
    ci: Optional[dict] = None

    @field_validator("curve")
    @classmethod
    def _starts_full(cls, pts):
        if pts[0].removed != 0:
            raise ValueError("must start with the unpruned drafter (removed = 0)")
        return pts


# ----------------------------------------------------------------------------- the bench result


class BenchRow(_Open):
    """One prompt decoded in one mode."""

    dataset: str
    id: str
    mode: str
    n_tokens: int
    rounds: int
    tau: Optional[float]  # None for peers that have no rounds
    decode_time_s: float
    prefill_time_s: float
    tokens_per_s: float
    target_forwards: Optional[int] = None
    hit_rate: Optional[float] = None
    overlap: Optional[float] = None
    lossless: Optional[bool] = None  # output == the ar output (None: no reference)
    accepted_hist: dict[str, int] = {}
    skipped_rounds: int = 0  # rounds the draft gate skipped (no draft: an AR step)
    span_ms: dict[str, dict[str, float]] = {}


class BenchSummary(_Open):
    """One dataset x mode (dataset "average": the mean over datasets)."""

    dataset: str
    mode: str
    n: int
    tau: Optional[float]
    tokens_per_s: Optional[float]
    speedup: Optional[float]  # ar's time per token / this mode's
    lossless_rate: Optional[float] = None
    hit_rate: Optional[float] = None
    overlap: Optional[float] = None
    skipped: Optional[float] = None  # share of rounds the draft gate skipped
    tokens: int


class BenchResult(_Open):
    """``python -m d3d_core.measure.bench``: settings, provenance (machine, engine, quiet), rows and summary."""

    config: dict
    machine: dict = {}
    engine: dict = {}
    quiet: dict = {}
    wall_time_s: float = 0.0
    rows: list[BenchRow]
    summary: list[BenchSummary]


SCHEMAS = {"pruning curve": PruneCurve, "bench result": BenchResult}


def checked(kind: str, data: dict) -> dict:
    """Validate a pruning curve / bench result against its schema; ValueError naming the first problem.
    Returns the data unchanged (the files and the UI keep plain JSON)."""
    try:
        SCHEMAS[kind].model_validate(data)
    except ValidationError as e:
        raise ValueError(explain(e, kind)) from None
    return data
