"""A vocabulary shortlist for a drafter's LM head (drafting speed on a CPU).

    python -m d3d_core.training.shortlist --drafter assets/drafters/smollm2-135m/d3d --size 8192
    python -m d3d_core.training.shortlist --drafter ... --source references --data-dir ../shared/datasets

The drafter then scores only the K most frequent tokens of the target's own responses in the
self-distillation data (``--source distill``), or of the training files' human-written reference
answers (``--source references``: no distillation needed), plus the end-of-turn tokens, instead
of the whole vocabulary: its LM-head matmul shrinks V/K times. Decoding stays lossless (see ``Drafter.logits``); what
it can cost is τ, when the target's next token is not in the list. The command reports the
held-out coverage and offline τ with and without the list, and writes it (with those figures) into
config.json, atomically, before the report is printed (``rawfirst``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from ..measure.datasets import load_training_references
from ..measure.rawfirst import Steps, write_json_atomic
from ..models.bundles import get_bundle
from ..models.loader import load_drafter
from .distill import distill_dir, read_examples
from .offline_tau import calibration_set, offline_tau
from .train import split_holdout


def build_shortlist(examples: list, size: int, always=()) -> tuple:
    """The `size` most frequent response tokens of `examples` (dicts with response_ids),
    plus `always` (end-of-turn ids must stay draftable)."""
    if size < 1:
        raise ValueError("shortlist size must be >= 1")
    counts = Counter(t for e in examples for t in e["response_ids"])
    ids = {t for t, _ in counts.most_common(size)} | {int(a) for a in always}
    return tuple(sorted(ids))


def coverage(shortlist, seqs: list) -> float:
    """Share of the sequences' response tokens that the shortlist contains."""
    s = set(shortlist)
    toks = [t for q in seqs for t in q.response_ids]
    return sum(t in s for t in toks) / len(toks) if toks else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m d3d_core.training.shortlist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors); config.json is rewritten")
    ap.add_argument("--data", default=None, help="distill directory (default $D3D_CACHE/distill/<bundle>)")
    ap.add_argument("--source", choices=["distill", "references"], default="distill",
                    help="count tokens of the target's distilled responses, or of the training files' reference answers")
    ap.add_argument("--data-dir", default=None, help="datasets directory for --source references (or $D3D_DATA_DIR)")
    ap.add_argument("--size", type=int, default=8192, help="tokens kept (0 removes the shortlist)")
    ap.add_argument("--eval", type=int, default=16, help="held-out sequences for coverage / offline τ")
    ap.add_argument("--dry-run", action="store_true", help="report only, do not write")
    args = ap.parse_args(argv)

    bundle = get_bundle(args.bundle)
    d = Path(args.drafter)
    drafter = load_drafter(d, bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype)
    if args.source == "references":

        train_ex = [{"response_ids": bundle.tokenizer.encode_prompt(t, chat=False)} for t in load_training_references(args.data_dir)]
        held = calibration_set(bundle)[: args.eval]  # the target's own continuations, never counted
    else:
        ex = read_examples(Path(args.data) if args.data else distill_dir(args.bundle))
        train_ex, held = split_holdout(ex, 384)
        held = held[: args.eval]
    if not train_ex or not held:
        print("error: no self-distillation data (python -m d3d_core.training.distill) — or use --source references", file=sys.stderr)
        return 2
    ids = build_shortlist(train_ex, args.size, bundle.tokenizer.eos_ids) if args.size else ()
    kw = dict(B=8, stride=4, target=bundle.target)
    full = offline_tau(drafter.shortlisted(()), held, **kw)
    short = offline_tau(drafter.shortlisted(ids), held, **kw) if ids else full
    cov = coverage(ids, held) if ids else 1.0
    steps = Steps(raw=None if args.dry_run else d / "config.json")
    if not args.dry_run:  # the result (the list and what it measured) reaches config.json before the report
        cfg = json.loads((d / "config.json").read_text())
        cfg["vocab_shortlist"] = list(ids)
        cfg.setdefault("training", {})["shortlist"] = {"size": len(ids), "source": args.source, "heldout_coverage": round(cov, 4),
                                                        "offline_tau": round(short, 4), "offline_tau_full_vocab": round(full, 4)}
        write_json_atomic(d / "config.json", cfg, indent=None)
    with steps.step("report"):
        print(f"shortlist {len(ids) or 'off'}: held-out coverage {cov:.2%}, offline τ {short:.3f} vs {full:.3f} with the whole vocabulary")
        if not args.dry_run:
            print(f"wrote {d / 'config.json'}", file=sys.stderr)
    return steps.exit_code()


if __name__ == "__main__":
    sys.exit(main())
