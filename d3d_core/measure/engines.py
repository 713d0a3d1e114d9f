"""Engines side by side: plain greedy decoding (``ar``) on each of this project's engines and on llama.cpp,
on the same prompts, threads and machine, in one run.

    python -m d3d_core.measure.engines --data-dir ../shared/datasets --datasets gsm8k,mt_bench --n 10 \\
        --max-new-tokens 128 --engines fast,int4 --peers llama-cpp --out results/engines.json

What it answers: how fast is the baseline every speedup is measured against, and how far is it from what a user
would run instead (llama.cpp on the same GGUF)? Each prompt runs every engine and peer once, in an order rotated
from prompt to prompt, so a drift in machine speed is spread over all of them. Times leave prefill and the first
token out (as the bench does). Per engine: tokens/s (pooled: all tokens over all decode time, and the median of the
prompts), the mean ``ar`` step; per pair: the ratio of tokens/s (pooled, and the median / range of the per-prompt
ratios), and how often the greedy tokens agree (identical outputs, mean shared prefix: different rounding
picks another token on a near-tie, after which the texts part).

Speculative decoding on the int4 engine is the bench's job (``bench --engine int4``); this command is the yardstick.
Raw results first (``rawfirst``): the per-prompt runs reach ``<out stem>.raw.json`` before any summary.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import combinations
from pathlib import Path

from ..decoding.config import DecodeConfig
from ..decoding.engine import decode
from ..models import fastops
from ..models.bundles import get_bundle
from .bench import item_ids
from .datasets import load_benchmark, parse_datasets, prompt_items
from .machine import QuietWatch, machine_info
from .peers import PEERS, common_prefix, parse_peers, peer_decode, usable_peers
from .rawfirst import Steps, raw_path, write_json_atomic

ENGINES = ("fast", "int4")  # this project's engines raced here (eager is Hugging Face's forward: hf-generate)
ENGINE_LABEL = {"fast": "fp32 (fast engine)", "int4": "int4 (GGUF Q4_1 blocks)"}


def _set_engine(engine: str) -> None:
    fastops.set_enabled(True)
    fastops.set_int4(engine == "int4")


def run_ours(bundle, engine: str, ids: list, base: DecodeConfig) -> dict:
    """One greedy ``ar`` decode of ``ids`` on ``engine``: its timing and tokens."""
    _set_engine(engine)
    tr = decode(bundle, ids, base.with_(mode="ar"))
    if engine == "int4" and bundle.target.engine != "int4":
        raise ValueError(f"the int4 engine cannot run this target: {bundle.target.int4_reason()}")
    steps = [sp.duration for sp in tr.spans if sp.round >= 0 and sp.kind == "verify"]
    n = tr.stats.n_tokens
    return {"n_tokens": n, "decode_time_s": tr.stats.decode_time_s, "prefill_time_s": tr.stats.prefill_time_s,
            "tokens_per_s": (n - 1) / tr.stats.decode_time_s if n > 1 and tr.stats.decode_time_s > 0 else 0.0,
            "step_ms": statistics.fmean(steps) if steps else None, "output_ids": list(tr.output_ids)}


def run_one(bundle, runner: str, ids: list, base: DecodeConfig) -> dict:
    if runner in ENGINES:
        return run_ours(bundle, runner, ids, base)
    _set_engine("fast")
    out, t_first, t_all = peer_decode(bundle, runner, ids, base)
    decode_s = max(t_all - t_first, 1e-9)
    return {"n_tokens": len(out), "decode_time_s": decode_s, "prefill_time_s": t_first,
            "tokens_per_s": (len(out) - 1) / decode_s if len(out) > 1 else 0.0, "step_ms": None, "output_ids": out}


def run_engines(bundle, items: list, runners: list, base: DecodeConfig, progress: bool = True) -> list:
    """Every runner on every item (order rotated per item); a warm-up decode per runner first (untimed)."""
    from tqdm import tqdm

    if not items:
        return []
    warm_ids = item_ids(bundle, items[0], base)
    for r in runners:
        run_one(bundle, r, warm_ids, base.with_(max_new_tokens=8))
    out, dropped = [], set()
    bar = tqdm(total=len(items) * len(runners), desc="engines", file=sys.stderr, disable=not progress)
    for i, it in enumerate(items):
        _set_engine("fast")
        ids = item_ids(bundle, it, base)
        order = runners[i % len(runners):] + runners[:i % len(runners)]
        runs = {}
        for r in order:
            if r in dropped:
                continue
            try:
                runs[r] = run_one(bundle, r, ids, base)
            except Exception as e:  # noqa: BLE001 — a peer (another library) failing must not take the run down
                if r in ENGINES:
                    raise
                dropped.add(r)
                print(f"note: peer {r} failed ({type(e).__name__}: {str(e)[:200]}) and is dropped from the rest of the run",
                      file=sys.stderr)
                continue
            bar.set_postfix(runner=r, tps=f"{runs[r]['tokens_per_s']:.1f}")
            bar.update(1)
        out.append({"dataset": it.dataset, "id": it.id, "order": order, "prompt_tokens": len(ids), "runs": runs})
    bar.close()
    _set_engine("fast")
    return out


def summarize(rows: list, runners: list) -> dict:
    """Per runner tokens/s and step; per pair speed ratio and token agreement (see the module doc)."""
    per: dict = {}
    for r in runners:
        runs = [row["runs"][r] for row in rows if r in row["runs"]]
        toks = sum(max(x["n_tokens"] - 1, 0) for x in runs)
        secs = sum(x["decode_time_s"] for x in runs)
        steps = [x["step_ms"] for x in runs if x.get("step_ms") is not None]
        per[r] = {"n": len(runs), "tokens_per_s": toks / secs if secs > 0 else None,
                  "tokens_per_s_median": statistics.median([x["tokens_per_s"] for x in runs]) if runs else None,
                  "step_ms": statistics.fmean(steps) if steps else None}
    pairs = []
    for a, b in combinations(runners, 2):
        both = [row["runs"] for row in rows if a in row["runs"] and b in row["runs"]]
        ratios = [x[a]["tokens_per_s"] / x[b]["tokens_per_s"] for x in both if x[b]["tokens_per_s"] > 0]
        prefix = [common_prefix(x[a]["output_ids"], x[b]["output_ids"]) for x in both]
        same = [x[a]["output_ids"] == x[b]["output_ids"] for x in both]
        lens = [min(len(x[a]["output_ids"]), len(x[b]["output_ids"])) for x in both]
        pa, pb = per[a]["tokens_per_s"], per[b]["tokens_per_s"]
        pairs.append({
            "a": a, "b": b, "n": len(both),
            "speed_ratio": pa / pb if pa and pb else None,
            "speed_ratio_median": statistics.median(ratios) if ratios else None,
            "speed_ratio_min": min(ratios) if ratios else None, "speed_ratio_max": max(ratios) if ratios else None,
            "identical": sum(same) / len(same) if same else None,
            "shared_prefix_mean": statistics.fmean(prefix) if prefix else None,
            "shared_prefix_share": sum(prefix) / sum(lens) if lens and sum(lens) else None,
        })
    return {"runners": per, "pairs": pairs}


def report_text(summary: dict) -> str:
    lines = ["runner                tok/s (pooled)  tok/s (median)  step ms"]
    for r, s in summary["runners"].items():
        tps = "—" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.1f}"
        med = "—" if s["tokens_per_s_median"] is None else f"{s['tokens_per_s_median']:.1f}"
        st = "—" if s["step_ms"] is None else f"{s['step_ms']:.1f}"
        lines.append(f"{r:<22}{tps:>14}  {med:>14}  {st:>7}")
    lines.append("")
    lines.append("pair                          speed ratio (median, range)        identical  shared prefix")
    for p in summary["pairs"]:
        if p["speed_ratio"] is None:
            continue
        rng = f"({p['speed_ratio_median']:.2f}, {p['speed_ratio_min']:.2f}–{p['speed_ratio_max']:.2f})"
        lines.append(f"{p['a'] + ' / ' + p['b']:<30}{p['speed_ratio']:.2f}× {rng:<26}{p['identical']:>9.0%}  "
                     f"{p['shared_prefix_share']:.0%} of tokens")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m d3d_core.measure.engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default="smollm2-135m")
    p.add_argument("--data-dir", default=None, help="directory in the layout of shared/datasets (or $D3D_DATA_DIR)")
    p.add_argument("--datasets", default="gsm8k,mt_bench", help="comma list or 'all'")
    p.add_argument("--n", "-n", dest="n", type=int, default=5, help="prompts per dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default=None, metavar="TEXT|@FILE", help="one prompt (text or @file) instead of datasets, --n times")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every runner (default: torch's, all cores)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ", ".join(ENGINES))
    p.add_argument("--peers", default="llama-cpp", help="comma list of " + ", ".join(PEERS) + " (llama-cpp names both llama.cpp rows), or 'none'")
    p.add_argument("--no-stop", action="store_true", help="always decode --max-new-tokens (ignore EOS): equal lengths for every runner")
    p.add_argument("--out", default="results/engines.json")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        bad = [e for e in engines if e not in ENGINES]
        if bad:
            raise ValueError(f"unknown engine(s) {', '.join(bad)}; choose from {', '.join(ENGINES)}")
        peers = parse_peers(args.peers)
        base = DecodeConfig(mode="ar", max_new_tokens=args.max_new_tokens, threads=args.threads,
                            stop_at_eos=not args.no_stop).validated()
        datasets = ["prompt"] if args.prompt is not None else parse_datasets(args.datasets)
        items = (prompt_items(args.prompt, args.n) if args.prompt is not None
                 else [it for ds in datasets for it in load_benchmark(ds, args.n, args.seed, args.data_dir)])
        bundle = get_bundle(args.bundle, None)
        if "int4" in engines:
            _set_engine("int4")
            if bundle.target.int4_reason() is not None:
                raise ValueError(f"--engines int4: {bundle.target.int4_reason()}")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        _set_engine("fast")
    peers = usable_peers(bundle, peers, warn=lambda m: print(m, file=sys.stderr))
    runners = engines + peers
    out = Path(args.out)
    steps = Steps(raw=raw_path(out))
    watch = QuietWatch()
    t0 = time.time()
    rows = run_engines(bundle, items, runners, base, progress=not args.no_progress)
    quiet = watch.stop()
    result = {"config": vars(args), "machine": steps.run("machine", machine_info, default={}),
              "runners": runners, "labels": {r: ENGINE_LABEL.get(r, r) for r in runners},
              "wall_time_s": time.time() - t0, "quiet": quiet.to_json(), "rows": rows}
    steps.save_raw(result)
    result["summary"] = steps.run("summary", summarize, rows, runners, default={"runners": {}, "pairs": []})
    with steps.step("print"):
        m = result["machine"]
        print(f"{m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads; {len(rows)} prompts, {args.max_new_tokens} new tokens")
        if quiet.noisy:
            print(quiet.warning)
        print(report_text(result["summary"]))
    steps.finish(out, result, write=lambda o, d: write_json_atomic(o, d, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return steps.exit_code()


if __name__ == "__main__":
    sys.exit(main())
