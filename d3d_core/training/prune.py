"""Progressive layer pruning of the D3D drafter, measured with offline τ.

    python -m d3d_core.training.prune --bundle smollm2-135m --calib 16 --eval 16 --block-size 8 \\
        --out assets/pruning/smollm2-135m.json

Greedy: at each step drop the layer whose removal costs the least offline τ on the
calibration set; record τ (and τ on held-out sequences never used for calibration) for
every removal count, and each layer's marginal cost when removed alone from the full
drafter. Writes ``{"layers", "order", "curve": [{"removed", "kept", "tau", "tau_rel",
"tau_eval", "tau_eval_rel", "tau_eval_rel_ci"}], "marginal_cost": {layer: Δτ}}`` and, with
``--calib-out``, the calibration sequences the app uses for live τ. ``tau_eval_rel_ci`` is a
95 % paired-bootstrap interval over the held-out sequences: with ~50 prompts a 1 % gap can be
noise, and the 99 % question needs to say so. Raw results first (``rawfirst``): the measured curve
reaches ``<out stem>.raw.json`` (and each healed point joins it) before any summary or schema check;
a failing step is named on stderr and in ``failed_steps``, and the command exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from ..measure.rawfirst import Steps, raw_path, write_json_atomic
from ..models.bundles import ASSETS, get_bundle
from ..models.loader import load_drafter
from ..models.sources import cache_dir
from ..schemas import checked
from .distill import distill_dir, read_examples
from .offline_tau import CALIB_PROMPTS, CalibSeq, greedy_continuations, held_out_set, offline_tau, paired_ratio_ci
from .train import TrainConfig, split_holdout, train


def progressive_prune(drafter, calib: list, eval_seqs: Optional[list] = None, B: int = 8, stride: int = 4,
                      target=None, min_layers: int = 1, progress=None) -> dict:
    """Greedy least-harm removal. Returns the curve dict (see module doc)."""
    L = drafter.cfg.num_layers
    base_skip = set(drafter.cfg.skip_layers)
    layers = [i for i in range(L) if i not in base_skip]

    def tau_of(skip, seqs, per_seq=False):
        return offline_tau(drafter.pruned(sorted(base_skip | set(skip))), seqs, B=B, stride=stride, target=target,
                           per_seq=per_seq)

    def held_out(skip):  # (τ, per-sequence sums) on the held-out prompts
        return tau_of(skip, eval_seqs, per_seq=True) if eval_seqs else (None, None)

    full = tau_of([], calib)
    full_eval, full_per = held_out([])
    marginal = {}
    removed: list = []
    curve = [_point(0, layers, full, full, full_eval, full_eval, full_per, full_per)]
    while len(layers) - len(removed) > min_layers:
        best = None
        for cand in layers:
            if cand in removed:
                continue
            t = tau_of(removed + [cand], calib)
            if not removed:
                marginal[str(cand)] = full - t
            if best is None or t > best[1]:
                best = (cand, t)
            if progress:
                progress()
        removed.append(best[0])
        kept = [i for i in layers if i not in removed]
        te, per = held_out(removed)
        curve.append(_point(len(removed), kept, best[1], full, te, full_eval, per, full_per))
    return {"layers": L, "block_size": B, "order": removed, "curve": curve, "marginal_cost": marginal,
            "calib_seqs": len(calib), "eval_seqs": len(eval_seqs or []), **({"ci": CI_NOTE} if eval_seqs else {})}


# how the held-out intervals are made (stored with a curve that has them)
CI_NOTE = {"level": 0.95, "method": "paired bootstrap over held-out sequences (2000 resamples)"}


def _point(k, kept, tau, full, te, full_eval, per=None, full_per=None):
    p = {"removed": k, "kept": list(kept), "tau": tau, "tau_rel": tau / full if full else 0.0}
    if te is not None:
        p["tau_eval"] = te
        p["tau_eval_rel"] = te / full_eval if full_eval else 0.0
        if per is not None:
            p["tau_eval_rel_ci"] = paired_ratio_ci(per, full_per)
    return p


def add_held_out_ci(curve: dict, drafter, eval_seqs: list, B: int = 8, stride: int = 4, target=None) -> dict:
    """Held-out intervals for a curve made before they were recorded: re-measure each point
    on ``eval_seqs`` (which must be the curve's own held-out set: its τ must come out the same)."""
    base_skip = set(drafter.cfg.skip_layers)

    def per_of(kept):
        skip = sorted(base_skip | {i for i in range(drafter.cfg.num_layers) if i not in kept})
        return offline_tau(drafter.pruned(skip), eval_seqs, B=B, stride=stride, target=target, per_seq=True)

    full_eval, full_per = per_of(curve["curve"][0]["kept"])
    for p in curve["curve"]:
        te, per = per_of(p["kept"]) if p["removed"] else (full_eval, full_per)
        if abs(te - p.get("tau_eval", te)) > 1e-6:
            raise ValueError(f"held-out τ {te:.4f} differs from the curve's {p['tau_eval']:.4f}: not the curve's held-out set")
        p["tau_eval_rel_ci"] = paired_ratio_ci(per, full_per)
    curve["ci"] = CI_NOTE
    return curve


def best_within(curve: dict, keep: float = 0.99, key: str = "tau_eval_rel", healed: bool = False) -> Optional[dict]:
    """The point with the most layers removed that keeps >= `keep` of τ (held-out when measured).
    ``healed``: judge the healed points by their healed τ instead; None when none keeps enough."""
    def rel(p):
        q = p["healed"] if healed else p
        return q.get(key, q["tau_rel"])

    ok = [p for p in curve["curve"] if (not healed or "healed" in p) and rel(p) >= keep]
    return max(ok, key=lambda p: p["removed"]) if ok else None


def heal(bundle, drafter, curve: dict, removed_counts: list, examples: list, calib: list, eval_seqs: list, out: Path,
         steps: int = 150, lr: float = 1e-4, control: bool = True, B: int = 8, stride: int = 4, progress: bool = True,
         kd: float = 0.0, guard: Optional[Steps] = None, save=None) -> dict:
    """Short healing fine-tune of the pruned drafters at ``removed_counts`` (layers from the
    greedy order skipped, so they get no gradient), each resumable under ``out/removed-<k>``.

    The unpruned drafter is also fine-tuned with the same steps, data order and learning rate
    (``out/control``): the drafter is not trained to convergence, so a healed drafter can beat
    the *original* just by training longer; the fair question is whether it keeps ≥ 99 % of what
    the full drafter reaches with the same extra training. Adds ``healed`` to those curve points
    and ``heal_control`` to the curve; returns the curve.

    ``kd`` = α > 0 also distils the unpruned drafter's block distributions into each one
    (loss (1-α)·CE + α·KL, see ``train.d3d_loss``); the control gets the same recipe.

    ``save``: called with the curve after each healed drafter is measured (the command writes its raw
    file there, so a later failure loses no earlier point); ``guard``: the
    :class:`~d3d_core.measure.rawfirst.Steps` that runs the closing summary (``best_99_healed``)."""

    L = drafter.cfg.num_layers
    guard = guard if guard is not None else Steps()
    base_skip = set(drafter.cfg.skip_layers)
    cfg = TrainConfig(kind="d3d", layers=L, block_size=drafter.cfg.block_size, steps=steps, lr=lr, warmup=min(20, steps // 5 + 1),
                      eval_every=steps, eval_seqs=8, ckpt_every=max(10, steps // 6), kd_alpha=kd)
    unpruned = drafter.pruned(sorted(base_skip))
    teacher = unpruned if kd > 0 else None
    recipe = {"steps": steps, "lr": lr, **({"kd_alpha": kd} if kd > 0 else {})}

    def tau_pair(d):  # calibration τ, held-out τ, held-out per-sequence sums
        te, per = (offline_tau(d, eval_seqs, B=B, stride=stride, target=bundle.target, per_seq=True)
                   if eval_seqs else (None, None))
        return offline_tau(d, calib, B=B, stride=stride, target=bundle.target), te, per

    ref_tau, ref_eval, ref_per = tau_pair(unpruned)  # = the curve's first point, re-measured for the pairing
    if control:
        res = train(bundle, examples, cfg, out / "control", progress=progress, init=unpruned,
                    init_note=f"healing control: the unpruned drafter fine-tuned {steps} steps like the pruned ones", teacher=teacher,
                    guard=guard)
        ctl = load_drafter(res["out"], bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype)
        t, te, per = tau_pair(ctl)
        curve["heal_control"] = {**recipe, "tau": t, "tau_eval": te}
        if per is not None:
            curve["heal_control"]["tau_eval_rel_ci"] = paired_ratio_ci(per, ref_per)  # control vs original
        print(f"control (unpruned + {steps} steps) saved in {res['out']}", file=sys.stderr)
        ref_tau, ref_eval, ref_per = t, te, per
        if save:
            save(curve)
    else:
        curve.pop("heal_control", None)  # a reused curve's control measured another recipe
    for k in removed_counts:
        point = next((p for p in curve["curve"] if p["removed"] == k), None)
        if point is None or k == 0:
            raise ValueError(f"no pruning point with {k} layers removed (curve has 1..{len(curve['curve']) - 1})")
        skip = sorted(base_skip | set(curve["order"][:k]))
        res = train(bundle, examples, cfg, out / f"removed-{k}", progress=progress, init=drafter.pruned(skip),
                    init_note=f"healing after pruning layers {curve['order'][:k]} ({k} of {L})", teacher=teacher, guard=guard)
        healed = load_drafter(res["out"], bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype)
        t, te, per = tau_pair(healed)
        point["healed"] = {**recipe, "tau": t, "tau_rel": t / ref_tau if ref_tau else 0.0}
        print(f"healed drafter ({k} removed) saved in {res['out']}", file=sys.stderr)
        if te is not None:
            point["healed"]["tau_eval"] = te
            point["healed"]["tau_eval_rel"] = te / ref_eval if ref_eval else 0.0
            point["healed"]["tau_eval_rel_ci"] = paired_ratio_ci(per, ref_per)
        if save:
            save(curve)
    curve["heal_reference"] = "heal_control" if control else "unpruned"
    curve["best_99_healed"] = guard.run("best_99_healed", best_within, curve, healed=True)
    return curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m d3d_core.training.prune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="D3D drafter directory (default: the bundle's)")
    ap.add_argument("--data", default=None, help="distill directory for calibration (default $D3D_CACHE/distill/<bundle>)")
    ap.add_argument("--calib", type=int, default=16, help="calibration sequences")
    ap.add_argument("--eval", type=int, default=16, help="held-out sequences (never used to choose layers)")
    ap.add_argument("--data-dir", default=None,
                    help="benchmark prompts (layout of shared/datasets): the held-out sequences are the target's "
                         "continuations of these, round-robin over the seven benchmarks (default: held-out distill data)")
    ap.add_argument("--eval-tokens", type=int, default=128, help="continuation length of the benchmark held-out sequences")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--out", default=None, help="default assets/pruning/<bundle>.json")
    ap.add_argument("--calib-out", default=None, help="also write the calibration set (assets/calibration/<bundle>.json)")
    ap.add_argument("--heal", default="", help="comma list of removal counts to heal with a short fine-tune (e.g. 1,2)")
    ap.add_argument("--heal-steps", type=int, default=150)
    ap.add_argument("--heal-lr", type=float, default=1e-4)
    ap.add_argument("--heal-kd", type=float, default=0.0,
                    help="α: also distil the unpruned drafter's block distributions while healing ((1-α)·CE + α·KL)")
    ap.add_argument("--heal-out", default=None, help="healing runs (resumable; default $D3D_CACHE/runs/heal-<bundle>)")
    ap.add_argument("--no-heal-control", action="store_true",
                    help="compare healed drafters with the original instead of the unpruned drafter fine-tuned the same steps")
    ap.add_argument("--curve", default=None, help="reuse this pruning curve JSON (skip the greedy search; e.g. only heal)")
    args = ap.parse_args(argv)
    try:
        heal_ks = [int(k) for k in args.heal.split(",") if k.strip()]
    except ValueError:
        print(f"error: --heal wants a comma list of integers, got {args.heal!r}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    bundle = get_bundle(args.bundle)
    drafter = bundle.drafter("d3d")
    if args.drafter:
        drafter = load_drafter(args.drafter, bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype)
    ex = read_examples(Path(args.data) if args.data else distill_dir(args.bundle))
    held = split_holdout(ex, args.max_len)[1]  # never trained on
    if args.data_dir and len(held) >= args.calib:
        calib, evals = held[: args.calib], held_out_set(bundle, args.data_dir, args.eval, args.eval_tokens)[0]
    elif len(held) >= args.calib + args.eval:
        calib, evals = held[: args.calib], held[args.calib : args.calib + args.eval]
    else:  # no distill data: the target's continuations of a few built-in prompts
        seqs = greedy_continuations(bundle, CALIB_PROMPTS, 96)
        calib, evals = seqs[:2], seqs[2:]
    L = drafter.cfg.num_layers
    t0 = time.time()
    out = Path(args.out) if args.out else ASSETS / "pruning" / f"{args.bundle}.json"
    steps = Steps(raw=raw_path(out))
    if args.calib_out:  # samples: written before anything is measured on them
        write_json_atomic(args.calib_out, {"bundle": args.bundle, "seqs": [
            {"prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for s in calib]}, indent=None)
    if args.curve:
        curve = json.loads(Path(args.curve).read_text())
        if evals and curve.get("eval_seqs") == len(evals) and any("tau_eval_rel_ci" not in p for p in curve["curve"]):
            try:
                add_held_out_ci(curve, drafter, evals, B=args.block_size, stride=args.stride, target=bundle.target)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    else:
        bar = tqdm(total=L * (L - 1) // 2 + L - 1, desc="prune", file=sys.stderr)
        curve = progressive_prune(drafter, calib, evals, B=args.block_size, stride=args.stride, target=bundle.target, progress=bar.update)
        bar.close()
        curve["bundle"] = args.bundle
        curve["drafter"] = drafter.cfg.training or "untrained"
        curve["wall_time_s"] = time.time() - t0
    steps.save_raw(curve)  # raw results first (rawfirst): the measured curve, before any summary or schema check
    if not args.curve:
        curve["best_99"] = steps.run("best_99", best_within, curve)

    def write(o, c):
        write_json_atomic(o, checked("pruning curve", c))

    if heal_ks:
        steps.run("write", write, out, steps.record(curve))  # the greedy curve survives a killed healing run

        out_heal = Path(args.heal_out) if args.heal_out else cache_dir() / "runs" / f"heal-{args.bundle}"
        try:
            heal(bundle, drafter, curve, heal_ks, ex, calib, evals, out_heal, steps=args.heal_steps, lr=args.heal_lr,
                 control=not args.no_heal_control, B=args.block_size, stride=args.stride, kd=args.heal_kd,
                 guard=steps, save=steps.save_raw)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    with steps.step("print"):
        print_curve(curve, out)
    return steps.finish(out, curve, write=write)


def print_curve(curve: dict, out) -> None:
    """The curve on stdout (held-out τ and intervals where measured), the best point within 99 % on stderr."""
    def ci(q):
        return f" [95 % CI {q['tau_eval_rel_ci'][0]:.1%}–{q['tau_eval_rel_ci'][1]:.1%}]" if q.get("tau_eval_rel_ci") else ""

    for p in curve["curve"]:
        ev = f"  held-out τ {p['tau_eval']:.3f} ({p['tau_eval_rel']:.1%}){ci(p)}" if p.get("tau_eval") is not None else ""
        print(f"removed {p['removed']:2d}  τ {p['tau']:.3f} ({p['tau_rel']:.1%}){ev}  kept {p['kept']}")
        if p.get("healed"):
            h = p["healed"]
            hev = f"  held-out τ {h['tau_eval']:.3f} ({h['tau_eval_rel']:.1%}){ci(h)}" if h.get("tau_eval") is not None else ""
            print(f"   healed ({h['steps']} steps)  τ {h['tau']:.3f} ({h['tau_rel']:.1%}){hev}  [vs {curve.get('heal_reference')}]")
    if "heal_control" in curve:
        c = curve["heal_control"]
        print(f"control: unpruned + {c['steps']} steps  τ {c['tau']:.3f}" + (f"  held-out τ {c['tau_eval']:.3f}" if c.get("tau_eval") else ""))
    best = curve.get("best_99")
    healed = f", {curve['best_99_healed']['removed']} after healing" if curve.get("best_99_healed") else ""
    print(f"best within 99 %: {best['removed'] if best else 'none'} layers removed{healed}; wrote {out}", file=sys.stderr)


__all__ = ["progressive_prune", "best_within", "heal", "add_held_out_ci", "CalibSeq"]

if __name__ == "__main__":
    sys.exit(main())
