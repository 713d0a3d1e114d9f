"""Standalone D3D drafters of their own shape, loaded from a causal-LM checkpoint.

The preprint's public drafters (``fudan-generative-ai/D3D-1.7B-8B``, ``D3D-8B-8B``, ...; DESIGN §5) are about the size
of whole Qwen3-1.7B / Qwen3-8B models, so they most likely are a **Qwen3 causal-LM checkpoint** — ``config.json``
(``model_type`` "qwen3") and safetensors weights under the usual names (``model.embed_tokens``, ``model.layers.{i}``,
``model.norm``, ``lm_head``) — plus a **mask token** whose embedding fills a block's MASK slots. That format is our
inference from their sizes and names; we have not been able to read one (no network here). What this loader accepts:

- a directory with ``config.json`` whose ``model_type`` is ``qwen3`` (or ``llama``, the same layer shape without
  q/k-norm) and ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (never a pickle: ``.bin`` /
  ``.pt`` are refused, not read);
- the same vocabulary as the target (``vocab_size`` equal): drafts are token ids the target verifies;
- a mask token id: ``mask_token_id`` in ``config.json`` (top level, or inside ``d3d_config``), or
  the ``mask_token`` of ``tokenizer_config.json`` resolved through its ``added_tokens_decoder`` or ``tokenizer.json``.

It becomes a :class:`~d3d_core.models.d3d.D3DDrafter` with ``standalone=True``: its own width, depth, heads,
q/k-norm, embedding, LM head and rotary embedding, the D3D rules unchanged (context stream with its own KV cache,
``[anchor, MASK x (B-1)]`` blocks bidirectional inside the block, packed successor drafting for H hypotheses). Anything
else fails with one sentence naming what is missing (:class:`StandaloneError`, a ValueError). ``loader.load_drafter``
tells such a directory (a config.json with ``model_type`` and no ``kind``) from the other drafter layouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from .d3d import D3DDrafter
from .drafter import DrafterConfig
from .hardware import estimate_params, require_memory
from .layers import ArchConfig, SharedParts

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MASK_CONFIG_KEYS = ("mask_token_id",)
MASK_NESTED = ("d3d_config",)


class StandaloneError(ValueError):
    """A directory that is not a loadable standalone D3D drafter; the message says what was missing, in one sentence."""


def _read_json(f: Path, what: str) -> dict:
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StandaloneError(f"{what} {f} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise StandaloneError(f"{what} {f} is not a JSON object")
    return d


def _token_id(name: str, path: Path) -> Optional[int]:
    """The id of token ``name`` from tokenizer_config.json's added_tokens_decoder or tokenizer.json (added tokens, vocab)."""
    tc = path / "tokenizer_config.json"
    if tc.is_file():
        for i, e in (_read_json(tc, "tokenizer config").get("added_tokens_decoder") or {}).items():
            if isinstance(e, dict) and e.get("content") == name and str(i).isdigit():
                return int(i)
    tj = path / "tokenizer.json"
    if tj.is_file():
        d = _read_json(tj, "tokenizer file")
        for e in d.get("added_tokens") or []:
            if isinstance(e, dict) and e.get("content") == name and isinstance(e.get("id"), int):
                return e["id"]
        vocab = (d.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(name), int):
            return vocab[name]
    return None


def find_mask_token(path, cfg: dict) -> tuple:
    """(mask token id or None, where it was found)."""
    path = Path(path)
    for k in MASK_CONFIG_KEYS:
        if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool):
            return cfg[k], f"config.json {k}"
    for sect in MASK_NESTED:
        sub = cfg.get(sect)
        if isinstance(sub, dict) and isinstance(sub.get("mask_token_id"), int):
            return sub["mask_token_id"], f"config.json {sect}.mask_token_id"
    tc = path / "tokenizer_config.json"
    if tc.is_file():
        tok = _read_json(tc, "tokenizer config").get("mask_token")
        name = tok.get("content") if isinstance(tok, dict) else tok
        if isinstance(name, str) and name:
            i = _token_id(name, path)
            if i is not None:
                return i, f"tokenizer mask_token {name!r}"
    return None, ""


def check_weights(path: Path) -> str:
    """'model.safetensors' or 'model.safetensors.index.json' (sharded); StandaloneError for anything else."""
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if (path / name).is_file():
            return name
    others = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)
    if others:
        raise StandaloneError(f"D3D drafter at {path} has weights in a non-safetensors format ({', '.join(others[:3])}), "
                              "which this project never loads (pickle): convert them to model.safetensors")
    raise StandaloneError(f"D3D drafter at {path} has no weights: model.safetensors (or model.safetensors.index.json) is missing")


def check_standalone_dir(path, vocab_size: int) -> tuple:
    """Everything that can be checked before a weight is read: (config dict, mask token id, where it was found)."""
    path = Path(path)
    if not path.is_dir():
        raise StandaloneError(f"D3D drafter {str(path)!r} is not a directory")
    f = path / "config.json"
    if not f.is_file():
        raise StandaloneError(f"D3D drafter at {path} has no config.json")
    cfg = _read_json(f, "D3D drafter config")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise StandaloneError(f"D3D drafter at {path} is a {mt!r} checkpoint; a standalone drafter must be a causal LM of type "
                              f"{' or '.join(SUPPORTED_MODEL_TYPES)}")
    v = cfg.get("vocab_size")
    if v != vocab_size:
        raise StandaloneError(f"D3D drafter at {path} has a vocabulary of {v} tokens but the target's has {vocab_size}; "
                              "a drafter must share the target's tokenizer and vocabulary")
    mask, where = find_mask_token(path, cfg)
    if mask is None:
        raise StandaloneError(f"D3D drafter at {path} names no mask token: set mask_token_id in its config.json "
                              "(or a mask_token in tokenizer_config.json)")
    if not 0 <= mask < vocab_size:
        raise StandaloneError(f"D3D drafter at {path}: its mask token id {mask} ({where}) is outside the vocabulary 0..{vocab_size - 1}")
    check_weights(path)
    return cfg, mask, where


def standalone_from_hf(model, mask_token_id: int, block_size: int = 8, source: str = "") -> D3DDrafter:
    """A standalone D3D drafter over an in-memory Hugging Face causal LM (Qwen3 / Llama layers): its decoder layers and
    final norm become the drafter's (the same tensors, assigned, no copy), its embedding, LM head and rotary embedding
    the drafter's own; the MASK slots' input is the embedding row of ``mask_token_id``."""
    hf = model.config
    arch = ArchConfig.from_hf(hf)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    shared = SharedParts(model.get_input_embeddings(), model.get_output_embeddings(), base.rotary_emb)
    n = int(hf.num_hidden_layers)
    cfg = DrafterConfig(kind="d3d", arch=arch, num_layers=n, block_size=block_size, init_layers=(), mask_token_id=int(mask_token_id),
                        standalone=True, training={"source": source} if source else {})
    with torch.device("meta"):  # the layers' tensors are the checkpoint's own (assigned below): nothing is allocated twice
        d = D3DDrafter(cfg, shared)
    sd = {f"layers.{i}.{k}": t for i, layer in enumerate(base.layers) for k, t in layer.state_dict().items()}
    sd.update({f"norm.{k}": t for k, t in base.norm.state_dict().items()})
    _, unexpected = nn.Module.load_state_dict(d, sd, strict=False, assign=True)  # the own parts (embedding, head) are real already
    emb = shared.embed_tokens.weight
    d.mask_embedding = nn.Parameter(emb.detach()[int(mask_token_id)].clone(), requires_grad=False)
    left = [k for k, t in list(d.named_parameters()) + list(d.named_buffers()) if t.is_meta]
    if unexpected or left:
        raise StandaloneError(f"D3D drafter{' ' + source if source else ''} does not fit a {hf.model_type} decoder stack "
                              f"(unfilled {left[:3]}, unexpected {unexpected[:3]})")
    for p in d.parameters():
        p.requires_grad_(False)
    return d.eval()


def load_standalone_d3d(path, vocab_size: int, device="cpu", dtype=torch.float32, block_size: int = 8) -> D3DDrafter:
    """Load a standalone D3D drafter from a local directory (see the module's docstring for what it must hold).
    The weights are read with safetensors only (``use_safetensors=True``) in ``dtype`` and moved to ``device``."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    _, mask, _ = check_standalone_dir(path, vocab_size)
    bad = (SafetensorError, OSError, ValueError, RuntimeError, KeyError, TypeError)

    def unreadable(e):
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return StandaloneError(f"D3D drafter at {path} could not be read as a causal-LM checkpoint ({type(e).__name__}: {first})")

    try:
        hf_cfg = AutoConfig.from_pretrained(str(path))
    except bad as e:
        raise unreadable(e) from None
    require_memory(f"D3D drafter at {path}", estimate_params(hf_cfg), dtype, device)  # BundleUnavailable (one sentence) before any weight is read
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), config=hf_cfg, dtype=dtype, use_safetensors=True, output_loading_info=True)
    except bad as e:
        raise unreadable(e) from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would leave them random: refuse rather than draft from noise
        raise StandaloneError(f"D3D drafter at {path} lacks {len(missing)} of its {hf_cfg.model_type} weights (e.g. {missing[0]}): "
                              "not a whole causal-LM checkpoint")
    model.eval()
    d = standalone_from_hf(model, mask, block_size=block_size, source=str(path))
    return d.to(device)

