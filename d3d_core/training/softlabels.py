"""Soft labels: the target's top-k next-token distribution at every position of a training sequence.

One teacher-forced target forward per sequence gives, at each position t, the target's logits for
token t + 1. Keeping the top k (ids int32, logits fp16) costs 6·k bytes per token — 192 bytes at
k = 32, about 190 MB per million tokens — and carries what the target "almost said", which a
hard greedy label throws away. Cached on disk under ``$D3D_CACHE/softlabels/<bundle>/k<k>/`` as one
safetensors file per example, keyed by the example id and checked against a hash of its tokens,
so a changed example is recomputed rather than misread.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import torch

from ..models.sources import cache_dir
from .losses import SoftTargets


def target_topk(target, ids: list, k: int) -> tuple:
    """(ids (T-1, k) int32, logits (T-1, k) fp16): row t is the target's top-k for token t + 1."""
    logits = target.forward(target.new_cache(), torch.tensor(ids, dtype=torch.long, device=target.device), len(ids)).logits  # (T, V)
    val, idx = logits[:-1].float().topk(k, dim=-1)
    return idx.to(torch.int32).cpu().clone(), val.to(torch.float16).cpu().clone()  # plain tensors, not inference ones


def _digest(ids: list) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


class SoftLabelCache:
    """Per-example top-k soft labels on disk: ``get(key, ids)`` computes once, then reads."""

    def __init__(self, root, target, k: int = 32):
        self.root = Path(root) / f"k{k}"
        self.target, self.k = target, k
        self.hits = self.misses = 0

    def path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.safetensors"

    def get(self, key: str, ids: list) -> tuple:
        from safetensors import safe_open
        from safetensors.torch import save_file

        p = self.path(key)
        if p.is_file():
            try:
                with safe_open(str(p), framework="pt") as f:
                    if f.metadata().get("digest") == _digest(ids):
                        self.hits += 1
                        return f.get_tensor("ids"), f.get_tensor("logits")
            except (OSError, ValueError, RuntimeError, KeyError):
                pass  # a file cut by a kill: recompute it
        self.misses += 1
        idx, val = target_topk(self.target, ids, self.k)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        save_file({"ids": idx.contiguous(), "logits": val.contiguous()}, str(tmp), metadata={"digest": _digest(ids), "key": key})
        tmp.replace(p)
        return idx, val


def soft_rows(topk: tuple, positions: torch.Tensor, temperature: float = 1.0) -> SoftTargets:
    """Soft targets for label positions: ``positions`` (N,) are indices t of the token being
    predicted (the row is t - 1); -1 = no soft label. Probabilities renormalised over the top k."""
    idx, val = topk
    valid = (positions >= 1) & (positions - 1 < len(idx))
    rows = (positions - 1).clamp(0, len(idx) - 1)
    ids = idx[rows].long()
    probs = torch.softmax(val[rows].float() / temperature, dim=-1)
    return SoftTargets(ids=ids, probs=probs * valid[:, None], valid=valid)


def cache_root(bundle: str) -> Path:
    return cache_dir() / "softlabels" / bundle


def maybe_cache(bundle, k: int) -> Optional[SoftLabelCache]:
    return SoftLabelCache(cache_root(bundle.name), bundle.target, k) if k > 0 else None
