"""Benchmark command: τ, speed and losslessness of every mode on real prompt sets.

    python -m d3d_core.measure.bench --bundle smollm2-135m --modes ar,dflash,d3d-seq,d3d-async \\
        --data-dir ../shared/datasets --datasets gsm8k,mt_bench --n 5 \\
        --max-new-tokens 128 --block-size 8 --temperature 0 --out results.json

Modes run interleaved per prompt (item-major), so machine drift hits all modes alike.
``speedup`` = AR time per output token / mode time per output token, prefill excluded,
from the same run. Writes JSON ``{"config", "machine", "rows", "summary"}`` plus CSV and
Markdown beside it; prints the summary table; a progress bar goes to stderr.

Raw results first (``rawfirst``): right after the decodes, ``<out stem>.raw.json`` holds config,
machine and rows (and the cost probe's table once measured); every summary step then runs guarded. A
failing step is named on stderr and in the result's ``failed_steps``, the rest is still written, the
raw file is kept and the command exits 1; with no failure the raw file is removed (the result holds it).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from ..decoding.config import DecodeConfig
from ..decoding.engine import decode
from ..decoding.plan import DRAFTING_RULES, VERIFY_RULES, plan_label, plan_of
from ..decoding.trace import MODES
from ..models import fastops, sources
from ..models.bundles import get_bundle
from ..models.loader import load_drafter
from ..schemas import checked
from .costs import costs_text, probe_costs
from .datasets import load_benchmark, parse_datasets, prompt_items
from .latency import mean_span, validate, validate_in_run
from .machine import QuietWatch, machine_info, step_reference
from .peers import HF_PEERS, PEERS, parse_peers, run_peer, usable_peers
from .rawfirst import Steps, raw_path, write_json_atomic
from .tables import SUMMARY_COLS, _fmt, table_markdown, table_text


def row_of(item, trace, ref_ids: Optional[list]) -> dict:
    st = trace.stats
    skipped = {r.index for r in trace.rounds if r.skipped}
    return {
        "dataset": item.dataset,
        "id": item.id,
        "mode": trace.mode,
        "n_tokens": st.n_tokens,
        "rounds": st.n_rounds,
        "tau": st.tau,
        "decode_time_s": st.decode_time_s,
        "prefill_time_s": st.prefill_time_s,
        "tokens_per_s": st.tokens_per_s,
        "target_forwards": st.target_forwards,
        "hit_rate": st.hit_rate,
        "overlap": st.overlap,
        "lossless": None if ref_ids is None else trace.output_ids == ref_ids,
        "accepted_hist": _hist([r.accepted for r in trace.rounds if not r.skipped]),  # drafted rounds: an undrafted one accepts nothing by construction
        "skipped_rounds": len(skipped),
        "span_ms": span_means(trace.spans, skipped),
    }


def span_means(spans, skipped: frozenset = frozenset()) -> dict:
    """{kind: {"mean": ms, "n": count}} over the decode rounds' spans (prefill excluded): the
    costs this run actually paid, which the latency model's in-run check uses. The verifies of rounds the
    draft gate skipped (the anchor alone: a step) are kept apart as ``step``."""
    acc: dict = {}
    for sp in spans:
        if sp.round < 0:
            continue
        a = acc.setdefault("step" if sp.kind == "verify" and sp.round in skipped else sp.kind, [0.0, 0])
        a[0] += sp.duration
        a[1] += 1
    return {k: {"mean": t / n, "n": n} for k, (t, n) in acc.items()}


def _hist(xs: list) -> dict:
    h: dict = {}
    for x in xs:
        h[str(x)] = h.get(str(x), 0) + 1
    return h


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list, datasets: list, modes: list) -> list:
    """Per dataset x mode, plus an 'average' row per mode over datasets. A dataset with no items gives
    rows with n 0 and nothing measured (None); peers have no τ (None); a mode whose every round the draft
    gate skipped has τ 1 (each round committed its bonus token alone)."""
    out = []

    def one(rs, dataset, mode, ar_rs):
        if not rs:
            if any(r["dataset"] == dataset for r in rows):  # the dataset ran, this mode did not (e.g. not at this plan)
                return None
            return {"dataset": dataset, "mode": mode, "n": 0, "tau": None, "tokens_per_s": None, "speedup": None, "lossless_rate": None,
                    "hit_rate": None, "overlap": None, "skipped": None, "tokens": 0}
        toks = sum(max(r["n_tokens"] - 1, 0) for r in rs)
        t = sum(r["decode_time_s"] for r in rs)
        tpt = t / toks if toks else None
        speed = None
        if ar_rs:
            ar_toks = sum(max(r["n_tokens"] - 1, 0) for r in ar_rs)
            ar_t = sum(r["decode_time_s"] for r in ar_rs)
            if ar_toks and tpt:
                speed = (ar_t / ar_toks) / tpt
        rounds = sum(r["rounds"] for r in rs)
        acc_tokens = sum(r["tau"] * r["rounds"] for r in rs if r["tau"] is not None)
        lossless = [r["lossless"] for r in rs if r["lossless"] is not None]
        skipped = sum(r.get("skipped_rounds", 0) for r in rs) / rounds if rounds else None
        return {
            "dataset": dataset,
            "mode": mode,
            "n": len(rs),
            "tau": acc_tokens / rounds if rounds else (None if mode in PEERS else 0.0),
            "tokens_per_s": toks / t if t else 0.0,
            "speedup": speed,
            "lossless_rate": (sum(lossless) / len(lossless)) if lossless else None,
            "hit_rate": _mean([r["hit_rate"] for r in rs]),
            "overlap": _mean([r["overlap"] for r in rs]),
            "skipped": skipped if mode not in PEERS and mode != "ar" else None,
            "tokens": toks + len(rs),
        }

    for ds in datasets:
        ar_rs = [r for r in rows if r["dataset"] == ds and r["mode"] == "ar"]
        for m in modes:
            s = one([r for r in rows if r["dataset"] == ds and r["mode"] == m], ds, m, ar_rs)
            if s:
                out.append(s)
    if len(datasets) > 1:
        for m in modes:
            per = [s for s in out if s["mode"] == m and s["dataset"] in datasets]
            if not per:
                continue
            avg = {"dataset": "average", "mode": m, "n": sum(s["n"] for s in per), "tokens": sum(s["tokens"] for s in per)}
            for k in ("tau", "tokens_per_s", "speedup", "lossless_rate", "hit_rate", "overlap", "skipped"):
                avg[k] = _mean([s[k] for s in per])
            out.append(avg)
    return out


def write_outputs(out: Path, result: dict, steps: Optional[Steps] = None) -> list:
    """The summary as CSV and Markdown beside ``out``, then the result JSON (atomic). The schema check and
    the tables run as steps (see rawfirst): a result that fails one is still written, with ``failed_steps``."""
    steps = steps or Steps()
    stem = out.with_suffix("")
    written = []
    steps.run("schema", checked, "bench result", result)

    def tables():
        with open(f"{stem}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=SUMMARY_COLS, extrasaction="ignore")
            w.writeheader()
            for s in result["summary"]:
                w.writerow(s)
        written.append(Path(f"{stem}.csv"))
        Path(f"{stem}.md").write_text(table_markdown(result["summary"]))
        written.append(Path(f"{stem}.md"))

    out.parent.mkdir(parents=True, exist_ok=True)
    steps.run("tables", tables)
    n_failed = len(steps.failed)
    steps.finish(out, result, write=lambda o, d: write_json_atomic(o, d, indent=2))
    if len(steps.failed) == n_failed:  # the JSON was written
        written.insert(0, out)
    return written


def item_ids(bundle, it, base: DecodeConfig) -> list:
    """Prompt ids of an item; MT-Bench's second turn first gets the target's own turn-1 answer."""

    msgs = [dict(m) for m in it.messages]
    if it.meta.get("needs_first_answer"):
        first = decode(bundle, bundle.tokenizer.encode_messages(msgs[:1]), base.with_(mode="ar"))
        msgs[1]["content"] = bundle.tokenizer.decode(first.output_ids, skip_special=True)
    return bundle.tokenizer.encode_messages(msgs)


def run_bench(bundle, items: list, modes: list, base: DecodeConfig, progress=True, drafters: Optional[dict] = None,
              block_sizes: Optional[list] = None, peers: tuple = (), plans: Optional[list] = None) -> list:
    """Decode every item with every mode (item-major; ar once per item, drafting modes once per block size
    and plan, (verify rule, drafting rule), then each peer once). Returns per-(item, mode, block size, plan) rows."""
    from tqdm import tqdm

    drafters = drafters or {}
    block_sizes = block_sizes or [base.block_size]
    plans = plans or [(base.verify, base.drafting)]
    if not items:
        return []
    # warm-up (untimed): first calls pay allocator / kernel selection costs
    for m in modes:
        decode(bundle, items[0].messages[-1]["content"], base.with_(mode=m, max_new_tokens=8), drafter=drafters.get(m))
    rows, dropped = [], set()
    draft_modes = [m for m in modes if m != "ar"]
    n_runs = ("ar" in modes) + len(draft_modes) * len(block_sizes) * len(plans) + len(peers)
    bar = tqdm(total=len(items) * n_runs, desc="bench", file=sys.stderr, disable=not progress)
    for it in items:
        ids = item_ids(bundle, it, base)
        need = len(ids) + base.max_new_tokens + max(block_sizes) + 2
        if need > bundle.target.max_positions:  # e.g. a long MT-Bench turn on a toy target: said, not a traceback
            print(f"skipped {it.dataset} item {it.id}: {len(ids)} prompt tokens + {base.max_new_tokens} new tokens + one block exceed "
                  f"the target's {bundle.target.max_positions} positions", file=sys.stderr)
            bar.update(n_runs)
            continue
        ref = None
        runs = ([("ar", base.block_size, (base.verify, base.drafting))] if "ar" in modes else []) + [
            (m, B, pl) for pl in plans for B in block_sizes for m in draft_modes]
        for m, B, (v, dr) in runs:
            tr = decode(bundle, ids, base.with_(mode=m, block_size=B, verify=v, drafting=dr), drafter=drafters.get(m))
            if m == "ar":
                ref = tr.output_ids
            greedy = base.temperature == 0
            rows.append(dict(row_of(it, tr, (tr.output_ids if m == "ar" else ref) if greedy and ref is not None else None),
                             block_size=B, verify=v, drafting=dr))
            bar.set_postfix(mode=m, B=B, tau=f"{tr.stats.tau:.2f}")
            bar.update(1)
        for p in peers:
            if p in dropped:
                bar.update(1)
                continue
            try:
                rows.append(dict(run_peer(bundle, p, ids, base, it, ref), block_size=base.block_size, verify=base.verify, drafting=base.drafting))
            except Exception as e:  # noqa: BLE001 — a peer (another library) failing must not take the run down
                dropped.add(p)
                print(f"note: peer {p} failed ({type(e).__name__}: {str(e)[:200]}) and is dropped from the rest of the run", file=sys.stderr)
            bar.update(1)
    bar.close()
    return rows


def speedup_spread(rows: list) -> dict:
    """{dataset: {mode: {"median", "min", "max", "n"}}}: each prompt's own speedup over its own ``ar`` run (time per
    output token, prefill excluded), so a reading on one prompt (a race, or ``--prompt``) can be set against the spread
    of prompts or of repeats. Modes without an ``ar`` partner on a prompt are left out."""
    import statistics

    ar = {(r["dataset"], r["id"]): r for r in rows if r["mode"] == "ar"}
    per: dict = {}
    for r in rows:
        a = ar.get((r["dataset"], r["id"]))
        if r["mode"] == "ar" or a is None:
            continue
        toks, a_toks = max(r["n_tokens"] - 1, 0), max(a["n_tokens"] - 1, 0)
        if toks and a_toks and r["decode_time_s"] > 0:
            per.setdefault(r["dataset"], {}).setdefault(r["mode"], []).append((a["decode_time_s"] / a_toks) / (r["decode_time_s"] / toks))
    return {ds: {m: {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} for m, xs in ms.items()} for ds, ms in per.items()}


def acceptance_hists(rows: list) -> dict:
    """{dataset: {mode: {accepted: count}}} summed over items (the block size of the main run)."""
    out: dict = {}
    for r in rows:
        h = out.setdefault(r["dataset"], {}).setdefault(r["mode"], {})
        for a, c in r["accepted_hist"].items():
            h[a] = h.get(a, 0) + c
    return out


def _variant_averages(rows: list, datasets: list, modes: list, keep) -> list:
    """Summary rows of the drafting modes over the rows ``keep`` selects (every ar row kept: the shared
    reference), averaged over datasets (or the one dataset)."""
    rs = [r for r in rows if r["mode"] == "ar" or keep(r)]
    where = "average" if len(datasets) > 1 else datasets[0]
    return [s for s in summarize(rs, datasets, modes) if s["dataset"] == where and s["mode"] != "ar"]


def sweep_table(rows: list, datasets: list, modes: list, block_sizes: list, plan: tuple = ("adaptive", "gated")) -> dict:
    """{mode: {B: {"tau", "speedup"}}} averaged over datasets (ar rows shared by every B), at one plan."""
    out: dict = {}
    for B in block_sizes:
        for s in _variant_averages(rows, datasets, modes, lambda r: r["block_size"] == B and plan_of(r) == plan):
            out.setdefault(s["mode"], {})[str(B)] = {"tau": s["tau"], "speedup": s["speedup"]}
    return out


def plan_table(rows: list, datasets: list, modes: list, B: int) -> dict:
    """{mode: {plan label: {"tau", "speedup", "tokens_per_s", "skipped"}}} per plan (verify rule, drafting rule)
    at block size B, averaged over datasets: what the verify plan and the draft gate buy, measured in one run
    (ar rows shared). ``skipped``: the share of rounds the draft gate skipped (averaged like the rest)."""
    out: dict = {}
    for pl in sorted({plan_of(r) for r in rows if r["mode"] != "ar" and r.get("verify")}):
        for s in _variant_averages(rows, datasets, modes, lambda r: r["block_size"] == B and plan_of(r) == pl):
            out.setdefault(s["mode"], {})[plan_label(pl)] = {k: s[k] for k in ("tau", "speedup", "tokens_per_s", "hit_rate", "skipped")}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m d3d_core.measure.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default="smollm2-135m")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.add_argument("--data-dir", default=None, help="directory in the layout of shared/datasets (or $D3D_DATA_DIR)")
    p.add_argument("--datasets", default="gsm8k,mt_bench", help="comma list or 'all'")
    p.add_argument("--n", "-n", "--num-prompts", dest="n", type=int, default=5,
                   help="prompts per dataset (under torchrun write -n: torchrun claims --n as an abbreviation)")
    p.add_argument("--seed", type=int, default=0, help="prompt selection and sampling seed")
    p.add_argument("--prompt", default=None, metavar="TEXT|@FILE",
                   help="time one prompt instead of datasets (the text, or @ a file holding it), --n times: what a race on it should read")
    for f in ("max_new_tokens", "block_size", "hypotheses", "threads"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(DecodeConfig(), f))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling", default="match", choices=["match", "rejection"])
    p.add_argument("--d3d-drafter", default=None, help="a D3D drafter: a shipped one's name (d3d-deep), or a directory / hub id holding this project's layout (config.json "
                        "with 'kind' + model.safetensors) or a standalone drafter of its own shape (a Qwen3 causal-LM safetensors "
                        "checkpoint with a mask token id, e.g. tests/fixtures/d3d-qwen3-tiny)")
    p.add_argument("--dflash-drafter", default=None, help="path of a DFlash-style drafter")
    p.add_argument("--skip-layers", default="", help="comma list of D3D drafter layers to skip (pruning)")
    p.add_argument("--device", default=None)
    p.add_argument("--engine", choices=["fast", "eager", "int4"], default="fast",
                   help="fast: prepacked CPU forwards for target and drafters (every mode); eager: the Hugging Face forward; "
                        "int4: the fast forward with the target's layers and LM head from the GGUF's 4-bit blocks (D3D_ENGINE=int4)")
    p.add_argument("--drafter-int8", choices=["on", "off"], default="on" if fastops.int8_status()["drafter_int8"] == "on" else "off",
                   help="on: the D3D drafter's MLPs and shortlist head run in int8 where the fast engine can (default here; "
                        "D3D_DRAFTER_INT8=off changes it); off: fp32")
    p.add_argument("--peers", default=",".join(HF_PEERS),
                   help="comma list of peers run beside the modes at temperature 0 (" + ", ".join(PEERS) + "; llama-cpp names "
                        "both llama.cpp rows, an optional install: scripts/setup_venv.sh --llama-cpp), or 'none'")
    p.add_argument("--cost-probe", action="store_true", help="also measure T_step, T_verify(B), T_draft, T_packed(H) and check the latency model")
    p.add_argument("--verify", choices=list(VERIFY_RULES), default=DecodeConfig().verify,
                   help="adaptive: verify the draft prefix that pays for itself on this bundle's cost table; full: all B-1 drafts")
    p.add_argument("--compare-verify", action="store_true", help="also run every drafting mode with the other verify rule (same run)")
    p.add_argument("--drafting", choices=list(DRAFTING_RULES), default=DecodeConfig().drafting,
                   help="gated: skip the draft while drafting has not paid lately (the draft gate); always: draft every round")
    p.add_argument("--compare-drafting", action="store_true", help="also run every drafting mode with the other drafting rule (same run)")
    p.add_argument("--block-sizes", default="", help="sweep: comma list of block sizes (e.g. 2,4,8,16); the table uses --block-size")
    p.add_argument("--out", default="results/bench.json")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
        peers = parse_peers(args.peers)
        if args.temperature > 0:
            peers = []  # peers are greedy baselines
        fastops.set_enabled(args.engine != "eager")
        fastops.set_int4(args.engine == "int4")
        fastops.set_int8(args.drafter_int8 == "on")
        datasets = ["prompt"] if args.prompt is not None else parse_datasets(args.datasets)
        base = DecodeConfig(
            mode=modes[0], block_size=args.block_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            hypotheses=args.hypotheses, sampling=args.sampling, seed=args.seed, threads=args.threads, verify=args.verify,
            drafting=args.drafting,
        ).validated()
        items_by_ds = ({"prompt": prompt_items(args.prompt, args.n)} if args.prompt is not None
                       else {ds: load_benchmark(ds, args.n, args.seed, args.data_dir) for ds in datasets})
        bundle = get_bundle(args.bundle, args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        block_sizes = sorted({int(b) for b in args.block_sizes.split(",") if b.strip()} | {base.block_size}) if args.block_sizes else [base.block_size]
        plans = [(base.verify, base.drafting)]
        plans += [(v, base.drafting) for v in VERIFY_RULES if v != base.verify and args.compare_verify]
        plans += [(base.verify, d) for d in DRAFTING_RULES if d != base.drafting and args.compare_drafting]
        for B in block_sizes:
            base.with_(block_size=B).validated()
    except ValueError as e:
        print(f"error: --block-sizes: {e}", file=sys.stderr)
        return 2
    peers = usable_peers(bundle, peers, warn=lambda m: print(m, file=sys.stderr))
    try:
        drafters = load_override_drafters(bundle, args)
    except (ValueError, FileNotFoundError) as e:  # a drafter that cannot be loaded: one sentence, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    dist = Dist.from_env(bundle.device)
    t0 = time.time()
    watch = QuietWatch()
    rows = []
    for ds in datasets:
        mine = dist.shard(items_by_ds[ds])
        rows += run_bench(bundle, mine, modes, base, progress=not args.no_progress and dist.rank == 0, drafters=drafters,
                          block_sizes=block_sizes, peers=tuple(peers), plans=plans)
    rows = dist.gather(rows)
    if dist.rank != 0:
        dist.close()
        return 0
    rows.sort(key=lambda r: (datasets.index(r["dataset"]), r["id"], r["mode"], r["block_size"]))
    heard = watch.stop()  # the decodes' quietness (the cost probe below is not part of it)
    wall = time.time() - t0
    out = Path(args.out)
    steps = Steps(raw=raw_path(out))
    # raw results first (rawfirst): config, machine and rows reach the disk before any summary runs
    result = {
        "config": steps.run("config", lambda: {**vars(args), "decode": asdict(base), "drafters": bundle.drafter_info,
                                               "drafters_run": {m: d.describe() for m, d in drafters.items()}, "world_size": dist.world},
                            default={**vars(args), "decode": asdict(base), "world_size": dist.world}),
        "machine": steps.run("machine", machine_info, default={}),
        "engine": steps.run("engine", lambda: {"target": bundle.target.engine, "why_not_fast": bundle.target.fast_reason(), "linears": fastops.status(),
                                               "drafter_int8": fastops.int8_status(), "row_plan": bundle.target.row_plan_info,
                                               "int4": bundle.target.int4_info()}, default={}),
        "wall_time_s": wall,
        "rows": rows,
    }
    steps.save_raw(result)
    if args.cost_probe:  # a measurement too: it joins the raw file before the latency model reads it
        costs = steps.run("cost_probe", probe_costs, bundle, block_sizes=(1, 2, 4, 8, 16), hypotheses=(1, 2, 4, 8))
        if costs is not None:
            result["costs"] = costs
            steps.save_raw(result)

    # summaries: each one guarded; a failing one is named on stderr and in failed_steps, the rest still run
    main_rows = [r for r in rows if r["mode"] == "ar" or (r["block_size"] == base.block_size and plan_of(r) == plans[0])]
    summary = steps.run("summary", summarize, main_rows, datasets, modes + peers, default=[])
    result["summary"] = summary
    machine = result["machine"]  # the AR steps ran on torch_threads: compare them with the quiet step at that count
    quiet = steps.run("quiet", lambda: heard.against(mean_span([r for r in main_rows if r["mode"] == "ar"], "verify"),  # ar's steps
                                                     step_reference(bundle.costs, machine.get("torch_threads"), bundle.target.engine)),
                      default=heard)
    result["quiet"] = quiet.to_json()
    result["acceptance_hist"] = steps.run("acceptance_hist", acceptance_hists, main_rows, default={})
    result["speedup_spread"] = steps.run("speedup_spread", speedup_spread, main_rows, default={})
    if len(block_sizes) > 1:
        result["sweep"] = steps.run("sweep", sweep_table, rows, datasets, modes, block_sizes, plans[0], default={})
    if len(plans) > 1:
        result["plan_compare"] = steps.run("plan_compare", plan_table, rows, datasets, modes, base.block_size, default={})
    if "costs" in result:
        result["latency_model"] = steps.run("latency_model", validate, result, default=[])
    result["latency_model_in_run"] = steps.run("latency_model_in_run", validate_in_run, result, default=[])
    with steps.step("print"):
        print_result(result, base.block_size)
    written = write_outputs(out, result, steps)
    if quiet.noisy:
        print(f"\nWARNING: {quiet.warning}", file=sys.stderr)
    print(f"\nwrote {', '.join(str(w) for w in written)} ({result['wall_time_s']:.0f} s, {dist.world} process(es))", file=sys.stderr)
    dist.close()
    return steps.exit_code()


LATENCY_COLS = ["dataset", "mode", "tau", "hit_rate", "measured_speedup", "predicted_speedup", "error"]


def print_result(result: dict, B: int) -> None:
    """The bench's report on stdout: summary table, plans, sweep, cost probe and latency-model checks."""
    print(f"{result['machine'].get('cpu', '?')}, {result['engine'].get('target', '?')} engine")
    print(table_text(result["summary"]))
    spread = result.get("speedup_spread") or {}
    if spread:
        print("\nspeedup per prompt (median, min-max over prompts or repeats):")
        for ds, ms in spread.items():
            print(f"  {ds:10s} " + "  ".join(f"{m}: {x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f}, n {x['n']})" for m, x in ms.items()))
    if result.get("plan_compare"):
        print(f"\nplans at B={B} (τ / speedup / rounds skipped by the draft gate):")
        for m, pts in result["plan_compare"].items():
            print(f"  {m:10s} " + "  ".join(f"{v}: {_fmt(x['tau'])} / {_fmt(x['speedup'])}x / {_pct(x['skipped'])}" for v, x in pts.items()))
    if result.get("sweep"):
        print("\nblock-size sweep (τ / speedup):")
        for m, pts in result["sweep"].items():
            print(f"  {m:10s} " + "  ".join(f"B={b}: {_fmt(v['tau'])} / {_fmt(v['speedup'])}x" for b, v in pts.items()))
    if "costs" in result:
        print()
        print(costs_text(result["costs"]))
    if "latency_model" in result:
        print("\nlatency model vs measured speedup:")
        print(table_text(result["latency_model"], cols=LATENCY_COLS))
    if result.get("latency_model_in_run"):
        print("\nlatency model with the costs this run paid (span means) vs measured speedup:")
        print(table_text(result["latency_model_in_run"], cols=LATENCY_COLS))


def _pct(x) -> str:
    return "—" if x is None else f"{x:.0%}"


class Dist:
    """Prompt sharding under torchrun: gloo on CPU, nccl on GPU (one GPU per rank); rows are
    gathered on rank 0, which writes one table identical in shape to a single-process run."""

    def __init__(self, rank: int = 0, world: int = 1, group=False):
        self.rank, self.world, self.group = rank, world, group

    @classmethod
    def from_env(cls, device) -> "Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch
        import torch.distributed as tdist

        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        if backend == "gloo":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
        tdist.init_process_group(backend=backend)
        return cls(tdist.get_rank(), tdist.get_world_size(), True)

    def shard(self, items: list) -> list:
        return items[self.rank :: self.world]

    def gather(self, rows: list) -> list:
        if not self.group:
            return rows
        import torch.distributed as tdist

        out = [None] * self.world
        tdist.all_gather_object(out, rows)
        return [r for part in out for r in part]

    def close(self):
        if self.group:
            import torch.distributed as tdist

            tdist.destroy_process_group()


def load_override_drafters(bundle, args) -> dict:
    """Drafters given by path / pruning flags, keyed by the modes that use them."""

    out = {}
    d3d = bundle.drafter("d3d")
    if args.d3d_drafter and args.d3d_drafter in bundle.d3d_names():  # a shipped one by name, e.g. d3d-deep
        d3d = bundle.drafter(args.d3d_drafter)
    elif args.d3d_drafter:  # a directory: this project's layout, or a causal-LM checkpoint (a standalone drafter of its own shape)
        d3d = load_drafter(sources.resolve(args.d3d_drafter, "D3D drafter"), bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype)
    if args.skip_layers:
        d3d = d3d.pruned([int(x) for x in args.skip_layers.split(",")])
    if d3d is not bundle.drafter("d3d"):
        out["d3d-seq"] = out["d3d-async"] = d3d
    if args.dflash_drafter:
        out["dflash"] = load_drafter(args.dflash_drafter, bundle.target.shared, bundle.target.arch, bundle.device, bundle.target.dtype)
    return out


if __name__ == "__main__":
    sys.exit(main())
