"""The parts every drafter shares, in one file you can read top to bottom: the decoder layer (attention, MLP, the
rank-r row adapter), the drafter's own KV cache, and the target's parts a drafter borrows (``SharedParts``).

The layers copy the target's decoder-layer shape (Llama / Qwen3) and its HF parameter names, so a target layer's
state dict loads straight in. The drafters built from them: ``d3d.py`` (standalone, a context stream of its own),
``dflash.py`` (target-conditioned), ``adapter.py`` (a D3D drafter over the target's own layers) and ``standalone.py``
(a D3D drafter of its own shape, from a causal-LM checkpoint); ``loader.py`` reads any of them from a directory.

Shapes: the engine decodes one sequence at a time, so tensors carry a leading batch of 1.
``T`` = cached positions, ``N`` = query positions in this forward, ``H`` = hidden size,
``nh``/``nkv`` = query / key-value heads, ``hd`` = head dim, ``V`` = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fastops

NEG_INF = -1e9  # additive mask value; finite so fully-masked rows never produce NaN


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor (ids, positions, a mask built on the CPU) on ``device`` without making the host wait: on CUDA it
    goes through pinned memory with a non-blocking copy on the current stream (a copy from pageable memory
    synchronises that stream first); elsewhere ``t.to(device)``, which on the CPU is ``t`` itself (no copy)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def additive_mask(allowed: torch.Tensor, dtype, device) -> torch.Tensor:
    """bool (N, K) "may attend" -> float additive mask (1, 1, N, K): 0 or NEG_INF.
    Float, not bool: a bool mask is silently wrong with some kernels (DESIGN §6)."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, NEG_INF)
    return to_device(mask, device)[None, None]


# ----------------------------------------------------------------------------- the layer shape


@dataclass(frozen=True)
class ArchConfig:
    """The target's decoder-layer shape, which the drafters copy (a standalone drafter: its own)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
    attention_bias: bool = False
    mlp_bias: bool = False
    num_target_layers: int = 0

    @classmethod
    def from_hf(cls, cfg) -> "ArchConfig":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            vocab_size=cfg.vocab_size,
            qk_norm=cfg.model_type.startswith("qwen3"),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            num_target_layers=cfg.num_hidden_layers,
        )


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32 and not torch.is_grad_enabled():  # one fused op where it is the same sum
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    # x: (1, heads, N, hd); cos/sin: (1, N, hd) -> broadcast over heads
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Attention(nn.Module):
    """GQA attention with parameter names of the HF Llama/Qwen3 layers, so a target
    layer's state dict loads straight in. Keys = cached keys + this forward's keys."""

    def __init__(self, a: ArchConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.nh * self.hd, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.nkv * self.hd, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.nkv * self.hd, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, a.hidden_size, bias=a.attention_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(self.hd, a.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, a.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_kv(self, x, cos, sin):
        """x: (1, N, H) -> k, v: (1, nkv, N, hd), RoPE applied to k."""
        k, v = fastops.fused_linear(self, "kv", [self.k_proj, self.v_proj], x)
        return self._shape_kv(k, v, cos, sin)

    def _shape_kv(self, k, v, cos, sin):
        n = k.shape[1]
        k = k.reshape(1, n, self.nkv, self.hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.reshape(1, n, self.nkv, self.hd).transpose(1, 2)
        return k, v

    def forward(self, x, cos, sin, past, mask):
        """x: (1, N, H); past: a cache's CachedKV, (k, v) each (1, nkv, T, hd), or None; mask:
        (1, 1, N, T+N) additive float. Returns the output (1, N, H) and this forward's (k, v)."""
        n = x.shape[1]
        q, k_new, v_new = fastops.fused_linear(self, "qkv", [self.q_proj, self.k_proj, self.v_proj], x)
        q = q.reshape(1, n, self.nh, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (1, nh, N, hd)
        k_new, v_new = self._shape_kv(k_new, v_new, cos, sin)
        if isinstance(past, CachedKV):
            k, v = past.join(k_new, v_new)
        elif past is not None and past[0].shape[2] > 0:
            k = torch.cat([past[0], k_new], dim=2)
            v = torch.cat([past[1], v_new], dim=2)
        else:
            k, v = k_new, v_new
        # float additive mask: bool masks are silently wrong with some kernels (DESIGN §6)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=self.nkv != self.nh)
        y = y.transpose(1, 2).reshape(1, n, self.nh * self.hd)
        return fastops.linear(self.o_proj, y), (k_new, v_new)


class MLP(nn.Module):
    def __init__(self, a: ArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x):
        gate, up = fastops.fused_linear(self, "gate_up", [self.gate_proj, self.up_proj], x)
        return fastops.linear(self.down_proj, F.silu(gate) * up)


class RowAdapter(nn.Module):
    """Rank-r residual adapter up(silu(down(x))), added to a sublayer's output on chosen rows only.
    ``up`` starts at zero, so a fresh adapter changes nothing."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.down.weight, std=dim**-0.5)
        nn.init.zeros_(self.up.weight)

    def forward(self, x, rows):
        """x: (1, N, H) sublayer input; rows: (1, N, 1) 0/1 -> (1, N, H), zero outside rows."""
        return rows * self.up(F.silu(self.down(x)))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer, HF parameter names (input_layernorm, self_attn, ...). With adapter_rank > 0
    it adds RowAdapters beside attention and MLP, applied where ``rows`` is 1 (DrafterConfig.adapter_rank)."""

    def __init__(self, a: ArchConfig, adapter_rank: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)
        if adapter_rank:
            self.adapter_attn = RowAdapter(a.hidden_size, adapter_rank)
            self.adapter_mlp = RowAdapter(a.hidden_size, adapter_rank)

    def forward(self, x, cos, sin, past, mask, rows=None):
        hx = self.input_layernorm(x)
        h, kv = self.self_attn(hx, cos, sin, past, mask)
        if rows is not None:
            h = h + self.adapter_attn(hx, rows)
        x = x + h
        hx = self.post_attention_layernorm(x)
        h = self.mlp(hx)
        if rows is not None:
            h = h + self.adapter_mlp(hx, rows)
        return x + h, kv


# ----------------------------------------------------------------------------- KV cache and the target's parts


class KVCache:
    """The drafter's own per-layer KV cache for committed positions 0..T-1, in preallocated buffers
    (1, nkv, capacity, hd) that grow by doubling: committing appends in place and rollback only
    moves a length, so the history is never copied. ``get(i)`` hands a layer's :class:`CachedKV`."""

    def __init__(self, num_layers: int):
        self.k: list = [None] * num_layers
        self.v: list = [None] * num_layers
        self.n: list = [0] * num_layers

    def __len__(self) -> int:
        for i, k in enumerate(self.k):
            if k is not None:
                return self.n[i]
        return 0

    def get(self, i):
        return None if self.k[i] is None else CachedKV(self, i)

    # the buffers are inference tensors (written in place, never part of a graph): every write runs in inference mode
    @torch.inference_mode()
    def reserve(self, i: int, total: int, like: torch.Tensor) -> None:
        """Room for ``total`` positions in layer i (like: a (1, nkv, n, hd) tensor)."""
        k = self.k[i]
        if k is not None and k.shape[2] >= total:
            return
        cap = max(total, 256, 2 * (k.shape[2] if k is not None else 0))
        nk, nv = (like.new_empty(like.shape[0], like.shape[1], cap, like.shape[3]) for _ in range(2))
        if k is not None:
            nk[:, :, : self.n[i]] = k[:, :, : self.n[i]]
            nv[:, :, : self.n[i]] = self.v[i][:, :, : self.n[i]]
        self.k[i], self.v[i] = nk, nv

    @torch.inference_mode()
    def write(self, i: int, k, v) -> int:
        """Write k, v (1, nkv, n, hd) at positions T..T+n-1 of layer i without committing them; returns T + n."""
        T, n = self.n[i], k.shape[2]
        self.reserve(i, T + n, k)
        self.k[i][:, :, T : T + n] = k
        self.v[i][:, :, T : T + n] = v
        return T + n

    def append(self, i: int, k, v):
        self.n[i] = self.write(i, k, v)

    def crop(self, length: int):
        self.n = [min(n, length) for n in self.n]


class CachedKV:
    """One layer's committed keys and values: ``kv[0]``, ``kv[1]`` are (1, nkv, T, hd) views, and
    ``join`` gives a forward its keys (cached + its own) by writing its own into the spare room
    past T — uncommitted until ``append`` — instead of concatenating a copy of the history."""

    def __init__(self, cache: KVCache, i: int):
        self.cache, self.i = cache, i

    def __getitem__(self, j: int) -> torch.Tensor:
        c = self.cache
        return (c.k, c.v)[j][self.i][:, :, : c.n[self.i]]

    def join(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple:
        c, i = self.cache, self.i
        if k_new.requires_grad:  # training through a cache: keep autograd's copy
            return torch.cat([self[0], k_new], dim=2), torch.cat([self[1], v_new], dim=2)
        end = c.write(i, k_new, v_new)  # uncommitted: the length stays T
        return c.k[i][:, :, :end], c.v[i][:, :, :end]


class SharedParts:
    """The target's frozen parts a drafter borrows (never saved with the drafter)."""

    def __init__(self, embed_tokens: nn.Module, lm_head: nn.Module, rotary_emb: nn.Module,
                 target_layers: Optional[nn.ModuleList] = None, final_norm: Optional[nn.Module] = None):
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.rotary_emb = rotary_emb
        # the target's decoder layers and final norm: what an adapter drafter's frozen base is rebuilt from
        self.target_layers = target_layers
        self.final_norm = final_norm

    def rope(self, positions: torch.Tensor, like: torch.Tensor, need: Optional[int] = None):
        """positions: (N,) long -> cos, sin: (1, N, hd). Under autograd the rotary embedding runs
        as is; otherwise rows of a table it computed once (elementwise, so the same values).
        ``need``: the largest position + 1, from a caller that knows it (the decode's forwards do): reading
        ``positions.max()`` off a GPU tensor would make the host wait for the stream."""
        if torch.is_grad_enabled():
            return self.rotary_emb(like, positions[None])
        if need is None:
            need = int(positions.max()) + 1 if positions.numel() else 0
        tables = self.__dict__.setdefault("_rope_tables", {})  # one per (dtype, device): fp32 features beside bf16 blocks
        key = (like.dtype, like.device)
        table = tables.get(key)
        if table is None or table[0].shape[1] < need:  # grows by doubling only when a longer one is needed
            n = max(need, 1024, 2 * table[0].shape[1] if table is not None else 0)
            with torch.inference_mode():
                table = self.rotary_emb(like, torch.arange(n, device=like.device)[None])
            tables[key] = table
        cos, sin = table
        return cos[:, positions], sin[:, positions]
