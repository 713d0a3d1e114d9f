"""The D3D drafter (standalone block diffusion), in one file you can read top to bottom.

No target features: committed tokens run through the drafter's own stack as a causal **context stream**, written to
its own KV cache (its LM-head output there is a next-token distribution, the paper's auxiliary AR supervision), and
blocks ``[anchor, MASK x (L-1)]`` attend to that cache. Because it needs nothing from the target, it can draft while
the target verifies: ``d3d-async`` packs ``H`` hypothesis blocks over a provisional context in one forward
(``forward_packed``); ``d3d-seq`` uses one block; training uses the same layout. Same-position prediction: the output
at block position k predicts the token at position s+k.

A D3D drafter may also be **standalone** (``DrafterConfig.standalone``, loaded by ``standalone.py`` from a causal-LM
checkpoint): its own width, depth, heads, embedding, LM head and rotary embedding, same vocabulary, same D3D rules;
or an **adapter drafter** (``adapter.py``): the target's own layers, shared, plus MASK-slot adapters.
Shapes as in ``layers.py``; ``C`` = context tokens, ``L`` = block length, ``nb`` = blocks.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import fastops
from .drafter import Drafter, DrafterConfig
from .layers import KVCache, SharedParts, additive_mask, to_device


class D3DDrafter(Drafter):
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
        rows = self.adapter_rows(x, C, len(blocks), block_len)
        new_kv = [None] * self.cfg.num_layers
        for i in self.active_layers():
            x, (k, v) = self.layers[i](x, cos, sin, cache.get(i), mask, rows)
            new_kv[i] = (k[:, :, :C], v[:, :, :C])
        h = x[0]
        return h[:C], h[C:].view(len(blocks), block_len, h.shape[-1]), new_kv

    def adapter_rows(self, x: torch.Tensor, C: int, nb: int, block_len: int):
        """(1, N, 1) 1 on the rows an adapter drafter's adapters act on (the MASK slots: every block row but its
        anchor), 0 on the context rows and anchors; None for a drafter without adapters."""
        if not self.frozen_base:
            return None
        m = torch.zeros(nb, block_len, 1, dtype=x.dtype, device=x.device)
        m[:, 1:] = 1
        return torch.cat([x.new_zeros(C, 1), m.reshape(-1, 1)])[None]

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

