"""The low-bit GEMM: 4-bit weight codes x 8-bit activations, every row computed alone (``lowbit.c``).

Why: torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) re-reads and unpacks the weights for every row, so a
verify of 8 rows costs about 3 one-row steps and speculation cannot pay on the int4 engine (issue 44). This kernel
reads each weight block once per tile of 8 outputs and serves every row from it while it sits in L1/registers:

- weights: the int4 engine's codes (``int4.Codes``: the GGUF's own Q4_1 blocks, or its Q8_0 head as two exact 4-bit
  planes) as w = d q + m per block of 32, d and m in fp16 — exactly the GGUF's values (Q4_1 stores fp16 d and m;
  the Q8_0 planes' 16 d, -128 d and d are exact in fp16), with no bf16 rounding;
- activations: each row's 32-input blocks quantised to int8 on their own (scale amax / 127), as llama.cpp's Q8
  activations; the zero term m · Σx uses the exact fp32 block sum;
- per output and block, Σ q · qx is an exact integer (AVX2 ``maddubs`` / ``madd``), scaled and accumulated in fp32
  over the blocks in a fixed order; threads split the outputs, never K.

The glue between the GEMMs runs here too, row by row (``add_rmsnorm``: the residual add and the RMSNorm after it in
one call, where torch spends about eight ops and 20-40 µs; ``swiglu``: the MLP's silu(gate) * up), so the int4
engine's step spends its time in the kernels rather than in op dispatch.

So a row's bits do not depend on how many rows share the call (:func:`self_test` checks it on this machine), and a
verify over B rows gives each row exactly what a one-row step gives it. The numerics differ from torch's kernel
(bf16 activations there, 8-bit here): output quality against fp32 is measured in docs/ENGINE.md.

Build: ``lowbit.c`` is compiled with the system C compiler (``cc``/``gcc``, -O3 -mavx2 -mfma -mf16c -fopenmp) into
``$D3D_CACHE/kernels/`` on first use (about a second; ``scripts/setup_venv.sh`` does it at set-up) and called through
ctypes with the tensors' data pointers. It runs its threads in the OpenMP runtime torch already loaded (same
``libgomp.so.1``), ``torch.get_num_threads()`` of them, so the two never oversubscribe the cores. A host without a
compiler, without AVX2 / FMA / F16C, or with ``D3D_LOWBIT=off`` runs torch's int4 kernel instead, and
:func:`status` says which kernel runs and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .. import limits

GROUP = 32
TILE = 8  # outputs per tile
TILE_BYTES = 160  # per tile and block: 128 bytes of codes, 8 fp16 d, 8 fp16 m
VERSION = 2  # lowbit.c's LB_VERSION
SOURCE = Path(__file__).with_name("lowbit.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off")
NEEDS = ("avx2", "fma", "f16c")
KERNEL_NAME = "lowbit AVX2 (4-bit codes x 8-bit activations, row-invariant)"
# profiler labels of the two calls (a ctypes call is no torch op), so the cost breakdown (measure/costs.py) can read them
GEMM_LABEL, ATTENTION_LABEL = "d3d::lowbit_gemm", "d3d::lowbit_attention"
LAYERS_LABEL = "d3d::lowbit_layers"  # the whole layer stack in one call (its GEMM / attention shares are not split out)
_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded ctypes library; "status": (ok, why)


@dataclass(frozen=True)
class KernelStatus:
    """Which low-bit kernel the int4 engine runs, and why (shown by the Race and Benchmarks tabs)."""

    lowbit: bool  # True: this module's kernel; False: torch's int4 kernel
    kernel: str
    reason: str

    def info(self) -> dict:
        return {"kernel": self.kernel, "lowbit": self.lowbit, "reason": self.reason}


@dataclass
class Codes:
    """A weight in the kernel's form before packing: codes (N, K) uint8 in 0..15, scale and zero (N, K/32)
    float32 (exact values; bf16 rounding happens at packing), so w[n, k] = (q - 8) * scale + zero."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    planes: int = 1  # 2: a Q8_0 weight as two 4-bit planes side by side along K ([hi | lo]); the input is [x | x]

    def rows(self, idx: torch.Tensor) -> "Codes":
        return Codes(self.q[idx], self.scale[idx], self.zero[idx], self.planes)

    @staticmethod
    def cat(parts: list) -> "Codes":
        assert len({p.planes for p in parts}) == 1
        return Codes(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts]), parts[0].planes)


def setting() -> str:
    """``D3D_LOWBIT``: "auto" (the default: this kernel where it builds and passes its self-test) or "off"."""
    v = os.environ.get("D3D_LOWBIT", "auto").strip().lower()
    return "off" if v in ("off", "0", "false", "no") else "auto"


def cpu_flags() -> set:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    return Path(os.environ.get("D3D_CACHE", Path.home() / ".cache" / "d3d-studio")) / "kernels"


def compiler() -> Optional[str]:
    for cc in (os.environ.get("CC"), "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    return None


def library_path(cc: str) -> Path:
    """Where the build for this source, compiler and flags lives (a new source or compiler builds anew)."""
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    h = hashlib.sha256(SOURCE.read_bytes() + repr((ver, CFLAGS, VERSION)).encode()).hexdigest()[:16]
    return cache_dir() / f"lowbit-{h}.so"


def build() -> tuple:
    """(path or None, why): compile ``lowbit.c`` into the cache unless this build is there already."""
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return None, f"the low-bit kernel is built for Linux x86-64 only (this host: {platform.system()} {platform.machine()})"
    missing = [f for f in NEEDS if f not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}, which the low-bit kernel needs"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc / gcc) to build the low-bit kernel"
    try:
        path = library_path(cc)
        if path.is_file():
            return path, f"cached build {path}"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        r = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            return None, f"the low-bit kernel failed to compile ({cc}: {r.stderr.strip()[:200]})"
        os.replace(tmp, path)
        return path, f"built {path}"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the low-bit kernel could not be built ({type(e).__name__}: {str(e)[:160]})"


def _load() -> tuple:
    """(ctypes library or None, why)."""
    path, why = build()
    if path is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"the low-bit kernel failed to load ({str(e)[:160]})"
    lib.lowbit_version.restype = ctypes.c_int
    if lib.lowbit_version() != VERSION:
        return None, f"stale low-bit kernel build at {path} (version {lib.lowbit_version()}, want {VERSION})"
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.lowbit_gemm.argtypes = [p, i, i, p, i, i, p, i]
    lib.lowbit_gemm.restype = ctypes.c_int
    L = ctypes.c_long
    lib.lowbit_attention.argtypes = [p, L, i, i, i, i, p, p, L, i, i, ctypes.c_float, p, i]
    lib.lowbit_attention.restype = ctypes.c_int
    lib.lowbit_add_rmsnorm.argtypes = [p, p, p, p, i, i, ctypes.c_float]
    lib.lowbit_add_rmsnorm.restype = ctypes.c_int
    lib.lowbit_swiglu.argtypes = [p, i, i, p]
    lib.lowbit_swiglu.restype = ctypes.c_int
    f = ctypes.c_float
    lib.lowbit_layers.argtypes = [p, i, i, i, i, i, i, i, p, p, p, p, p, p, p, p, p, p, f, p, p, i, i, p, f, p, i, p, i]
    lib.lowbit_layers.restype = ctypes.c_int
    return lib, why


def _label(name: str):
    """A profiler region around a kernel call while a profiler runs (free otherwise)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- packing


def pack(c) -> torch.Tensor:
    """``int4.Codes`` (codes (N, K') 0..15, scale / zero (N, K'/32): w = (q - 8) scale + zero) -> the kernel's bytes
    (tiles, K'/32, TILE_BYTES) uint8 with d = scale, m = zero - 8 scale in fp16, N padded to tiles of 8 with zeros."""
    q = c.q.numpy().astype(np.uint8)
    n, kw = q.shape
    if kw % GROUP:
        raise ValueError(f"the low-bit kernel needs input sizes in multiples of {GROUP}; this weight has {kw}")
    d = c.scale.double().numpy()
    m = c.zero.double().numpy() - 8 * d
    pad = -n % TILE
    if pad:
        q = np.concatenate([q, np.zeros((pad, kw), np.uint8)])
        d, m = (np.concatenate([a, np.zeros((pad, a.shape[1]))]) for a in (d, m))
    t, nb = (n + pad) // TILE, kw // GROUP
    # k = 32 b + 16 half + 4 i + kk -> byte (t, b, i, lane, kk): low nibble half 0, high nibble half 1
    qq = q.reshape(t, TILE, nb, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)  # (t, b, half, i, lane, kk)
    codes = (qq[:, :, 0] | (qq[:, :, 1] << 4)).reshape(t, nb, 128)
    scales = [a.astype(np.float16).reshape(t, TILE, nb).transpose(0, 2, 1).copy().view(np.uint8) for a in (d, m)]  # (t, nb, 16)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([codes, *scales], axis=-1)))


def packed_weight(c) -> torch.Tensor:
    """The (N, K') fp64 weight the kernel multiplies by: d q + m with d, m rounded to fp16 as packed (planes summed)."""
    d = c.scale.double().numpy()
    d16 = torch.from_numpy(d.astype(np.float16).astype(np.float64))
    m16 = torch.from_numpy((c.zero.double().numpy() - 8 * d).astype(np.float16).astype(np.float64))
    w = c.q.double() * d16.repeat_interleave(GROUP, 1) + m16.repeat_interleave(GROUP, 1)
    if c.planes == 2:
        half = w.shape[1] // 2
        w = w[:, :half] + w[:, half:]
    return w


def check_shape(n: int, k: int, planes: int) -> Optional[str]:
    """Why the kernel refuses a weight of n outputs, k inputs and ``planes`` 4-bit planes, or None."""
    if n < 1 or k < 1 or planes not in (1, 2):
        return f"a low-bit weight needs N >= 1, K >= 1 and 1 or 2 planes (got N {n}, K {k}, planes {planes})"
    if k % GROUP:
        return f"the low-bit kernel needs K in multiples of {GROUP} (got {k})"
    if n > limits.LOWBIT_MAX_N or k > limits.LOWBIT_MAX_K:
        return f"a low-bit weight of {n} x {k} is past the kernel's limits ({limits.LOWBIT_MAX_N} x {limits.LOWBIT_MAX_K})"
    return None


class LowbitLinear:
    """One packed weight: ``self(x)`` = x @ W.T through the low-bit kernel; x (M, K) float32 -> (M, N) float32."""

    __slots__ = ("packed", "n", "k", "planes")

    def __init__(self, packed: torch.Tensor, n: int, k: int, planes: int = 1):
        why = check_shape(n, k, planes)
        if why:
            raise ValueError(why)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (-(-n // TILE), k * planes // GROUP, TILE_BYTES):
            raise ValueError(f"packed low-bit weight has shape {tuple(packed.shape)} {packed.dtype}; "
                             f"{n} x {k} in {planes} plane(s) needs ({-(-n // TILE)}, {k * planes // GROUP}, {TILE_BYTES}) uint8")
        self.packed, self.n, self.k, self.planes = packed.contiguous(), n, k, planes

    @classmethod
    def from_codes(cls, c) -> "LowbitLinear":
        return cls(pack(c), c.q.shape[0], c.q.shape[1] // c.planes, c.planes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib = library()
        if lib is None:
            raise RuntimeError(f"the low-bit kernel is not available here: {status().reason}")
        return self.run(lib, x)

    def run(self, lib, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"low-bit linear of {self.n} x {self.k} got input of shape {tuple(x.shape)}")
        m = x.shape[0]
        if not 1 <= m <= limits.LOWBIT_MAX_ROWS:
            raise ValueError(f"low-bit linear takes 1 to {limits.LOWBIT_MAX_ROWS} rows (got {m})")
        x = x.float().contiguous() if x.dtype != torch.float32 or not x.is_contiguous() else x
        y = torch.empty(m, self.n, dtype=torch.float32)
        with _label(GEMM_LABEL):
            rc = lib.lowbit_gemm(x.data_ptr(), m, self.k, self.packed.data_ptr(), self.n, self.k * self.planes, y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"the low-bit kernel refused its arguments (code {rc})")
        return y

    def tensors(self, prefix: str) -> dict:
        return {prefix + ".lowbit": self.packed}

    def nbytes(self) -> int:
        return self.packed.numel()


# ----------------------------------------------------------------------------- attention


def attention_into(lib, qk: torch.Tensor, nh: int, kc: torch.Tensor, vc: torch.Tensor, T: int) -> torch.Tensor:
    """Causal attention of n rows at positions T..T+n-1, each row computed alone (``lowbit_attention``): qk (n, >= nh,
    hd) fp32 with heads contiguous (q heads first; the rows may be strided), kc / vc (1, nkv, capacity, hd) fp32
    contiguous holding keys / values 0..T+n-1 -> (n, nh * hd). Scale 1 / sqrt(hd), as SDPA's default."""
    n, _, hd = qk.shape
    nkv, cap = kc.shape[1], kc.shape[2]
    if qk.dtype != torch.float32 or qk.stride(2) != 1 or qk.stride(1) != hd or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError("low-bit attention wants fp32 q rows with contiguous heads and contiguous K / V caches")
    y = torch.empty(n, nh * hd, dtype=torch.float32)
    with _label(ATTENTION_LABEL):
        rc = lib.lowbit_attention(qk.data_ptr(), qk.stride(0), n, nh, nkv, hd, kc.data_ptr(), vc.data_ptr(), cap * hd, T, cap,
                                  hd**-0.5, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"low-bit attention refused n {n}, heads {nh} / {nkv}, head dim {hd}, T {T}, capacity {cap} (code {rc})")
    return y


def attention(qk: torch.Tensor, nh: int, kc: torch.Tensor, vc: torch.Tensor, T: int) -> torch.Tensor:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the low-bit kernel is not available here: {status().reason}")
    return attention_into(lib, qk, nh, kc, vc, T)


# ----------------------------------------------------------------------------- the glue between the GEMMs


def _plain(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.dim() == 2 and t.is_contiguous()


def add_rmsnorm(lib, x: torch.Tensor, y: Optional[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    """x (n, H) fp32 += y (n, H) in place (y None: no add); returns RMSNorm(x) * w (n, H), each row alone
    (``lowbit_add_rmsnorm``): one call for the residual add and the norm that torch spends about eight ops on."""
    n, H = x.shape
    if not (_plain(x) and (y is None or (_plain(y) and y.shape == x.shape)) and w.dtype == torch.float32
            and w.is_contiguous() and w.numel() == H):
        raise ValueError(f"low-bit add_rmsnorm wants contiguous fp32 x (n, H), y like x and w (H,); got {tuple(x.shape)}, "
                         f"{None if y is None else (tuple(y.shape), y.dtype)}, {tuple(w.shape)} {w.dtype}")
    h = torch.empty_like(x)
    if lib.lowbit_add_rmsnorm(x.data_ptr(), None if y is None else y.data_ptr(), w.data_ptr(), h.data_ptr(), n, H, eps) != 0:
        raise ValueError(f"low-bit add_rmsnorm refused n {n}, H {H} (H must be a multiple of 8)")
    return h


def swiglu(lib, gu: torch.Tensor) -> torch.Tensor:
    """gu (n, 2I) fp32 (the fused gate | up GEMM's output) -> silu(gate) * up (n, I), each row alone."""
    if not _plain(gu) or gu.shape[1] % 2:
        raise ValueError(f"low-bit swiglu wants contiguous fp32 (n, 2I); got {tuple(gu.shape)} {gu.dtype}")
    n, I2 = gu.shape
    out = torch.empty(n, I2 // 2, dtype=torch.float32)
    if lib.lowbit_swiglu(gu.data_ptr(), n, I2 // 2, out.data_ptr()) != 0:
        raise ValueError(f"low-bit swiglu refused n {n}, I {I2 // 2} (I must be a multiple of 8)")
    return out


class LayerStack:
    """A Llama-style target's decoder layers as one ``lowbit_layers`` call: the packed weights' and norm weights' data
    pointers gathered once (the tensors stay owned by the int4 weights and the model). ``run`` does every layer of a
    forward of n rows with no Python between the kernels (the per-op path's ~12 calls a layer cost about a quarter
    of a one-row step here, measured in docs/ENGINE.md)."""

    def __init__(self, layers: list, ln1: list, ln2: list, H: int, nh: int, nkv: int, hd: int, I: int, eps: float):
        nq = (nh + 2 * nkv) * hd
        want = {"qkv": (nq, H), "o": (H, nh * hd), "gate_up": (2 * I, H), "down": (H, I)}
        for i, q4 in enumerate(layers):
            for key, (n, k) in want.items():
                lin = q4.get(key)
                if not isinstance(lin, LowbitLinear) or (lin.n, lin.k) != (n, k):
                    raise ValueError(f"layer {i}'s {key} is not a low-bit weight of {n} x {k}")
        for w in (*ln1, *ln2):
            if w.dtype != torch.float32 or not w.is_contiguous() or w.numel() != H:
                raise ValueError(f"the layer stack wants contiguous fp32 norm weights of {H}")
        self.L, self.H, self.nh, self.nkv, self.hd, self.I, self.eps = len(layers), H, nh, nkv, hd, I, eps
        self._keep = (layers, ln1, ln2)
        ptrs = lambda ts: np.array([t.data_ptr() for t in ts], dtype=np.uint64)  # noqa: E731
        kws = lambda key: np.array([q4[key].k * q4[key].planes for q4 in layers], dtype=np.int32)  # noqa: E731
        self.w = {key: ptrs([q4[key].packed for q4 in layers]) for key in want}
        self.kw = {key: kws(key) for key in want}
        self.ln1, self.ln2 = ptrs(ln1), ptrs(ln2)

    def run(self, lib, x: torch.Tensor, kc: list, vc: list, T: int, rope: torch.Tensor, scale: float, feat: tuple = ()) -> Optional[torch.Tensor]:
        """x (n, H) fp32 contiguous, updated in place to the residual stream after the last layer; kc / vc: the cache's
        per-layer (1, nkv, capacity, hd) fp32 tensors (keys and values written at T..T+n-1); rope (n, hd/2, 2) fp32
        (cos, sin) for those positions. Returns x after each layer of ``feat`` as (n, len(feat) * H), or None."""
        n, cap = x.shape[0], kc[0].shape[2]
        if not (_plain(x) and x.shape[1] == self.H and rope.dtype == torch.float32 and rope.is_contiguous()
                and rope.numel() == n * self.hd and len(kc) == len(vc) == self.L):
            raise ValueError("the layer stack wants x (n, H) fp32, rope (n, hd/2, 2) fp32 and one K / V tensor per layer")
        kp = np.array([t.data_ptr() for t in kc], dtype=np.uint64)
        vp = np.array([t.data_ptr() for t in vc], dtype=np.uint64)
        fl = np.array(sorted(feat) or [0], dtype=np.int32)
        feats = torch.empty(n, len(feat) * self.H, dtype=torch.float32) if feat else None
        a = lambda arr: arr.ctypes.data  # noqa: E731
        with _label(LAYERS_LABEL):
            rc = lib.lowbit_layers(x.data_ptr(), n, self.H, self.L, self.nh, self.nkv, self.hd, self.I,
                                   a(self.w["qkv"]), a(self.kw["qkv"]), a(self.w["o"]), a(self.kw["o"]), a(self.w["gate_up"]),
                                   a(self.kw["gate_up"]), a(self.w["down"]), a(self.kw["down"]), a(self.ln1), a(self.ln2), self.eps,
                                   a(kp), a(vp), T, cap, rope.data_ptr(), scale, a(fl), len(feat),
                                   None if feats is None else feats.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the low-bit layer stack refused n {n}, T {T}, capacity {cap} (code {rc})")
        return feats


# ----------------------------------------------------------------------------- platform check


def reference(c, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in fp64 from its definition (each row's blocks quantised to int8, the integer
    dots, then d · dx and m · Σx per block): the oracle of the self-test and the tests."""
    x = x.float()
    k = x.shape[1]
    xb = x.reshape(x.shape[0], k // GROUP, GROUP)
    amax = xb.abs().amax(-1, keepdim=True)
    dx = amax / 127
    qx = torch.where(amax > 0, xb * (127 / amax), torch.zeros_like(xb)).round()  # round half to even, as cvtps
    xs = xb.sum(-1)  # (M, nb)
    d = torch.from_numpy(c.scale.double().numpy().astype(np.float16).astype(np.float64))
    mm = torch.from_numpy((c.zero.double().numpy() - 8 * c.scale.double().numpy()).astype(np.float16).astype(np.float64))
    nbw = c.q.shape[1] // GROUP
    qw = c.q.double().reshape(c.q.shape[0], nbw, GROUP)
    idx = torch.arange(nbw) % (k // GROUP)
    isum = torch.einsum("nbg,mbg->mnb", qw, qx[:, idx].double())
    return (isum * d[None] * dx[:, idx, 0].double()[:, None] + mm[None] * xs[:, idx].double()[:, None]).sum(-1)


def _self_test(lib) -> tuple:
    g = torch.Generator().manual_seed(0)
    for n, k, planes in ((44, 96, 1), (24, 64, 2)):  # a partial tile; two planes over one input
        c = Codes(torch.randint(0, 16, (n, k * planes), generator=g, dtype=torch.uint8),
                  torch.rand(n, k * planes // GROUP, generator=g) * 0.05 + 0.01, torch.randn(n, k * planes // GROUP, generator=g) * 0.1, planes)
        lin = LowbitLinear.from_codes(c)
        x = torch.randn(37, k, generator=g)
        y = lin.run(lib, x)
        ref = reference(c, x)
        err = (y.double() - ref).abs().max().item()
        if not err <= 1e-4 * ref.abs().max().item():
            return False, f"the low-bit kernel disagrees with its definition here (max error {err:.3g})"
        single = torch.cat([lin.run(lib, x[i : i + 1]) for i in range(x.shape[0])])
        for m in (2, 3, 4, 5, 8, 16, 37):
            if not torch.equal(lin.run(lib, x[:m]), single[:m]):
                return False, f"the low-bit kernel's rows depend on the row count here ({m} rows differ from one at a time)"
    # attention: against SDPA (fp32 rounding apart) and row by row
    nh, nkv, hd, cap, T, n = 6, 2, 64, 80, 41, 23
    kc, vc = torch.randn(1, nkv, cap, hd, generator=g), torch.randn(1, nkv, cap, hd, generator=g)
    qk = torch.randn(n, nh + nkv, hd, generator=g)
    y = attention_into(lib, qk, nh, kc, vc, T)
    import torch.nn.functional as F

    q = qk[:, :nh].transpose(0, 1).reshape(nkv, nh // nkv * n, hd)
    mask = torch.zeros(n, T + n).masked_fill_(torch.arange(T + n)[None] > torch.arange(T, T + n)[:, None], float("-inf")).repeat(nh // nkv, 1)
    ref = F.scaled_dot_product_attention(q[None], kc[:, :, : T + n], vc[:, :, : T + n], attn_mask=mask).reshape(nh, n, hd).transpose(0, 1).reshape(n, -1)
    err = (y - ref).abs().max().item()
    if not err <= 1e-4:
        return False, f"the low-bit attention disagrees with SDPA here (max error {err:.3g})"
    single = torch.cat([attention_into(lib, qk[i : i + 1], nh, kc, vc, T + i) for i in range(n)])
    if not torch.equal(y, single):
        return False, "the low-bit attention's rows depend on the row count here"
    return True, "row-invariant on this machine"


def status() -> KernelStatus:
    """Which kernel the int4 engine runs (built, loaded and self-tested once per process)."""
    if "status" not in _state:
        with _lock:
            if "status" not in _state:
                _state["status"] = _probe()
    return _state["status"]


def _probe() -> KernelStatus:
    fallback = "torch int4 kernel (_weight_int4pack_mm_for_cpu, bf16 activations)"
    if setting() == "off":
        return KernelStatus(False, fallback, "D3D_LOWBIT=off: the low-bit kernel is switched off, torch's int4 kernel runs")
    lib, why = _load()
    if lib is None:
        return KernelStatus(False, fallback, f"{why}; torch's int4 kernel runs instead")
    _state["lib"] = lib
    try:
        ok, test = _self_test(lib)
    except Exception as e:  # a crash in the self-test means: do not use it
        ok, test = False, f"the low-bit kernel's self-test failed ({type(e).__name__}: {str(e)[:160]})"
    if not ok:
        _state.pop("lib", None)
        return KernelStatus(False, fallback, f"{test}; torch's int4 kernel runs instead")
    return KernelStatus(True, KERNEL_NAME, f"{why}; {test}")


def library():
    """The loaded kernel library, or None when :func:`status` says it does not run here."""
    return _state.get("lib") if status().lowbit else None


def reset() -> None:
    """Forget the probe (tests switch ``D3D_LOWBIT`` and probe again)."""
    with _lock:
        _state.clear()


if __name__ == "__main__":  # scripts/setup_venv.sh: build at set-up, say what runs
    print(f"[setup] int4 engine GEMM: {status().kernel} ({status().reason})")
