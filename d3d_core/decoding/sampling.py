"""Token choice and the verify rules (which drafts the target accepts).

Both rules are lossless: at temperature 0 the committed tokens are the target's
greedy tokens; at temperature > 0 they are distributed exactly as the target's samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: int  # a
    bonus: int  # the target's token after the accepted prefix
    target_ids: list  # y_1..y_B (the target's own choice at each block position)


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n, V) logits -> (n, V) float32 probabilities (temperature 0 -> softmax at T=1, for display)."""
    t = temperature if temperature > 0 else 1.0
    return torch.softmax(logits.float() / t, dim=-1)


def choose(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """(n, V) -> (n,) tokens: argmax at temperature 0, else one sample per row."""
    if temperature <= 0:
        return logits.argmax(-1)
    p = probs(logits, temperature)
    return torch.multinomial(p.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


def accept_match(drafts: list, target_logits: torch.Tensor, temperature: float, gen: torch.Generator) -> Verdict:
    """Match rule: sample the target's token at every block position, accept drafts while
    they equal those samples. Each committed token is a target sample given its prefix."""
    y = choose(target_logits, temperature, gen).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == y[a]:
        a += 1
    return Verdict(a, y[a], y)


def accept(drafts: list, q, target_logits: torch.Tensor, temperature: float, rule: str, gen: torch.Generator) -> Verdict:
    """The verify rule of a run: greedy at temperature 0 (``accept_match`` with argmax), else the
    chosen rule ("match" or "rejection"; a block without drafts has nothing to reject)."""
    if temperature > 0 and rule == "rejection" and drafts:
        return accept_rejection(drafts, q, target_logits, temperature, gen)
    return accept_match(drafts, target_logits, temperature, gen)


def accept_rejection(drafts: list, q: torch.Tensor, target_logits: torch.Tensor, temperature: float, gen: torch.Generator) -> Verdict:
    """Standard speculative sampling (Leviathan et al. / Chen et al.): accept d_j with
    probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection the bonus is drawn
    from norm(max(p_j - q_j, 0)); if all are accepted the bonus is drawn from p_B.
    q: (>= B-1, V) the drafter distributions the drafts were sampled from."""
    p = probs(target_logits, temperature).cpu()
    q = q.float().cpu()
    y = p.argmax(-1).tolist()  # reported target choice per position (for display)
    for j, d in enumerate(drafts):
        pj, qj = p[j, d].item(), q[j, d].item()
        r = torch.rand((), generator=gen).item()
        if qj > 0 and r < min(1.0, pj / qj):
            continue
        resid = torch.clamp(p[j] - q[j], min=0)
        s = resid.sum()
        resid = resid / s if s > 0 else p[j]
        bonus = int(torch.multinomial(resid, 1, generator=gen).item())
        return Verdict(j, bonus, y)
    bonus = int(torch.multinomial(p[len(drafts)], 1, generator=gen).item())
    return Verdict(len(drafts), bonus, y)
