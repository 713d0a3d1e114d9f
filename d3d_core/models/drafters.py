"""The two block-diffusion drafters, in one file you can read top to bottom.

Both drafters reuse the target's layer shape (Llama / Qwen3 decoder layers), share the
target's frozen token embedding, LM head and rotary embedding, and draft a whole block
``[anchor, MASK x (B-1)]`` in one forward (same-position prediction: the output at block
position k predicts the token at position s+k).

- ``DFlashDrafter`` (target-conditioned): hidden states of a few target layers are fused
  (``Linear(n*H -> H)`` + RMSNorm) and injected as extra keys/values in every drafter
  layer. It cannot draft the next block before the target has verified this one.
- ``D3DDrafter`` (standalone): no target features. Committed tokens run through the
  same stack as a causal *context stream* written to the drafter's own KV cache; blocks
  attend to that cache. Because it needs nothing from the target, it can draft while
  the target verifies (the ``d3d-async`` mode, see ``engine.py``).

A D3D drafter may also be **standalone** (``DrafterConfig.standalone``, loaded by ``standalone.py`` from a causal-LM
checkpoint): its own width, depth, heads, embedding, LM head and rotary embedding, same vocabulary, same D3D rules.

Shapes: the engine decodes one sequence at a time, so tensors carry a leading batch of 1.
``T`` = cached positions, ``N`` = query positions in this forward, ``H`` = hidden size,
``nh``/``nkv`` = query / key-value heads, ``hd`` = head dim, ``V`` = vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

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


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class ArchConfig:
    """The target's decoder-layer shape, which both drafters copy."""

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


@dataclass(frozen=True)
class DrafterConfig:
    """Everything needed to rebuild a drafter (saved as JSON next to its weights)."""

    kind: str  # "d3d" or "dflash"
    arch: ArchConfig
    num_layers: int
    block_size: int = 8  # block size it was trained for; any B >= 2 runs
    init_layers: tuple = ()  # target layers the drafter layers were initialised from
    target_layer_ids: tuple = ()  # dflash only: target layers whose hidden states are fused
    skip_layers: tuple = ()  # pruned layers: their residual stream passes through
    mask_token_id: Optional[int] = None  # dflash checkpoints may name a vocab mask token
    training: dict = field(default_factory=dict)  # how it was trained (data, steps, offline tau)
    # token ids the drafter may draft (empty = the whole vocabulary); see _DrafterBase.logits
    vocab_shortlist: tuple = ()
    # where draft 1 is read (d3d): "mask" = the first MASK slot's output; "anchor" = the anchor slot's own
    # next-token output (it saw the same context plus the anchor; measured +1.8 % offline τ, see RESULTS)
    first_draft: str = "mask"
    # what a D3D block's anchor slot attends to: "block" = the context prefix and its whole block (bidirectional,
    # the shipped drafters); "causal" = the context prefix and itself only, so in a full-depth target-initialised
    # drafter the anchor slot computes exactly the target's next-token prediction (issue #15, lever 5)
    anchor_attention: str = "block"
    # 0: every drafter weight is its own (the shipped drafters). r > 0 (D3D): the layers are the target's layers init_layers,
    # frozen and shared with it (the same tensors, no copy: rebuild_base) at load time, never saved; each layer adds a rank-r residual
    # adapter (RowAdapter) on the MASK slots' rows only. Context and anchor rows then compute exactly what the target
    # computes, so with a causal anchor slot at full depth draft 1 stays the target's token however training goes
    # (issue #15, "protect the anchor path"), and the saved drafter is the adapters alone
    adapter_rank: int = 0
    # True (D3D): a standalone drafter of its own shape — its own width, depth, heads, embedding, LM head and rotary embedding
    # (``arch`` is then the drafter's own, not the target's; same vocabulary), loaded from a causal-LM checkpoint (``standalone``)
    standalone: bool = False

    def __post_init__(self):
        if self.anchor_attention not in ANCHOR_ATTENTION_RULES:
            raise ValueError(f"drafter config: anchor_attention must be one of {', '.join(ANCHOR_ATTENTION_RULES)}, "
                             f"got {self.anchor_attention!r}")
        if self.anchor_attention != "block" and self.kind != "d3d":
            raise ValueError("drafter config: anchor_attention applies to D3D drafters only")
        if self.first_draft not in FIRST_DRAFT_RULES:
            raise ValueError(f"drafter config: first_draft must be one of {', '.join(FIRST_DRAFT_RULES)}, got {self.first_draft!r}")
        if self.first_draft == "anchor" and self.kind != "d3d":
            raise ValueError("drafter config: first_draft='anchor' needs a D3D drafter (its anchor slot has a context stream behind it)")
        if self.adapter_rank < 0:
            raise ValueError(f"drafter config: adapter_rank must be >= 0, got {self.adapter_rank}")
        if self.adapter_rank and self.kind != "d3d":
            raise ValueError("drafter config: adapter_rank applies to D3D drafters only (their MASK slots carry the adapters)")
        if self.standalone and (self.kind != "d3d" or self.adapter_rank):
            raise ValueError("drafter config: standalone applies to D3D drafters without adapters (they own every weight)")

    def describe(self) -> str:
        """One short line naming the drafter this config builds (a trace's ``drafter``, the app's picker and columns)."""
        name = {"d3d": "D3D", "dflash": "DFlash"}.get(self.kind, self.kind)
        n = self.num_layers - len(self.skip_layers)
        text = f"{name} drafter, {n} layer{'s' if n != 1 else ''}"
        if self.standalone:
            text = f"{name} standalone drafter, {n} layer{'s' if n != 1 else ''} (own width {self.arch.hidden_size}, embedding and LM head)"
        if self.adapter_rank and not self.training:
            text = f"{name} shared-weight adapter drafter, {n} layer{'s' if n != 1 else ''} (the target's own, + rank-{self.adapter_rank} adapters"
            text += ", untrained adapters: draft 1 = target's token)" if self.first_draft_is_targets() else ", untrained)"
        elif self.adapter_rank:
            text = f"{name} shared-weight adapter drafter, {n} layer{'s' if n != 1 else ''} (the target's own, + trained rank-{self.adapter_rank} adapters)"
        if self.skip_layers:
            text += f", layer{'s' if len(self.skip_layers) > 1 else ''} {sorted(self.skip_layers)} of {self.num_layers} skipped"
        return text

    def first_draft_is_targets(self) -> bool:
        """Whether draft 1 is the target's own next-token prediction whatever the adapters learn: an adapter drafter
        over all of the target's layers, in order, none skipped, reading draft 1 at a causal anchor slot (issue #15)."""
        return (self.kind == "d3d" and self.adapter_rank > 0 and self.first_draft == "anchor" and self.anchor_attention == "causal"
                and not self.skip_layers and tuple(self.init_layers) == tuple(range(self.arch.num_target_layers)))

    def to_json(self) -> dict:
        d = asdict(self)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "DrafterConfig":
        d = dict(d)
        arch = ArchConfig(**d.pop("arch"))
        for k in ("init_layers", "target_layer_ids", "skip_layers", "vocab_shortlist"):
            d[k] = tuple(int(x) for x in (d.get(k) or ()))
        return cls(arch=arch, **d)


FIRST_DRAFT_RULES = ("mask", "anchor")
ANCHOR_ATTENTION_RULES = ("block", "causal")


def evenly_spaced(n: int, lo: int, hi: int) -> tuple:
    """n integers evenly spaced in [lo, hi] (DFlash picks target layers this way)."""
    if n <= 0:
        return ()
    if n == 1:
        return (int(round((lo + hi) / 2)),)
    return tuple(int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n))


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


# ----------------------------------------------------------------------------- KV cache


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


def _share_weights(mine: nn.Module, theirs: nn.Module, what: str, skip: str = "") -> None:
    """Make every parameter of ``theirs`` the weight of the same name in ``mine``, shared: ``mine``'s parameter (or
    buffer) is replaced by a buffer viewing ``theirs``' storage (still in ``state_dict``, under its old name). Names containing ``skip`` (an adapter's)
    stay ``mine``'s own. ValueError when the two do not have the same weights of the same shapes."""
    own = {n: t for n, t in list(mine.named_parameters()) + list(mine.named_buffers()) if not (skip and skip in "." + n)}
    src = dict(theirs.named_parameters())
    missing, extra = sorted(set(own) - set(src)), sorted(set(src) - set(own))
    bad = [n for n in set(own) & set(src) if tuple(own[n].shape) != tuple(src[n].shape)]
    if missing or extra or bad:
        raise ValueError(f"{what} does not fit the drafter layer it should share: missing {missing[:4]}, unexpected {extra[:4]}, "
                         f"other shapes {sorted(bad)[:4]}")
    for name, t in src.items():
        path, _, leaf = name.rpartition(".")
        owner = mine.get_submodule(path) if path else mine
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)
        owner.register_buffer(leaf, t.detach())


def build_adapter_drafter(cfg: DrafterConfig, shared: SharedParts) -> "_DrafterBase":
    """An adapter drafter (``cfg.adapter_rank > 0``) whose base is the target's layers, shared (``rebuild_base``), built
    without ever allocating a copy of them: the module is built on the meta device, its base then points at the target's
    tensors and only its own parts (the mask embedding and fresh adapters: ``up`` zero, so they change nothing yet) are
    allocated, on the target's device and in its dtype."""
    if not cfg.adapter_rank:
        raise ValueError("build_adapter_drafter needs an adapter drafter config (adapter_rank > 0)")
    if shared.target_layers is None or not len(shared.target_layers):
        raise ValueError(f"an adapter drafter needs its target's layers {list(cfg.init_layers)}")
    like = next(shared.target_layers[0].parameters())
    with torch.device("meta"):
        d = build_drafter(cfg, shared)
    d.rebuild_base()
    a = cfg.arch
    # built on the CPU and moved with .to(): the one way ZeroGPU lets the main process place tensors on "cuda"
    for layer in d.layers:
        layer.adapter_attn = RowAdapter(a.hidden_size, cfg.adapter_rank).to(device=like.device, dtype=like.dtype)
        layer.adapter_mlp = RowAdapter(a.hidden_size, cfg.adapter_rank).to(device=like.device, dtype=like.dtype)
    d.mask_embedding = nn.Parameter(torch.zeros(a.hidden_size).to(device=like.device, dtype=like.dtype))
    left = [n for n, t in list(d.named_parameters()) + list(d.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"adapter drafter: weights {left[:4]} were neither shared nor built")
    return d


# ----------------------------------------------------------------------------- drafters


class _DrafterBase(nn.Module):
    def __init__(self, cfg: DrafterConfig, shared: SharedParts):
        super().__init__()
        self.cfg = cfg
        a = cfg.arch
        self.layers = nn.ModuleList([DecoderLayer(a, cfg.adapter_rank) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # stored outside the module tree so state_dict() / parameters() hold only our weights
        object.__setattr__(self, "shared", shared)
        self.skip = set(cfg.skip_layers)
        for n, p in self.named_parameters():  # an adapter drafter's base is the target's: frozen from the start
            p.requires_grad_(self.is_own(n))

    # ---- weights
    def init_from_target(self, target_layers: nn.ModuleList, final_norm: nn.Module):
        """Copy target layers cfg.init_layers[i] -> drafter layer i (and the final norm)."""
        for i, src in enumerate(self.cfg.init_layers):
            missing, unexpected = self.layers[i].load_state_dict(target_layers[src].state_dict(), strict=False)
            if unexpected or any(".adapter_" not in "." + k for k in missing):  # only an adapter is not the target's
                raise RuntimeError(f"target layer {src} does not fit drafter layer {i}: missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.norm.load_state_dict(final_norm.state_dict())

    def rebuild_base(self) -> None:
        """An adapter drafter's frozen base: the target's own layers ``init_layers`` and final norm, **shared, not
        copied** — each base weight becomes a view of the target's tensor (same storage, ``data_ptr`` equal), held
        as a buffer (not a parameter: no optimizer sees it), so the drafter adds no copy of the target's weights to
        memory. A later ``.to(...)`` that changes device or dtype gives the drafter its own converted copy and leaves
        the target untouched, and ``load_state_dict`` never writes into them. Its saved weights and checkpoints hold
        the adapters only (``own_state_dict``)."""
        layers = self.shared.target_layers
        if layers is None or len(layers) <= max(self.cfg.init_layers, default=-1) or self.shared.final_norm is None:
            raise ValueError(f"an adapter drafter needs its target's layers {list(self.cfg.init_layers)}")
        for i, src in enumerate(self.cfg.init_layers):
            _share_weights(self.layers[i], layers[src], f"target layer {src}", skip=".adapter_")
        _share_weights(self.norm, self.shared.final_norm, "the target's final norm")
        self._base_shared = True

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``; on a drafter whose base is the target's (``rebuild_base``) the base entries
        are left out — they are the target's weights, never written through — and ``strict`` checks the own ones."""
        if not getattr(self, "_base_shared", False):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        own = set(self.own_state_dict())
        sd = {k: v for k, v in state_dict.items() if self.is_own(k)}
        if strict and (own - set(sd) or set(sd) - own):
            raise RuntimeError(f"missing keys {sorted(own - set(sd))[:5]}, unexpected keys {sorted(set(sd) - own)[:5]}")
        return super().load_state_dict(sd, strict=False, assign=assign)

    def shares_base(self) -> bool:
        """True when every base weight is a view of the target's (``rebuild_base``), checked by storage address."""
        if not self.frozen_base or self.shared.target_layers is None:
            return False
        pairs = [(self.layers[i], self.shared.target_layers[src]) for i, src in enumerate(self.cfg.init_layers)] + [(self.norm, self.shared.final_norm)]
        for mine, theirs in pairs:
            ours = dict(mine.named_buffers())
            for name, t in theirs.named_parameters():
                if name not in ours or ours[name].data_ptr() != t.data_ptr():
                    return False
        return True

    @property
    def frozen_base(self) -> bool:
        """True for an adapter drafter: its layers and final norm are the target's, frozen and never saved."""
        return self.cfg.adapter_rank > 0

    def is_own(self, name: str) -> bool:
        """Whether parameter ``name`` is the drafter's own (trained and saved): all of them, or for an
        adapter drafter the adapters and the mask embedding."""
        return not self.frozen_base or ".adapter_" in name or not (name.startswith("layers.") or name.startswith("norm."))

    def own_state_dict(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if self.is_own(k)}

    def own_parameters(self) -> list:
        return [p for n, p in self.named_parameters() if self.is_own(n)]

    def load_own_state(self, sd: dict) -> None:
        """Load exactly the own parameters (strict: a missing or unexpected one raises RuntimeError)."""
        own = set(self.own_state_dict())
        missing, unexpected = sorted(own - set(sd)), sorted(set(sd) - own)
        if missing or unexpected:
            raise RuntimeError(f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        self.load_state_dict(sd, strict=False)

    def set_skip_layers(self, skip) -> None:
        skip = tuple(sorted(set(int(s) for s in skip)))
        bad = [s for s in skip if not 0 <= s < self.cfg.num_layers]
        if bad:
            raise ValueError(f"skip_layers {bad} out of range: this drafter has layers 0..{self.cfg.num_layers - 1}")
        self.skip = set(skip)
        self.cfg = replace(self.cfg, skip_layers=skip)

    def pruned(self, skip) -> "_DrafterBase":
        """A copy sharing every weight, with its own skip set (pruning without copying)."""
        import copy

        c = copy.copy(self)
        c.set_skip_layers(skip)
        return c

    def shortlisted(self, ids) -> "_DrafterBase":
        """A copy sharing every weight that drafts only from ``ids`` (empty: the whole vocabulary)."""
        import copy

        c = copy.copy(self)
        c.set_shortlist(ids)
        return c

    def with_first_draft(self, rule: str) -> "_DrafterBase":
        """A copy sharing every weight that reads draft 1 from ``rule``'s slot ("mask" or "anchor")."""
        import copy

        cfg = replace(self.cfg, first_draft=rule)  # DrafterConfig validates the rule
        c = copy.copy(self)
        c.cfg = cfg
        return c

    def draft_rows(self, h_blocks: torch.Tensor) -> torch.Tensor:
        """(nb, L, H) block outputs -> (nb, L-1, H): the rows that predict positions 1..L-1 of each block.
        Position 1 comes from the first MASK slot, or, with ``first_draft == "anchor"``, from the anchor
        slot's own next-token output; positions 2.. always from their MASK slots."""
        if self.cfg.first_draft == "anchor":
            return torch.cat([h_blocks[:, :1], h_blocks[:, 2:]], dim=1)
        return h_blocks[:, 1:]

    def active_layers(self):
        return [i for i in range(self.cfg.num_layers) if i not in self.skip]

    def describe(self) -> str:
        """One short line naming this drafter, its skipped layers included (``DrafterConfig.describe``)."""
        return self.cfg.describe()

    def block_embeddings(self, anchor_ids: list, block_len: int) -> torch.Tensor:
        """[anchor, MASK x (L-1)] per block -> (nb * L, H) input embeddings."""
        a_emb = self.shared.embed_tokens(to_device(torch.tensor(anchor_ids, dtype=torch.long), self.device))  # (nb, H)
        x = self.mask_embedding.to(a_emb.dtype).expand(len(anchor_ids), block_len, -1).clone()
        x[:, 0] = a_emb
        return x.reshape(len(anchor_ids) * block_len, -1)

    def logits(self, h):
        """h: (..., H) final hidden -> (..., V) logits via the shared, frozen LM head.

        With a vocabulary shortlist (and not training) only the shortlisted rows of the LM head
        are multiplied — on a CPU the head is about half of a draft's weight reads — and every
        other token gets -inf: argmax and softmax then range over the shortlist only. That stays
        lossless: the target still verifies every draft, rejection sampling only needs q > 0 where
        it drafted, and a token outside the list just cannot be drafted (the bonus can still be it)."""
        x, vocab = self.draft_logits(h)
        if vocab is None:
            return x
        out = x.new_full((*x.shape[:-1], self.cfg.arch.vocab_size), float("-inf"))
        out[..., vocab] = x  # (..., K) scattered into (..., V)
        return out

    def draft_logits(self, h) -> tuple:
        """h: (..., H) -> (logits (..., K), vocab): the logits over the shortlist's K token ids
        ``vocab`` (ascending), or over the whole vocabulary with vocab None. What drafting uses:
        argmax, softmax and sampling over K columns instead of V, equal to ``logits`` restricted to vocab."""
        with record_function(fastops.LM_HEAD):
            x = self.norm(h)
            if not self.cfg.vocab_shortlist or self.training:
                return fastops.linear(self.shared.lm_head, x), None
            ids, w = self._shortlist_rows(x)
            return fastops.rows_linear(self, f"shortlist-{hash(self.cfg.vocab_shortlist)}", w, x), ids

    def _shortlist_rows(self, like: torch.Tensor):
        """(ids, LM-head rows) of the shortlist on like's device / dtype, built once."""
        key = (like.device, like.dtype, self.cfg.vocab_shortlist)
        cached = getattr(self, "_short_cache", None)
        if cached is None or cached[0] != key:
            ids = torch.tensor(self.cfg.vocab_shortlist, dtype=torch.long, device=like.device)
            w = self.shared.lm_head.weight.detach()[ids.to(self.shared.lm_head.weight.device)].to(like.device, like.dtype)
            cached = (key, ids, w.contiguous())
            object.__setattr__(self, "_short_cache", cached)  # not a parameter: never saved or trained
        return cached[1], cached[2]

    def set_shortlist(self, ids) -> None:
        ids = tuple(sorted(set(int(i) for i in ids)))
        bad = [i for i in ids if not 0 <= i < self.cfg.arch.vocab_size]
        if bad:
            raise ValueError(f"shortlist ids {bad[:5]} out of range 0..{self.cfg.arch.vocab_size - 1}")
        self.cfg = replace(self.cfg, vocab_shortlist=ids)

    def save(self, path) -> None:
        from safetensors.torch import save_file

        if self.cfg.standalone:  # its rotary embedding and shape live in its causal-LM config.json, which this layout does not hold
            raise ValueError("a standalone D3D drafter is not re-saved in this project's layout: keep (or copy) its causal-LM checkpoint directory")

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().to(torch.float16).contiguous() for k, v in self.own_state_dict().items()}
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt", "kind": self.cfg.kind})
        (path / "config.json").write_text(json.dumps(self.cfg.to_json(), indent=2))

    @property
    def device(self):
        return self.norm.weight.device

    @property
    def dtype(self):
        return self.norm.weight.dtype


class D3DDrafter(_DrafterBase):
    """Standalone block-diffusion drafter with a causal context stream.

    One forward can hold, in this order: ``C`` context tokens (causal, each sees the cache
    and earlier context tokens) and any number of blocks, each ``[anchor, MASK x (L-1)]``
    that sees the cache, a prefix of the context tokens, and itself (bidirectional) —
    never another block. ``d3d-seq`` uses one block; ``d3d-async`` packs ``H`` hypothesis
    blocks over a provisional context in one forward; training uses the same layout.
    """

    def __init__(self, cfg: DrafterConfig, shared: SharedParts):
        super().__init__(cfg, shared)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.arch.hidden_size))
        # decoding runs the MLPs and the shortlist head (owner: self) in int8 where it can (fastops): a draft
        # only proposes, so outputs cannot change; the attention projections stay fp32
        # (not an adapter drafter: its base must compute exactly the target's values at the anchor slot)
        if not cfg.adapter_rank:
            fastops.mark_int8(self, *(layer.mlp for layer in self.layers), *(layer.mlp.down_proj for layer in self.layers))
        if cfg.standalone:  # its own embedding, LM head and rotary embedding: registered, so .to() moves them with the layers
            self.embed_tokens, self.lm_head, self.rotary_emb = shared.embed_tokens, shared.lm_head, shared.rotary_emb

    def build_inputs(self, cache_len: int, ctx_ids: torch.Tensor, blocks: list, block_len: int, cache_prefix: bool = False):
        """Embeddings, positions and the 4-D additive mask for one packed forward.

        ctx_ids: (C,) tokens at positions cache_len .. cache_len+C-1.
        blocks: list of (anchor_id, n_visible): the block's anchor sits right after the
        first n_visible context tokens, i.e. at position cache_len + n_visible.
        cache_prefix (training, C = 0): n_visible counts cached positions instead, so the block sits at
        position n_visible and sees only cache[:n_visible] (a cache filled once with a whole sequence).
        Returns x (1, N, H), positions (N,), mask (1, 1, N, T+N) with N = C + len(blocks)*L.
        """
        return self._inputs(cache_len, ctx_ids, blocks, block_len, cache_prefix)[:3]

    def _inputs(self, cache_len: int, ctx_ids: torch.Tensor, blocks: list, block_len: int, cache_prefix: bool = False):
        """``build_inputs`` and the largest position + 1 (counted while laying the positions out, never read off a tensor)."""
        dev = self.device
        C, L, T = ctx_ids.shape[0], block_len, cache_len
        nb = len(blocks)
        N = C + nb * L
        causal_anchor = self.cfg.anchor_attention == "causal"
        if cache_prefix and C:
            raise ValueError("cache_prefix packs blocks over the cache alone (no context tokens)")
        parts = [self.shared.embed_tokens(to_device(ctx_ids, dev))] if C else []
        if nb:
            parts.append(self.block_embeddings([b[0] for b in blocks], L))
        x = torch.cat(parts, dim=0)[None]  # (1, N, H)

        pos = torch.empty(N, dtype=torch.long)
        pos[:C] = torch.arange(T, T + C)
        need = T + C if C else 0  # the largest position + 1, counted here rather than read off pos
        allowed = torch.zeros(N, T + N, dtype=torch.bool)
        allowed[:, :T] = not cache_prefix  # everyone sees the committed cache (its prefix, with cache_prefix)
        allowed[:C, T : T + C] = torch.tril(torch.ones(C, C, dtype=torch.bool))  # causal context
        for b, (_, n_vis) in enumerate(blocks):
            r = C + b * L
            start = n_vis if cache_prefix else T + n_vis
            pos[r : r + L] = torch.arange(start, start + L)
            need = max(need, start + L)
            if cache_prefix:
                allowed[r : r + L, :n_vis] = True  # the cached prefix up to the anchor
            else:
                allowed[r : r + L, T : T + n_vis] = True  # context prefix up to the anchor
            allowed[r : r + L, T + r : T + r + L] = True  # bidirectional inside the block
            if causal_anchor:
                allowed[r, T + r + 1 : T + r + L] = False  # the anchor slot sees the prefix and itself only
        return x, to_device(pos, dev), additive_mask(allowed, self.dtype, dev), need

    def forward_packed(self, cache: KVCache, ctx_ids: torch.Tensor, blocks: list, block_len: int, cache_prefix: bool = False):
        """Run context + blocks in one forward (``cache_prefix``: see ``build_inputs``).

        Returns (h_ctx (C, H), h_blocks (nb, L, H), new_kv) where new_kv[i] = (k, v) of the
        context tokens for layer i, (1, nkv, C, hd) — commit a prefix with ``commit_kv``.
        Block keys are dropped: blocks are never cached.
        """
        T = len(cache)
        C = ctx_ids.shape[0]
        x, pos, mask, need = self._inputs(T, ctx_ids, blocks, block_len, cache_prefix)
        cos, sin = self.shared.rope(pos, x, need)
        rows = None
        if self.frozen_base:  # the adapters act on MASK slots: every block row but its anchor
            m = torch.zeros(len(blocks), block_len, 1, dtype=x.dtype, device=x.device)
            m[:, 1:] = 1
            rows = torch.cat([x.new_zeros(C, 1), m.reshape(-1, 1)])[None]  # (1, N, 1)
        new_kv = [None] * self.cfg.num_layers
        for i in self.active_layers():
            x, (k, v) = self.layers[i](x, cos, sin, cache.get(i), mask, rows)
            new_kv[i] = (k[:, :, :C], v[:, :, :C])
        h = x[0]
        return h[:C], h[C:].view(len(blocks), block_len, h.shape[-1]), new_kv

    @staticmethod
    def commit_kv(cache: KVCache, new_kv: list, n: int) -> None:
        """Append the first n context positions of a forward's KV to the cache."""
        if n <= 0:
            return
        for i, e in enumerate(new_kv):
            if e is not None:
                cache.append(i, e[0][:, :, :n], e[1][:, :, :n])

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.num_layers)


class DFlashDrafter(_DrafterBase):
    """Target-conditioned block-diffusion drafter (DFlash-style).

    Target hidden states of ``target_layer_ids`` for committed positions are fused to
    one feature per position; every drafter layer turns those features into extra keys /
    values (its own k_proj / v_proj, cached). Queries come only from the block.
    """

    def __init__(self, cfg: DrafterConfig, shared: SharedParts):
        super().__init__(cfg, shared)
        a = cfg.arch
        n = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * a.hidden_size, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(a.hidden_size))

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: (1, N, n*H) concatenated target hidden states -> (1, N, H)."""
        return self.hidden_norm(self.fc(feats.to(self.dtype)))

    def extend_context(self, cache: KVCache, feats: torch.Tensor) -> None:
        """Append K/V for N newly committed positions. feats: (1, N, n*H)."""
        n = feats.shape[1]
        if n == 0:
            return
        T = len(cache)
        f = self.fuse(feats)
        pos = torch.arange(T, T + n, device=self.device)
        cos, sin = self.shared.rope(pos, f, T + n)
        for i in self.active_layers():
            k, v = self.layers[i].self_attn.project_kv(f, cos, sin)
            cache.append(i, k, v)

    def forward_blocks(self, cache: KVCache, blocks: list, block_len: int):
        """Decode: blocks (anchor ids) all anchored at position len(cache), each seeing the
        whole cached context. Returns h (nb, L, H)."""
        T = len(cache)
        return self.forward_anchored(cache.get, T, [(a, T) for a in blocks], block_len)

    def forward_anchored(self, past, T: int, blocks: list, block_len: int):
        """The block pass. past(i) -> (k, v) of T context positions for layer i; blocks:
        [(anchor_id, pos)] — block [anchor, MASK x (L-1)] at positions pos.., seeing the
        context before pos and itself, never another block. Returns h (nb, L, H)."""
        nb, L = len(blocks), block_len
        x = self.block_embeddings([a for a, _ in blocks], L)[None]  # (1, nb*L, H)
        pos = to_device(torch.cat([torch.arange(p, p + L) for _, p in blocks]), self.device)
        allowed = torch.zeros(nb * L, T + nb * L, dtype=torch.bool)
        for b, (_, p) in enumerate(blocks):
            allowed[b * L : (b + 1) * L, :p] = True
            allowed[b * L : (b + 1) * L, T + b * L : T + (b + 1) * L] = True
        mask = additive_mask(allowed, self.dtype, self.device)
        cos, sin = self.shared.rope(pos, x, max(p for _, p in blocks) + L)
        for i in self.active_layers():
            x, _ = self.layers[i](x, cos, sin, past(i), mask)
        return x[0].view(nb, L, -1)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.num_layers)


DRAFTER_CLASSES = {"d3d": D3DDrafter, "dflash": DFlashDrafter}


def build_drafter(cfg: DrafterConfig, shared: SharedParts) -> _DrafterBase:
    if cfg.kind not in DRAFTER_CLASSES:
        raise ValueError(f"unknown drafter kind {cfg.kind!r}; expected one of {sorted(DRAFTER_CLASSES)}")
    return DRAFTER_CLASSES[cfg.kind](cfg, shared)


def load_drafter(path, shared: SharedParts, arch: ArchConfig, device="cpu", dtype=torch.float32):
    """Load a drafter saved with ``save``: config.json + model.safetensors (never pickle). A causal-LM checkpoint (a
    standalone D3D drafter of its own shape) is read by ``standalone.load_any_drafter``, which dispatches here otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    missing = [p.name for p in (cfg_file, w_file) if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"drafter at {path} is missing {', '.join(missing)}")
    try:
        cfg = DrafterConfig.from_json(json.loads(cfg_file.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"drafter config {cfg_file} is malformed: {e}") from e
    if cfg.arch != arch:
        raise ValueError(f"drafter at {path} was built for a different target shape ({cfg.arch}) than this bundle's ({arch})")
    try:  # an adapter drafter's base is the target's own layers, shared (no copy is ever allocated)
        model = build_adapter_drafter(cfg, shared) if cfg.adapter_rank else build_drafter(cfg, shared)
    except ValueError as e:
        raise ValueError(f"drafter at {path}: {e}") from e
    try:
        sd = load_file(str(w_file))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"drafter weights {w_file} are unreadable (truncated or not safetensors): {e}") from e
    try:
        model.load_own_state(sd)
    except RuntimeError as e:
        raise ValueError(f"drafter weights {w_file} do not match its config: {str(e)[:400]}") from e
    return model.to(device=device, dtype=dtype).eval()

