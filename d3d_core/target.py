"""The target model: prefill, verify a block with KV rollback, capture hidden states.

A thin wrapper over a Hugging Face causal LM and its ``DynamicCache``. The cache always
holds the *committed* positions the target has processed; the anchor of the next block is
committed but not yet in the cache (verify feeds it as the block's first token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .drafters import ArchConfig, SharedParts


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (n, V) float32, one row per fed position (the last n)
    feats: Optional[torch.Tensor]  # (1, n_fed, k*H) hidden states of the chosen layers, or None


class Target:
    def __init__(self, model, name: str = "target"):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.name = name
        self.config = model.config
        self.arch = ArchConfig.from_hf(model.config)
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = base.layers
        self.final_norm = base.norm
        self.shared = SharedParts(model.get_input_embeddings(), model.get_output_embeddings(), base.rotary_emb)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 4096))

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return self.arch.num_target_layers

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(self, cache, ids: torch.Tensor, n_logits: int, feature_layers: tuple = ()) -> TargetOutput:
        """Feed ids (n,) after the cached positions; return logits for the last n_logits
        positions and, when feature_layers is given, their hidden states (all n fed)."""
        ids = ids.to(self.device)[None]
        out = self.model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=n_logits,
            output_hidden_states=bool(feature_layers),
        )
        feats = None
        if feature_layers:
            # hidden_states[0] is the embedding output; layer l's output is hidden_states[l + 1]
            feats = torch.cat([out.hidden_states[l + 1] for l in feature_layers], dim=-1)
        return TargetOutput(out.logits[0].float(), feats)

    def prefill(self, cache, prompt_ids: torch.Tensor, feature_layers: tuple = ()) -> TargetOutput:
        """Process the prompt; logits (1, V) predict the first output token."""
        return self.forward(cache, prompt_ids, 1, feature_layers)

    def verify(self, cache, block_ids: torch.Tensor, feature_layers: tuple = ()) -> TargetOutput:
        """Feed [anchor, d_1..d_{B-1}]; logits (B, V): row k predicts position s+k+1."""
        return self.forward(cache, block_ids, block_ids.shape[0], feature_layers)

    @staticmethod
    def rollback(cache, n_remove: int) -> None:
        """Drop the last n_remove positions (rejected drafts). crop() wants a negative count."""
        if n_remove > 0:
            cache.crop(-n_remove)

    @staticmethod
    def cache_len(cache) -> int:
        return cache.get_seq_length()
