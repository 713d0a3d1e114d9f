"""Train a drafter on the target's own responses (self-distillation), resumably.

    python -m d3d_core.training.train --kind d3d --bundle smollm2-135m --layers 8 --block-size 8 \\
        --steps 4000 --out runs/d3d-8L
    python -m d3d_core.training.train --kind dflash --layers 2 --steps 4000 --out runs/dflash-2L
    python -m d3d_core.training.train --init assets/drafters/smollm2-135m/d3d --steps 400 --lr 3e-4 --out runs/d3d-more

Both drafters see the same data, the same random anchors inside responses and the same
weighted block loss ``w_k = exp(-(k-1)/γ)`` on block positions 1..B-1 (D3D also on its
lookahead slot B), so equal steps = equal training budget. D3D adds ``λ ×`` next-token
cross-entropy on its context stream (the auxiliary AR supervision). The target's embedding
and LM head stay frozen. Every ``--ckpt-every`` steps the drafter and the optimizer state are
written as safetensors (+ JSON) to ``--out``; rerunning the same command resumes there.
``--init`` fine-tunes a trained drafter (e.g. the shipped one on newly distilled data) instead.
A held-out evaluation, log or report that fails is named on stderr (``rawfirst``), the checkpoint
is still written and the command exits 1.

Training runs on the bundle's device (the target's: ``--device``, CUDA when there is one). The drafter's own
parameters and the AdamW moments are fp32 (master weights) whatever the target's dtype; on CUDA the forwards run
under bf16 autocast (``--amp``) and the sequences of one optimizer step go through the drafter in one packed
forward (``--pack``). On a CPU both default to off: fp32 throughout, one sequence at a time, the same numbers as
before either existed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..measure.rawfirst import Steps
from ..models import fastops
from ..models.adapter import build_adapter_drafter
from ..models.bundles import BUNDLES, get_bundle
from ..models.d3d import D3DDrafter
from ..models.dflash import DFlashDrafter
from ..models.layers import NEG_INF
from ..models.loader import build_drafter, init_drafter
from .distill import default_device, distill_dir, read_examples
from .losses import HeadLoss, block_position_weights, block_targets, weighted_mean
from .offline_tau import CalibSeq, dflash_anchor_logits, load_any_drafter, offline_tau, target_features
from .softlabels import SoftLabelCache, soft_rows
from .softlabels import cache_root as softlabel_root


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "d3d"
    layers: int = 8
    block_size: int = 8
    steps: int = 2000
    lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.0
    gamma: float = 4.0  # block-position weight decay w_k = exp(-(k-1)/γ)
    ar_lambda: float = 0.5  # λ: weight of the context stream's next-token loss (D3D)
    ar_positions: int = 64  # context positions per sequence that get the AR loss; 0 = all of them
    head_shortlist: int = 0  # 0 = full LM head in the loss; N = the N most frequent response tokens + a sampled "other" bucket
    other_samples: int = 512  # rows sampled to estimate the other bucket's log-partition (losses.HeadLoss)
    soft_k: int = 0  # top-k soft labels from the target (cached, softlabels.py); 0 = hard labels only
    soft_alpha: float = 0.5  # weight of the soft-label cross-entropy in the block term
    anchors: int = 16  # blocks per sequence per step; 0 = dense: every response position
    max_len: int = 384  # prompt + response tokens kept per sequence
    accum: int = 2  # sequences per optimizer step
    seed: int = 0
    eval_every: int = 200
    eval_seqs: int = 16
    ckpt_every: int = 100
    holdout_pct: float = 2.0
    kd_alpha: float = 0.0  # α: mix KL(teacher ‖ drafter) into the block loss (healing from the unpruned drafter)
    first_draft: str = ""  # "mask" | "anchor": the slot draft 1 is read (and trained) at; "" keeps the drafter's own (mask when fresh)
    anchor_attention: str = ""  # "block" | "causal" (DrafterConfig.anchor_attention); "" keeps the drafter's own (block when fresh)
    adapter_rank: int = 0  # fresh D3D drafter only: > 0 = frozen target layers + rank-r MASK-slot adapters (DrafterConfig.adapter_rank)
    amp: str = "auto"  # "auto": bf16 autocast on CUDA, none elsewhere | "bf16": always | "off": never (parameters stay fp32 unless "off" on a bf16 target)
    pack: str = "auto"  # the step's sequences in one packed forward? "auto": on CUDA | "on" | "off" (one forward per sequence)

    def __post_init__(self):
        for f, ok in (("amp", AMP_MODES), ("pack", PACK_MODES)):
            if getattr(self, f) not in ok:
                raise ValueError(f"{f} must be one of {', '.join(ok)} (got {getattr(self, f)!r})")


AMP_MODES = ("auto", "bf16", "off")
PACK_MODES = ("auto", "on", "off")


def amp_dtype(cfg: TrainConfig, device) -> "torch.dtype | None":
    """The autocast dtype of training's forwards on ``device``: bf16 on CUDA ("auto"), or always ("bf16"); None = no
    autocast (a CPU by default: fp32 as stored, the numbers every earlier run gave)."""
    if cfg.amp == "bf16" or (cfg.amp == "auto" and torch.device(device).type == "cuda"):
        return torch.bfloat16
    return None


def autocast(cfg: TrainConfig, device):
    """The context training's forwards (and its held-out evaluation) run in: ``amp_dtype``'s autocast, or nothing."""
    dt = amp_dtype(cfg, device)
    return torch.autocast(device_type=torch.device(device).type, dtype=dt) if dt is not None else contextlib.nullcontext()


def packs(cfg: TrainConfig, device) -> bool:
    """Whether a step's sequences go through the drafter in one packed forward (``packed_hidden``, ``dflash_packed_logits``)."""
    return cfg.pack == "on" or (cfg.pack == "auto" and torch.device(device).type == "cuda")


def master_dtype(cfg: TrainConfig, target_dtype, device) -> torch.dtype:
    """The dtype of the trained parameters and their optimizer state: fp32 (master weights), except without autocast on
    a target of lower precision (``--amp off`` on a bf16 target), whose forwards need weights of the target's dtype."""
    return torch.float32 if target_dtype == torch.float32 or amp_dtype(cfg, device) is not None else target_dtype


def for_training(drafter, device, dtype=torch.float32):
    """``drafter`` on ``device`` with its own (trained) parameters in ``dtype`` (fp32: master weights). Whatever it
    borrows from the target (an adapter drafter's base, the shared embedding and head) keeps the target's dtype and
    storage — a base already on ``device`` is not copied; autocast reconciles the dtypes in the forward."""
    drafter.to(device=device)  # tensors already there (an adapter drafter's shared base) stay the target's
    with torch.no_grad():
        for p in drafter.own_parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return drafter


PRESETS = {
    "d3d-8L": TrainConfig(kind="d3d", layers=8),
    "d3d-6L": TrainConfig(kind="d3d", layers=6),
    "dflash-2L": TrainConfig(kind="dflash", layers=2),
    "toy": TrainConfig(layers=2, block_size=4, steps=30, anchors=6, max_len=96, accum=1, eval_every=10, eval_seqs=4, ckpt_every=10),
}


def fresh_drafter(bundle, cfg: TrainConfig):
    """An untrained drafter for cfg: cfg.layers target layers (evenly spaced; all of them at the target's
    depth), with cfg.first_draft and cfg.anchor_attention where cfg names them. A full-depth D3D drafter that
    reads draft 1 at a causal anchor slot starts out as the target's own next-token prediction there."""
    d = init_drafter(cfg.kind, bundle.target, BUNDLES[bundle.name], num_layers=cfg.layers, block_size=cfg.block_size, seed=cfg.seed,
                     adapter_rank=cfg.adapter_rank)
    return with_rules(d.to(device=bundle.target.device), cfg)  # built on the CPU (in the target's dtype): to the target's device


def with_rules(d, cfg: TrainConfig):
    """d with cfg's first_draft / anchor_attention where cfg names them (DrafterConfig validates both)."""
    over = {k: getattr(cfg, k) for k in ("first_draft", "anchor_attention") if getattr(cfg, k)}
    if over:
        d.cfg = replace(d.cfg, **over)
    return d


def is_holdout(key: str, pct: float) -> bool:
    h = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
    return (h % 10000) < pct * 100


def split_holdout(examples: list, max_len: int, pct: float = TrainConfig.holdout_pct) -> tuple:
    """(training examples, held-out sequences): the same hash split training uses, so nothing
    that scores a drafter (offline τ, pruning calibration, shortlist checks) was trained on."""
    train_ex = [e for e in examples if not is_holdout(e["id"], pct)]
    held = [to_seq(e, max_len) for e in examples if is_holdout(e["id"], pct)]
    return train_ex, held


def to_seq(e: dict, max_len: int) -> CalibSeq:
    p, r = list(e["prompt_ids"]), list(e["response_ids"])
    if len(p) + len(r) > max_len:
        keep_p = max(16, max_len - len(r))
        p = p[-keep_p:]
        r = r[: max_len - len(p)]
    return CalibSeq(p, r)


def sample_anchors(seq: CalibSeq, n: int, rng: random.Random) -> list:
    """n random anchors in the response; n <= 0: dense, every response position."""
    P, T = len(seq.prompt_ids), len(seq.ids)
    cand = list(range(P, T - 1))  # the anchor must have at least one token after it
    if not cand or n <= 0:
        return cand
    return sorted(rng.sample(cand, min(n, len(cand))))


def head_shortlist(examples: list, n: int) -> list:
    """The n most frequent response tokens of the training examples (ties by id): the exact rows
    of the training head (``losses.HeadLoss``); rarer labels join per batch."""
    from collections import Counter

    c = Counter(t for e in examples for t in e["response_ids"])
    return sorted(t for t, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:n])


def weighted_block_ce(logits: torch.Tensor, ids: list, anchors: list, gamma: float) -> torch.Tensor:
    """logits (nb, n, V): row k-1 of block b predicts ids[p_b + k]. Cross-entropy weighted
    w_k = exp(-(k-1)/γ), positions past the end of the sequence ignored."""
    tgt = block_targets(ids, anchors, logits.shape[1])
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1).to(logits.device), reduction="none", ignore_index=-100)
    return weighted_mean(ce, block_position_weights(tgt, gamma).reshape(-1))


def weighted_block_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, ids: list, anchors: list, gamma: float) -> torch.Tensor:
    """KL(teacher ‖ drafter) per block position, weighted like the CE (w_k, past-the-end ignored).
    Soft labels from the unpruned drafter carry what it learned about the target beyond the one
    greedy token — the usual way to heal a pruned network on little data. A teacher with a vocabulary
    shortlist gives -inf outside it: those tokens have probability 0 and add 0 (not 0 · ∞ = NaN)."""
    w = block_position_weights(block_targets(ids, anchors, logits.shape[1]), gamma)  # (nb, n)
    lt = F.log_softmax(teacher_logits, -1)
    pt = lt.exp()
    kl = torch.where(pt > 0, pt * (lt - F.log_softmax(logits, -1)), torch.zeros((), dtype=pt.dtype)).sum(-1)
    return weighted_mean(kl, w)


def d3d_block_terms(drafter: D3DDrafter, seq: CalibSeq, anchors: list, cfg: TrainConfig, head: HeadLoss,
                    topk=None, generator=None, hidden=None) -> tuple:
    """One packed forward over the context and every block. Returns (h_ctx (T, H), block hidden
    states (nb, B, H), Σ w·CE, Σ w, Σ w·soft CE or None) — sums, not means, so a dense pass over many anchors
    equals the sum of one pass per anchor (tested). ``hidden``: this sequence's (h_ctx, h_blocks) from a forward
    over several sequences (``packed_hidden``) instead of its own."""
    ids = seq.ids
    B = cfg.block_size
    ctx = torch.tensor(ids, dtype=torch.long, device=drafter.device)
    blocks = [(ids[p], p) for p in anchors]
    if hidden is not None:
        h_ctx, hb = hidden
    elif drafter.frozen_base:
        # nothing trainable acts on the context rows: run them once without autograd, then backpropagate through
        # the blocks alone, each over its prefix of that cache (the same values as the packed forward; tested)
        cache = drafter.new_cache()
        with torch.no_grad():
            h_ctx, _, kv = drafter.forward_packed(cache, ctx, [], B + 1)
        drafter.commit_kv(cache, kv, len(ids))
        _, hb, _ = drafter.forward_packed(cache, ctx[:0], blocks, B + 1, cache_prefix=True)
    else:
        h_ctx, hb, _ = drafter.forward_packed(drafter.new_cache(), ctx, blocks, B + 1)
    hb = drafter.draft_rows(hb)  # (nb, B, H): predicts p+1 .. p+B (draft 1 from the slot the drafter's rule names)
    tgt = block_targets(ids, anchors, B)  # (nb, B)
    w = block_position_weights(tgt, cfg.gamma).reshape(-1)
    soft = None
    if topk is not None:
        pos = torch.tensor([[p + k if p + k < len(ids) else -1 for k in range(1, B + 1)] for p in anchors]).reshape(-1)
        soft = soft_rows(topk, pos)
    hard, soft_ce = head(drafter, hb.reshape(-1, hb.shape[-1]), tgt.reshape(-1), soft, generator)
    ws = (hard.float().cpu() * w).sum()
    soft_sum = None if soft_ce is None else (soft_ce.float().cpu() * w).sum()
    return h_ctx, hb, ws, w.sum(), soft_sum


@fastops.exact  # the teacher runs under no_grad: keep it fp32 like the student
def d3d_loss(drafter: D3DDrafter, seq: CalibSeq, anchors: list, cfg: TrainConfig, rng: random.Random, teacher=None,
             head: HeadLoss | None = None, topk=None, hidden=None):
    """Weighted block CE (positions 1..B, B = lookahead) + λ · next-token CE on the context.
    ``head``: the LM-head loss (default: full head); ``topk``: the target's soft labels for this
    sequence (``softlabels``), mixed into the block term with weight ``cfg.soft_alpha``;
    with a ``teacher`` and ``cfg.kd_alpha`` = α the block term is (1-α)·CE + α·KL(teacher ‖ drafter).
    ``hidden``: the sequence's hidden states from a packed forward over several (``packed_hidden``)."""
    ids = seq.ids
    T, B = len(ids), cfg.block_size
    head = head or HeadLoss(drafter.cfg.arch.vocab_size)
    # only a sampling head draws from rng: the full-head recipe keeps the random stream it always had
    gen = None if head.full else torch.Generator().manual_seed(rng.getrandbits(62))
    h_ctx, hb, ce_sum, w_sum, soft_sum = d3d_block_terms(drafter, seq, anchors, cfg, head, topk, gen, hidden)
    block = ce_sum / w_sum.clamp(min=1e-6)
    if soft_sum is not None and cfg.soft_alpha > 0:
        block = (1 - cfg.soft_alpha) * block + cfg.soft_alpha * soft_sum / w_sum.clamp(min=1e-6)
    if teacher is not None and cfg.kd_alpha > 0:
        ctx = torch.tensor(ids, dtype=torch.long, device=drafter.device)
        blocks = [(ids[p], p) for p in anchors]
        logits = drafter.logits(hb).float()
        with torch.no_grad():
            t_logits = teacher.logits(teacher.draft_rows(teacher.forward_packed(teacher.new_cache(), ctx, blocks, B + 1)[1])).float()
        block = (1 - cfg.kd_alpha) * block + cfg.kd_alpha * weighted_block_kl(logits, t_logits, ids, anchors, cfg.gamma)
    ar = torch.zeros(())
    if cfg.ar_lambda > 0:
        P = len(seq.prompt_ids)
        pos = list(range(max(0, P - 1), T - 1))
        if cfg.ar_positions > 0:
            pos = sorted(rng.sample(pos, min(cfg.ar_positions, len(pos))))
        if pos:
            ce, _ = head(drafter, h_ctx[pos], torch.tensor([ids[t + 1] for t in pos]), None, gen)
            ar = ce.float().cpu().mean()
    return block + cfg.ar_lambda * ar, float(block.detach()), float(ar.detach())


def packed_hidden(drafter: D3DDrafter, items: list, block_size: int) -> list:
    """Several sequences through the drafter in **one** forward: ``items`` = [(seq, anchors)], each laid out as
    ``forward_packed`` lays out one (its context, causal, then its blocks, from a fresh cache) and placed side by side
    along the rows, every sequence at its own positions and masked from the others (a block-diagonal mask). Returns
    [(h_ctx (T, H), h_blocks (nb, B+1, H))] per item — the values of one ``forward_packed`` per sequence, up to the
    rounding of the larger matrix products (tested). On a GPU one larger forward uses it far better than several
    small ones; an adapter drafter pays the autograd of its (frozen) context rows here, which one-at-a-time avoids."""
    L = block_size + 1
    xs, poss, masks, rows, sizes = [], [], [], [], []
    for seq, anchors in items:
        ctx = torch.tensor(seq.ids, dtype=torch.long, device=drafter.device)
        x, pos, mask = drafter.build_inputs(0, ctx, [(seq.ids[p], p) for p in anchors], L)
        xs.append(x[0])
        poss.append(pos)
        masks.append(mask[0, 0])  # (N, N) additive: what may attend to what inside this sequence
        r = torch.zeros(len(ctx) + len(anchors) * L, 1)
        for b in range(len(anchors)):
            r[len(ctx) + b * L + 1 : len(ctx) + (b + 1) * L] = 1  # the adapters act on MASK slots (forward_packed)
        rows.append(r)
        sizes.append((len(ctx), len(anchors)))
    N = sum(m.shape[0] for m in masks)
    mask = torch.full((N, N), NEG_INF, dtype=masks[0].dtype, device=drafter.device)  # nothing across sequences
    o = 0
    for m in masks:
        mask[o : o + m.shape[0], o : o + m.shape[0]] = m
        o += m.shape[0]
    mask = mask[None, None]
    x = torch.cat(xs)[None]
    pos = torch.cat(poss)
    cos, sin = drafter.shared.rope(pos, x)
    rw = torch.cat(rows)[None].to(device=x.device, dtype=x.dtype) if drafter.frozen_base else None
    for i in drafter.active_layers():
        x, _ = drafter.layers[i](x, cos, sin, None, mask, rw)
    h, out, o = x[0], [], 0
    for C, nb in sizes:
        out.append((h[o : o + C], h[o + C : o + C + nb * L].view(nb, L, h.shape[-1])))
        o += C + nb * L
    return out


def dflash_feats(drafter: DFlashDrafter, target, ids: list, feat_cache: dict | None = None, key=None) -> torch.Tensor:
    """The target's features of a sequence (1, T, n·H), on the drafter's device in its parameters' dtype.
    ``feat_cache``: the target is frozen, so its hidden states of a sequence never change;
    keeping them (fp16, in host memory, T×5H per sequence, ~1 GB for 150k tokens on SmolLM2) turns every later
    epoch over that sequence from a 30-layer target forward into a lookup."""
    feats = feat_cache.get(key) if feat_cache is not None else None
    if feats is None:
        with torch.no_grad():
            feats = target_features(drafter, target, ids).clone()  # inference tensors cannot enter autograd
        if feat_cache is not None:
            feat_cache[key] = feats.to("cpu", torch.float16)  # host memory: a GPU's is for the models
    return feats.to(device=drafter.device, dtype=next(drafter.parameters()).dtype)


def dflash_loss(drafter: DFlashDrafter, target, seq: CalibSeq, anchors: list, cfg: TrainConfig,
                feat_cache: dict | None = None, key=None, logits=None):
    """Weighted block CE of the DFlash drafter (``dflash_feats`` for ``feat_cache``). ``logits``: this sequence's
    block logits from a pass over several sequences (``dflash_packed_logits``) instead of its own."""
    ids = seq.ids
    T, B = len(ids), cfg.block_size
    anchors = [p for p in anchors if p + 1 < T]
    if logits is None:
        feats = dflash_feats(drafter, target, ids, feat_cache, key)
        logits = dflash_anchor_logits(drafter, feats, ids, anchors, B).float()  # (nb, B-1, V)
    block = weighted_block_ce(logits, ids, anchors, cfg.gamma)
    return block, float(block.detach()), 0.0


def dflash_packed_logits(drafter: DFlashDrafter, items: list, block_size: int) -> list:
    """The DFlash block pass over several sequences at once: ``items`` = [(feats (1, T, n·H), ids, anchors)]; every
    sequence's fused features become context keys at its own positions, every block sees the context of its own
    sequence before its anchor (``forward_anchored``'s rule) and itself, nothing of another sequence. Returns
    [(nb, B-1, V) float logits] per item, the values of one ``dflash_anchor_logits`` each up to rounding (tested)."""
    L = block_size
    anchors = [[p for p in a if p + 1 < len(ids)] for _, ids, a in items]
    f = drafter.fuse(torch.cat([feats for feats, _, _ in items], dim=1))  # per position: one call for all
    Ts = [len(ids) for _, ids, _ in items]
    T, NB = sum(Ts), sum(len(a) for a in anchors) * L
    dev = drafter.device
    cos_c, sin_c = drafter.shared.rope(torch.cat([torch.arange(t) for t in Ts]).to(dev), f)
    x = torch.cat([drafter.block_embeddings([ids[p] for p in a], L) for (_, ids, _), a in zip(items, anchors) if a])[None]
    pos = torch.cat([torch.arange(p, p + L) for a in anchors for p in a]).to(dev)
    allowed = torch.zeros(NB, T + NB, dtype=torch.bool)
    off = r = 0
    for t, a in zip(Ts, anchors):
        for p in a:
            allowed[r : r + L, off : off + p] = True  # its own sequence's context before the anchor
            allowed[r : r + L, T + r : T + r + L] = True  # itself, bidirectional
            r += L
        off += t
    mask = torch.zeros(allowed.shape, dtype=drafter.dtype).masked_fill_(~allowed, NEG_INF).to(dev)[None, None]
    cos, sin = drafter.shared.rope(pos, x)
    for i in drafter.active_layers():
        past = drafter.layers[i].self_attn.project_kv(f, cos_c, sin_c)  # every sequence's context keys, as extend_context makes them
        x, _ = drafter.layers[i](x, cos, sin, past, mask)
    h, out, r = x[0], [], 0
    for a in anchors:
        hb = h[r : r + len(a) * L].view(len(a), L, h.shape[-1])
        out.append(drafter.logits(drafter.draft_rows(hb)).float())
        r += len(a) * L
    return out


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(out: Path, drafter, opt, step: int, cfg: TrainConfig, history: list, extra: dict | None = None) -> None:
    """Drafter (fp32 for resuming) + AdamW moments, all safetensors; state in JSON. Atomic."""
    from safetensors.torch import save_file

    tmp = out / "ckpt.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in drafter.own_state_dict().items()}, str(tmp / "drafter.safetensors"))
    names = {id(p): n for n, p in drafter.named_parameters()}
    moments, steps = {}, {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                n = names[id(p)]
                moments[f"{n}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
                moments[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
                steps[n] = float(st["step"])
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({
        "step": step, "train": asdict(cfg), "drafter": drafter.cfg.to_json(), "adam_steps": steps, "history": history,
        **(extra or {}),
    }, indent=1))
    final = out / "ckpt"
    if final.exists():
        import shutil

        shutil.rmtree(final)
    tmp.rename(final)


def load_checkpoint(out: Path, drafter, opt) -> tuple:
    """(step, history, state): state is the whole state.json ({} when there is no checkpoint)."""
    from safetensors.torch import load_file

    d = out / "ckpt"
    if not (d / "state.json").is_file():
        return 0, [], {}
    st = json.loads((d / "state.json").read_text())
    drafter.load_own_state(load_file(str(d / "drafter.safetensors")))
    moments = load_file(str(d / "optimizer.safetensors"))
    params = dict(drafter.named_parameters())
    for n, s in st["adam_steps"].items():
        p = params[n]
        # the moments go back where (and in the dtype) the parameter lives: fp32 master weights, on the training device
        opt.state[p] = {"step": torch.tensor(s), "exp_avg": moments[f"{n}.exp_avg"].to(p.device, p.dtype),
                        "exp_avg_sq": moments[f"{n}.exp_avg_sq"].to(p.device, p.dtype)}
    return st["step"], st.get("history", []), st


# ----------------------------------------------------------------------------- loop


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@fastops.exact  # a frozen teacher drafter runs under no_grad: keep it fp32, like the stored weights
def train(bundle, examples: list, cfg: TrainConfig, out: Path, progress: bool = True, log=None, reload=None,
          init=None, init_note: str = "", teacher=None, stop_after: int | None = None, guard: Steps | None = None) -> dict:
    """Train (or resume) a drafter of cfg.kind on examples; returns a summary dict.
    ``reload``: optional callable returning a fresh example list, called at every eval
    (training can start while the self-distillation data is still being generated).
    ``init``: start from a copy of this trained drafter (its skip set included: skipped layers
    get no gradient) instead of target layers — fine-tuning, e.g. healing after pruning.
    ``teacher``: a frozen D3D drafter whose block distributions the drafter also learns
    (weight ``cfg.kd_alpha``), e.g. the unpruned drafter when healing a pruned one.
    ``stop_after``: run at most this many steps now (checkpointed; calling again continues on
    the same schedule) — for sessions shorter than a run, and for comparing recipes at equal steps.
    ``guard``: the :class:`~d3d_core.measure.rawfirst.Steps` that runs the post-processing between
    checkpoints (held-out evaluation after step 0, data reload, log, the final provenance) — a failing
    one is recorded (``failed_steps`` in the result, offline τ None at that point) and never costs the
    checkpoint. The evaluation before step 0 is not guarded: a run that cannot be scored fails before any work."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    guard = guard if guard is not None else Steps(raw=out / "ckpt")
    n_failed = len(guard.failed)
    torch.manual_seed(cfg.seed)
    device = bundle.target.device  # the bundle's device: the drafter, its inputs and its optimizer state live there
    mdt = master_dtype(cfg, bundle.target.dtype, device)
    amp = lambda: autocast(cfg, device)  # noqa: E731
    if init is not None:
        if init.cfg.kind != cfg.kind:
            raise ValueError(f"cannot fine-tune a {init.cfg.kind} drafter as {cfg.kind}")
        # an adapter drafter's base is the target's own layers, shared (no copy); its adapters and the rest are copied
        drafter = (build_adapter_drafter if init.cfg.adapter_rank else build_drafter)(init.cfg, bundle.target.shared)
        drafter = for_training(drafter, device, mdt)
        drafter.load_state_dict(init.state_dict())  # copied into the training dtype
        drafter = with_rules(drafter, cfg)
    else:
        drafter = for_training(fresh_drafter(bundle, cfg), device, mdt)
    if teacher is not None:
        if cfg.kind != "d3d" or teacher.cfg.kind != "d3d":
            raise ValueError("distillation from a teacher drafter is implemented for D3D drafters")
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    if init is not None and cfg.adapter_rank and cfg.adapter_rank != drafter.cfg.adapter_rank:
        raise ValueError(f"adapter_rank {cfg.adapter_rank} applies to a fresh drafter; the init drafter has {drafter.cfg.adapter_rank}")
    drafter.train()
    own = drafter.own_parameters()  # an adapter drafter trains its adapters and mask embedding only
    for p in drafter.parameters():
        p.requires_grad_(False)
    for p in own:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(own, lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, history, state = load_checkpoint(out, drafter, opt)
    train_ex, held = split_holdout(examples, cfg.max_len, cfg.holdout_pct)
    head_rows = state.get("head_rows") or (head_shortlist(train_ex, cfg.head_shortlist) if cfg.head_shortlist else None)
    head = HeadLoss(drafter.cfg.arch.vocab_size, head_rows, cfg.other_samples)
    soft = SoftLabelCache(softlabel_root(bundle.name), bundle.target, cfg.soft_k) if cfg.soft_k > 0 else None
    held = held[: cfg.eval_seqs]
    if not train_ex:
        raise ValueError("no training examples (run python -m d3d_core.training.distill first)")
    if not held:
        held = [to_seq(e, cfg.max_len) for e in train_ex[: cfg.eval_seqs]]

    def evaluate() -> float:
        drafter.eval()
        with torch.no_grad(), amp():
            t = offline_tau(drafter, held, B=cfg.block_size, stride=4, target=bundle.target)
        drafter.train()
        return t

    if start == 0:
        history.append({"step": 0, "offline_tau": evaluate(), "tokens_seen": 0})
    bar = tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.kind}", file=sys.stderr, disable=not progress)
    t0, cpu0 = time.time(), time.process_time()
    tokens_seen = history[-1].get("tokens_seen", 0) if history else 0
    cpu_base = history[-1].get("cpu_s", 0.0) if history else 0.0  # CPU seconds of earlier runs of this schedule
    loss_ema = None
    feat_cache: dict = {}  # DFlash: target features per sequence (see dflash_loss)
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for step in range(start, end):
        rng = random.Random(cfg.seed * 1_000_003 + step)  # the same data order on resume, whatever was done
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        tot = bl = arl = 0.0
        if packs(cfg, device):  # the step's sequences in one forward, one backward
            batch = []
            for _ in range(cfg.accum):
                ex = rng.choice(train_ex)
                seq = to_seq(ex, cfg.max_len)
                anchors = sample_anchors(seq, cfg.anchors, rng)
                if anchors:
                    batch.append((ex, seq, anchors))
            if batch:
                total = 0.0
                with amp():
                    if cfg.kind == "d3d":
                        packed = packed_hidden(drafter, [(s, a) for _, s, a in batch], cfg.block_size)
                    else:
                        packed = dflash_packed_logits(drafter, [(dflash_feats(drafter, bundle.target, s.ids, feat_cache, e["id"]), s.ids, a)
                                                                for e, s, a in batch], cfg.block_size)
                    for (ex, seq, anchors), hs in zip(batch, packed):
                        if cfg.kind == "d3d":
                            topk = soft.get(ex["id"], seq.ids) if soft is not None else None
                            loss, b, a = d3d_loss(drafter, seq, anchors, cfg, rng, teacher, head, topk, hidden=hs)
                        else:
                            loss, b, a = dflash_loss(drafter, bundle.target, seq, anchors, cfg, logits=hs)
                        total = total + loss / cfg.accum
                        tot += float(loss.detach()) / cfg.accum
                        bl += b / cfg.accum
                        arl += a / cfg.accum
                        tokens_seen += len(anchors) * cfg.block_size
                total.backward()
        else:
            for _ in range(cfg.accum):
                ex = rng.choice(train_ex)
                seq = to_seq(ex, cfg.max_len)
                anchors = sample_anchors(seq, cfg.anchors, rng)
                if not anchors:
                    continue
                with amp():  # the forward only: backward runs in the dtypes autocast chose
                    if cfg.kind == "d3d":
                        topk = soft.get(ex["id"], seq.ids) if soft is not None else None
                        loss, b, a = d3d_loss(drafter, seq, anchors, cfg, rng, teacher, head, topk)
                    else:
                        loss, b, a = dflash_loss(drafter, bundle.target, seq, anchors, cfg, feat_cache, ex["id"])
                (loss / cfg.accum).backward()
                tot += float(loss.detach()) / cfg.accum
                bl += b / cfg.accum
                arl += a / cfg.accum
                tokens_seen += len(anchors) * cfg.block_size
        torch.nn.utils.clip_grad_norm_(own, 1.0)
        opt.step()
        loss_ema = tot if loss_ema is None else 0.95 * loss_ema + 0.05 * tot
        bar.set_postfix(loss=f"{loss_ema:.3f}", block=f"{bl:.3f}", ar=f"{arl:.3f}", tau=_tau_text(history[-1]["offline_tau"]))
        bar.update(1)
        done = step + 1
        if done % cfg.eval_every == 0 or done == end:  # end: the last step of this run or of the schedule
            if reload is not None:
                fresh = guard.run("reload", lambda: [e for e in reload() if not is_holdout(e["id"], cfg.holdout_pct)], default=[])
                if len(fresh) > len(train_ex):
                    train_ex = fresh
            # held-out τ is a summary of the weights: a failure leaves None here, the checkpoint below is still written
            history.append({"step": done, "offline_tau": guard.run(f"evaluate (step {done})", evaluate), "loss": loss_ema,
                            "tokens_seen": tokens_seen, "elapsed_s": time.time() - t0,
                            "cpu_s": round(cpu_base + time.process_time() - cpu0, 1), "train_examples": len(train_ex)})
            if log:
                guard.run("log", log, history[-1])
        if done % cfg.ckpt_every == 0 or done == cfg.steps or done == end:
            save_checkpoint(out, drafter, opt, done, cfg, history, {"head_rows": head_rows})
    bar.close()
    failed = {"failed_steps": guard.failed[n_failed:]} if len(guard.failed) > n_failed else {}
    if end < cfg.steps:  # stopped early on purpose: the checkpoint is the result so far
        return {"offline_tau": history[-1]["offline_tau"], "history": history, "out": str(out / "ckpt"), "stopped_at": end, **failed}
    drafter.eval()
    final_tau = history[-1]["offline_tau"]

    def provenance() -> dict:
        info = {
            "data_examples": len(train_ex), "data_tokens": sum(len(e["response_ids"]) for e in train_ex),
            "steps": cfg.steps, "tokens_seen": tokens_seen, "offline_tau": None if final_tau is None else round(final_tau, 4),
            "offline_tau_block": cfg.block_size, "train_config": asdict(cfg),
        }
        if init is not None:  # keep the history: what it was fine-tuned from, and how
            info = {**info, "fine_tune_note": init_note, "fine_tuned_from": init.cfg.training or "untrained"}
        return info

    info = guard.run("provenance", provenance, default={"steps": cfg.steps, "offline_tau": None, "train_config": asdict(cfg)})
    trained = replace(drafter.cfg, training=info)
    drafter.cfg = trained
    drafter.save(out / "final")
    failed = {"failed_steps": guard.failed[n_failed:]} if len(guard.failed) > n_failed else {}
    return {"offline_tau": final_tau, "history": history, "out": str(out / "final"), **failed}


def _tau_text(t) -> str:
    return "—" if t is None else f"{t:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m d3d_core.training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS))
    ap.add_argument("--data", default=None, help="distill directory (default $D3D_CACHE/distill/<bundle>)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="where the target, the drafter and training run (default: cuda when there is one, else cpu)")
    ap.add_argument("--init", default=None,
                    help="fine-tune this saved drafter (directory, or a training run) instead of starting from target layers")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="run at most this many steps now (checkpointed; rerun to continue on the same schedule)")
    for f, default in asdict(TrainConfig()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(default), default=None)
    args = ap.parse_args(argv)

    cfg = PRESETS[args.preset] if args.preset else TrainConfig()
    try:  # TrainConfig checks amp / pack
        cfg = replace(cfg, **{f: getattr(args, f) for f in asdict(cfg) if getattr(args, f) is not None})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = get_bundle(args.bundle, args.device or default_device())
    data = Path(args.data) if args.data else distill_dir(args.bundle)
    examples = read_examples(data)
    if not examples:
        print("error: no self-distillation data; run python -m d3d_core.training.distill first", file=sys.stderr)
        return 2
    init = None
    if args.init:

        try:
            init, _ = load_any_drafter(args.init, bundle)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: cannot load --init {args.init}: {e}", file=sys.stderr)
            return 2
        if not args.preset and args.kind is None:
            cfg = replace(cfg, kind=init.cfg.kind)
        cfg = replace(cfg, layers=init.cfg.num_layers, block_size=args.block_size or init.cfg.block_size)
    guard = Steps(raw=Path(args.out) / "ckpt")  # raw results: the checkpoint, written before any summary runs
    try:
        res = train(bundle, examples, cfg, Path(args.out), log=lambda h: print(json.dumps(h), file=sys.stderr),
                    reload=lambda: read_examples(data), stop_after=args.stop_after, init=init,
                    init_note=f"fine-tuned from {args.init}" if init is not None else "", guard=guard)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with guard.step("report"):
        print(json.dumps(guard.record({"offline_tau": res["offline_tau"], "out": res["out"],
                                       **({"stopped_at": res["stopped_at"]} if "stopped_at" in res else {})})))
    return guard.exit_code()


if __name__ == "__main__":
    sys.exit(main())
