"""Offline τ: acceptance length without a decoding loop (fast; used by pruning, training, the app).

Teacher-force the target's own greedy continuation: for many anchors inside it, draft the
block once and count leading drafts equal to the continuation, + 1 (the bonus). For the
D3D drafter one packed forward per sequence holds the whole sequence as causal context
plus every anchor's block (each block sees the context before its anchor). At
temperature 0 this equals the τ a real decode would see on that continuation.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from ..decoding.config import DecodeConfig
from ..decoding.engine import decode
from ..measure.datasets import BENCHMARKS, data_dir, load_benchmark
from ..measure.rawfirst import Steps, raw_path
from ..models import fastops
from ..models.bundles import ASSETS, get_bundle
from ..models.d3d import D3DDrafter
from ..models.dflash import DFlashDrafter
from ..models.drafter import DrafterConfig
from ..models.loader import build_drafter, load_drafter
from ..models.sources import cache_dir
from .distill import generate_batch


@dataclass
class CalibSeq:
    prompt_ids: list
    response_ids: list  # the target's greedy continuation

    @property
    def ids(self) -> list:
        return self.prompt_ids + self.response_ids


def anchors_for(seq: CalibSeq, B: int, stride: int) -> list:
    """Anchor positions p (token p is the anchor) inside the response with B-1 tokens after."""
    P, T = len(seq.prompt_ids), len(seq.ids)
    return list(range(P, T - (B - 1), stride))


@torch.no_grad()
def d3d_block_logits(drafter: D3DDrafter, ids: list, anchors: list, B: int) -> torch.Tensor:
    """(n_anchors, B-1, V) draft logits for positions p+1..p+B-1 of each anchor p."""
    dev = drafter.device
    ctx = torch.tensor(ids, dtype=torch.long, device=dev)
    cache = drafter.new_cache()
    blocks = [(ids[p], p) for p in anchors]  # anchor token, context visible up to p-1 => n_visible = p
    _, hb, _ = drafter.forward_packed(cache, ctx, blocks, B + 1)
    return drafter.logits(drafter.draft_rows(hb)[:, : B - 1]).float()


def target_features(drafter: DFlashDrafter, target, ids: list) -> torch.Tensor:
    """(1, T, n*H) hidden states of the drafter's target layers for every position."""
    cache = target.new_cache()
    return target.forward(cache, torch.tensor(ids, dtype=torch.long, device=target.device), 1, tuple(drafter.cfg.target_layer_ids)).feats


@torch.no_grad()
def dflash_block_logits(drafter: DFlashDrafter, target, ids: list, anchors: list, B: int) -> torch.Tensor:
    """Same for the DFlash drafter: one target forward gives the features of every position;
    each block sees the features before its anchor (4-D mask over one shared context)."""
    return dflash_anchor_logits(drafter, target_features(drafter, target, ids), ids, anchors, B)


def dflash_anchor_logits(drafter: DFlashDrafter, feats: torch.Tensor, ids: list, anchors: list, B: int) -> torch.Tensor:
    """(n_anchors, B-1, V) with gradients (training uses it too). feats: (1, T, n*H)."""
    T = len(ids)
    f = drafter.fuse(feats)  # (1, T, H)
    # the rotary table in the block's dtype (the embedding's): with fp32 master weights under bf16 autocast the fused
    # features are fp32 and the blocks bf16, and SharedParts.rope rebuilds its no-grad table, twice as long, whenever
    # the dtype it is asked for changes — alternating the two doubled it per sequence until memory ran out
    cos_c, sin_c = drafter.shared.rope(torch.arange(T, device=drafter.device), f.to(drafter.shared.embed_tokens.weight.dtype))
    # every layer's context K/V comes from the same fused features (what extend_context caches)
    past = lambda i: drafter.layers[i].self_attn.project_kv(f, cos_c, sin_c)  # noqa: E731
    h = drafter.forward_anchored(past, T, [(ids[p], p) for p in anchors], B)
    return drafter.logits(drafter.draft_rows(h)).float()


def offline_tau(drafter, seqs: list, B: int = 8, stride: int = 4, target=None, per_seq: bool = False, int8: bool = False):
    """Mean over anchors of (leading matches + 1). ``target`` is needed for DFlash drafters.
    ``per_seq``: also return [(Σ τ, n anchors)] per usable sequence — the anchors depend only on
    the sequence, so two drafters' lists pair up (see ``paired_ratio_ci``). The drafter runs as stored
    (fp32) unless ``int8``: then its int8-marked modules run in int8, as decoding runs them (fastops)."""
    if int8:
        return _offline_tau(drafter, seqs, B, stride, target, per_seq)
    with fastops.exact_drafters():
        return _offline_tau(drafter, seqs, B, stride, target, per_seq)


def _offline_tau(drafter, seqs: list, B: int, stride: int, target, per_seq: bool):
    taus = []
    per = []
    for s in seqs:
        anchors = anchors_for(s, B, stride)
        if not anchors:
            continue
        ids = s.ids
        if isinstance(drafter, D3DDrafter):
            lg = d3d_block_logits(drafter, ids, anchors, B)
        else:
            if target is None:
                raise ValueError("offline τ of a DFlash drafter needs the target (for its hidden states)")
            lg = dflash_block_logits(drafter, target, ids, anchors, B)
        pred = lg.argmax(-1).cpu()  # (n, B-1)
        truth = torch.tensor([[ids[p + k] for k in range(1, B)] for p in anchors])
        eq = (pred == truth).int()
        lead = eq.cumprod(dim=1).sum(dim=1)  # leading matches per anchor
        t = (lead + 1).float()
        taus.append(t)
        per.append((float(t.sum()), len(anchors)))
    if not taus:
        raise ValueError("calibration set has no usable anchors (responses shorter than the block)")
    tau = float(torch.cat(taus).mean())
    return (tau, per) if per_seq else tau


def paired_ratio_ci(num: list, den: list, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> list:
    """Bootstrap interval of τ(num) / τ(den) on the same sequences (``offline_tau(per_seq=True)``
    lists): resample whole sequences, because anchors inside one continuation are correlated;
    the pairing cancels the sequences' own difficulty, which both drafters share."""
    import numpy as np

    if len(num) != len(den) or any(a[1] != b[1] for a, b in zip(num, den)):
        raise ValueError("paired_ratio_ci needs per-sequence τ of two drafters on the same sequences")
    a = np.array([s for s, _ in num])
    b = np.array([s for s, _ in den])
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_boot, len(a)))
    r = a[idx].sum(1) / b[idx].sum(1)  # the anchor counts are equal, so they cancel
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


# ----------------------------------------------------------------------------- calibration sets

CALIB_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Please reason step by step.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner.",
]
_CALIB: dict = {}
_CALIB_LOCK = threading.Lock()


def greedy_continuations(bundle, prompts: list, max_new_tokens: int = 96) -> list:
    """The target's greedy continuations of prompts (chat template), as CalibSeq."""

    out = []
    for p in prompts:
        tr = decode(bundle, p, DecodeConfig(mode="ar", max_new_tokens=max_new_tokens))
        out.append(CalibSeq(tr.prompt_ids, tr.output_ids))
    return out


def calibration_set(bundle, max_new_tokens: int = 96) -> list:
    """A small calibration set for live τ in the app: shipped for the bundle when present
    (assets/calibration/<bundle>.json), else made once from the target and kept in memory."""
    import json

    with _CALIB_LOCK:
        if bundle.name in _CALIB:
            return _CALIB[bundle.name]
        p = ASSETS / "calibration" / f"{bundle.name}.json"
        if p.is_file():
            d = json.loads(p.read_text())
            seqs = [CalibSeq(s["prompt_ids"], s["response_ids"]) for s in d["seqs"]]
        else:
            seqs = greedy_continuations(bundle, CALIB_PROMPTS, max_new_tokens)
        _CALIB[bundle.name] = seqs
        return seqs


# ----------------------------------------------------------------------------- CLI


def benchmark_continuations(bundle, root: str, n: int, max_new_tokens: int, seed: int = 1) -> list:
    """The target's greedy continuations of n benchmark prompts (round-robin over the seven
    benchmarks, a different shuffle from the bench's), batched: prompts no calibration saw."""

    pools = [load_benchmark(b, n, seed=seed, root=root) for b in BENCHMARKS if b != "mt_bench_2turn"]
    items = [pool[i] for i in range(n) for pool in pools if i < len(pool)][:n]
    tok = bundle.tokenizer
    prompts = [tok.encode_messages(it.messages) for it in items]
    out = []
    for b in range(0, len(prompts), 8):
        batch = prompts[b : b + 8]
        for p, (r, _) in zip(batch, generate_batch(bundle.target, tok, batch, max_new_tokens)):
            out.append(CalibSeq(list(p), list(r)))
    return out


def held_out_set(bundle, root, n: int, max_new_tokens: int) -> tuple:
    """``benchmark_continuations`` cached under $D3D_CACHE/eval/<bundle>-n<n>-t<tokens>.json (the
    target's greedy continuations take minutes on a CPU; pruning and ``python -m d3d_core.training.offline_tau``
    share the file, so both score drafters on the same sequences). Returns (seqs, path)."""

    f = cache_dir() / "eval" / f"{bundle.name}-n{n}-t{max_new_tokens}.json"
    if f.is_file():
        return [CalibSeq(s["prompt_ids"], s["response_ids"]) for s in json.loads(f.read_text())], f
    seqs = benchmark_continuations(bundle, str(data_dir(root)), n, max_new_tokens)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".part")
    tmp.write_text(json.dumps([{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for s in seqs]))
    tmp.replace(f)  # a killed run leaves no half-written set behind
    return seqs, f


def load_any_drafter(path, bundle):
    """A drafter from a saved directory (config.json + model.safetensors) or from a training
    checkpoint directory (ckpt/: state.json + drafter.safetensors)."""
    import json
    from pathlib import Path

    p = Path(path)
    if (p / "ckpt" / "state.json").is_file():
        p = p / "ckpt"
    if (p / "state.json").is_file() and (p / "drafter.safetensors").is_file():
        from safetensors.torch import load_file

        st = json.loads((p / "state.json").read_text())
        d = build_drafter(DrafterConfig.from_json(st["drafter"]), bundle.target.shared)
        if d.frozen_base:  # an adapter drafter's checkpoint holds its own weights only: the base is the target's
            d.rebuild_base()
        d.load_own_state(load_file(str(p / "drafter.safetensors")))
        return d.to(bundle.device, bundle.target.dtype).eval(), st["step"]
    return load_drafter(p, bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype), None


def main(argv=None) -> int:
    """Offline τ of drafters on fixed held-out sets: the target's continuations of benchmark
    prompts (no training or calibration saw them), cached under $D3D_CACHE/eval/."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m d3d_core.training.offline_tau", description=main.__doc__.split("\n")[0])
    ap.add_argument("drafters", nargs="+", help="drafter directories or training run / checkpoint directories")
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--data-dir", default=None, help="benchmark prompts (layout of shared/datasets)")
    ap.add_argument("--n", type=int, default=21, help="benchmark prompts, round-robin over the seven")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="run the D3D drafters' MLPs and head in int8, as decoding does")
    ap.add_argument("--out", default=None, help="also write the scores as JSON (each drafter's reaches <out stem>.raw.json as soon as it is measured)")
    args = ap.parse_args(argv)

    bundle = get_bundle(args.bundle)
    seqs, f = held_out_set(bundle, args.data_dir, args.n, args.tokens)
    steps = Steps(raw=raw_path(args.out) if args.out else None)
    doc = {"bundle": args.bundle, "held_out": str(f), "n_seqs": len(seqs), "block_size": args.block_size, "stride": args.stride,
           "int8": args.int8, "drafters": []}
    print(f"{len(seqs)} held-out sequences ({f}), B={args.block_size}, stride {args.stride}")
    first = None  # (τ, per-sequence sums) of the first drafter that loads: the reference for the ratios
    for path in args.drafters:
        try:
            d, step = load_any_drafter(path, bundle)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: cannot load ({e})", file=sys.stderr)
            continue
        t, per = offline_tau(d, seqs, B=args.block_size, stride=args.stride, target=bundle.target, per_seq=True, int8=args.int8)
        rec = {"path": str(path), "kind": d.cfg.kind, "layers": len(d.active_layers()), "step": step, "tau": t, "per_seq": per}
        doc["drafters"].append(rec)
        if args.out:  # raw results first (rawfirst): this drafter's score is on disk before the comparison runs
            steps.save_raw(doc)
        vs = ""
        if first is None:
            first = (t, per)
        else:  # paired with the first drafter on the same sequences
            ci = steps.run(f"paired interval ({path})", paired_ratio_ci, per, first[1])
            rec["ratio_vs_first"] = t / first[0] if first[0] else None
            rec["ratio_ci95"] = ci
            ratio = "—" if rec["ratio_vs_first"] is None else f"{rec['ratio_vs_first']:.1%}"
            vs = f"  ({ratio} of the first" + (f", 95 % CI {ci[0]:.1%}–{ci[1]:.1%})" if ci else ")")
        with steps.step("print"):
            print(f"{t:.3f}  {d.cfg.kind} {len(d.active_layers())}L" + (f" step {step}" if step is not None else "") + f"  {path}{vs}")
    if args.out:
        return steps.finish(args.out, doc)
    return steps.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
