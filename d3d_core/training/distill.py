"""Self-distillation data: the target's own greedy responses to training prompts.

    python -m d3d_core.training.distill --bundle smollm2-135m --data-dir ../shared/datasets \\
        --max-new-tokens 256 --batch-size 24 --target-tokens 1000000

Runs on the bundle's device (``--device``: CUDA when there is one); the prompts' ids are made there.
Prompts come only from training files (gsm8k train, mbpp train ids 601-974, alpaca).
Batched greedy generation (left padding), written as JSONL shards of token ids with the
prompt boundary under ``$D3D_CACHE/distill/<bundle>/``. Resumable: prompts already in a
shard are skipped, so a killed run continues where it stopped. Each batch is flushed to its shard
before the next one runs; the closing report is a guarded step (``rawfirst``): if it fails, it is
named on stderr and the command exits 1, the shards untouched.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from ..measure.datasets import load_training_prompts
from ..measure.rawfirst import Steps
from ..models.bundles import get_bundle
from ..models.sources import cache_dir


def distill_dir(bundle: str) -> Path:
    return cache_dir() / "distill" / bundle


def read_examples(path: Path, limit=None) -> list:
    """All examples from a distill directory: dicts with prompt_ids, response_ids."""
    out = []
    for f in sorted(Path(path).glob("shard_*.jsonl")):
        with f.open() as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a kill mid-write
                if limit and len(out) >= limit:
                    return out
    return out


def default_device() -> str:
    """Where distillation and training run unless told: the GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def done_ids(path: Path) -> set:
    return {e["id"] for e in read_examples(path)}


@torch.inference_mode()
def generate_batch(target, tok, prompts: list, max_new_tokens: int) -> list:
    """Greedy responses for a batch of prompt id lists (left-padded), generated on the target's device (the ids and the
    attention mask are made there)."""
    model = target.model
    pad = 0
    L = max(len(p) for p in prompts)
    dev = target.device
    ids = torch.full((len(prompts), L), pad, dtype=torch.long, device=dev)
    att = torch.zeros((len(prompts), L), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long, device=dev)
        att[i, L - len(p):] = 1
    eos = sorted(tok.eos_ids)
    out = model.generate(
        input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos, pad_token_id=pad,
    )
    res = []
    for i in range(len(prompts)):
        r = out[i, L:].tolist()  # one copy to the host per prompt
        finish = "length"
        for j, t in enumerate(r):
            if t in tok.eos_ids:
                r = r[: j + 1]
                finish = "eos"
                break
        res.append((r, finish))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m d3d_core.training.distill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None, help="default: $D3D_CACHE/distill/<bundle>")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--target-tokens", type=int, default=1_000_000, help="stop after this many response tokens in total")
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="where the target generates (default: cuda when there is one, else cpu)")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else distill_dir(args.bundle)
    out.mkdir(parents=True, exist_ok=True)
    bundle = get_bundle(args.bundle, args.device or default_device())
    tok = bundle.tokenizer
    items = load_training_prompts(args.data_dir)
    random.Random(args.seed).shuffle(items)
    have = read_examples(out)
    done = {e["id"] for e in have}
    total = sum(len(e["response_ids"]) for e in have)
    todo = []
    for it in items:
        key = f"{it.dataset}/{it.id}"
        if key in done:
            continue
        ids = tok.encode_messages(it.messages)
        if len(ids) <= args.max_prompt_tokens:
            todo.append((key, ids))
    shard = out / f"shard_{len(list(out.glob('shard_*.jsonl'))):05d}.jsonl"
    bar = tqdm(total=args.target_tokens, initial=min(total, args.target_tokens), unit="tok", desc="distill", file=sys.stderr)
    t0 = time.time()
    with shard.open("a") as fh:
        # batches of similar prompt length waste less compute on padding
        chunk = args.batch_size * 8
        for c in range(0, len(todo), chunk):
            group = sorted(todo[c : c + chunk], key=lambda x: len(x[1]))
            for b in range(0, len(group), args.batch_size):
                if total >= args.target_tokens:
                    break
                batch = group[b : b + args.batch_size]
                res = generate_batch(bundle.target, tok, [x[1] for x in batch], args.max_new_tokens)
                for (key, ids), (resp, finish) in zip(batch, res):
                    fh.write(json.dumps({"id": key, "prompt_ids": ids, "response_ids": resp, "finish": finish}) + "\n")
                    total += len(resp)
                    bar.update(len(resp))
                fh.flush()
            if total >= args.target_tokens:
                break
    steps = Steps(raw=out)  # the raw results: the shards, flushed batch by batch above
    with steps.step("report"):
        bar.close()
        n = len(read_examples(out))
        print(f"{n} examples, {total} response tokens in {out} ({time.time() - t0:.0f} s this run)", file=sys.stderr)
    return steps.exit_code()


if __name__ == "__main__":
    sys.exit(main())
