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

import torch

from ..measure.rawfirst import Steps, raw_path, write_json_atomic
from ..models import fastops
from ..models.bundles import ASSETS, get_bundle
from ..models.d3d import D3DDrafter
from ..models.loader import load_drafter
from ..models.sources import cache_dir
from ..schemas import checked
from .distill import distill_dir, read_examples
from .offline_tau import CALIB_PROMPTS, CalibSeq, anchors_for, greedy_continuations, held_out_set, offline_tau, paired_ratio_ci
from .train import TrainConfig, split_holdout, train


class PrefixTau:
    """Offline τ of a D3D drafter under many skip sets, computed as ``offline_tau`` computes it (the same packed
    forward, the same bits: tested) but reusing what two skip sets share. Dropping layer ``c`` from skip set ``S``
    changes nothing below ``c``, so with the input of every layer under ``S`` kept (``settle``), the candidate
    ``S ∪ {c}`` runs only the active layers above ``c``. A greedy pruning step over 30 candidates then costs about
    half of 30 full passes. Inputs (embeddings, positions, masks) are built once per sequence."""

    def __init__(self, drafter, seqs: list, B: int = 8, stride: int = 4):
        self.d, self.B = drafter, B
        self.items = []  # per usable sequence: (x (1, N, H), cos, sin, mask, rows, truth (n, B-1))
        with torch.no_grad(), fastops.exact_drafters():
            for s in seqs:
                anchors = anchors_for(s, B, stride)
                if not anchors:
                    continue
                ids = s.ids
                ctx = torch.tensor(ids, dtype=torch.long, device=drafter.device)
                blocks = [(ids[p], p) for p in anchors]
                x, pos, mask, need = drafter._inputs(0, ctx, blocks, B + 1)
                cos, sin = drafter.shared.rope(pos, x, need)
                rows = drafter.adapter_rows(x, len(ids), len(blocks), B + 1)  # as forward_packed
                truth = torch.tensor([[ids[p + k] for k in range(1, B)] for p in anchors])
                self.items.append((x, cos, sin, mask, rows, truth, len(ids), len(blocks)))
        if not self.items:
            raise ValueError("calibration set has no usable anchors (responses shorter than the block)")
        self.skip: tuple = ()
        self.inputs: list = []  # per item: {layer: its input under self.skip}

    def _run(self, item, x, layers):
        _, cos, sin, mask, rows, _, _, _ = item
        empty = self.d.new_cache()
        for i in layers:
            x, _ = self.d.layers[i](x, cos, sin, empty.get(i), mask, rows)
        return x

    def _tau_of_output(self, item, x) -> torch.Tensor:
        truth, C, nb = item[5], item[6], item[7]
        hb = x[0][C:].view(nb, self.B + 1, x.shape[-1])
        pred = self.d.logits(self.d.draft_rows(hb)[:, : self.B - 1]).float().argmax(-1).cpu()
        lead = (pred == truth).int().cumprod(dim=1).sum(dim=1)
        return (lead + 1).float()  # per anchor; averaged over all anchors as offline_tau averages them

    def settle(self, skip) -> float:
        """Make ``skip`` the base: keep every layer's input under it; returns its τ."""
        self.skip = tuple(sorted(set(skip)))
        active = [i for i in range(self.d.cfg.num_layers) if i not in self.skip]
        self.inputs, taus = [], []
        with torch.no_grad(), fastops.exact_drafters():
            for item in self.items:
                x, kept = item[0], {}
                for i in active:
                    kept[i] = x
                    x = self._run(item, x, [i])
                self.inputs.append(kept)
                taus.append(self._tau_of_output(item, x))
        return float(torch.cat(taus).mean())

    def tau_without(self, c: int) -> float:
        """τ of the base skip set plus layer ``c`` (an active layer of the base)."""
        if c in self.skip or not self.inputs:
            raise ValueError(f"layer {c} is not an active layer of the settled skip set {list(self.skip)}")
        above = [i for i in range(c + 1, self.d.cfg.num_layers) if i not in self.skip]
        with torch.no_grad(), fastops.exact_drafters():
            taus = [self._tau_of_output(item, self._run(item, kept[c], above)) for item, kept in zip(self.items, self.inputs)]
        return float(torch.cat(taus).mean())


def progressive_prune(drafter, calib: list, eval_seqs: Optional[list] = None, B: int = 8, stride: int = 4,
                      target=None, min_layers: int = 1, progress=None, max_removed: Optional[int] = None,
                      shortlist: int = 0, state: Optional[dict] = None, save_state=None) -> dict:
    """Greedy least-harm removal. Returns the curve dict (see module doc).

    ``max_removed``: stop after that many removals. ``shortlist`` > 0: after the first step (which measures every
    layer), measure only the ``shortlist`` layers that cost least in the previous step — an approximation of the
    full greedy search, recorded in the curve's ``search``. ``state`` / ``save_state``: resume a search (the dict
    ``save_state`` was last called with, after each removal); the resumed curve is the one an uninterrupted run makes."""
    L = drafter.cfg.num_layers
    base_skip = set(drafter.cfg.skip_layers)
    layers = [i for i in range(L) if i not in base_skip]
    fast = PrefixTau(drafter, calib, B=B, stride=stride) if isinstance(drafter, D3DDrafter) else None

    def tau_of(skip, seqs, per_seq=False):
        return offline_tau(drafter.pruned(sorted(base_skip | set(skip))), seqs, B=B, stride=stride, target=target,
                           per_seq=per_seq)

    def held_out(skip):  # (τ, per-sequence sums) on the held-out prompts
        return tau_of(skip, eval_seqs, per_seq=True) if eval_seqs else (None, None)

    st = state or {}
    if st:
        full, full_eval, full_per = st["full"], st["full_eval"], st["full_per"]
        marginal, removed, curve, last = st["marginal"], list(st["order"]), st["curve"], st.get("last_costs", {})
    else:
        full = fast.settle(base_skip) if fast else tau_of([], calib)
        full_eval, full_per = held_out([])
        marginal, removed, last = {}, [], {}
        curve = [_point(0, layers, full, full, full_eval, full_eval, full_per, full_per)]
    stop_at = len(layers) - min_layers if max_removed is None else min(max_removed, len(layers) - min_layers)
    while len(removed) < stop_at:
        if fast:
            fast.settle(base_skip | set(removed))
        cands = [c for c in layers if c not in removed]
        if shortlist and removed and last:
            cands = sorted(cands, key=lambda c: last.get(str(c), float("inf")))[:shortlist]
        costs, best = {}, None
        for cand in cands:
            t = fast.tau_without(cand) if fast else tau_of(removed + [cand], calib)
            costs[str(cand)] = curve[-1]["tau"] - t
            if not removed:
                marginal[str(cand)] = full - t
            if best is None or t > best[1]:
                best = (cand, t)
            if progress:
                progress()
        last = {**last, **costs}
        removed.append(best[0])
        kept = [i for i in layers if i not in removed]
        te, per = held_out(removed)
        curve.append(_point(len(removed), kept, best[1], full, te, full_eval, per, full_per))
        curve[-1]["measured"] = len(cands)
        if save_state:
            save_state({"full": full, "full_eval": full_eval, "full_per": full_per, "marginal": marginal,
                        "order": removed, "curve": curve, "last_costs": last})
    search = "greedy: every remaining layer measured at every step"
    if shortlist:
        search = (f"greedy with a shortlist: step 1 measures every layer, each later step the {shortlist} layers that "
                  "cost least in the step before")
    return {"layers": L, "block_size": B, "order": removed, "curve": curve, "marginal_cost": marginal,
            "calib_seqs": len(calib), "eval_seqs": len(eval_seqs or []), "search": search,
            **({"ci": CI_NOTE} if eval_seqs else {})}


def draft_ms_by_layers(drafter, kept_lists: list, B: int = 8, context: int = 256, new_tokens: int = 3, reps: int = 9,
                       target=None) -> dict:
    """What one draft costs with each kept-layer list: a D3D draft pass as a d3d-seq round runs it (``new_tokens``
    accepted tokens into a cache of ``context`` committed ones, plus one block of ``B``, then the head over its
    drafts), median wall ms over ``reps``, the points interleaved so that a machine's drift hits them alike. With
    ``target``: also one target step and one verify of ``B`` rows at the same context on the target's engine, timed
    in the same loop, so the round's economics (break-even τ) come from one machine and one run."""
    import os

    g = torch.Generator().manual_seed(0)
    V = drafter.cfg.arch.vocab_size
    ids = torch.randint(3, V, (context + B,), generator=g)
    ds = [drafter.pruned(sorted(set(range(drafter.cfg.num_layers)) - set(k))) for k in kept_lists]
    caches = []
    with torch.inference_mode():
        for d in ds:
            c = d.new_cache()
            _, _, kv = d.forward_packed(c, ids[:context], [], B)
            d.commit_kv(c, kv, context)
            caches.append(c)
        tc = None
        if target is not None:
            tc = target.new_cache()
            target.prefill(tc, ids[:context])
        times = [[] for _ in ds]
        step, verify = [], []
        for r in range(reps + 1):
            for j, (d, c) in enumerate(zip(ds, caches)):
                t = time.perf_counter()
                _, hb, _ = d.forward_packed(c, ids[context : context + new_tokens], [(int(ids[context + new_tokens]), new_tokens)], B)
                d.logits(d.draft_rows(hb)[:, : B - 1])
                if r:
                    times[j].append((time.perf_counter() - t) * 1e3)
            if tc is not None:
                for n, out in ((1, step), (B, verify)):
                    t = time.perf_counter()
                    target.verify(tc, ids[context : context + n])
                    if r:
                        out.append((time.perf_counter() - t) * 1e3)
                    target.rollback(tc, n)

    def med(t):
        return round(sorted(t)[len(t) // 2], 2)

    out = {"ms": [med(t) for t in times], "what": f"one draft pass (Drafter.forward_packed, outside the decode engine): "
           f"{new_tokens} new context tokens + a block of {B} over {context} cached, and the head; median of {reps}",
           "threads": torch.get_num_threads(),
           "load_average": round(os.getloadavg()[0], 2)}
    if tc is not None:
        out.update(step_ms=med(step), verify_ms=med(verify), verify_rows=B, engine=target.engine)
    return out


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
    curve["heal_data"] = {"examples": len(examples), "response_tokens": sum(len(e.get("response_ids") or []) for e in examples),
                          "threads": torch.get_num_threads()}  # what the healing runs trained on (provenance)
    curve["best_99_healed"] = guard.run("best_99_healed", best_within, curve, healed=True)
    return curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m d3d_core.training.prune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--drafter", default=None,
                    help="a shipped D3D drafter's name (d3d, d3d-deep) or a drafter directory (default: the bundle's d3d)")
    ap.add_argument("--calib-set", default=None,
                    help="calibration sequences from a JSON like assets/calibration/<bundle>.json (default: held-out distill data)")
    ap.add_argument("--max-removed", type=int, default=None, help="stop after removing this many layers")
    ap.add_argument("--shortlist", type=int, default=0,
                    help="after step 1, measure only the K layers that cost least in the step before (0: every layer)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--fresh", action="store_true", help="ignore a saved search and start again")
    ap.add_argument("--retime", action="store_true",
                    help="with --curve: time the draft at every point again (and a target step and verify), on a quiet machine")
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

    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = get_bundle(args.bundle)
    name = args.drafter or "d3d"
    if name in bundle.d3d_names():
        drafter = bundle.drafter(name)
    else:
        try:
            drafter = load_drafter(args.drafter, bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype)
        except (FileNotFoundError, OSError, ValueError) as e:
            print(f"error: --drafter {args.drafter!r} is neither one of this bundle's D3D drafters "
                  f"({', '.join(bundle.d3d_names())}) nor a drafter directory ({e})", file=sys.stderr)
            return 2
        name = Path(args.drafter).name
    try:
        ex = read_examples(Path(args.data) if args.data else distill_dir(args.bundle))
    except (FileNotFoundError, OSError, ValueError):
        ex = []  # no distill data here: --calib-set or the built-in prompts
    held = split_holdout(ex, args.max_len)[1] if ex else []  # never trained on
    if args.calib_set:
        sets = json.loads(Path(args.calib_set).read_text())["seqs"]
        calib = [CalibSeq(s["prompt_ids"], s["response_ids"]) for s in sets][: args.calib]
        evals = held_out_set(bundle, args.data_dir, args.eval, args.eval_tokens)[0] if args.data_dir else held[: args.eval]
    elif args.data_dir and len(held) >= args.calib:
        calib, evals = held[: args.calib], held_out_set(bundle, args.data_dir, args.eval, args.eval_tokens)[0]
    elif len(held) >= args.calib + args.eval:
        calib, evals = held[: args.calib], held[args.calib : args.calib + args.eval]
    else:  # no distill data: the target's continuations of a few built-in prompts
        seqs = greedy_continuations(bundle, CALIB_PROMPTS, 96)
        calib, evals = seqs[:2], seqs[2:]
    L = drafter.cfg.num_layers
    t0 = time.time()
    out = Path(args.out) if args.out else ASSETS / "pruning" / (f"{args.bundle}.json" if name == "d3d" else f"{args.bundle}-{name}.json")
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
        # the search is saved after every removal and resumed by the same command (a session may end mid-search)
        key = {"bundle": args.bundle, "drafter": name, "calib": [len(s.ids) for s in calib], "eval": [len(s.ids) for s in evals],
               "block_size": args.block_size, "stride": args.stride, "shortlist": args.shortlist}
        run_dir = cache_dir() / "runs" / f"prune-{args.bundle}-{name}"
        saved = run_dir / "search.json"
        state = None
        if saved.is_file() and not args.fresh:
            st = json.loads(saved.read_text())
            if st.get("key") == key:
                state = st["state"]
                t0 -= st.get("wall_time_s", 0.0)
                print(f"resuming the search saved in {saved}: {len(state['order'])} layers removed so far", file=sys.stderr)
            else:
                print(f"a saved search in {saved} measured other settings: starting again", file=sys.stderr)

        def save_state(s):
            write_json_atomic(saved, {"key": key, "state": s, "wall_time_s": time.time() - t0}, indent=None)

        n_max = L - 1 if args.max_removed is None else args.max_removed
        total = sum(L - k if (not args.shortlist or k == 0) else min(args.shortlist, L - k) for k in range(n_max))
        bar = tqdm(total=total, desc="prune", file=sys.stderr)
        curve = progressive_prune(drafter, calib, evals, B=args.block_size, stride=args.stride, target=bundle.target,
                                  progress=bar.update, max_removed=args.max_removed, shortlist=args.shortlist,
                                  state=state, save_state=save_state)
        bar.close()
        curve["bundle"] = args.bundle
        curve["drafter_name"] = name
        curve["drafter"] = drafter.cfg.training or "untrained"
        curve["wall_time_s"] = time.time() - t0
        curve["threads"] = torch.get_num_threads()
    if not args.curve or args.retime:
        curve["draft_ms"] = draft_ms_by_layers(drafter, [p["kept"] for p in curve["curve"]], B=args.block_size, target=bundle.target)
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
