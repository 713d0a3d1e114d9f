"""Training losses for the drafters: block targets and weights, and a cheaper LM head.

A drafter's loss has two parts, both read through the target's frozen LM head:

* the **block loss**: draft position k of the block anchored at p predicts ids[p + k], weighted
  w_k = exp(-(k-1)/γ) (the first positions decide most of τ); positions past the sequence's end
  are ignored;
* D3D's **context loss**: the context stream's next-token prediction (auxiliary AR supervision).

Both can use hard labels (the target's greedy token) and soft labels (the target's top-k next-token
distribution at the same position, see ``softlabels``).

:class:`HeadLoss` computes the cross-entropies through a vocabulary *shortlist* plus one "other"
bucket instead of all V rows of the head. The other bucket's log-partition is estimated from a
uniform sample of the remaining rows (scaled by how many rows each sample stands for), so a
step multiplies |shortlist| + samples rows instead of V (49 152 on SmolLM2). Every token that is
a label in the batch joins the exact rows, so its own logit is never estimated. With the whole
vocabulary as the shortlist nothing is left to sample and the loss is the full cross-entropy
exactly (tested). Inference is unaffected: this only changes what training multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def block_weights(n: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/γ) for k = 1..n."""
    return torch.exp(-torch.arange(n, dtype=torch.float32) / gamma)


def block_targets(ids: list, anchors: list, n: int) -> torch.Tensor:
    """(nb, n) labels: row b, column k-1 is ids[p_b + k]; -100 past the end of the sequence."""
    T = len(ids)
    tgt = torch.full((len(anchors), n), -100, dtype=torch.long)
    for b, p in enumerate(anchors):
        m = min(n, T - 1 - p)
        if m > 0:
            tgt[b, :m] = torch.tensor(ids[p + 1 : p + 1 + m])
    return tgt


def block_position_weights(tgt: torch.Tensor, gamma: float) -> torch.Tensor:
    """(nb, n) weights w_k, zero where the label is ignored."""
    return block_weights(tgt.shape[1], gamma)[None] * (tgt != -100).float()


@dataclass(frozen=True)
class SoftTargets:
    """Soft labels for N rows: the target's top-k token ids and their probabilities (renormalised
    over the k kept), plus which rows have one at all."""

    ids: torch.Tensor  # (N, k) long
    probs: torch.Tensor  # (N, k) float, rows sum to 1 where valid
    valid: torch.Tensor  # (N,) bool


class HeadLoss:
    """Per-row cross-entropies through the frozen LM head: full, or shortlist + sampled "other".

    ``shortlist``: token ids (None = the whole vocabulary, i.e. the exact full head).
    ``other_samples``: rows sampled uniformly from outside the exact set to estimate the other
    bucket's log-partition log Σ_{j∉S} exp(z_j) ≈ log((|O| / m) Σ_{sampled} exp(z_j))."""

    def __init__(self, vocab_size: int, shortlist=None, other_samples: int = 512):
        self.V = vocab_size
        self.other_samples = other_samples
        self.shortlist = None if shortlist is None else torch.as_tensor(sorted(set(int(i) for i in shortlist)), dtype=torch.long)
        if self.shortlist is not None and len(self.shortlist) and not (0 <= int(self.shortlist[0]) and int(self.shortlist[-1]) < vocab_size):
            raise ValueError(f"shortlist ids must lie in 0..{vocab_size - 1}")

    @property
    def full(self) -> bool:
        return self.shortlist is None

    def rows_for(self, labels: torch.Tensor, soft: Optional[SoftTargets]) -> torch.Tensor:
        """The exact rows of this batch: shortlist ∪ hard labels ∪ soft-label ids (sorted, unique)."""
        if self.full:
            return torch.arange(self.V)
        extra = [labels[labels >= 0].reshape(-1)]
        if soft is not None:
            extra.append(soft.ids[soft.valid].reshape(-1))
        return torch.unique(torch.cat([self.shortlist, *extra]))

    def __call__(self, drafter, h: torch.Tensor, labels: torch.Tensor, soft: Optional[SoftTargets] = None,
                 generator: Optional[torch.Generator] = None) -> tuple:
        """h (N, H) final hidden states (before the drafter's norm); labels (N,) with -100 = none.
        Returns (hard (N,), soft (N,) or None): -log q(label) and -Σ_k p_k log q(id_k) per row,
        zero where there is no label."""
        x = drafter.norm(h)  # (N, H)
        W = drafter.shared.lm_head.weight  # (V, H), frozen
        rows = self.rows_for(labels, soft).to(W.device)
        z = x @ _like(W if self.full else W[rows], x).T  # (N, R) exact logits
        lse = torch.logsumexp(z.float(), dim=-1)  # (N,)
        n_other = self.V - len(rows)
        if n_other > 0 and self.other_samples > 0:
            mask = torch.ones(self.V, dtype=torch.bool)
            mask[rows.cpu()] = False
            others = mask.nonzero().squeeze(1)
            m = min(self.other_samples, n_other)
            pick = others[torch.randperm(n_other, generator=generator)[:m]].to(W.device)
            zo = (x @ _like(W[pick], x).T).float()  # (N, m)
            lse_other = torch.logsumexp(zo, dim=-1) + torch.log(torch.tensor(n_other / m))
            lse = torch.logaddexp(lse, lse_other)
        col = torch.full((self.V,), -1, dtype=torch.long)
        col[rows.cpu()] = torch.arange(len(rows))
        zf = z.float()
        ok = labels >= 0
        idx = col[labels.clamp(min=0)].clamp(min=0).to(z.device)  # ignored rows read column 0, then drop
        hard = torch.where(ok.to(z.device), lse - zf.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(lse))
        soft_ce = None
        if soft is not None:
            sidx = col[soft.ids].clamp(min=0).to(z.device)  # (N, k): every valid row's soft ids are exact rows
            logq = zf.gather(1, sidx) - lse[:, None]
            soft_ce = torch.where(soft.valid.to(z.device), -(soft.probs.to(z.device) * logq).sum(-1), torch.zeros_like(lse))
        return hard, soft_ce


def _like(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w`` in ``x``'s dtype for ``x @ w.T`` — unless autocast is on, which casts both itself: a bf16 head is then used
    as stored instead of being copied to fp32 on every call (a 2.5 GB copy for Qwen3-8B's head)."""
    return w if torch.is_autocast_enabled(x.device.type) else w.to(x.dtype)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values.float().cpu() * weights).sum() / weights.sum().clamp(min=1e-6)
