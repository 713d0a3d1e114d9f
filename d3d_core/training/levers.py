"""Training-recipe levers, compared at equal CPU time on held-out prompts.

    python -m d3d_core.training.levers cost --threads 1                 # ms per training sequence, per recipe
    python -m d3d_core.training.levers run --minutes 10 --threads 1     # equal-time runs + paired held-out τ

``cost`` times one forward + backward of the D3D loss per recipe on the same training sequences
and counts the supervised positions, so "signal per FLOP" is a number, not a hope. ``run`` trains one
drafter per recipe from the same target-initialised start for the same wall time (steps = budget /
measured step time, so every recipe completes its own learning-rate schedule), then scores each on
held-out benchmark continuations (``offline_tau.held_out_set``) with a paired bootstrap interval against the
``base`` recipe (the shipped one). Runs checkpoint under ``$D3D_CACHE/levers/<recipe>`` and the plan is
kept beside them, so rerunning the same command resumes; results go to ``--json``, each recipe's to
``<json stem>.raw.json`` as soon as it is scored (``rawfirst``: a failing summary step is named and exits 1).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..measure.machine import machine_info
from ..measure.rawfirst import Steps, raw_path
from ..models.bundles import get_bundle
from ..models.loader import load_drafter
from ..models.sources import cache_dir
from .distill import distill_dir, read_examples
from .losses import HeadLoss
from .offline_tau import held_out_set, offline_tau, paired_ratio_ci
from .softlabels import SoftLabelCache
from .softlabels import cache_root as softlabel_root
from .train import TrainConfig, autocast, d3d_loss, for_training, fresh_drafter, head_shortlist, master_dtype, sample_anchors, split_holdout, to_seq, train

RECIPES = {
    "base": dict(anchors=16, ar_positions=64),  # the shipped recipe
    "dense": dict(anchors=0, ar_positions=0),
    "dense-short": dict(anchors=0, ar_positions=0, head_shortlist=8192),
    "dense-short-soft": dict(anchors=0, ar_positions=0, head_shortlist=8192, soft_k=32),
    "short": dict(anchors=16, ar_positions=64, head_shortlist=8192),  # the shipped anchors, the cheaper head
    "short-soft": dict(anchors=16, ar_positions=64, head_shortlist=8192, soft_k=32),
    # depth, then the slot draft 1 is read at (issue #15, levers 4 and 5): the cheaper head, the shipped anchors. No 16- or
    # 24-layer recipe: no subset of the target's layers tried drafts draft 1 right even 55 % of the time untrained (LEDGER)
    "short-anchor": dict(anchors=16, ar_positions=64, head_shortlist=8192, first_draft="anchor"),
    "deep30-anchor": dict(layers=30, anchors=16, ar_positions=64, head_shortlist=8192, first_draft="anchor", anchor_attention="causal"),
    # the same at a tenth of the learning rate: does keeping the anchor slot near the target (draft 1 exact) pay?
    "deep30-anchor-slow": dict(layers=30, anchors=16, ar_positions=64, head_shortlist=8192, first_draft="anchor",
                               anchor_attention="causal", lr=3e-5),
    # the anchor path protected by construction: frozen target layers, trained rank-64 adapters on the MASK slots only
    # (DrafterConfig.adapter_rank), so draft 1 stays the target's token; no AR term (nothing trainable acts on the context)
    "deep30-adapter": dict(layers=30, anchors=16, head_shortlist=8192, first_draft="anchor", anchor_attention="causal",
                           adapter_rank=64, ar_lambda=0.0, lr=1e-3),
}


def recipe_config(name: str, **over) -> TrainConfig:
    return replace(TrainConfig(kind="d3d", layers=8, block_size=8), **{**RECIPES[name], **over})


def first_draft_accuracy(drafter, seqs: list) -> dict:
    """How often draft 1 equals the target's token, read at the anchor slot and at the first MASK slot
    (offline τ at B = 2, every anchor, minus the bonus): lever 5, whichever slot the drafter decodes with."""
    return {rule: round(offline_tau(drafter.with_first_draft(rule), seqs, B=2, stride=1) - 1.0, 4) for rule in ("anchor", "mask")}


def step_cost(bundle, examples: list, cfg: TrainConfig, n_seqs: int = 4, seed: int = 0) -> dict:
    """Mean wall ms of forward + backward of the D3D loss over the same n training sequences,
    and the supervised positions (block + context) each one trains."""
    dev = bundle.target.device
    drafter = for_training(fresh_drafter(bundle, cfg), dev, master_dtype(cfg, bundle.target.dtype, dev)).train()  # as train() runs it
    train_ex, _ = split_holdout(examples, cfg.max_len)
    picked = random.Random(seed).sample(train_ex, n_seqs)
    head = HeadLoss(drafter.cfg.arch.vocab_size, head_shortlist(train_ex, cfg.head_shortlist) if cfg.head_shortlist else None,
                    cfg.other_samples)
    soft = SoftLabelCache(softlabel_root(bundle.name), bundle.target, cfg.soft_k) if cfg.soft_k else None
    times, positions = [], []
    for i, e in enumerate(picked):
        s = to_seq(e, cfg.max_len)
        anchors = sample_anchors(s, cfg.anchors, random.Random(i))
        topk = soft.get(e["id"], s.ids) if soft else None  # cached before timing
        for rep in range(2):  # the first pass warms the allocator and oneDNN
            t0 = time.perf_counter()
            with autocast(cfg, dev):
                loss, _, _ = d3d_loss(drafter, s, anchors, cfg, random.Random(i), head=head, topk=topk)
            loss.backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the clock stops when the GPU has done the work, not when it was queued
            drafter.zero_grad(set_to_none=True)
            if rep:
                times.append(time.perf_counter() - t0)
        ctx = len(s.ids) - len(s.prompt_ids) if cfg.ar_positions <= 0 else min(cfg.ar_positions, len(s.response_ids))
        positions.append(len(anchors) * cfg.block_size + ctx)
    ms = 1000 * sum(times) / len(times)
    pos = sum(positions) / len(positions)
    return {"ms_per_seq": round(ms, 1), "supervised_per_seq": round(pos, 1), "positions_per_s": round(1000 * pos / ms, 1)}


def _plan_path() -> Path:
    return cache_dir() / "levers" / "plan.json"


def run(bundle, examples: list, minutes: float, names: list, eval_n: int, eval_tokens: int, data_dir, out_json: Path,
        reference: str = "base", steps: Steps | None = None) -> dict:
    """Train and score every recipe; returns the result document. Raw results first (``rawfirst``): after each
    recipe the results so far reach ``<json stem>.raw.json``; the comparison with the reference and the
    provenance then run as guarded steps. Without ``steps`` the document is also written to ``out_json``
    (with ``steps``, the caller finishes it: ``steps.finish(out_json, doc)``)."""
    own = steps is None
    steps = steps if steps is not None else Steps(raw=raw_path(out_json))
    plan_f = _plan_path()
    plan = json.loads(plan_f.read_text()) if plan_f.is_file() else {}
    seqs, _ = held_out_set(bundle, data_dir, eval_n, eval_tokens)
    results = {}
    doc = {"minutes_per_recipe": minutes, "threads": torch.get_num_threads(), "held_out": f"{eval_n} benchmark continuations × {eval_tokens} tokens",
           "train_examples": len(split_holdout(examples, TrainConfig.max_len)[0]),
           "train_tokens": sum(len(e["response_ids"]) for e in examples), "results": results}
    for name in names:
        key = f"{name}@{minutes}"
        if key not in plan:
            c = step_cost(bundle, examples, recipe_config(name))
            n_steps = max(10, int(minutes * 60 * 1000 / (c["ms_per_seq"] * TrainConfig.accum)))
            plan[key] = {"steps": n_steps, "cost": c}
            plan_f.parent.mkdir(parents=True, exist_ok=True)
            plan_f.write_text(json.dumps(plan, indent=1))
        n_steps = plan[key]["steps"]
        cfg = recipe_config(name, steps=n_steps, warmup=max(1, n_steps // 10), eval_every=n_steps, eval_seqs=8, ckpt_every=10)
        out = cache_dir() / "levers" / key
        t0 = time.process_time()
        res = train(bundle, examples, cfg, out, progress=False, guard=steps)
        d = load_drafter(Path(res["out"]), bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype).eval()
        tau, per = offline_tau(d, seqs, B=8, stride=4, per_seq=True)
        start = fresh_drafter(bundle, cfg).eval()  # the untrained start: what the CPU time bought is the difference
        tau0 = offline_tau(start, seqs, B=8, stride=4)
        results[name] = {"steps": cfg.steps, "layers": cfg.layers, "first_draft": d.cfg.first_draft, "cost": plan[key]["cost"],
                         "held_out_tau": round(tau, 4), "held_out_tau_start": round(tau0, 4), "per_seq": per,
                         "draft1": first_draft_accuracy(d, seqs), "draft1_start": first_draft_accuracy(start, seqs),
                         "cpu_s_this_run": round(time.process_time() - t0, 1), "history": res["history"],
                         "train_config": asdict(cfg)}
        steps.save_raw(doc)  # this recipe's measurements are on disk before the next one starts
        with steps.step("log"):
            print(json.dumps({"recipe": name, "steps": cfg.steps, "held_out_tau": round(tau, 4), "start": round(tau0, 4),
                              "draft1": results[name]["draft1"]}), file=sys.stderr)
    if reference in results:
        steps.run("reference", compare_with, results, reference)
    doc["machine"] = steps.run("machine", machine_info, default={})
    if own:
        steps.finish(out_json, doc)
    return doc


def compare_with(results: dict, reference: str) -> None:
    """Each recipe's held-out τ as a ratio of the reference recipe's, with a paired 95 % interval (in place)."""
    ref = results[reference]
    for name, r in results.items():
        if name != reference:
            r["reference"] = reference
            r["ratio_vs_reference"] = round(r["held_out_tau"] / ref["held_out_tau"], 4) if ref["held_out_tau"] else None
            r["ratio_ci95"] = [round(x, 4) for x in paired_ratio_ci(r["per_seq"], ref["per_seq"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m d3d_core.training.levers", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["cost", "run"])
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--data", default=None, help="distill directory (default $D3D_CACHE/distill/<bundle>)")
    ap.add_argument("--data-dir", default=None, help="benchmark datasets (held-out prompts)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--minutes", type=float, default=10.0, help="wall minutes of training per recipe")
    ap.add_argument("--eval-n", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reference", default="base", help="the recipe every other one is compared with (paired interval)")
    ap.add_argument("--json", default="docs/levers.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    bad = [n for n in names if n not in RECIPES]
    if bad:
        print(f"error: unknown recipe(s) {bad}; choose from {sorted(RECIPES)}", file=sys.stderr)
        return 2
    bundle = get_bundle(args.bundle)
    examples = read_examples(Path(args.data) if args.data else distill_dir(args.bundle))
    if len(examples) < 8:
        print("error: too little self-distillation data; run python -m d3d_core.training.distill first", file=sys.stderr)
        return 2
    if args.what == "cost":
        rows = {n: step_cost(bundle, examples, recipe_config(n)) for n in names}
        print(json.dumps({"threads": torch.get_num_threads(), "recipes": rows}, indent=1))
        return 0
    steps = Steps(raw=raw_path(args.json))
    doc = run(bundle, examples, args.minutes, names, args.eval_n, args.eval_tokens, args.data_dir, Path(args.json), args.reference, steps=steps)
    with steps.step("print"):
        for n, r in doc["results"].items():
            ratio = r.get("ratio_vs_reference", 1.0)
            print(f"{n:18s} {r['layers']:2d}L steps {r['steps']:5d}  held-out τ {r['held_out_tau_start']:.3f} -> {r['held_out_tau']:.3f}  "
                  f"{'—' if ratio is None else f'{ratio:.3f}'}× {args.reference} {r.get('ratio_ci95', '')}  draft 1 right {r['draft1']}")
    return steps.finish(Path(args.json), doc)


if __name__ == "__main__":
    sys.exit(main())
