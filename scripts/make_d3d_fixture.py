"""Write the tiny standalone D3D drafter fixture ``tests/fixtures/d3d-qwen3-tiny`` with transformers' own
``Qwen3ForCausalLM.save_pretrained`` (safetensors, fp16), in the form a public D3D checkpoint most likely takes:
a Qwen3 causal LM of its own shape plus a mask token id in its config.json (``d3d_core.models.standalone``).

    python scripts/make_d3d_fixture.py [--out tests/fixtures/d3d-qwen3-tiny] [--vocab N] [--no-mask]

Its vocabulary is the ``toy-qwen3`` target's (the toy character tokenizer, 50 tokens) and its hidden size (48) differs
from that target's (64), as do its depth (2 layers), heads (3 of head dim 16, 1 key-value head) and MLP (96). The
weights are random (seeded): it drafts badly, which is what a losslessness test wants — every token is still the
target's. ``--vocab`` / ``--no-mask`` write the broken variants the loader's error tests use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "fixtures" / "d3d-qwen3-tiny"
MASK_TOKEN_ID = 0  # the toy tokenizer has no mask token of its own: the pad token's row stands in (any in-vocabulary id works)
SHAPE = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=16)


def make(out: Path, vocab: int = 0, mask: bool = True, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from d3d_core.models.tokenizer import CharTokenizer

    vocab = vocab or CharTokenizer().vocab_size
    extra = {"mask_token_id": MASK_TOKEN_ID} if mask else {}
    cfg = Qwen3Config(vocab_size=vocab, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=1, pad_token_id=0, **SHAPE, **extra)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # sharpen the random head as the toy target does, so its drafts are not uniform noise
        model.lm_head.weight.mul_(12.0)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(FIXTURE))
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the toy tokenizer's)")
    ap.add_argument("--no-mask", action="store_true", help="leave the mask token out of config.json")
    args = ap.parse_args(argv)
    out = make(Path(args.out), args.vocab, not args.no_mask)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
