"""Decode settings: a frozen dataclass with named presets; CLI flags map onto its fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Optional

from ..limits import BLOCK_MAX, BLOCK_MIN, MAX_HYPOTHESES, MAX_NEW_TOKENS, TEMPERATURE_MAX
from .plan import DRAFTING_RULES, VERIFY_RULES
from .trace import MODES

SAMPLING_RULES = ("match", "rejection")


@dataclass(frozen=True)
class DecodeConfig:
    mode: str = "d3d-async"
    block_size: int = 8  # B: tokens per drafted block (anchor + B-1 drafts); ar always uses 1
    max_new_tokens: int = 128
    temperature: float = 0.0
    hypotheses: int = 4  # H: successor blocks drafted in the packed pass (d3d-async)
    sampling: str = "match"  # verify rule at temperature > 0: "match" or "rejection"
    seed: int = 0
    stop_at_eos: bool = True
    threads: Optional[int] = None  # CPU intra-op threads; None: all cores (1 per lane in d3d-async)
    verify: str = "adaptive"  # "adaptive": verify the draft prefix that pays for itself (plan.py); "full": all B-1
    drafting: str = "gated"  # "gated": skip the draft while drafting has not paid lately (plan.DraftGate); "always"

    def validated(self) -> "DecodeConfig":
        """Return self if every field is in range, else raise ValueError saying which."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        _int_in(self.block_size, "block size", BLOCK_MIN, BLOCK_MAX)
        _int_in(self.max_new_tokens, "max new tokens", 1, MAX_NEW_TOKENS)
        _int_in(self.hypotheses, "hypotheses H", 1, MAX_HYPOTHESES)
        _int_in(self.seed, "seed", 0, 2**63 - 1)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= TEMPERATURE_MAX:
            raise ValueError(f"temperature must be a number in [0, {TEMPERATURE_MAX:g}], got {t!r}")
        if self.sampling not in SAMPLING_RULES:
            raise ValueError(f"sampling rule must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify rule must be one of {', '.join(VERIFY_RULES)}, got {self.verify!r}")
        if self.drafting not in DRAFTING_RULES:
            raise ValueError(f"drafting rule must be one of {', '.join(DRAFTING_RULES)}, got {self.drafting!r}")
        if self.threads is not None:
            _int_in(self.threads, "threads", 1, 256)
        return self

    @property
    def effective_block(self) -> int:
        return 1 if self.mode == "ar" else self.block_size

    def with_(self, **kw) -> "DecodeConfig":
        return replace(self, **kw)

    @classmethod
    def field_names(cls) -> list:
        return [f.name for f in fields(cls)]


def _int_in(v, name, lo, hi):
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be between {lo} and {hi}, got {v}")


PRESETS = {
    "default": DecodeConfig(),
    "greedy-b8": DecodeConfig(block_size=8, temperature=0.0),
    "greedy-b16": DecodeConfig(block_size=16, temperature=0.0),
    "sample-t1": DecodeConfig(temperature=1.0, sampling="rejection"),
    "pearl": DecodeConfig(hypotheses=1),  # H = 1: optimistic drafting
}
