"""Warm every forward shape a race will use, per mode, before the race is timed.

On a CPU the fast engine's GEMMs run through oneDNN, which builds a kernel (a "primitive") the first time it meets
an input shape, and keys it by row count *and* by the number of threads of the call (``fastops.row_bucket``). A
mode's first round of a new width therefore pays a one-time cost the other modes may not pay: ``ar`` only ever
verifies one row, a drafting mode verifies 1..B rows, d3d-async verifies on one thread (the drafter has the other
core) while d3d-seq verifies on two, and the drafter's row counts depend on B, on H and on how many committed
tokens it catches up on. ``warm_shapes`` runs each such shape once, through the same functions and at the same
thread counts as the decode loop (``engine.mode_threads``; d3d-async's packed pass on a drafter-lane worker
thread), so no mode of the race pays a first use and none pays another's.

What each mode meets (B = block size, H = hypotheses, N = max new tokens):

- every mode: target verify of 1 row (ar's step; a drafting round the draft gate skipped);
- dflash, d3d-seq: verify of 1..B rows at all threads; dflash also the fusion of 1..N+B committed positions'
  target features into the drafter's context, and the block pass over B rows;
- d3d-seq: a draft = the committed tokens it has not seen (0..N+B) + the block of B+1 slots;
- d3d-async: verify of 1..B rows at one thread; a packed pass of k provisional tokens (1..B) + h hypothesis
  blocks (1..H) of B+1 slots on the drafter lane; a synchronous draft (as d3d-seq's) and a skipped round's verify
  of 1 row on every core.

Row counts beyond 32 run at ``fastops.row_bucket``'s bounded sizes, so one row count per bucket is enough there. On
a GPU (no per-shape kernels to build; a ZeroGPU window is short) the catch-up sweeps stop at B tokens.
The target's prefill (the prompt's length) is not warmed: it is not part of any speedup.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..models import fastops
from .config import DecodeConfig
from .engine import STRATEGIES, d3d_draft, d3d_packed, d3d_prefill, dflash_draft, mode_threads
from .timing import Lanes, cpu_threads

_PROMPT = 16  # tokens of the warm-up's own context (target and drafter)


def row_counts(lo: int, hi: int) -> list:
    """One row count per distinct GEMM size in lo..hi (exact up to 32, then one per ``row_bucket``)."""
    seen, out = set(), []
    for m in range(max(1, lo), hi + 1):
        b = fastops.row_bucket(m)
        if b not in seen:
            seen.add(b)
            out.append(m)
    return out


def warm_rows(cfg: DecodeConfig) -> int:
    """The largest GEMM size (``row_bucket``) a decode of ``cfg`` warms: a draft catching up on every token at once
    (max new tokens + B) plus its block (B + 1). Two configurations with the same value warm the same shapes."""
    return fastops.row_bucket(cfg.max_new_tokens + 2 * cfg.block_size + 1)


def _ids(n: int, vocab: int, start: int = 3) -> list:
    return [start + (i % max(1, vocab - start)) for i in range(n)]


def _verify_widths(target, widths, feature_layers: tuple, vocab: int) -> None:
    cache = target.new_cache()
    target.prefill(cache, torch.tensor(_ids(_PROMPT, vocab), dtype=torch.long), feature_layers)
    for k in widths:
        target.verify(cache, torch.tensor(_ids(k, vocab, 7), dtype=torch.long), feature_layers)
        target.rollback(cache, k)


def _back_to(cache, n: int, fresh):
    """The cache cut back to its first n positions (a fresh one where the cache type cannot crop)."""
    if hasattr(cache, "crop"):
        cache.crop(n)
        return cache
    return fresh()


def _d3d_fresh(drafter, vocab: int):
    cache = drafter.new_cache()
    d3d_prefill(drafter, cache, _ids(_PROMPT, vocab))
    return cache


def _dflash_fresh(drafter, feats):
    cache = drafter.new_cache()
    drafter.extend_context(cache, feats)
    return cache


@torch.inference_mode()
def _d3d_drafts(drafter, cfg: DecodeConfig, ctx_lengths, vocab: int) -> None:
    """A draft after each number of not-yet-seen committed tokens (what d3d-seq and d3d-async's sync draft run)."""
    gen = torch.Generator().manual_seed(0)
    cache = _d3d_fresh(drafter, vocab)
    base = len(cache)
    for c in ctx_lengths:
        d3d_draft(drafter, cache, _ids(c, vocab, 11), 5, cfg, gen)
        cache = _back_to(cache, base, lambda: _d3d_fresh(drafter, vocab))


@torch.inference_mode()
def _d3d_packed(drafter, cfg: DecodeConfig, lanes: Lanes, vocab: int) -> None:
    """Every packed pass d3d-async may run at (B, H): k = 1..B provisional tokens, 1..H hypotheses, on the
    drafter lane (its own worker thread, as in the decode)."""
    B, H = cfg.block_size, cfg.hypotheses
    gen = torch.Generator().manual_seed(0)
    cache = _d3d_fresh(drafter, vocab)
    full = d3d_draft(drafter, cache, [], 5, cfg, gen)  # a real block, with its distributions, to form hypotheses
    seen = set()
    for k in range(1, B + 1):
        draft = full.truncated(k - 1)
        for h in range(1, H + 1):
            key = (fastops.row_bucket(k + h * (B + 1)), h)
            if key in seen:
                continue
            seen.add(key)
            lanes.submit(d3d_packed, drafter, cache, 5, draft, cfg.with_(hypotheses=h), gen).result()


@torch.inference_mode()
def _dflash(drafter, target, cfg: DecodeConfig, n_max: int, vocab: int) -> None:
    """Fusing 1..n_max committed positions' target features, then the block pass (what dflash's draft runs)."""
    gen = torch.Generator().manual_seed(0)
    layers = tuple(drafter.cfg.target_layer_ids)
    t_cache = target.new_cache()
    out = target.prefill(t_cache, torch.tensor(_ids(_PROMPT, vocab), dtype=torch.long), layers)
    d_cache = _dflash_fresh(drafter, out.feats)
    base = len(d_cache)
    feats = out.feats
    for n in row_counts(1, n_max):
        f = feats[:, :1].expand(1, n, feats.shape[-1]).contiguous()
        dflash_draft(drafter, d_cache, f, 5, cfg, gen)
        d_cache = _back_to(d_cache, base, lambda: _dflash_fresh(drafter, out.feats))


def warm_shapes(bundle, cfg: DecodeConfig, drafter=None) -> float:
    """Run once every forward shape a decode of ``cfg`` (its mode, B, H, max new tokens, threads) can meet, at the
    thread counts that mode uses; ``drafter`` overrides the bundle's (a pruned or another D3D drafter). Returns the
    seconds it took. Nothing is timed or kept; caches built here are dropped."""
    t0 = time.perf_counter()
    cfg = cfg.validated()
    mode = cfg.mode
    strategy = STRATEGIES[mode]
    if drafter is None and strategy.drafter_kind:
        drafter = bundle.drafter(strategy.drafter_kind)
    target = bundle.target
    device = target.device
    vocab = target.arch.vocab_size
    threads, solo = mode_threads(cfg, device)
    on_cpu = torch.device(device).type == "cpu"
    at = (lambda n: cpu_threads(n)) if on_cpu else (lambda n: contextlib.nullcontext())
    B, N = cfg.block_size, cfg.max_new_tokens
    feature_layers = tuple(drafter.cfg.target_layer_ids) if mode == "dflash" else ()
    with torch.inference_mode():
        with at(threads):
            _verify_widths(target, [1] if mode == "ar" else range(1, B + 1), feature_layers, vocab)
        if mode == "ar":
            return time.perf_counter() - t0
        # rows of a draft: unseen tokens + B + 1 slots. On a GPU no kernel is built per row count (no oneDNN), and a
        # ZeroGPU window is short: there only the common catch-ups (up to B unseen tokens) run.
        ctx = [c - (B + 1) for c in row_counts(B + 1, B + 1 + (N + B if on_cpu else B))]
        if mode == "dflash":
            with at(threads):
                _dflash(drafter, target, cfg, N + B if on_cpu else B, vocab)
        elif mode == "d3d-seq":
            with at(threads):
                _d3d_drafts(drafter, cfg, ctx, vocab)
        elif mode == "d3d-async":
            with at(solo):
                _verify_widths(target, [1], (), vocab)  # a round the draft gate skipped: the drafter lane is idle
                _d3d_drafts(drafter, cfg, ctx, vocab)  # a miss's synchronous draft, on every core
            lanes = Lanes(device, True)
            try:
                with at(threads):  # the lanes split the cores: the drafter lane's thread reads this setting
                    _d3d_packed(drafter, cfg, lanes, vocab)
            finally:
                lanes.close()
    return time.perf_counter() - t0


__all__ = ["warm_shapes", "warm_rows", "row_counts"]
