"""Token choice, the verify rules (which drafts the target accepts), and the decode loop's one way back to the host.

Both rules are lossless: at temperature 0 the committed tokens are the target's
greedy tokens; at temperature > 0 they are distributed exactly as the target's samples.

Device traffic: everything of vocabulary size (softmax, argmax, sampling, the rejection test) runs on the logits'
own device, and the few numbers the loop needs on the host (token ids, the accepted count, the drafts'
probabilities) come back through ``to_host`` — once per verify and once per drafter forward (engine.py). On a GPU
that is the one point per lane and round where the host waits; on the CPU it is ``.tolist()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.layers import to_device


@dataclass
class Verdict:
    accepted: int  # a
    bonus: int  # the target's token after the accepted prefix
    target_ids: list  # y_1..y_B (the target's own choice at each block position)


def to_host(*tensors: torch.Tensor) -> list:
    """Small tensors -> Python lists (a 0-d tensor -> a number), one per tensor, with at most one wait: the decode
    loop's only read of device values. On CUDA each is copied without blocking into pinned memory on the current
    stream (the lane's own), then the host waits once, on an event recorded after the copies: for this lane's work
    so far, never for the other lane's (``torch.cuda.synchronize`` would). On the CPU: ``.tolist()``, no copy."""
    if not any(t.is_cuda for t in tensors):
        return [t.tolist() for t in tensors]
    host = []
    for t in tensors:
        if t.is_cuda:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            t = h
        host.append(t)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return [h.tolist() for h in host]


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n, V) logits -> (n, V) float32 probabilities (temperature 0 -> softmax at T=1, for display)."""
    t = temperature if temperature > 0 else 1.0
    return torch.softmax(logits.float() / t, dim=-1)


def _drawn_on(gen, device) -> torch.device:
    """Where the generator draws (the tensors' own device without one)."""
    return gen.device if gen is not None else torch.device(device)


def uniform(n: int, gen, device) -> torch.Tensor:
    """(n,) U[0, 1) on ``device`` from ``gen`` (the same numbers as n draws of one; a host generator's go over without a wait)."""
    return to_device(torch.rand(n, generator=gen, device=_drawn_on(gen, device)), device)


def sample(p: torch.Tensor, gen) -> torch.Tensor:
    """(..., V) non-negative weights -> (...,) one token per row, drawn exactly as ``torch.multinomial(p, 1)`` draws
    it for one sample (argmax of p / E, E ~ Exp(1): the same numbers from the same generator), without multinomial's
    checks of p, which read the device twice per call."""
    e = torch.empty(p.shape, dtype=p.dtype, device=_drawn_on(gen, p.device)).exponential_(1, generator=gen)
    return (p / to_device(e, p.device)).argmax(-1)


def choose(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """(n, V) -> (n,) tokens on the logits' device: argmax at temperature 0, else one sample per row."""
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(probs(logits, temperature), gen)


def accept_match(drafts: list, target_logits: torch.Tensor, temperature: float, gen: torch.Generator) -> Verdict:
    """Match rule: sample the target's token at every block position, accept drafts while
    they equal those samples. Each committed token is a target sample given its prefix.
    One read: the B chosen tokens."""
    (y,) = to_host(choose(target_logits, temperature, gen))
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
    q: (>= B-1, V) the drafter distributions the drafts were sampled from.

    One pass on the logits' device and one read (accepted count, bonus, the target's argmax per position): the B-1
    uniforms are drawn together (the same numbers as B-1 draws one by one), the accepted prefix is the run of passed
    tests, and the bonus is one sample from the row it ends on. The uniforms past the first rejection are drawn too,
    unused: after an early rejection the generator's stream moves on differently from a loop that stops there, the
    distribution does not (every uniform is independent of the rest); with all drafts accepted it is the same stream."""
    p = probs(target_logits, temperature)  # (B, V) on the target's device
    n, dev = len(drafts), p.device
    q = q[:n].float().to(dev)
    d = to_device(torch.tensor(drafts, dtype=torch.long), dev)[:, None]
    pd, qd = p[:n].gather(1, d).squeeze(1), q.gather(1, d).squeeze(1)
    passed = (qd > 0) & (uniform(n, gen, dev) < torch.clamp(pd / qd, max=1.0))
    a = passed.long().cumprod(0).sum().view(1)  # the leading passes: how many drafts are accepted
    pa = p.index_select(0, a)  # (1, V)
    rejected = (a < n).to(p.dtype)[:, None]  # 0 when every draft was accepted: nothing to subtract from p_B
    qa = q.index_select(0, a.clamp(max=n - 1)) * rejected if n else torch.zeros_like(pa)
    resid = torch.clamp(pa - qa, min=0)
    s = resid.sum(-1, keepdim=True)
    resid = torch.where((s > 0) & (a < n), resid / s, pa)  # norm(max(p_j - q_j, 0)); p_j itself when that is empty; p_B
    accepted, bonus, y = to_host(a, sample(resid, gen), p.argmax(-1))
    return Verdict(accepted[0], bonus[0], y)
