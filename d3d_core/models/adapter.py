"""The shared-weight adapter drafter, in one file you can read top to bottom: a D3D drafter whose layers and final norm
are the target's own — **shared, not copied** (each base weight a view of the target's tensor) — plus, in every layer,
rank-r residual adapters (``layers.RowAdapter``) that act on the MASK slots' rows only.

Context and anchor rows then compute exactly what the target computes, so over all of the target's layers with a
causal anchor slot, draft 1 is the target's own next-token prediction however training goes (issue #15, "protect
the anchor path"), and every drafting round accepts at least one draft (τ ≥ 2 at temperature 0). It is the D3D
drafter a bundle gets until a trained one is named (``shared_adapter_drafter``), and the kind ``d3d-deep`` ships
as: its saved weights are the adapters and the mask embedding alone (``Drafter.own_state_dict``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .d3d import D3DDrafter
from .drafter import DrafterConfig
from .layers import ArchConfig, RowAdapter, SharedParts

SHARED_ADAPTER_INFO = "shared-weight adapter drafter (untrained adapters: draft 1 = target's token)"


class AdapterDrafter(D3DDrafter):
    """A D3D drafter with ``cfg.adapter_rank > 0``: frozen base (the target's layers ``init_layers`` and final norm),
    trained adapters. Built by ``build_adapter_drafter`` (base shared at once) or by ``loader.build_drafter`` (fresh
    base weights; ``rebuild_base`` then shares them)."""

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


def build_adapter_drafter(cfg: DrafterConfig, shared: SharedParts) -> AdapterDrafter:
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
        d = AdapterDrafter(cfg, shared)
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


def shared_adapter_drafter(shared: SharedParts, arch: ArchConfig, rank: int, block_size: int = 8, seed: int = 0,
                          mask_embedding: Optional[torch.Tensor] = None) -> AdapterDrafter:
    """The D3D drafter a bundle gets until a trained one is named: every target layer (``shared.target_layers``), in order,
    *shared* with the target (``build_adapter_drafter``: views of its tensors, no copy), plus rank-``rank`` MASK-slot
    adapters that start at zero, with draft 1 read at a causal anchor slot. That slot computes exactly the target's
    next-token prediction, so draft 1 is the target's own token and every drafting round accepts at least one draft
    (τ ≥ 2 at temperature 0); drafts 2.. are whatever the untrained MASK slots propose. Training its adapters
    (``train --adapter-rank``) only adds to that. ``mask_embedding``: the MASK slots' input (default: the mean token
    embedding), e.g. computed on the CPU before the target moved to its GPU."""
    L = arch.num_target_layers
    cfg = DrafterConfig(kind="d3d", arch=arch, num_layers=L, block_size=block_size, init_layers=tuple(range(L)),
                        adapter_rank=rank, first_draft="anchor", anchor_attention="causal")
    torch.manual_seed(seed)
    d = build_adapter_drafter(cfg, shared)
    with torch.no_grad():
        mean = mask_embedding if mask_embedding is not None else shared.embed_tokens.weight.mean(0)
        d.mask_embedding.copy_(mean.to(device=d.mask_embedding.device, dtype=d.mask_embedding.dtype))
    return d.eval()
