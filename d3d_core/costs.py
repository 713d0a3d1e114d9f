"""Cost probe: what one forward of each kind costs on this machine.

T_step (one AR step), T_verify(B), the drafters' T_draft(B) and the packed pass T_packed(H),
each the median of several runs at a fixed context length, measured with the same thread
settings the modes use (all cores for sequential work, one per lane for d3d-async).

d3d-async runs its verify and its packed pass *at the same time*, on two lanes that share the
machine's memory bandwidth and caches, so each costs more than when it runs alone. The probe
therefore also times the pair together (``concurrent_ms``: verify(B) ‖ packed(H), one thread
each), and the latency model's async round uses those contended costs.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .config import DecodeConfig
from .engine import Draft, d3d_draft, d3d_packed, d3d_prefill, dflash_draft
from .timing import cpu_threads


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


@torch.inference_mode()
def probe_costs(bundle, block_sizes=(1, 2, 4, 8, 16), hypotheses=(1, 2, 4, 8), ctx_len: int = 300, repeats: int = 7, B_packed: int = 8) -> dict:
    target = bundle.target
    V = target.arch.vocab_size
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, V - 1, (ctx_len,), generator=g)
    cache = target.new_cache()
    target.prefill(cache, ctx)
    all_threads = torch.get_num_threads()
    res = {"ctx_len": ctx_len, "repeats": repeats, "threads": all_threads, "verify_ms": {}, "verify_1thread_ms": {}}

    def verify(B):
        blk = torch.randint(100, V - 1, (B,), generator=g)
        target.verify(cache, blk)
        target.rollback(cache, B)

    for B in block_sizes:
        res["verify_ms"][B] = _median_ms(lambda: verify(B), repeats)
    with cpu_threads(1):
        for B in block_sizes:
            res["verify_1thread_ms"][B] = _median_ms(lambda: verify(B), repeats)
    res["step_ms"] = res["verify_ms"].get(1)

    d3d = bundle.drafter("d3d")
    dfl = bundle.drafter("dflash")
    dcache = d3d.new_cache()
    d3d_prefill(d3d, dcache, ctx.tolist())
    fcache = dfl.new_cache()
    feats = torch.randn(1, ctx_len, len(dfl.cfg.target_layer_ids) * target.arch.hidden_size, generator=g).to(device=dfl.device, dtype=dfl.dtype)
    dfl.extend_context(fcache, feats)
    res["d3d_draft_ms"], res["dflash_draft_ms"], res["packed_ms"] = {}, {}, {}
    for B in [b for b in block_sizes if b >= 2]:
        cfg = DecodeConfig(block_size=B)
        res["d3d_draft_ms"][B] = _median_ms(lambda: d3d_draft(d3d, dcache, [], 5, cfg, g), repeats)
        res["dflash_draft_ms"][B] = _median_ms(lambda: dflash_draft(dfl, fcache, None, 5, cfg, g), repeats)
    draft = d3d_draft(d3d, dcache, [], 5, DecodeConfig(block_size=B_packed), g)
    with cpu_threads(1):
        res["d3d_draft_1thread_ms"] = _median_ms(lambda: d3d_draft(d3d, dcache, [], 5, DecodeConfig(block_size=B_packed), g), repeats)
        for H in hypotheses:
            cfg = DecodeConfig(block_size=B_packed, hypotheses=H)
            res["packed_ms"][H] = _median_ms(lambda: d3d_packed(d3d, dcache, 5, draft, cfg, g), repeats)
        g_lane = torch.Generator().manual_seed(1)  # the lane never shares a generator with the main thread
        res["concurrent_ms"] = {H: _concurrent_ms(lambda: verify(B_packed),
                                                  lambda H=H: d3d_packed(d3d, dcache, 5, draft, DecodeConfig(block_size=B_packed, hypotheses=H), g_lane),
                                                  repeats) for H in hypotheses}
    res["packed_block_size"] = B_packed
    return res


def _concurrent_ms(main_fn, lane_fn, repeats: int) -> dict:
    """Run main_fn on this thread while lane_fn runs on a worker (as d3d-async does); medians
    of each one's own duration and of the pair's wall time."""
    pool = ThreadPoolExecutor(max_workers=1)

    def timed(fn):
        t = time.perf_counter()
        with torch.inference_mode():
            fn()
        return (time.perf_counter() - t) * 1e3

    try:
        main_t, lane_t, wall_t = [], [], []
        for i in range(repeats + 1):
            t = time.perf_counter()
            fut = pool.submit(timed, lane_fn)
            m = timed(main_fn)
            ln = fut.result()
            if i:  # the first pair warms up
                main_t.append(m)
                lane_t.append(ln)
                wall_t.append((time.perf_counter() - t) * 1e3)
    finally:
        pool.shutdown(wait=True)
    return {"verify": statistics.median(main_t), "packed": statistics.median(lane_t), "round": statistics.median(wall_t)}


def costs_text(c: dict) -> str:
    lines = [f"cost probe (context {c['ctx_len']} tokens, median of {c['repeats']}, ms)"]
    lines.append("B            " + "  ".join(f"{b:>7}" for b in c["verify_ms"]))
    lines.append(f"verify ({c['threads']}t)   " + "  ".join(f"{v:7.1f}" for v in c["verify_ms"].values()))
    lines.append("verify (1t)   " + "  ".join(f"{v:7.1f}" for v in c["verify_1thread_ms"].values()))
    lines.append("d3d draft    " + "  ".join(f"{c['d3d_draft_ms'].get(b, float('nan')):7.1f}" for b in c["verify_ms"]))
    lines.append("dflash draft " + "  ".join(f"{c['dflash_draft_ms'].get(b, float('nan')):7.1f}" for b in c["verify_ms"]))
    lines.append(f"d3d packed pass, B={c['packed_block_size']}, 1 thread: " + ", ".join(f"H={h}: {v:.1f}" for h, v in c["packed_ms"].items()))
    lines.append(f"d3d sync draft, B={c['packed_block_size']}, 1 thread: {c['d3d_draft_1thread_ms']:.1f}")
    if c.get("concurrent_ms"):
        lines.append(f"verify(B={c['packed_block_size']}) ‖ packed pass, 1 thread each, at the same time: " + ", ".join(
            f"H={h}: {v['verify']:.1f} ‖ {v['packed']:.1f} (round {v['round']:.1f})" for h, v in c["concurrent_ms"].items()))
    return "\n".join(lines)
