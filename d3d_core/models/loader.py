"""The one drafter loader: a directory, or a bundle's ``DrafterSpec``, in; a ready drafter (eval mode, on its device, in
its dtype) out — ``load_drafter``.

A directory is told apart by its ``config.json``:

- ``kind`` (this project's layout, ``Drafter.save``): ``model.safetensors`` holds the drafter's own weights — all of
  them, or for an adapter drafter its adapters and mask embedding (its base is the target's layers, shared);
- ``dflash_config`` (the z-lab layout of public DFlash checkpoints): ``dflash.load_zlab_dflash``;
- ``model_type`` without ``kind`` (a causal-LM checkpoint): a standalone D3D drafter of its own shape
  (``standalone.load_standalone_d3d``).

A ``DrafterSpec`` names its source (a directory, or a hub id fetched through ``sources.resolve``) or, with none,
asks for a drafter built from the target: ``layers`` of its layers copied (evenly spaced; DFlash fuses ``features``
of them), untrained; or, for D3D with ``adapter_rank``, the shared-weight adapter drafter. Weights are read with
safetensors only, never pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import sources
from .adapter import AdapterDrafter, build_adapter_drafter, shared_adapter_drafter
from .d3d import D3DDrafter
from .dflash import DFlashDrafter, load_zlab_dflash
from .drafter import Drafter, DrafterConfig, evenly_spaced
from .layers import ArchConfig, SharedParts
from .standalone import load_standalone_d3d

DRAFTER_CLASSES = {"d3d": D3DDrafter, "dflash": DFlashDrafter}


@dataclass(frozen=True)
class DrafterSpec:
    """Where one of a bundle's drafters comes from (data): ``source`` (a directory or hub id; the environment variable
    ``env``, when set, names another, an empty value none), else built from the target: ``layers`` target layers
    copied, evenly spaced (DFlash: fusing ``features`` target layers' hidden states), untrained; or (D3D,
    ``adapter_rank`` > 0) the shared-weight adapter drafter."""

    kind: str  # "d3d" or "dflash"
    layers: int = 0
    features: int = 0
    adapter_rank: int = 0
    source: Optional[str] = None
    env: str = ""


def load_drafter(source, shared: SharedParts, arch: ArchConfig, device="cpu", dtype=torch.float32, *, target_config=None,
                 mask_embedding: Optional[torch.Tensor] = None, block_size: int = 8, seed: int = 0) -> Drafter:
    """A ready drafter from ``source``: a directory (any of the three layouts above) or a ``DrafterSpec``. ``shared`` and
    ``arch``: the target's parts and shape; ``target_config`` (its HF config) lets a z-lab DFlash drafter whose RoPE
    differs be refused; ``mask_embedding``: the adapter drafter's MASK input (default: the mean token embedding);
    ``block_size`` and ``seed``: an untrained drafter's. One pass, top to bottom: where it comes from, which layout,
    then that layout's reader."""
    spec = source if isinstance(source, DrafterSpec) else None
    if spec is not None and spec.source is None:  # built from the target
        d = _untrained(spec, shared, arch, dtype, block_size, seed, mask_embedding)
        return d if spec.kind == "d3d" and spec.adapter_rank else d.to(device)
    path = Path(source) if spec is None else Path(spec.source).expanduser()
    if spec is not None and not path.is_dir():  # a hub id (a bundle's load has fetched it already: sources.load_target)
        path = Path(sources.resolve(spec.source, f"{spec.kind} drafter"))
    layout = directory_layout(path)
    if layout == "zlab":
        d = load_zlab_dflash(path, shared, arch, device=device, dtype=dtype, target_config=target_config)
    elif layout == "causal-lm":
        d = load_standalone_d3d(path, arch.vocab_size, device=device, dtype=dtype)
    else:  # this project's layout: config.json + model.safetensors (the drafter's own weights)
        d = _load_saved(path, shared, arch, device, dtype)
    if spec is not None and d.cfg.kind != spec.kind:
        raise ValueError(f"{spec.source} holds a {d.cfg.kind} drafter, not the {spec.kind} drafter it was named as")
    return d


def directory_layout(path) -> str:
    """"zlab", "causal-lm" or "project" (this project's layout), from ``config.json`` alone; "project" when it is
    missing or unreadable (that layout's checks then say what is wrong)."""
    try:
        d = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "project"
    if not isinstance(d, dict):
        return "project"
    if "dflash_config" in d:
        return "zlab"
    return "causal-lm" if "model_type" in d and "kind" not in d else "project"


def _load_saved(path: Path, shared: SharedParts, arch: ArchConfig, device, dtype) -> Drafter:
    """A drafter ``Drafter.save`` wrote: its config, checked against the target's shape, then its own weights (an
    adapter drafter's base is the target's layers, shared: no copy is ever allocated)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
    if cfg.kind not in DRAFTER_CLASSES:
        raise ValueError(f"drafter at {path}: unknown drafter kind {cfg.kind!r}; expected one of {sorted(DRAFTER_CLASSES)}")
    try:
        model = build_adapter_drafter(cfg, shared) if cfg.adapter_rank else DRAFTER_CLASSES[cfg.kind](cfg, shared)
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


def build_drafter(cfg: DrafterConfig, shared: SharedParts) -> Drafter:
    """A drafter of ``cfg``'s class with fresh weights (an adapter config: an ``AdapterDrafter`` whose base is not shared
    yet — ``rebuild_base`` shares it; ``build_adapter_drafter`` never allocates it)."""
    if cfg.kind not in DRAFTER_CLASSES:
        raise ValueError(f"unknown drafter kind {cfg.kind!r}; expected one of {sorted(DRAFTER_CLASSES)}")
    return (AdapterDrafter if cfg.adapter_rank else DRAFTER_CLASSES[cfg.kind])(cfg, shared)


# ----------------------------------------------------------------------------- built from the target (untrained)


def default_drafter_config(spec: DrafterSpec, arch: ArchConfig, block_size: int = 8) -> DrafterConfig:
    """The config of an untrained drafter of ``spec``: its layers copied from target layers evenly spaced over all of
    them (DFlash: fusing ``spec.features`` target layers evenly spaced over 1 .. L-3)."""
    L, n = arch.num_target_layers, spec.layers
    if spec.kind == "d3d":
        return DrafterConfig(kind="d3d", arch=arch, num_layers=n, block_size=block_size, init_layers=evenly_spaced(n, 0, L - 1),
                             adapter_rank=spec.adapter_rank)
    if spec.adapter_rank:
        raise ValueError("adapter_rank applies to D3D drafters only")
    if spec.kind == "dflash":
        return DrafterConfig(kind="dflash", arch=arch, num_layers=n, block_size=block_size, init_layers=evenly_spaced(n, 0, L - 1),
                             target_layer_ids=evenly_spaced(spec.features, 1, max(1, L - 3)))
    raise ValueError(f"unknown drafter kind {spec.kind!r}")


def init_drafter(kind: str, target, spec, num_layers: Optional[int] = None, block_size: int = 8, seed: int = 0,
                 adapter_rank: int = 0) -> Drafter:
    """An untrained drafter of ``kind`` for ``target`` (a ``Target``), as bundle ``spec`` (a ``BundleSpec``) builds it,
    ``num_layers`` deep when given: layers copied from the target, mask embedding = mean token embedding (with
    ``adapter_rank`` > 0, D3D: the target's own layers ``init_layers``, shared and frozen, plus zero-output MASK-slot
    adapters). On the CPU, in the target's dtype."""
    base = next((d for d in spec.drafters if d.kind == kind), DrafterSpec(kind))
    own = DrafterSpec(kind, layers=num_layers or base.layers, features=base.features, adapter_rank=adapter_rank)
    return _init(own, target.shared, target.arch, target.dtype, block_size, seed)


def _untrained(spec: DrafterSpec, shared, arch, dtype, block_size: int, seed: int, mask_embedding) -> Drafter:
    """What a spec without a source builds: the shared-weight adapter drafter (D3D with an adapter rank: every target
    layer, draft 1 the target's own token), else layers copied from the target (``_init``)."""
    if spec.kind == "d3d" and spec.adapter_rank:
        return shared_adapter_drafter(shared, arch, spec.adapter_rank, block_size=block_size, seed=seed, mask_embedding=mask_embedding)
    return _init(spec, shared, arch, dtype, block_size, seed)


def _init(spec: DrafterSpec, shared: SharedParts, arch: ArchConfig, dtype, block_size: int, seed: int) -> Drafter:
    cfg = default_drafter_config(spec, arch, block_size)
    torch.manual_seed(seed)
    if cfg.adapter_rank:
        d = build_adapter_drafter(cfg, shared)  # no copy of the target's layers is allocated
    else:
        d = DRAFTER_CLASSES[cfg.kind](cfg, shared).to(dtype=dtype)
        d.init_from_target(shared.target_layers, shared.final_norm)
    with torch.no_grad():
        d.mask_embedding.copy_(shared.embed_tokens.weight.mean(0))
        if cfg.kind == "dflash":  # start as "average of the fused layers" so untrained features are sane
            H, n = arch.hidden_size, len(cfg.target_layer_ids)
            d.fc.weight.copy_(torch.cat([torch.eye(H)] * n, dim=1) / n)
    return d.eval()
