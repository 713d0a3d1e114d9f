"""The DFlash-style drafter (target-conditioned block diffusion) and the public checkpoints it loads from, in one file
you can read top to bottom.

Hidden states of a few target layers (``target_layer_ids``) are concatenated per committed position, fused
(``Linear(n*H -> H)`` + RMSNorm) and injected as extra keys / values in every drafter layer (each layer's own
k_proj / v_proj, cached); queries come only from the block ``[anchor, MASK x (L-1)]``. It cannot draft the next
block before the target has verified this one.

Public DFlash checkpoints (z-lab layout, e.g. ``z-lab/Qwen3-8B-DFlash-b16``) load into this class, no remote code:
a Qwen3-style ``config.json`` with ``num_hidden_layers`` = drafter layers, ``num_target_layers``, ``block_size`` and
``dflash_config`` {``mask_token_id``, ``target_layer_ids``}, and safetensors weights named
``layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
mlp.{gate,up,down}_proj}``, ``fc``, ``hidden_norm`` and ``norm`` — the parameter names of our class, so they load one
to one. The block's mask positions use the target's embedding row of ``mask_token_id``. Weights are read with
safetensors only. Shapes as in ``layers.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from .drafter import Drafter, DrafterConfig, evenly_spaced
from .layers import ArchConfig, KVCache, RMSNorm, SharedParts, additive_mask, to_device


class DFlashDrafter(Drafter):
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


# ----------------------------------------------------------------------------- public checkpoints (z-lab layout)

ZLAB_SOURCE = "z-lab DFlash checkpoint"  # DrafterConfig.training["source"] of a drafter loaded from one
# names of weights that belong to other DFlash variants (e.g. DFlash2) we do not implement
UNSUPPORTED_PREFIXES = ("candidate_selector.", "attention_conv", "mlp_conv")


def build_target_layer_ids(num_target_layers: int, n: int) -> tuple:
    """DFlash's choice when a config names no layers: n layers evenly over [1, L-3]."""
    if n == 1:
        return (num_target_layers // 2,)
    return evenly_spaced(n, 1, num_target_layers - 3)


def read_zlab_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"no config.json in {path} (expected a z-lab DFlash checkpoint directory)")
    try:
        cfg = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or "dflash_config" not in cfg:
        raise ValueError(f"{f} has no 'dflash_config': not a DFlash checkpoint")
    return cfg


def _rope_of(cfg) -> dict:
    """{theta, scaling} of an HF config (dict or object), in the 4.x (rope_theta / rope_scaling) or the
    5.x (rope_parameters) spelling; keys that only name the default are dropped."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    rp = dict(get("rope_parameters") or {})
    theta = rp.pop("rope_theta", None) or get("rope_theta")
    scaling = dict(get("rope_scaling") or {}) or rp
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta",) and not (k in ("rope_type", "type") and v == "default")}
    return {"theta": float(theta) if theta is not None else None, "scaling": scaling}


def check_zlab_compatible(cfg: dict, target_config) -> None:
    """Refuse, with a clear message, what this loader does not implement: the drafter uses the
    target's rotary embedding, so its RoPE must equal the target's; every layer attends fully."""
    if target_config is not None:
        mine, theirs = _rope_of(cfg), _rope_of(target_config)
        if mine["theta"] is not None and theirs["theta"] is not None and mine["theta"] != theirs["theta"]:
            raise ValueError(f"DFlash drafter rope_theta {mine['theta']:g} differs from the target's {theirs['theta']:g}; "
                             "this loader applies the target's rotary embedding to the drafter, so they must match")
        if mine["scaling"] and mine["scaling"] != theirs["scaling"]:
            raise ValueError(f"DFlash drafter rope_scaling {mine['scaling']} differs from the target's {theirs['scaling'] or 'none'}; "
                             "this loader applies the target's rotary embedding to the drafter, so they must match")
    kinds = set(cfg.get("layer_types") or [])
    if cfg.get("use_sliding_window") or kinds - {"full_attention"}:
        raise ValueError(f"DFlash drafter declares sliding-window attention ({sorted(kinds) or 'use_sliding_window'}), "
                         "which this loader does not implement (every drafter layer attends to the whole context)")


def zlab_drafter_config(cfg: dict, target_arch: ArchConfig, target_config=None) -> DrafterConfig:
    check_zlab_compatible(cfg, target_config)
    dc = cfg.get("dflash_config") or {}
    need = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "rms_norm_eps"]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"DFlash config lacks {', '.join(missing)}")
    if cfg["hidden_size"] != target_arch.hidden_size:
        raise ValueError(f"DFlash drafter hidden size {cfg['hidden_size']} does not match the target's {target_arch.hidden_size}")
    n_target = int(cfg.get("num_target_layers", target_arch.num_target_layers))
    if n_target != target_arch.num_target_layers:
        raise ValueError(f"DFlash drafter was trained for a {n_target}-layer target; this target has {target_arch.num_target_layers}")
    layers = int(cfg["num_hidden_layers"])
    ids = tuple(dc.get("target_layer_ids") or build_target_layer_ids(n_target, layers))
    if any(not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {ids} out of range for a {n_target}-layer target")
    arch = ArchConfig(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        vocab_size=target_arch.vocab_size,
        qk_norm=True,  # DFlash drafters are Qwen3-style layers
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        num_target_layers=n_target,
    )
    mask_id = dc.get("mask_token_id")
    if mask_id is None:
        raise ValueError("dflash_config.mask_token_id is missing")
    if not 0 <= int(mask_id) < target_arch.vocab_size:
        raise ValueError(f"mask_token_id {mask_id} is outside the target's vocabulary ({target_arch.vocab_size})")
    return DrafterConfig(
        kind="dflash", arch=arch, num_layers=layers, block_size=int(cfg.get("block_size") or dc.get("block_size") or 16),
        target_layer_ids=ids, mask_token_id=int(mask_id), training={"source": ZLAB_SOURCE},
    )


def load_zlab_dflash(path, shared: SharedParts, target_arch: ArchConfig, device="cpu", dtype=torch.float32,
                     target_config=None) -> DFlashDrafter:
    """Load a z-lab DFlash checkpoint directory into ``DFlashDrafter``. ``target_config`` (the
    target's HF config) lets the loader refuse a drafter whose RoPE differs from the target's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg = zlab_drafter_config(read_zlab_config(path), target_arch, target_config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path} (pickled .bin weights are never loaded)")
    sd = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f} is unreadable (truncated or not safetensors): {e}") from None
    odd = sorted({k for k in sd if k.startswith(UNSUPPORTED_PREFIXES) or ".attention_conv" in k or ".mlp_conv" in k})
    if odd:
        raise ValueError(f"{path} holds weights of an unsupported DFlash variant (e.g. {odd[0]}); only the DFlash v1 layout loads")
    model = DFlashDrafter(cfg, shared)
    with torch.no_grad():
        emb = shared.embed_tokens.weight[cfg.mask_token_id].detach().float()
    sd["mask_embedding"] = emb
    try:
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not match the DFlash layout: {str(e)[:400]}") from None
    return model.to(device=device, dtype=dtype).eval()


def save_zlab_dflash(model: DFlashDrafter, path, num_target_layers: int, mask_token_id: int) -> None:
    """Write a drafter in the z-lab layout (tests and export use it)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    a = model.cfg.arch
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim, "rms_norm_eps": a.rms_norm_eps,
        "num_hidden_layers": model.cfg.num_layers, "num_target_layers": num_target_layers, "vocab_size": a.vocab_size,
        "attention_bias": a.attention_bias, "block_size": model.cfg.block_size, "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(model.cfg.target_layer_ids)},
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "mask_embedding"}
    save_file(sd, str(path / "model.safetensors"))
