"""Output quality of the int4 engine's two kernels against the fp32 engine, on the bundled SmolLM2-135M.

    .venv/bin/python scripts/lowbit_quality.py [--n 8] [--tokens 96] [--datasets gsm8k,mt_bench]

The fp32 engine (the GGUF's weights dequantised) writes its greedy answer to each held-out prompt; then each engine
reads prompt + that answer in one teacher-forced pass, and per answer position we count
- **agreement**: its argmax equals the fp32 engine's (which is the answer's next token);
- **NLL**: its negative log-likelihood of the answer's next token (perplexity = exp of the mean);
- **KL**: KL(fp32 || engine) of the next-token distributions.
Engines: ``int4-torch`` (torch's ``_weight_int4pack_mm_for_cpu``, bf16 activations) and ``int4-lowbit`` (the low-bit
kernel, 8-bit block activations), both from the same GGUF codes, and ``fp32`` itself (agreement 1 by definition).
Also the free-running greedy answers' agreement with fp32's: the share of answers identical to fp32's, and of the
first 32 tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def greedy(t, cache_weights, ids: list, n: int) -> list:
    c = t.new_cache()
    c.int4 = cache_weights
    logits = t.prefill(c, torch.tensor(ids)).logits
    out = []
    for _ in range(n):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = t.verify(c, torch.tensor([tok])).logits
    return out


def teacher_forced(t, cache_weights, ids: list, n_answer: int) -> torch.Tensor:
    """log-probs (n_answer, V) predicting each answer token, from one pass over prompt + answer."""
    c = t.new_cache()
    c.int4 = cache_weights
    logits = t.forward(c, torch.tensor(ids), n_answer + 1).logits[:-1]
    return torch.log_softmax(logits.double(), -1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8, help="prompts per dataset")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--datasets", default="gsm8k,mt_bench")
    a = ap.parse_args(argv)
    from d3d_core.measure.datasets import load_benchmark
    from d3d_core.models import int4, lowbit
    from d3d_core.models.bundles import get_bundle

    b = get_bundle("smollm2-135m")
    t = b.target
    t.engine_request = "int4"
    weights = {}
    lowbit.reset()
    os.environ["D3D_LOWBIT"] = "off"
    weights["int4-torch"] = int4.load(t, t.int4_source)
    del os.environ["D3D_LOWBIT"]
    lowbit.reset()
    if lowbit.status().lowbit:
        weights["int4-lowbit"] = int4.load(t, t.int4_source)
    else:
        print(f"# the low-bit kernel does not run here: {lowbit.status().reason}")
    t.engine_request = "fast"
    items = [it for name in a.datasets.split(",") for it in load_benchmark(name, a.n, seed=1)]
    stats = {e: {"agree": 0, "nll": 0.0, "kl": 0.0, "same": 0, "same32": 0} for e in ["fp32", *weights]}
    total = 0
    t0 = time.time()
    for it in items:
        ids = b.tokenizer.encode_messages(it.messages)
        ref = greedy(t, None, ids, a.tokens)
        full = ids + ref
        lp_ref = teacher_forced(t, None, full, len(ref))
        total += len(ref)
        for e in stats:
            w = weights.get(e)
            lp = lp_ref if e == "fp32" else teacher_forced(t, w, full, len(ref))
            st = stats[e]
            st["agree"] += int((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
            st["nll"] += float(-lp[torch.arange(len(ref)), torch.tensor(ref)].sum())
            st["kl"] += float((lp_ref.exp() * (lp_ref - lp)).sum())
            out = ref if e == "fp32" else greedy(t, w, ids, a.tokens)
            st["same"] += int(out == ref)
            st["same32"] += int(out[:32] == ref[:32])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d', time.gmtime())}, {cpu}, torch {torch.__version__}, commit {commit}; {len(items)} prompts "
          f"({a.datasets}, n {a.n} each, seed 1), {a.tokens} tokens of fp32's greedy answer each ({total} positions), {time.time() - t0:.0f} s")
    print("| engine | top-1 agreement with fp32 | perplexity of fp32's answer | mean KL(fp32 ‖ engine) | answers identical to fp32's | first 32 tokens identical |")
    print("|---|---|---|---|---|---|")
    for e, st in stats.items():
        print(f"| {e} | {st['agree'] / total:.4f} | {math.exp(st['nll'] / total):.4f} | {st['kl'] / total:.5f} | "
              f"{st['same']}/{len(items)} | {st['same32']}/{len(items)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
