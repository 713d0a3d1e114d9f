"""Offline τ: acceptance length without a decoding loop (fast; used by pruning, training, the app).

Teacher-force the target's own greedy continuation: for many anchors inside it, draft the
block once and count leading drafts equal to the continuation, + 1 (the bonus). For the
D3D drafter one packed forward per sequence holds the whole sequence as causal context
plus every anchor's block (each block sees the context before its anchor). At
temperature 0 this equals the τ a real decode would see on that continuation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .drafters import D3DDrafter, DFlashDrafter


@dataclass
class CalibSeq:
    prompt_ids: list
    response_ids: list  # the target's greedy continuation

    @property
    def ids(self) -> list:
        return self.prompt_ids + self.response_ids


def anchors_for(seq: CalibSeq, B: int, stride: int) -> list:
    """Anchor positions p (token p is the anchor) inside the response with B-1 tokens after."""
    P, T = len(seq.prompt_ids), len(seq.ids)
    return list(range(P, T - (B - 1), stride))


@torch.no_grad()
def d3d_block_logits(drafter: D3DDrafter, ids: list, anchors: list, B: int) -> torch.Tensor:
    """(n_anchors, B-1, V) draft logits for positions p+1..p+B-1 of each anchor p."""
    dev = drafter.device
    ctx = torch.tensor(ids, dtype=torch.long, device=dev)
    cache = drafter.new_cache()
    blocks = [(ids[p], p) for p in anchors]  # anchor token, context visible up to p-1 => n_visible = p
    _, hb, _ = drafter.forward_packed(cache, ctx, blocks, B + 1)
    return drafter.logits(hb[:, 1:B]).float()


def target_features(drafter: DFlashDrafter, target, ids: list) -> torch.Tensor:
    """(1, T, n*H) hidden states of the drafter's target layers for every position."""
    cache = target.new_cache()
    return target.forward(cache, torch.tensor(ids), 1, tuple(drafter.cfg.target_layer_ids)).feats


@torch.no_grad()
def dflash_block_logits(drafter: DFlashDrafter, target, ids: list, anchors: list, B: int) -> torch.Tensor:
    """Same for the DFlash drafter: one target forward gives the features of every position;
    each block sees the features before its anchor (4-D mask over one shared context)."""
    return dflash_anchor_logits(drafter, target_features(drafter, target, ids), ids, anchors, B)


def dflash_anchor_logits(drafter: DFlashDrafter, feats: torch.Tensor, ids: list, anchors: list, B: int) -> torch.Tensor:
    """(n_anchors, B-1, V) with gradients (training uses it too). feats: (1, T, n*H)."""
    T = len(ids)
    f = drafter.fuse(feats)  # (1, T, H)
    cos_c, sin_c = drafter.shared.rope(torch.arange(T, device=drafter.device), f)
    # every layer's context K/V comes from the same fused features (what extend_context caches)
    past = lambda i: drafter.layers[i].self_attn.project_kv(f, cos_c, sin_c)  # noqa: E731
    h = drafter.forward_anchored(past, T, [(ids[p], p) for p in anchors], B)
    return drafter.logits(h[:, 1:]).float()


def offline_tau(drafter, seqs: list, B: int = 8, stride: int = 4, target=None, per_seq: bool = False):
    """Mean over anchors of (leading matches + 1). ``target`` is needed for DFlash drafters."""
    taus = []
    per = []
    for s in seqs:
        anchors = anchors_for(s, B, stride)
        if not anchors:
            continue
        ids = s.ids
        if isinstance(drafter, D3DDrafter):
            lg = d3d_block_logits(drafter, ids, anchors, B)
        else:
            if target is None:
                raise ValueError("offline τ of a DFlash drafter needs the target (for its hidden states)")
            lg = dflash_block_logits(drafter, target, ids, anchors, B)
        pred = lg.argmax(-1).cpu()  # (n, B-1)
        truth = torch.tensor([[ids[p + k] for k in range(1, B)] for p in anchors])
        eq = (pred == truth).int()
        lead = eq.cumprod(dim=1).sum(dim=1)  # leading matches per anchor
        t = (lead + 1).float()
        taus.append(t)
        per.append(float(t.mean()))
    if not taus:
        raise ValueError("calibration set has no usable anchors (responses shorter than the block)")
    tau = float(torch.cat(taus).mean())
    return (tau, per) if per_seq else tau


# ----------------------------------------------------------------------------- calibration sets

CALIB_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Please reason step by step.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner.",
]
_CALIB: dict = {}
_CALIB_LOCK = threading.Lock()


def greedy_continuations(bundle, prompts: list, max_new_tokens: int = 96) -> list:
    """The target's greedy continuations of prompts (chat template), as CalibSeq."""
    from .config import DecodeConfig
    from .engine import decode

    out = []
    for p in prompts:
        tr = decode(bundle, p, DecodeConfig(mode="ar", max_new_tokens=max_new_tokens))
        out.append(CalibSeq(tr.prompt_ids, tr.output_ids))
    return out


def calibration_set(bundle, max_new_tokens: int = 96) -> list:
    """A small calibration set for live τ in the app: shipped for the bundle when present
    (assets/calibration/<bundle>.json), else made once from the target and kept in memory."""
    import json

    from .bundles import ASSETS

    with _CALIB_LOCK:
        if bundle.name in _CALIB:
            return _CALIB[bundle.name]
        p = ASSETS / "calibration" / f"{bundle.name}.json"
        if p.is_file():
            d = json.loads(p.read_text())
            seqs = [CalibSeq(s["prompt_ids"], s["response_ids"]) for s in d["seqs"]]
        else:
            seqs = greedy_continuations(bundle, CALIB_PROMPTS, max_new_tokens)
        _CALIB[bundle.name] = seqs
        return seqs
