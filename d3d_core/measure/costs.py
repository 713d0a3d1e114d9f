"""Cost probe: what one forward of each kind costs on this machine.

T_step (one AR step), T_verify(B), the drafters' T_draft(B) and the packed pass T_packed(H),
each the median of several runs at a fixed context length, measured with the same thread
settings the modes use (all cores for sequential work, one per lane for d3d-async).

d3d-async runs its verify and its packed pass *at the same time*, on two lanes that share the
machine's memory bandwidth and caches, so each costs more than when it runs alone. The probe
therefore also times the pair together (``concurrent_ms``: verify(B) ‖ packed(H), one thread
each), and the latency model's async round uses those contended costs. On CUDA the pair runs on two
streams timed by CUDA events, beside two controls (one issuing thread; one stream): ``_concurrent_ms_cuda``.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from ..decoding.config import DecodeConfig
from ..decoding.engine import d3d_draft, d3d_packed, d3d_prefill, dflash_draft
from ..decoding.timing import cpu_threads
from ..models import fastops
from ..models.bundles import BUNDLES, get_bundle
from ..models.fastops import LM_HEAD
from ..models.loader import init_drafter
from .machine import QuietWatch, machine_info, step_reference
from .rawfirst import Steps, raw_path


def forwards_at(costs: Optional[dict], threads: Optional[int] = None) -> dict:
    """{forward: row} of a cost breakdown's rows at ``threads`` (default: the most it measured); {} without rows."""
    rows = (costs or {}).get("rows") or []
    if not rows:
        return {}
    th = threads or max(r["threads"] for r in rows)
    return {r["forward"]: r for r in rows if r["threads"] == th}


def _prefilled(target, ctx_len: int, g: torch.Generator) -> tuple:
    """A random context of ``ctx_len`` tokens (no special ids), prefilled: (ctx, verifier) where
    ``verifier(B)`` returns a function that verifies a random block of B and rolls it back."""
    V = target.arch.vocab_size
    lo = min(100, V // 4)  # skip special tokens (toy vocabularies are small)
    ctx = torch.randint(lo, V - 1, (ctx_len,), generator=g)
    cache = target.new_cache()
    target.prefill(cache, ctx)

    def verifier(B: int):
        blk = torch.randint(lo, V - 1, (B,), generator=g)

        def verify():
            target.verify(cache, blk)
            target.rollback(cache, B)
        return verify

    return ctx, verifier


def _drafters_at(bundle, ctx: torch.Tensor, g: torch.Generator) -> tuple:
    """(d3d, its cache, dflash, its cache) with the context ``ctx`` already in both caches (random
    target features stand in for the DFlash drafter's: its cost does not depend on their values)."""
    d3d, dfl = bundle.drafter("d3d"), bundle.drafter("dflash")
    dcache = d3d.new_cache()
    d3d_prefill(d3d, dcache, ctx.tolist())
    fcache = dfl.new_cache()
    feats = torch.randn(1, ctx.shape[0], len(dfl.cfg.target_layer_ids) * bundle.target.arch.hidden_size, generator=g)
    dfl.extend_context(fcache, feats.to(device=dfl.device, dtype=dfl.dtype))
    return d3d, dcache, dfl, fcache


def _interleaved_medians(fns: list, repeats: int) -> list:
    """Median ms of each function, timed round-robin (every function once per round, ``repeats`` rounds,
    after one warm-up round): a burst of contention from outside the machine then lands on every
    function alike instead of spoiling all the samples of one."""
    for fn in fns:
        fn()
    ts = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ts[i].append((time.perf_counter() - t) * 1e3)
    return [statistics.median(t) for t in ts]


def _median_ms(fn, repeats: int) -> float:
    """Median ms of ``fn`` over ``repeats`` calls after one warm-up call."""
    return _interleaved_medians([fn], repeats)[0]


@torch.inference_mode()
def probe_costs(bundle, block_sizes=(1, 2, 4, 8, 16), hypotheses=(1, 2, 4, 8), ctx_len: int = 300, repeats: int = 7, B_packed: int = 8) -> dict:
    target = bundle.target
    g = torch.Generator().manual_seed(0)
    ctx, verifier = _prefilled(target, ctx_len, g)
    all_threads = torch.get_num_threads()
    res = {"ctx_len": ctx_len, "repeats": repeats, "threads": all_threads, "verify_ms": {}, "verify_1thread_ms": {}}

    for B in block_sizes:
        res["verify_ms"][B] = _median_ms(verifier(B), repeats)
    with cpu_threads(1):
        for B in block_sizes:
            res["verify_1thread_ms"][B] = _median_ms(verifier(B), repeats)
    res["step_ms"] = res["verify_ms"].get(1)

    d3d, dcache, dfl, fcache = _drafters_at(bundle, ctx, g)
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
        res["concurrent_ms"] = {H: _concurrent_ms(verifier(B_packed),
                                                  lambda H=H: d3d_packed(d3d, dcache, 5, draft, DecodeConfig(block_size=B_packed, hypotheses=H), g_lane),
                                                  repeats, device=target.device) for H in hypotheses}
    res["packed_block_size"] = B_packed
    return res


def _concurrent_ms(main_fn, lane_fn, repeats: int, device=None) -> dict:
    """verify ‖ packed pass as d3d-async runs them: medians of each one's own duration and of the pair's round time.

    On CUDA (``device`` a CUDA device): :func:`_concurrent_ms_cuda` — each lane on its own stream, timed by CUDA events,
    with its two controls. Elsewhere (the CPU path, labelled ``clock``): main_fn on this thread while lane_fn runs on a
    worker thread, each timed by the host's ``perf_counter`` (on a CPU the work is done when the call returns)."""
    if device is not None and torch.device(device).type == "cuda":
        return _concurrent_ms_cuda(main_fn, lane_fn, repeats, torch.device(device))
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
    return {"verify": statistics.median(main_t), "packed": statistics.median(lane_t), "round": statistics.median(wall_t),
            "clock": "cpu: perf_counter, two host threads"}


CUDA_ARMS = ("two_streams", "one_thread", "one_stream")


def _concurrent_ms_cuda(main_fn, lane_fn, repeats: int, device) -> dict:
    """The CUDA concurrency probe. Three arms, interleaved (each once per repeat, after one warm-up round each):

    - ``two_streams`` (what d3d-async does): main_fn issued by this thread on the target's stream, lane_fn issued by a
      worker thread on the drafter's own stream;
    - ``one_thread`` (control): the same two streams, both issued by this thread one after the other (what the second
      issuing thread buys);
    - ``one_stream`` (control): both on one stream, back to back (no overlap possible: the sequential cost).

    Every arm starts after a device synchronise and ends with one, so ``round`` (host wall ms, launch overhead
    included) times the work, not its launch. Each lane's own time and the overlap come from CUDA events recorded on
    its stream around its work (``overlap``: ms during which both lanes' event intervals were open). Streams and
    events are created here, inside the call (never at import)."""
    s_main, s_lane = torch.cuda.Stream(device), torch.cuda.Stream(device)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3d-probe-lane")

    def on(stream, fn):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), torch.inference_mode():
            a.record(stream)
            fn()
            b.record(stream)
        return a, b

    def arm(kind: str) -> dict:
        torch.cuda.synchronize(device)
        base = torch.cuda.Event(enable_timing=True)
        base.record(torch.cuda.current_stream(device))
        s_main.wait_event(base)
        s_lane.wait_event(base)
        t = time.perf_counter()
        if kind == "two_streams":
            fut = pool.submit(on, s_lane, lane_fn)
            m = on(s_main, main_fn)
            ln = fut.result()
        elif kind == "one_thread":
            m = on(s_main, main_fn)
            ln = on(s_lane, lane_fn)
        else:
            m = on(s_main, main_fn)
            ln = on(s_main, lane_fn)
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t) * 1e3
        (m0, m1), (l0, l1) = [(base.elapsed_time(a), base.elapsed_time(b)) for a, b in (m, ln)]
        return {"verify": m1 - m0, "packed": l1 - l0, "round": wall, "events_round": max(m1, l1) - min(m0, l0),
                "overlap": max(0.0, min(m1, l1) - max(m0, l0))}

    try:
        for kind in CUDA_ARMS:  # warm-up
            arm(kind)
        samples = {k: [] for k in CUDA_ARMS}
        for _ in range(repeats):
            for kind in CUDA_ARMS:
                samples[kind].append(arm(kind))
    finally:
        pool.shutdown(wait=True)
    med = {k: {f: statistics.median(x[f] for x in xs) for f in xs[0]} for k, xs in samples.items()}
    out = dict(med["two_streams"])
    out["clock"] = "cuda: events per stream, device synchronised before and after each round"
    out["controls"] = {"one_thread": med["one_thread"], "one_stream": med["one_stream"]}
    return out


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


# ----------------------------------------------------------------------------- the cost breakdown
#
#     python -m d3d_core.measure.costs --bundle smollm2-135m --out results/costs.json
#
# For every forward the modes run (step(1), verify(B), the D3D draft, the packed pass for H
# hypotheses, the DFlash draft), at 1 and 2 threads: wall ms, the share spent in the layer
# GEMMs, attention, the LM head and everything else (a torch profile of the same forward), and
# the bound this machine puts on it (bytes read / measured bandwidth, FLOPs / measured GEMM rate).
# The measured rows reach ``<out stem>.raw.json`` before the overlap probe and any summary run
# (``rawfirst``): a failing step is named, recorded in ``failed_steps`` and the command exits 1.

GEMM_OPS = ("mkldnn::_linear_pointwise", "quantized::linear_dynamic", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear",  # int8: drafters
            "aten::_weight_int4pack_mm_for_cpu", "d3d::lowbit_gemm")  # the int4 engine's GEMMs (torch's kernel, or lowbit.py's)
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "d3d::lowbit_attention")  # an attention call, its kernel inside it
PARTS = ("layer_gemm", "attention", "lm_head", "other")


def machine_limits(threads: int, mb: int = 256) -> dict:
    """Measured read bandwidth (GB/s, a sum over ``mb`` MB) and fp32 GEMM rate (GFLOP/s, 1024³)."""
    with cpu_threads(threads), torch.inference_mode():
        x = torch.ones(mb * 2**20 // 4)
        bw_ms = _median_ms(lambda: x.sum(), 5)
        a = torch.randn(1024, 1024)
        mm_ms = _median_ms(lambda: a @ a, 5)
    return {"threads": threads, "read_gb_s": x.numel() * 4 / bw_ms / 1e6, "gemm_gflop_s": 2 * 1024**3 / mm_ms / 1e6}


def _attn_params(arch) -> int:
    h, kv = arch.hidden_size, arch.num_key_value_heads * arch.head_dim
    return h * arch.num_attention_heads * arch.head_dim * 2 + 2 * h * kv


def _mlp_params(arch) -> int:
    return 3 * arch.hidden_size * arch.intermediate_size


def _layer_params(arch) -> int:
    return _attn_params(arch) + _mlp_params(arch)


def work_of(arch, n_rows: int, n_layers: int, head_rows: int, head_vocab: int, ctx: int, int8: bool = False,
            int4: bool = False) -> dict:
    """Bytes read (weights + fp32 KV) and FLOPs of a forward over ``n_rows`` query rows. Weights are fp32
    (4 bytes), except with ``int8`` (a drafter as decoding runs it, see fastops.mark_int8): the MLPs and
    the head are 1 byte per weight plus one fp32 scale per output row; attention stays fp32; and with ``int4``
    (the int4 engine's target): every layer linear is half a byte per weight plus a bf16 scale and zero per group
    of 32 (0.625 bytes a weight); the head, the GGUF's Q8_0 blocks run as two 4-bit planes, twice that."""
    h = arch.hidden_size
    if int4:
        w_bytes = 0.625 * (_layer_params(arch) * n_layers + 2 * head_vocab * h)
        kv = 2 * n_layers * arch.num_key_value_heads * arch.head_dim * (ctx + n_rows)
        attn = 4 * n_rows * (ctx + n_rows) * arch.num_attention_heads * arch.head_dim * n_layers
        flops = 2 * n_rows * _layer_params(arch) * n_layers + 2 * head_rows * head_vocab * h + attn
        return {"bytes": int(w_bytes + 4 * kv), "flops": flops}
    if int8:
        mlp_b = _mlp_params(arch) + 4 * (2 * arch.intermediate_size + h)
        head_b = head_vocab * h + 4 * head_vocab
    else:
        mlp_b, head_b = 4 * _mlp_params(arch), 4 * head_vocab * h
    w_bytes = (4 * _attn_params(arch) + mlp_b) * n_layers + head_b
    kv = 2 * n_layers * arch.num_key_value_heads * arch.head_dim * (ctx + n_rows)
    attn = 4 * n_rows * (ctx + n_rows) * arch.num_attention_heads * arch.head_dim * n_layers
    flops = 2 * n_rows * _layer_params(arch) * n_layers + 2 * head_rows * head_vocab * h + attn
    return {"bytes": w_bytes + 4 * kv, "flops": flops}


def _profile_parts(fn, wall_ms: float, repeats: int = 3) -> dict:
    """Split ``wall_ms`` (measured without a profiler) into PARTS, each from the profiled kernels' own times:
    "layer_gemm" and "lm_head" the GEMM ops' self times outside and inside the LM-head region, "attention" the
    attention calls (``scaled_dot_product_attention``, kernel included, the q / output reshapes around it not).
    "other" is the rest of the unprofiled wall time — Python, the small ops (norms, RoPE, casts, KV writes,
    reshapes), dispatch — so neither the profiler's own overhead nor its per-op cost inside a labelled region is
    counted in a part (an inclusive region time would be: the 2026-12-06 table of commit 5136cc1 read attention as 4.3 of a 17 ms int4 step, the
    kernel alone is under 1). Should the profiled parts exceed the wall time, they are scaled down to it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    parts = {"layer_gemm": 0.0, "attention": 0.0, "lm_head": 0.0}
    for e in prof.events():
        if e.name not in GEMM_OPS and e.name not in ATTENTION_OPS:
            continue
        above, up = set(), e.cpu_parent
        while up is not None:
            above.add(up.name)
            up = up.cpu_parent
        if above & set(ATTENTION_OPS):  # a kernel inside an attention call (math path) is attention's
            continue
        if e.name in ATTENTION_OPS:
            parts["attention"] += e.cpu_time_total
        else:
            parts["lm_head" if LM_HEAD in above else "layer_gemm"] += e.self_cpu_time_total
    parts = {k: v / 1e3 / repeats for k, v in parts.items()}
    known = sum(parts.values())
    if known > wall_ms:
        parts = {k: v * wall_ms / known for k, v in parts.items()}
    parts["other"] = max(wall_ms - sum(parts.values()), 0.0)
    return {k: {"share": v / wall_ms, "ms": v} for k, v in parts.items()}


VERIFY_WIDTHS = (2, 3, 4, 5, 6, 7, 8, 12, 16)  # every width the verify plan picks at B <= 8 is measured, not interpolated


@torch.inference_mode()
def breakdown(bundle, ctx_len: int = 300, block_sizes=VERIFY_WIDTHS, hypotheses=(1, 2, 4, 8), threads=(1, 2),
              repeats: int = 5, B_draft: int = 8) -> dict:
    """The cost breakdown (see the comment above) as a JSON-ready dict."""
    target = bundle.target
    arch, L = target.arch, target.num_layers
    V = arch.vocab_size
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    ctx, verifier = _prefilled(target, ctx_len, g)  # in a fresh process this includes packing the weights once
    first_ms = (time.perf_counter() - t0) * 1e3
    d3d, dcache, dfl, fcache = _drafters_at(bundle, ctx, g)
    cfg = DecodeConfig(block_size=B_draft)
    draft = d3d_draft(d3d, dcache, [], 5, cfg, g)
    head_k = lambda d: len(d.cfg.vocab_shortlist) or V  # noqa: E731
    q4 = target.engine == "int4"
    forwards = [("step", 1, verifier(1), work_of(arch, 1, L, 1, V, ctx_len, int4=q4))]
    forwards += [(f"verify({B})", B, verifier(B), work_of(arch, B, L, B, V, ctx_len, int4=q4)) for B in block_sizes]
    nd = len(d3d.active_layers())
    q8 = fastops.int8_status()["drafter_int8"] == "on"  # the D3D drafter's MLPs and head read 1 byte per weight
    forwards.append((f"d3d draft({B_draft})", B_draft, lambda: d3d_draft(d3d, dcache, [], 5, cfg, g),
                     work_of(d3d.cfg.arch, B_draft + 1, nd, B_draft, head_k(d3d), ctx_len, int8=q8)))  # a standalone drafter has its own shape
    for H in hypotheses:
        cH = cfg.with_(hypotheses=H)
        forwards.append((f"d3d packed(H={H})", B_draft, lambda cH=cH: d3d_packed(d3d, dcache, 5, draft, cH, g),
                         work_of(d3d.cfg.arch, B_draft + H * (B_draft + 1), nd, H * B_draft, head_k(d3d), ctx_len, int8=q8)))
    forwards.append((f"dflash draft({B_draft})", B_draft, lambda: dflash_draft(dfl, fcache, None, 5, cfg, g),
                     work_of(arch, B_draft, len(dfl.active_layers()), B_draft - 1, head_k(dfl), ctx_len)))
    out = {"ctx_len": ctx_len, "repeats": repeats, "engine": target.engine, "machine": {}, "rows": [],
           "first_prefill_ms": first_ms, "d3d_active_layers": nd,
           "drafter_int8": fastops.int8_status()["drafter_int8"], "row_plan": target.row_plan_info}
    for th in threads:
        lim = machine_limits(th)
        out["machine"][str(th)] = lim
        with cpu_threads(th):
            walls = _interleaved_medians([f[2] for f in forwards], repeats)
            step_ms = walls[0]  # forwards[0] is the step
            for (name, B, fn, work), wall in zip(forwards, walls):
                bw_ms = work["bytes"] / lim["read_gb_s"] / 1e6
                fl_ms = work["flops"] / lim["gemm_gflop_s"] / 1e6
                out["rows"].append({
                    "forward": name, "threads": th, "B": B, "wall_ms": wall, "per_step": wall / step_ms,
                    "parts": _profile_parts(fn, wall), "bytes": work["bytes"], "flops": work["flops"],
                    "bound_ms": max(bw_ms, fl_ms), "bound": "bandwidth" if bw_ms >= fl_ms else "compute",
                })
    return out


@torch.inference_mode()
def overlap_crossover(bundle, depths=(8, 16, 30), B: int = 8, H: int = 1, ctx_len: int = 300, repeats: int = 5,
                      hit_rate: float = 1.0) -> dict:
    """When does overlap pay on this machine? For D3D drafters of several depths (untrained, built
    from target layers: cost does not depend on training), time one sequential round (verify(B) +
    draft, all threads) against one async round (verify(B) ‖ packed pass, one thread each, plus
    ``1 - hit_rate`` of a one-thread sync draft), at equal τ. ``crossover`` is the draft / verify
    cost ratio (all threads) where the two rounds cost the same, interpolated between depths."""

    target = bundle.target
    g = torch.Generator().manual_seed(0)
    ctx, verifier = _prefilled(target, ctx_len, g)
    verify = verifier(B)
    cfg = DecodeConfig(block_size=B, hypotheses=H)
    spec = BUNDLES.get(bundle.name, BUNDLES["toy"])
    rows = []
    for d in sorted({min(int(x), target.num_layers) for x in depths}):
        dr = init_drafter("d3d", target, spec, num_layers=d).to(target.device)
        dcache = dr.new_cache()
        d3d_prefill(dr, dcache, ctx.tolist())
        draft = d3d_draft(dr, dcache, [], 5, cfg, g)
        v2 = _median_ms(verify, repeats)
        d2 = _median_ms(lambda: d3d_draft(dr, dcache, [], 5, cfg, g), repeats)
        with cpu_threads(1):
            d1 = _median_ms(lambda: d3d_draft(dr, dcache, [], 5, cfg, g), repeats)
            g_lane = torch.Generator().manual_seed(1)
            pair = _concurrent_ms(verify, lambda: d3d_packed(dr, dcache, 5, draft, cfg, g_lane), repeats, device=target.device)
        seq, asy = v2 + d2, pair["round"] + (1 - hit_rate) * d1
        rows.append({"depth": d, "verify_ms": v2, "draft_ms": d2, "draft_per_verify": d2 / v2, "seq_round_ms": seq,
                     "async_round_ms": asy, "verify_1t_concurrent_ms": pair["verify"], "packed_1t_concurrent_ms": pair["packed"],
                     "sync_draft_1t_ms": d1, "async_over_seq": seq / asy, "pays": asy < seq})
    return {"B": B, "H": H, "hit_rate": hit_rate, "ctx_len": ctx_len, "rows": rows, "crossover": _crossing(rows)}


def _crossing(rows: list) -> Optional[float]:
    """The draft/verify ratio where async_over_seq crosses 1 (linear between measured depths);
    None when every depth is on the same side."""
    pts = sorted((r["draft_per_verify"], r["async_over_seq"]) for r in rows)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if (y0 - 1) * (y1 - 1) <= 0 and y1 != y0:
            return x0 + (1 - y0) * (x1 - x0) / (y1 - y0)
    return None


def crossover_text(c: dict) -> str:
    lines = [f"overlap on this machine (B={c['B']}, H={c['H']}, hit rate {c['hit_rate']:.0%}, context {c['ctx_len']}):"]
    lines.append(f"{'depth':>6}{'draft/verify':>14}{'seq round':>11}{'async round':>13}{'async/seq speed':>17}")
    for r in c["rows"]:
        lines.append(f"{r['depth']:>6}{r['draft_per_verify']:>14.2f}{r['seq_round_ms']:>11.1f}{r['async_round_ms']:>13.1f}"
                     f"{r['async_over_seq']:>16.2f}x")
    x = c["crossover"]
    lines.append(f"overlap pays once a draft costs more than {x:.0%} of a verify" if x is not None else
                 "overlap " + ("pays at every measured depth" if all(r["pays"] for r in c["rows"]) else "does not pay at any measured depth"))
    return "\n".join(lines)


def breakdown_text(c: dict) -> str:
    lines = [f"cost breakdown ({c['engine']} engine, context {c['ctx_len']} tokens, median of {c['repeats']} interleaved rounds; "
             f"first prefill of the process {c.get('first_prefill_ms', float('nan')):.0f} ms, packing included)"]
    for th, m in c["machine"].items():
        lines.append(f"  {th} thread(s): read {m['read_gb_s']:.1f} GB/s, fp32 GEMM {m['gemm_gflop_s']:.0f} GFLOP/s")
    lines.append(f"{'forward':<18}{'thr':>4}{'wall ms':>9}{'/step':>7}   " + "".join(f"{p:>11}" for p in PARTS)
                 + f"{'MB read':>9}{'GFLOP':>7}{'bound ms':>10}  bound")
    for r in c["rows"]:
        lines.append(f"{r['forward']:<18}{r['threads']:>4}{r['wall_ms']:>9.1f}{r['per_step']:>7.2f}   "
                     + "".join(f"{r['parts'][p]['share']:>10.0%} " for p in PARTS)
                     + f"{r['bytes'] / 1e6:>9.0f}{r['flops'] / 1e9:>7.2f}{r['bound_ms']:>10.1f}  {r['bound']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m d3d_core.measure.costs", description="What each forward costs on this machine, and where the time goes.")
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--ctx", type=int, default=300, help="context length the forwards run at")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="comma list of intra-op thread counts")
    ap.add_argument("--widths", default=",".join(map(str, VERIFY_WIDTHS)), help="verify widths B to time (the verify plan reads them)")
    ap.add_argument("--engine", choices=["fast", "eager", "int4"], default="fast",
                    help="eager: the Hugging Face forward, F.linear drafters; int4: the target's layers and LM head from the GGUF's 4-bit blocks")
    ap.add_argument("--crossover", default="8,16,30", help="D3D drafter depths for the overlap crossover ('' skips it)")
    ap.add_argument("--out", default="results/costs.json")
    args = ap.parse_args(argv)
    fastops.set_enabled(args.engine != "eager")
    fastops.set_int4(args.engine == "int4")
    bundle = get_bundle(args.bundle)
    watch = QuietWatch()
    try:
        widths = tuple(sorted({int(w) for w in args.widths.split(",") if w.strip()}))
        if not widths or min(widths) < 2 or max(widths) > 64:
            raise ValueError
    except ValueError:
        print(f"error: --widths must be a comma list of integers in 2..64, got {args.widths!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    steps = Steps(raw=raw_path(out))  # raw results first (rawfirst): the measured rows reach the disk before any summary
    res = breakdown(bundle, ctx_len=args.ctx, repeats=args.repeats, threads=tuple(int(t) for t in args.threads.split(",")), block_sizes=widths)
    steps.save_raw(res)
    if args.crossover.strip():
        overlap = steps.run("overlap", overlap_crossover, bundle, depths=[int(d) for d in args.crossover.split(",")], repeats=args.repeats)
        if overlap is not None:
            res["overlap"] = overlap
            steps.save_raw(res)
    heard = watch.stop()

    def quiet() -> dict:
        top = max(r["threads"] for r in res["rows"])
        step = next((r["wall_ms"] for r in res["rows"] if r["forward"] == "step" and r["threads"] == top), None)
        return heard.against(step, step_reference(bundle.costs, top, res.get("engine"))).to_json()

    res["machine_info"] = steps.run("machine_info", machine_info, default={})
    res["quiet"] = steps.run("quiet", quiet, default=heard.to_json())
    with steps.step("print"):
        print(res["machine_info"].get("cpu", "?"))
        print(breakdown_text(res))
        if "overlap" in res:
            print(crossover_text(res["overlap"]))
    if res["quiet"].get("noisy"):
        print(f"WARNING: {res['quiet']['warning']}", file=sys.stderr)
    rc = steps.finish(out, res)
    print(f"wrote {out}" if out.is_file() else f"kept {steps.raw}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
