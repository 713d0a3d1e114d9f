"""What every drafter is, in one file you can read top to bottom: its config (``DrafterConfig``, saved as JSON beside
its weights) and the base class ``Drafter`` — a stack of decoder layers (``layers.py``) and a final norm over the
target's frozen token embedding, LM head and rotary embedding, which it borrows (``SharedParts``) and never saves.

The base holds what both kinds share: which weights are the drafter's own (all of them; an adapter drafter's
adapters and mask embedding only), copying target layers in, skipped (pruned) layers, the vocabulary shortlist
head, the block's input embeddings ``[anchor, MASK x (L-1)]`` and ``save``. The kinds: ``d3d.py`` (standalone,
context stream + packed blocks), ``dflash.py`` (target-conditioned), ``adapter.py`` (a D3D drafter whose base is the
target's own layers, shared). Shapes as in ``layers.py``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from torch.profiler import record_function

from . import fastops
from .layers import ArchConfig, DecoderLayer, RMSNorm, SharedParts, to_device

# ----------------------------------------------------------------------------- the config


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
    # token ids the drafter may draft (empty = the whole vocabulary); see Drafter.logits
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


# ----------------------------------------------------------------------------- the drafter


class Drafter(nn.Module):
    """A block-diffusion drafter's common parts (see the module's docstring); ``D3DDrafter`` and ``DFlashDrafter`` add their forwards."""

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

    def pruned(self, skip) -> "Drafter":
        """A copy sharing every weight, with its own skip set (pruning without copying)."""
        c = copy.copy(self)
        c.set_skip_layers(skip)
        return c

    def shortlisted(self, ids) -> "Drafter":
        """A copy sharing every weight that drafts only from ``ids`` (empty: the whole vocabulary)."""
        c = copy.copy(self)
        c.set_shortlist(ids)
        return c

    def with_first_draft(self, rule: str) -> "Drafter":
        """A copy sharing every weight that reads draft 1 from ``rule``'s slot ("mask" or "anchor")."""
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
