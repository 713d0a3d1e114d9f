"""Peers: what a user would run instead, on the same target, prompts and machine.

- ``hf-generate``: Hugging Face ``generate``, plain greedy (the eager HF forward and cache);
- ``hf-prompt-lookup``: its built-in speculative variant that needs no extra model
  (``prompt_lookup_num_tokens``: drafts are n-gram copies from the prompt).

Their rows have the bench's shape. Decode time excludes prefill the way our modes do: the time
of ``generate(max_new_tokens=1)`` (prefill + first token) is subtracted from the full call.
``lossless`` says whether their tokens equal our ``ar`` tokens (the fast engine's greedy
tokens); a difference means the two forwards' rounding differs on a near-tie, and the bench
reports how often that happens. τ is not observable through ``generate``, so it is left empty.
"""

from __future__ import annotations

import time

import torch

PEERS = ("hf-generate", "hf-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10  # n-gram draft length (the value HF's docs use)


@torch.inference_mode()
def _generate(bundle, ids: list, name: str, max_new_tokens: int, stop_at_eos: bool) -> tuple:
    model = bundle.target.model
    x = torch.tensor([ids], dtype=torch.long, device=bundle.target.device)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(x),
              pad_token_id=0, eos_token_id=sorted(bundle.tokenizer.eos_ids) if stop_at_eos else None)
    if not stop_at_eos:
        kw["min_new_tokens"] = max_new_tokens
    if name == "hf-prompt-lookup":
        kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    t = time.perf_counter()
    out = model.generate(x, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def run_peer(bundle, name: str, ids: list, cfg, item, ref_ids) -> dict:
    """One bench row for peer ``name`` on prompt ``ids`` (temperature 0 only)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    if cfg.temperature > 0:
        raise ValueError("peers run greedy only (temperature 0)")
    _, t_first = _generate(bundle, ids, name, 1, cfg.stop_at_eos)
    out, t_all = _generate(bundle, ids, name, cfg.max_new_tokens, cfg.stop_at_eos)
    decode_s = max(t_all - t_first, 1e-9)
    return {
        "dataset": item.dataset, "id": item.id, "mode": name, "n_tokens": len(out), "rounds": 0, "tau": None,
        "decode_time_s": decode_s, "prefill_time_s": t_first, "tokens_per_s": (len(out) - 1) / decode_s if len(out) > 1 else 0.0,
        "target_forwards": None, "hit_rate": None, "overlap": None,
        "lossless": None if ref_ids is None else out == ref_ids, "accepted_hist": {}, "span_ms": {},
    }
