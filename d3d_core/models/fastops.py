"""The fast CPU path: prepacked oneDNN linears, the same for the target and both drafters.

Why: on these CPUs the GEMM library's choice per shape matters as much as the FLOPs. With the
default ``F.linear`` (MKL), a forward over 8 rows can cost several times a forward over one
(measured on an AVX2 EPYC, 2 threads: the 49152 × 576 LM head took 15.8 ms at 1 row and 68 ms
at 8; the 576 → 3072 MLP projection 0.26 and 1.41 ms). oneDNN with the weight reordered once
into its blocked layout ("prepacked") took 6.3 / 9.2 ms and 0.20 / 0.35 ms. This module keeps
one prepacked copy per ``nn.Linear`` (or per fused group of them, e.g. q|k|v), rebuilt only when
the weight changes (its version counter moves), and uses it wherever no gradient is needed.
Which library wins at one to a few rows depends on the CPU, so the target's GEMMs follow a row plan
measured per machine (:class:`RowPlan`, below): on the AVX-512 Intel Xeon MKL's plain sgemm on a (K, N)
copy of the weight streamed the layers' weights about 1.5× as fast as oneDNN at one row.

The path is taken only where it can run: CPU, float32, oneDNN present, no autograd, and a
self-test call that succeeded once. Elsewhere (CUDA, bf16, training, another platform) every call
falls back to ``F.linear``; :func:`status` says which path is active and why.
``D3D_ENGINE=eager`` (or :func:`set_enabled(False)`) switches the fast path off process-wide.

Drafter MLPs and the drafter's shortlist head may run in **int8** (:func:`mark_int8`): weights quantized per
output channel once, activations per tensor at each call (PyTorch's dynamic quantized linear, fbgemm / x86).
A drafter only proposes tokens and the target verifies every one, so this cannot change any output: it
moves τ a little and the draft's cost a lot (D3D on the AMD EPYC: draft 19 -> 14 ms, offline τ -1.8 %;
docs/RESULTS.md). The attention projections stay fp32 (in int8 they cost a third of τ). ``D3D_DRAFTER_INT8=off``
(or :func:`set_int8(False)`) keeps every drafter fp32; :func:`exact_drafters` does so for one thread, which
offline τ, pruning and training use, so that their figures describe the stored weights.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

# the profiler label the cost breakdown (costs.py) reads the LM head's GEMM by; free when no profiler is running
LM_HEAD = "d3d::lm_head"
_PACK_BATCH_HINT = 16  # the reorder's expected row count; measured best for 1..17 rows here
_lock = threading.Lock()
_state = {"enabled": os.environ.get("D3D_ENGINE", "fast").lower() != "eager", "ok": None, "why": "",
          "int4": os.environ.get("D3D_ENGINE", "fast").lower() == "int4",
          "int8": os.environ.get("D3D_DRAFTER_INT8", "on").lower() not in ("off", "0", "false", "no"), "int8_ok": None, "int8_why": ""}
_local = threading.local()  # .exact: this thread keeps marked drafter modules in fp32 (exact_drafters)


def _self_test() -> tuple:
    """(usable, reason): does a prepacked oneDNN linear run and agree with F.linear here?"""
    try:
        if not torch.backends.mkldnn.is_available():
            return False, "oneDNN (mkldnn) is not available in this PyTorch build"
        w, x = torch.randn(24, 16), torch.randn(3, 16)
        with torch.inference_mode():
            wp = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
            y = torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
        if not torch.allclose(y, F.linear(x, w), atol=1e-4, rtol=1e-4):
            return False, "oneDNN prepacked linear disagrees with F.linear"
        return True, "oneDNN prepacked linear (CPU, fp32)"
    except Exception as e:  # missing op, unsupported ISA, another platform
        return False, f"oneDNN prepacked linear unavailable ({type(e).__name__}: {str(e)[:120]})"


def _passed(ok: str, why: str, test) -> bool:
    """Whether a platform self-test passed: ``test()`` runs once per process (thread-safe) and its
    (usable, reason) is kept in ``_state[ok]``, ``_state[why]``."""
    if _state[ok] is None:
        with _lock:
            if _state[ok] is None:
                _state[ok], _state[why] = test()
    return _state[ok]


def status() -> dict:
    """{'engine': 'fast' | 'eager', 'reason': ...}: which linear path CPU forwards take."""
    if not _state["enabled"]:
        return {"engine": "eager", "reason": "fast path switched off (D3D_ENGINE=eager or set_enabled(False))"}
    return {"engine": "fast" if _passed("ok", "why", _self_test) else "eager", "reason": _state["why"]}


def set_enabled(on: bool) -> None:
    _state["enabled"] = bool(on)


def set_int4(on: bool) -> None:
    """Ask for the int4 engine process-wide (``D3D_ENGINE=int4``): targets with int4 weights run their layers and
    LM head through them (``Target.engine``), and the drafters' shared LM head too (:func:`linear`)."""
    _state["int4"] = bool(on)


def int4_requested() -> bool:
    return _state["int4"] and _state["enabled"]


def enabled() -> bool:
    return status()["engine"] == "fast"


def _quantize_rows(w: torch.Tensor) -> torch.Tensor:
    """(N, K) fp32 -> per-output-channel symmetric qint8 (the deprecation warning of the quantized-tensor API
    is silenced: torch is pinned, and a platform without it fails the self-test and stays fp32)."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(w.contiguous().float(), scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)


def _int8_self_test() -> tuple:
    """(usable, reason): does the dynamic int8 linear run here and stay close to F.linear?"""
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 32, generator=g), torch.randn(3, 32, generator=g)
        with torch.inference_mode():
            y = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(_quantize_rows(w), None))
        ref = F.linear(x, w)
        if (y - ref).abs().max() > 0.05 * ref.abs().max():
            return False, "dynamic int8 linear disagrees with F.linear"
        return True, f"dynamic int8 linear ({torch.backends.quantized.engine}), per-channel weights"
    except Exception as e:
        return False, f"dynamic int8 linear unavailable ({type(e).__name__}: {str(e)[:120]})"


def int8_status() -> dict:
    """{'drafter_int8': 'on' | 'off', 'reason': ...}: whether marked drafter modules run in int8."""
    if not _state["int8"]:
        return {"drafter_int8": "off", "reason": "switched off (D3D_DRAFTER_INT8=off or set_int8(False))"}
    if not enabled():
        return {"drafter_int8": "off", "reason": "the fast engine is off"}
    return {"drafter_int8": "on" if _passed("int8_ok", "int8_why", _int8_self_test) else "off", "reason": _state["int8_why"]}


def set_int8(on: bool) -> None:
    _state["int8"] = bool(on)


def mark_int8(*modules: nn.Module) -> None:
    """Let these modules' fast-path linears run in int8 (drafter MLPs, the drafter's shortlist head)."""
    for m in modules:
        m._d3d_int8 = True


@contextlib.contextmanager
def exact_drafters():
    """Within the block, this thread runs marked drafter modules in fp32 (offline τ, pruning, training)."""
    before = getattr(_local, "exact", False)
    _local.exact = True
    try:
        yield
    finally:
        _local.exact = before


def exact(fn):
    """Decorator: ``fn`` runs under :func:`exact_drafters` (training: a frozen teacher drafter stays fp32)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with exact_drafters():
            return fn(*args, **kwargs)

    return wrapper


def _int8(owner: nn.Module) -> bool:
    """Run this owner's linear in int8? Called per linear on the fast path (which the caller has already
    checked), so it reads the cached self-test result instead of building :func:`int8_status`."""
    return (owner.__dict__.get("_d3d_int8", False) and _state["int8"] and not getattr(_local, "exact", False)
            and _passed("int8_ok", "int8_why", _int8_self_test))


def _usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        _state["enabled"] and x.device.type == "cpu" and w.device.type == "cpu"
        and x.dtype == torch.float32 and w.dtype == torch.float32
        and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
        and (_state["ok"] if _state["ok"] is not None else enabled())
    )


def _sig(t: Optional[torch.Tensor]):
    """What identifies a weight's current values: its storage and its version counter (inference
    tensors have none and cannot be modified in place after creation)."""
    if t is None:
        return None
    return (t.data_ptr(), 0 if t.is_inference() else t._version)


def _packed(owner: nn.Module, key: str, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]], prep=None,
            form: str = "onednn"):
    """(weight copy, bias) of ``weights`` concatenated along rows, cached on ``owner`` and rebuilt when any weight
    changes (in-place updates bump ``_version``; a new tensor has a new data pointer). ``prep(w, b)`` may reorder
    the concatenated rows first (done once). ``form``: "onednn", the prepacked oneDNN weight; "blas", W^T as a
    contiguous (K, N) fp32 copy (``x @ W^T`` is MKL's sgemm without a transpose); "int8", the fbgemm-packed qint8
    weight with its bias inside (returned as (packed, None))."""
    key = key if form == "onednn" else f"{key}#{form}"
    sig = tuple(_sig(w) for w in weights) + tuple(_sig(b) for b in biases)
    cache = owner.__dict__.setdefault("_d3d_packed", {})
    hit = cache.get(key)
    if hit is not None and hit[0] == sig:
        return hit[1], hit[2]
    with torch.inference_mode():
        w = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights], 0)
        if any(b is not None for b in biases):
            b = torch.cat([(b.detach() if b is not None else w.new_zeros(wt.shape[0])) for b, wt in zip(biases, weights)])
        else:
            b = None
        if prep is not None:
            w, b = prep(w, b)
        if form == "int8":
            wp, b = torch.ops.quantized.linear_prepack(_quantize_rows(w), None if b is None else b.float().contiguous()), None
        elif form == "blas":
            wp = w.t().contiguous()
        else:
            wp = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_BATCH_HINT)
    cache[key] = (sig, wp, b)
    return wp, b


def row_bucket(m: int) -> int:
    """The row count a GEMM of m rows runs at. oneDNN builds (and keeps) a primitive for every
    input shape it meets, about 0.6 MB each, and memory did not come back past its cache's
    capacity (measured: +2 GB after 2,400 distinct row counts). A server meets a new row count with
    every new prompt length, so rows are padded up to a bounded set of sizes: exact up to 32 (the
    decode steps, verifies up to B = 16 and drafts that decide speed), then multiples of 16 up to
    128, of 64 up to 1024 and of 256 beyond — about 80 shapes per weight up to 8k rows, at ≤ 12 %
    (beyond 128 rows) extra work on prefills and large packed passes only."""
    if m <= 32:
        return m
    step = 16 if m <= 128 else (64 if m <= 1024 else 256)
    return -(-m // step) * step


# ----------------------------------------------------------------------------- the row plan
#
# oneDNN's kernel for a GEMM depends on its row count, and a few more rows can cost less than fewer:
# on the AVX-512 AMD EPYC (2 threads) the target's forward over 2 rows took 38–43 ms and over 3 to 6
# rows 33–39 ms (the 2-row kernels stream the weights more slowly); on the AVX2 EPYC verify(2) was
# cheaper than verify(4). And at one or two rows oneDNN's prepacked kernel can be the slower library:
# on the AVX-512 Intel Xeon (2 threads) the 30 layers' GEMMs streamed their weights at about 27 GB/s
# through oneDNN against about 40 through MKL's plain sgemm, a one-row forward 37 ms against 29. So the
# plan is measured on each machine, once per process, on the target's own forward before its first
# real one (Target.row_plan): every row count m <= ROW_PLAN_MAX runs either through oneDNN at the
# m' >= m whose forward was fastest or through plain BLAS (``torch.mm`` on a (K, N) copy of the
# weight) at m, whichever was fastest, when it was at least ROW_PLAN_GAIN faster than oneDNN at m.
# Padding adds rows and changes no real row's inputs; a wider kernel or the other library may change
# float rounding (last bits of fp32), the same way in every mode: the plan is fixed before the first
# forward, so AR and every drafting mode run the same kernels at each row count.

ROW_PLAN_MAX = 8  # row counts the plan may pad (a step, short verifies, drafter commits)
ROW_PLAN_GAIN = 0.05  # leave oneDNN at m rows only for a forward at least 5 % faster
IDENTITY_ROWS = tuple(range(ROW_PLAN_MAX + 1))  # rows[m] = m (index 0 unused)


@dataclass(frozen=True)
class RowPlan:
    """How the fast engine runs a GEMM of m <= ROW_PLAN_MAX rows: through the plain BLAS GEMM when m is in
    ``blas``, else through oneDNN's prepacked kernel at ``rows[m]`` >= m rows (zero rows padded, dropped after).
    Larger row counts run through oneDNN at ``row_bucket(m)``."""

    rows: tuple = IDENTITY_ROWS
    blas: tuple = ()

    def info(self) -> dict:
        return {"plan": list(self.rows), "blas": list(self.blas)}

    def onednn(self) -> "RowPlan":
        """This plan with every row count on oneDNN (for a GEMM that stays there, e.g. the LM head)."""
        return _onednn_only(self)


@functools.lru_cache(maxsize=64)
def _onednn_only(plan: RowPlan) -> RowPlan:
    return RowPlan(plan.rows) if plan.blas else plan


IDENTITY_PLAN = RowPlan()  # oneDNN at every row count, unpadded


def row_plan_setting() -> str:
    """``D3D_ROW_PLAN``: "auto" (measure, the default), "off" (oneDNN, never pad), "blas" (plain BLAS for every
    m <= ROW_PLAN_MAX), or an integer F (oneDNN, every row count below F padded up to F)."""
    return os.environ.get("D3D_ROW_PLAN", "auto").strip().lower() or "auto"


def plan_from_times(times: dict, blas_times: Optional[dict] = None, gain: float = ROW_PLAN_GAIN) -> RowPlan:
    """{m: ms of a forward over m rows through oneDNN} for m = 1..ROW_PLAN_MAX (and the same through plain BLAS,
    if measured) -> the plan: for each m the fastest of oneDNN at any m' >= m and BLAS at m, when it beats oneDNN
    at m by ``gain``; else oneDNN at m."""
    rows, blas = list(IDENTITY_ROWS), []
    blas_times = blas_times or {}
    for m in range(1, ROW_PLAN_MAX + 1):
        if m not in times:
            continue
        best = min((k for k in times if k >= m), key=lambda k: (times[k], k))
        best_ms = times[best]
        if m in blas_times and blas_times[m] < best_ms:
            best, best_ms = "blas", blas_times[m]
        if best_ms < (1 - gain) * times[m]:
            if best == "blas":
                blas.append(m)
            else:
                rows[m] = best
    return RowPlan(tuple(rows), tuple(blas))


def fixed_plan(floor: int) -> RowPlan:
    floor = max(1, min(int(floor), ROW_PLAN_MAX))
    return RowPlan(tuple(max(m, floor) if m else 0 for m in IDENTITY_ROWS))


BLAS_PLAN = RowPlan(blas=tuple(range(1, ROW_PLAN_MAX + 1)))  # D3D_ROW_PLAN=blas: plain BLAS for every m <= ROW_PLAN_MAX


def drop_blas(module: nn.Module) -> int:
    """Free the BLAS copies (``_packed(..., form="blas")``) cached under ``module`` (a plan that runs no row count on
    BLAS needs none); bytes freed."""
    freed = 0
    for m in module.modules():
        cache = m.__dict__.get("_d3d_packed")
        for k in [k for k in (cache or {}) if k.endswith("#blas")]:
            freed += cache[k][1].numel() * cache[k][1].element_size()
            del cache[k]
    return freed


def run_blas(wt: torch.Tensor, b: Optional[torch.Tensor], x2: torch.Tensor) -> torch.Tensor:
    """(m, K) @ (K, N) (+ bias) through plain BLAS."""
    return torch.mm(x2, wt) if b is None else torch.addmm(b, x2, wt)


def run_onednn(wp: torch.Tensor, b: Optional[torch.Tensor], x2: torch.Tensor, plan: Optional[RowPlan] = None) -> torch.Tensor:
    """(m, K) through a prepacked oneDNN weight, rows padded to ``plan.rows[m]`` (small m) or ``row_bucket(m)``."""
    m = x2.shape[0]
    mb = plan.rows[m] if plan is not None and m < len(plan.rows) else row_bucket(m)
    if mb != m:
        x2 = torch.cat([x2, x2.new_zeros(mb - m, x2.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(x2, wp, b, "none", [], "")
    return y[:m] if mb != m else y


def packed_linear(owner: nn.Module, key: str, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]], x: torch.Tensor, prep=None,
                  plan: Optional[RowPlan] = None) -> torch.Tensor:
    """``x @ cat(weights).T (+ bias)`` through the prepacked kernel, unconditionally (callers that
    chose the fast engine already checked :func:`enabled`). Rows are padded to ``row_bucket``; a row plan
    (see above) runs small row counts through plain BLAS or pads them to ``plan.rows[m]``.
    Owners marked with :func:`mark_int8` run the dynamic int8 linear instead (no per-shape primitives
    to bound, so no padding)."""
    lead = x.shape[:-1]
    if _int8(owner):
        qp, _ = _packed(owner, key, weights, biases, prep, "int8")
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]).contiguous(), qp)
        return y.reshape(*lead, y.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if plan is not None and x2.shape[0] in plan.blas:
        y = run_blas(*_packed(owner, key, weights, biases, prep, "blas"), x2)
    else:
        y = run_onednn(*_packed(owner, key, weights, biases, prep), x2, plan)
    return y.reshape(*lead, y.shape[-1])


def linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)``, through the prepacked kernel when the fast path applies; through the int4 kernel for a module
    the int4 engine attached its weights to (the target's LM head, shared by the drafters) while int4 is on."""
    if not _usable(x, mod.weight):
        return mod(x)
    w4 = mod.__dict__.get("_d3d_int4")
    if w4 is not None and _state["int4"]:
        return w4(x.reshape(-1, x.shape[-1])).float().reshape(*x.shape[:-1], w4.n)
    return packed_linear(mod, "w", [mod.weight], [mod.bias], x)


def fused_linear(owner: nn.Module, key: str, mods: Sequence[nn.Linear], x: torch.Tensor) -> list:
    """``[m(x) for m in mods]`` as one GEMM over the row-concatenated weights (fast path), or the
    separate linears (fallback). Returns one output per module."""
    if not _usable(x, mods[0].weight):
        return [m(x) for m in mods]
    y = packed_linear(owner, key, [m.weight for m in mods], [m.bias for m in mods], x)
    return list(y.split([m.weight.shape[0] for m in mods], dim=-1))


def rows_linear(owner: nn.Module, key: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a weight that is not an nn.Linear (e.g. LM-head shortlist rows)."""
    if not _usable(x, weight):
        return x @ weight.T
    return packed_linear(owner, key, [weight], [None], x)
