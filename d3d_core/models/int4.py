"""The int4 engine's weights: the target's linears as 4-bit group-quantised weights for torch's CPU kernel.

``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)`` multiplies bf16 activations by a weight whose
element (n, k) is ``(q - 8) * scale + zero`` with q in 0..15 and one (scale, zero) pair per output row and group
of 32 inputs (``sz``: (K/32, N, 2) bf16), accumulating in fp32 and returning bf16. The weights come from the
bundled GGUF's own blocks, never re-quantised from fp32:

- **Q4_1** (every decoder-layer linear of SmolLM2-135M): 32 weights, fp16 scale d and fp16 minimum m,
  w = d·q + m. Exactly the kernel's form with scale = d, zero = m + 8·d; only the bf16 rounding of the two
  (relative 2^-9 each) separates the kernel's weights from the GGUF's (:func:`deviation_bound`).
- **Q8_0** (the token embedding, which is SmolLM2's tied LM head): 32 signed 8-bit q and an fp16 d, w = d·q.
  Split exactly into two 4-bit planes, q = 16·hi + lo (hi = q >> 4 in -8..7, lo = q & 15): plane 1 has codes
  hi + 8, scale 16·d, zero 0; plane 2 codes lo, scale d, zero 8·d. One kernel call over [x | x] against
  [plane 1 | plane 2] (K doubled, each group inside one plane) sums them: 8 bits a weight, a quarter of fp32's
  bytes, and the only change is bf16(d) for d.

Everything else stays as the fp32 fast engine has it: the embedding lookup (the Q8_0 values dequantised),
RMSNorm weights (F32 in the GGUF), RoPE, attention and the residual stream in fp32.

Two GEMM kernels run these codes; :func:`kernel_status` says which (the Race and Benchmarks tabs show it):

- **lowbit** (``lowbit.py``, the default where it builds: Linux x86-64 with AVX2, FMA, F16C and a C compiler): the
  codes with the GGUF's fp16 d and m exactly, 8-bit per-block activations, integer dots; reads each weight block
  once for all rows, so a verify of 8 rows costs far less than 8 steps;
- **torch** (``_weight_int4pack_mm_for_cpu``, the fallback, or ``D3D_LOWBIT=off``): bf16 activations, bf16 scale
  and zero, fp32 accumulation, bf16 out; re-reads and unpacks the weights for every row.

Either computes every output row on its own (the same accumulation order whatever the row count), which each
kernel's self-test checks on this machine, so a verify over B rows gives each row the logits a one-row step gives it
and every mode stays lossless against ``ar``.

Converted weights are cached under ``$D3D_CACHE/int4/`` (safetensors, keyed by GGUF, torch version and the CPU
capability the packing was done for) so later loads skip the conversion.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from . import lowbit
from .lowbit import Codes  # noqa: F401 (the codes are the kernel's input; int4.Codes is their name here too)

GROUP = 32  # weights per block in Q4_1 / Q8_0 and the kernel's group size here
FORMAT = 1  # cache layout version
_Q4_1_BYTES, _Q8_0_BYTES = 20, 34  # bytes per 32-weight block: d, m (fp16) + 16 nibble bytes; d (fp16) + 32 int8
_mm = None  # torch.ops.aten._weight_int4pack_mm_for_cpu, looked up once
_lock = threading.Lock()
_test: dict = {}


def _kernel():
    global _mm
    if _mm is None:
        _mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    return _mm


# ----------------------------------------------------------------------------- the format mapping


def q4_1_codes(raw: np.ndarray, k: int) -> Codes:
    """GGUF Q4_1 blocks (N, K/32*20 bytes) -> Codes with scale = d, zero = m + 8 d (w = d q + m)."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, k // GROUP, _Q4_1_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = b[..., 4:]  # byte j holds element j (low nibble) and element j + 16 (high nibble)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return Codes(torch.from_numpy(q), torch.from_numpy(d).float(), torch.from_numpy(m + 8 * d).float())


def q8_0_codes(raw: np.ndarray, k: int) -> Codes:
    """GGUF Q8_0 blocks (N, K/32*34 bytes) -> two exact 4-bit planes: q = 16 hi + lo,
    plane 1: codes hi + 8, scale 16 d, zero 0; plane 2: codes lo, scale d, zero 8 d."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, k // GROUP, _Q8_0_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).reshape(n, k)
    hi, lo = (q >> 4).astype(np.int16) + 8, (q & 0x0F).astype(np.int16)  # arithmetic shift: hi in -8..7
    codes = np.concatenate([hi, lo], axis=1).astype(np.uint8)
    dt = torch.from_numpy(d)
    return Codes(torch.from_numpy(codes), torch.cat([16 * dt, dt], 1), torch.cat([torch.zeros_like(dt), 8 * dt], 1), planes=2)


def quantize_codes(w: torch.Tensor, planes: int = 1) -> Codes:
    """Blocks computed from an fp32 weight the way llama.cpp quantises (Q4_1 for planes=1, Q8_0 for
    planes=2) — only for targets without a GGUF (the toy targets of the tests)."""
    from gguf import quants

    w = w.detach().float().contiguous().numpy()
    n, k = w.shape
    if planes == 1:
        return q4_1_codes(quants.Q4_1.quantize_blocks(w.reshape(-1, GROUP)).reshape(n, -1), k)
    return q8_0_codes(quants.Q8_0.quantize_blocks(w.reshape(-1, GROUP)).reshape(n, -1), k)


def bf16_pair(c: Codes) -> tuple:
    """(scale, zero) as the kernel holds them: bf16."""
    return c.scale.bfloat16(), c.zero.bfloat16()


def effective_weight(c: Codes) -> torch.Tensor:
    """The (N, K) fp64 weight the kernel multiplies by: (q - 8) * bf16(scale) + bf16(zero), planes summed."""
    s, z = (t.double().repeat_interleave(GROUP, 1) for t in bf16_pair(c))
    w = (c.q.double() - 8) * s + z
    if c.planes == 2:
        half = w.shape[1] // 2
        w = w[:, :half] + w[:, half:]
    return w


def kernel_weight(c: Codes) -> torch.Tensor:
    """The (N, K) fp64 weight the kernel that runs here multiplies by (:func:`kernel_status`)."""
    return lowbit.packed_weight(c) if kernel_status().lowbit else effective_weight(c)


def exact_weight(c: Codes) -> torch.Tensor:
    """The (N, K) fp64 weight the block format itself means (no bf16): the GGUF's dequantised values."""
    s, z = (t.double().repeat_interleave(GROUP, 1) for t in (c.scale, c.zero))
    w = (c.q.double() - 8) * s + z
    if c.planes == 2:
        half = w.shape[1] // 2
        w = w[:, :half] + w[:, half:]
    return w


def deviation_bound(c: Codes) -> float:
    """The largest |effective - exact| the bf16 rounding of scale and zero can cause for these codes:
    |q - 8| * |δscale| + |δzero| per group (each plane's, summed), the δ the actual rounding errors."""
    s, z = bf16_pair(c)
    ds, dz = (s.double() - c.scale.double()).abs(), (z.double() - c.zero.double()).abs()
    qmax = (c.q.double() - 8).abs().reshape(c.q.shape[0], -1, GROUP).amax(-1)
    per = qmax * ds + dz  # (N, groups)
    if c.planes == 2:
        g = per.shape[1] // 2
        per = per[:, :g] + per[:, g:]
    return float(per.max())


# ----------------------------------------------------------------------------- the linear


class Int4Linear:
    """One packed weight: ``self(x)`` = x @ W.T through the int4 kernel; x (M, K) float32 or bf16 -> (M, N) bf16."""

    __slots__ = ("packed", "sz", "n", "k", "planes")

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, n: int, k: int, planes: int = 1):
        self.packed, self.sz, self.n, self.k, self.planes = packed, sz, n, k, planes

    @classmethod
    def from_codes(cls, c: Codes) -> "Int4Linear":
        n, kk = c.q.shape
        pad = -n % 16  # the kernel runs output rows in blocks of 16
        q, s, z = c.q, *bf16_pair(c)
        if pad:
            q = torch.cat([q, q.new_full((pad, kk), 8)])
            s, z = torch.cat([s, s.new_zeros(pad, s.shape[1])]), torch.cat([z, z.new_zeros(pad, z.shape[1])])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()  # (groups, N, 2) bf16
        return cls(packed, sz, n, kk // c.planes, c.planes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.planes == 2:
            x = torch.cat([x, x], -1)
        y = _kernel()(x if x.is_contiguous() else x.contiguous(), self.packed, GROUP, self.sz)
        return y if y.shape[-1] == self.n else y[:, : self.n]

    def tensors(self, prefix: str) -> dict:
        return {prefix + ".packed": self.packed, prefix + ".sz": self.sz}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.sz))


@dataclass
class Int4Weights:
    """Every int4 linear of a target, in the fast engine's layout: per layer ``qkv`` (q|k|v rows, q and k with
    their rotary halves interleaved as ``Target._prep_qkv`` does), ``o``, ``gate_up`` (gate|up rows), ``down``;
    and ``head`` (None: the LM head stays fp32), each an ``Int4Linear`` (torch's kernel) or a ``lowbit.LowbitLinear``
    (``kernel``). ``info`` says what went int4, what stayed as it was, and which kernel runs."""

    layers: list
    head: Optional[Int4Linear]
    info: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        lins = [lin for d in self.layers for lin in d.values()] + ([self.head] if self.head else [])
        return sum(lin.nbytes() for lin in lins)

    @property
    def kernel(self) -> str:
        """"lowbit" or "torch": which GEMM these weights were packed for."""
        lins = [lin for d in self.layers for lin in d.values()] + ([self.head] if self.head else [])
        return "lowbit" if lins and isinstance(lins[0], lowbit.LowbitLinear) else "torch"


LAYER_PARTS = ("qkv", "o", "gate_up", "down")


def kernel_status() -> lowbit.KernelStatus:
    """Which GEMM the int4 engine packs its weights for and runs: the low-bit kernel where it builds and passes its
    self-test here (``lowbit.status``), else torch's int4 kernel."""
    return lowbit.status()


def usable() -> tuple:
    """(usable, reason): can the int4 engine run here at all (either kernel)?"""
    st = kernel_status()
    if st.lowbit:
        return True, st.kernel
    ok, why = self_test()
    return ok, (f"{why} ({st.reason})" if ok else f"{why}; and {st.reason}")


def make_linear(c: Codes):
    """The linear for these codes on the kernel that runs here."""
    return lowbit.LowbitLinear.from_codes(c) if kernel_status().lowbit else Int4Linear.from_codes(c)


def _from_codes(layers: list, head: Optional[Codes], info: dict) -> Int4Weights:
    return Int4Weights([{k: make_linear(c) for k, c in d.items()} for d in layers], make_linear(head) if head is not None else None, info)


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class GGUFSource:
    """Where a target's int4 weights come from: its GGUF, and the directory the packed cache lives in."""

    gguf: Path
    cache: Path

    def describe(self) -> str:
        return f"GGUF {self.gguf.name}"


QUANTIZE_FP32 = "quantize-fp32"  # targets without a GGUF (toy): Q4_1 / Q8_0 blocks computed from the fp32 weights


def _unpermute(c: Codes, n_head: int) -> Codes:
    """llama.cpp stores q / k rows per head as (half, 2); Hugging Face as (2, half) — transformers'
    GGUF loader's reverse permutation, applied to the codes so they line up with the fp32 weights."""
    n = c.q.shape[0]
    half = n // n_head // 2
    idx = torch.arange(n).reshape(n_head, half, 2).transpose(1, 2).reshape(n)
    return c.rows(idx)


def gguf_codes(path: Path, arch) -> tuple:
    """(per-layer dict of Codes by GGUF role, head Codes or None, info) from a GGUF's raw blocks, rows in
    Hugging Face order. Roles whose tensor is not Q4_1 are left out (they stay fp32); the head is taken
    from ``output.weight`` or the tied ``token_embd.weight`` when Q4_1 or Q8_0."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    types: dict = {}
    for t in r.tensors:
        types.setdefault(t.tensor_type.name, []).append(t.name)
    roles = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
    layers, kept = [], []
    for i in range(arch.num_target_layers):
        d = {}
        for role, g in roles.items():
            t = tensors[f"blk.{i}.{g}.weight"]
            k = int(t.shape[0])
            if t.tensor_type == T.Q4_1:
                c = q4_1_codes(np.asarray(t.data), k)
                if role == "q":
                    c = _unpermute(c, arch.num_attention_heads)
                elif role == "k":
                    c = _unpermute(c, arch.num_key_value_heads)
                d[role] = c
            else:
                kept.append(f"blk.{i}.{g} ({t.tensor_type.name})")
        layers.append(d)
    ht = tensors.get("output.weight") or tensors.get("token_embd.weight")
    head = None
    if ht is not None and ht.tensor_type in (T.Q4_1, T.Q8_0):
        k = int(ht.shape[0])
        head = q4_1_codes(np.asarray(ht.data), k) if ht.tensor_type == T.Q4_1 else q8_0_codes(np.asarray(ht.data), k)
    info = {"source": f"GGUF {Path(path).name}", "tensor_types": {k: len(v) for k, v in types.items()},
            "head_tensor": None if ht is None else f"{ht.name} ({ht.tensor_type.name})", "not_int4": kept}
    return layers, head, info


def codes_from_target(target) -> tuple:
    """The toy path: Q4_1 blocks for every layer linear and Q8_0 for the head, computed from fp32 weights."""
    layers = []
    for layer in target.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append({r: quantize_codes(mod.weight) for r, mod in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                                                                      ("gate", m.gate_proj), ("up", m.up_proj), ("down", m.down_proj))})
    head = quantize_codes(target.shared.lm_head.weight, planes=2)
    return layers, head, {"source": "Q4_1 / Q8_0 blocks computed from the fp32 weights (a target without a GGUF)", "not_int4": []}


def _check(target) -> Optional[str]:
    """Why this target's linears cannot run as int4 (biases, group size), or None."""
    for layer in target.layers:
        for mod in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            if mod.bias is not None:
                return "the int4 engine has no bias path (this target's linears have biases)"
            if mod.weight.shape[1] % GROUP:
                return f"a linear's input size {mod.weight.shape[1]} is not a multiple of the group size {GROUP}"
    return None


def _cache_file(src: GGUFSource) -> Path:
    st = src.gguf.stat()
    kernel = f"lowbit{lowbit.VERSION}" if kernel_status().lowbit else f"torch{torch.__version__.split('+')[0]}-{torch.backends.cpu.get_cpu_capability()}"
    tag = f"{src.gguf.stem}-{st.st_size}-{kernel}-v{FORMAT}"
    return src.cache / f"{tag}.safetensors"


def _cached_linear(t: dict, key: str, shape: list):
    """A linear saved under ``key`` (``tensors(key)``), on whichever kernel it was packed for."""
    if f"{key}.lowbit" in t:
        return lowbit.LowbitLinear(t[f"{key}.lowbit"], *shape)
    return Int4Linear(t[f"{key}.packed"], t[f"{key}.sz"], *shape)


def load(target, source) -> Int4Weights:
    """The target's int4 weights from ``source`` (a GGUFSource, or QUANTIZE_FP32), through the packed cache."""
    why = _check(target)
    if why:
        raise ValueError(why)
    if source == QUANTIZE_FP32:
        layers, head, info = codes_from_target(target)
        w = _from_codes([_full_layer(d, target) for d in layers], head, info)
        return _described(w)
    from safetensors.torch import load_file, save_file

    path = _cache_file(source)
    if path.is_file():
        t = load_file(str(path))
        with open(path, "rb") as f:  # the metadata: which linears, what stayed fp32
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n)).get("__metadata__", {})
        info = json.loads(meta.get("info", "{}"))
        shapes = json.loads(meta.get("shapes", "{}"))
        layers = [{p: _cached_linear(t, f"{i}.{p}", shapes[f"{i}.{p}"]) for p in LAYER_PARTS if f"{i}.{p}" in shapes}
                  for i in range(len(target.layers))]
        head = _cached_linear(t, "head", shapes["head"]) if "head" in shapes else None
        info["cache"] = f"loaded {path}"
        return _described(Int4Weights(layers, head, info))
    layers, head, info = gguf_codes(source.gguf, target.arch)
    w = _from_codes([_full_layer(d, target) for d in layers], head, info)
    tensors, shapes = {}, {}
    for i, d in enumerate(w.layers):
        for p, lin in d.items():
            tensors.update(lin.tensors(f"{i}.{p}"))
            shapes[f"{i}.{p}"] = [lin.n, lin.k, lin.planes]
    if w.head is not None:
        tensors.update(w.head.tensors("head"))
        shapes["head"] = [w.head.n, w.head.k, w.head.planes]
    source.cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"info": json.dumps(info), "shapes": json.dumps(shapes)})
    os.replace(tmp, path)
    info["cache"] = f"converted and saved {path}"
    return _described(w)


def _full_layer(d: dict, target) -> dict:
    """Fuse a layer's role codes into the engine's linears; a fused linear whose parts are not all int4 stays fp32."""
    out = {}
    if all(r in d for r in ("q", "k", "v")):
        qkv = Codes.cat([d["q"], d["k"], d["v"]])
        target._fast_tables()
        out["qkv"] = qkv.rows(target._prep_qkv(torch.arange(qkv.q.shape[0])[:, None], None)[0][:, 0])  # the engine's q|k|v row order
    if "o" in d:
        out["o"] = d["o"]
    if "gate" in d and "up" in d:
        out["gate_up"] = Codes.cat([d["gate"], d["up"]])
    if "down" in d:
        out["down"] = d["down"]
    return out


def _described(w: Int4Weights) -> Int4Weights:
    n_int4 = sum(len(d) for d in w.layers)
    full = all(len(d) == len(LAYER_PARTS) for d in w.layers)
    head = "none" if w.head is None else ("two exact 4-bit planes of its Q8_0 blocks" if w.head.planes == 2 else "4-bit")
    st = kernel_status()
    low = w.kernel == "lowbit"
    w.info.update({
        "kernel": st.kernel if low == st.lowbit else ("lowbit" if low else "torch int4 kernel"), "kernel_reason": st.reason,
        "int4_linears": n_int4, "all_layer_linears_int4": full, "lm_head": "int4 (" + head + ")" if w.head is not None else "fp32 (no Q4_1 / Q8_0 head tensor)",
        "int4_mb": round(w.nbytes() / 2**20, 1),
        "stays_fp32": "token embedding lookup (dequantised), RMSNorm weights, RoPE, attention, residual stream"
                      + ("" if full else "; layer linears listed in not_int4") + ("" if w.head is not None else "; LM head"),
        "activations": ("8-bit per block of 32 into each GEMM (integer dots, fp32 accumulation and out)" if low
                        else "bf16 into each int4 GEMM (fp32 accumulation, bf16 out)"),
    })
    return w


# ----------------------------------------------------------------------------- platform check


def self_test() -> tuple:
    """(usable, reason), once per process: the kernel runs, computes (q - 8) * scale + zero with (groups, N, 2)
    scales and zeros, and gives every row the same result whatever the row count (what lossless needs)."""
    if "r" not in _test:
        with _lock:
            if "r" not in _test:
                _test["r"] = _run_self_test()
    return _test["r"]


def _run_self_test() -> tuple:
    try:
        g = torch.Generator().manual_seed(0)
        n, k = 80, 96
        c = Codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                  torch.rand(n, k // GROUP, generator=g) * 0.05 + 0.01, torch.randn(n, k // GROUP, generator=g) * 0.1)
        lin = Int4Linear.from_codes(c)
        x = torch.randn(37, k, generator=g).bfloat16()
        y = lin(x)
        ref = x.double() @ effective_weight(c).T
        err = (y.double() - ref).abs().max().item()
        if err > 0.02 * ref.abs().max().item():
            return False, f"int4 kernel disagrees with (q - 8) * scale + zero (max error {err:.3g})"
        single = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])
        for m in (2, 3, 5, 8, 16, 37):
            if not torch.equal(lin(x[:m]), single[:m]):
                return False, f"int4 kernel's rows depend on the row count here ({m} rows differ from one at a time): verify could not match ar"
        return True, f"torch int4 weight-only kernel (CPU {torch.backends.cpu.get_cpu_capability()}, bf16 activations, group {GROUP})"
    except Exception as e:  # missing op, unsupported platform
        return False, f"int4 kernel unavailable ({type(e).__name__}: {str(e)[:120]})"


# ----------------------------------------------------------------------------- the target's forward on these weights

ATTN_BUCKET = 64  # torch's kernel path: attention key lengths in multiples of this (attention_groups)


def attention_groups(T: int, n: int, g: int) -> list:
    """The int4 engine's attention plan on torch's kernel, for a forward of n rows at positions T..T+n-1 (g query heads
    per KV head): [(a, a+1, L, mask)], one group per row — row a attends over the first L cached keys, L its position's
    bucket end (a multiple of ATTN_BUCKET), keys past its own position masked. Each row is its own SDPA call, the very
    call a one-row step at that position makes: torch's CPU SDPA gives a row a result 1 ulp away from the same row
    inside a call of several rows (measured on an AVX2 EPYC, torch 2.13), and the int4 engine's bf16 rounding does not
    always hide it, so a verify over B rows must give every row the bits a one-row step gives it by making the same
    call. The int4 GEMMs (each row computed alone) then see the same values."""
    out, keys = [], None
    for a in range(n):
        p = T + a
        L = p // ATTN_BUCKET * ATTN_BUCKET + ATTN_BUCKET
        if keys is None or keys.numel() != L:
            keys = torch.arange(L)
        m = torch.zeros(1, L).masked_fill_(keys[None] > p, float("-inf"))
        out.append((a, a + 1, L, m.repeat(g, 1)))
    return out


def layer_stack(w4: Int4Weights, fast_layers: list, arch) -> Optional[lowbit.LayerStack]:
    """The target's Llama-style layers (their ``ln1`` / ``ln2`` norm weights and these int4 weights) as one
    ``lowbit.LayerStack`` call, or None where the weights are not all low-bit ones of the expected shapes."""
    try:
        return lowbit.LayerStack(w4.layers, [fl.ln1 for fl in fast_layers], [fl.ln2 for fl in fast_layers], arch.hidden_size,
                                 arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.intermediate_size,
                                 arch.rms_norm_eps)
    except ValueError:
        return None

