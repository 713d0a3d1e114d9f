"""GPU check: the CUDA path on random-weight Qwen3-shaped targets, no network, < 6 min on one H200.

    python scripts/gpu_check.py --out gpu_check.json            # 1.7B and 8B shapes, bf16, CUDA
    python scripts/gpu_check.py --tiny --device cpu              # smoke test of the script itself

For each shape: builds a random target (lm_head sharpened so greedy text has structure) and
random-initialised drafters, checks that all four modes emit the AR tokens at temperature 0,
measures T_step, T_verify(B), T_draft(B), T_packed(H) (CUDA-synchronised), decodes once per mode
and prints the overlap share and the async vs sequential time per round. Writes a JSON that
``d3d_core`` can read back as a measured GPU cost profile.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from d3d_core.decoding.config import DecodeConfig  # noqa: E402
from d3d_core.decoding.engine import decode  # noqa: E402
from d3d_core.decoding.trace import MODES  # noqa: E402
from d3d_core.measure.costs import probe_costs  # noqa: E402
from d3d_core.models.bundles import BUNDLES, Bundle, choose_attention, init_drafter  # noqa: E402
from d3d_core.models.target import Target  # noqa: E402
from d3d_core.models.tokenizer import CharTokenizer  # noqa: E402

SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def build_bundle(shape: str, device: str, dtype, vocab: int) -> Bundle:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      eos_token_id=1, pad_token_id=0, **SHAPES[shape])
    attn = choose_attention(device)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)  # initialised directly on the device: seconds, not minutes
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    target = Target(model.eval(), name=shape)
    spec = BUNDLES["qwen3-8b"]
    drafters = {
        "d3d": init_drafter("d3d", target, spec, num_layers=4).to(device),
        "dflash": init_drafter("dflash", target, spec, num_layers=1).to(device),
    }
    return Bundle(shape, target, CharTokenizer(), drafters, {}, f"random {shape}", attention=attn)


def check(shape: str, device: str, dtype, max_new: int, B: int, H: int, vocab: int) -> dict:
    t0 = time.time()
    b = build_bundle(shape, device, dtype, vocab)
    res = {"shape": shape, "device": device, "dtype": str(dtype), "attention": b.attention, "build_s": time.time() - t0}
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, vocab - 1, (200,), generator=g).tolist()
    traces = {}
    for m in MODES:
        decode(b, prompt[:50], DecodeConfig(mode=m, block_size=B, hypotheses=H, max_new_tokens=8, stop_at_eos=False))  # warm-up
        traces[m] = decode(b, prompt, DecodeConfig(mode=m, block_size=B, hypotheses=H, max_new_tokens=max_new, stop_at_eos=False))
    ref = traces["ar"].output_ids
    res["lossless"] = {m: traces[m].output_ids == ref for m in MODES}
    res["first_divergence"] = {m: next((i for i, (x, y) in enumerate(zip(traces[m].output_ids, ref)) if x != y), None) for m in MODES}
    res["modes"] = {m: {"tau": t.stats.tau, "tokens_per_s": t.stats.tokens_per_s, "overlap": t.stats.overlap,
                        "hit_rate": t.stats.hit_rate, "ms_per_round": 1e3 * t.stats.decode_time_s / max(1, t.stats.n_rounds)}
                    for m, t in traces.items()}
    res["costs"] = probe_costs(b, block_sizes=(1, 4, 8, 16), hypotheses=(1, 2, 4, 8), ctx_len=200, repeats=5, B_packed=B)
    del b
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-1.7b,qwen3-8b")
    ap.add_argument("--tiny", action="store_true", help="only the tiny shape (CPU smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--hypotheses", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
           "results": []}
    for s in shapes:
        r = check(s, args.device, dtype, args.max_new_tokens, args.block_size, args.hypotheses, 512 if args.tiny else args.vocab)
        out["results"].append(r)
        c = r["costs"]
        print(f"\n== {s} on {args.device} ({r['attention']}, {r['dtype']}), built in {r['build_s']:.0f} s")
        print("lossless:", r["lossless"])
        print("T_step {:.2f} ms | T_verify(B) {} | T_draft d3d {} | T_packed(H) {}".format(
            c["step_ms"], {k: round(v, 2) for k, v in c["verify_ms"].items()},
            {k: round(v, 2) for k, v in c["d3d_draft_ms"].items()}, {k: round(v, 2) for k, v in c["packed_ms"].items()}))
        for m, v in r["modes"].items():
            print(f"  {m:9s} ms/round {v['ms_per_round']:7.2f}  tok/s {v['tokens_per_s']:8.1f}  overlap {v['overlap']}  hit {v['hit_rate']}")
        seq, asy = r["modes"]["d3d-seq"]["ms_per_round"], r["modes"]["d3d-async"]["ms_per_round"]
        print(f"  async vs sequential round time: {asy:.2f} vs {seq:.2f} ms ({seq / asy:.2f}x)")
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {args.out}")
    return 0 if all(all(r["lossless"].values()) for r in out["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
