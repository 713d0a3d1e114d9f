"""Race one of the app's presets several times on this machine, report every mode's reading, and keep one race.

    .venv/bin/python scripts/record_race.py                          # the lesson preset, 3 races, report only
    .venv/bin/python scripts/record_race.py --repeat 3 --out assets/races/smollm2-135m-lesson.json

Two uses. (1) **The class demo's recorded race**: ``--out`` writes the race whose d3d-seq speedup is the median of
the runs (a typical race, not the best) with where and when it ran; the Race tab's "📼 Recorded race" button opens
it, so a class on a busy or slow machine still sees a clean race. (2) **The default race reads the same each time**:
every run's per-mode speedup, whether each mode got a reading (not too short, not flagged implausible, machine not
busy) and d3d-seq's spread over the runs ((max − min) / median) are printed as a Markdown table.

Run it on a quiet machine (pause your own jobs first); it refuses to write ``--out`` when any race was busy.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app import lesson  # noqa: E402
from d3d_core import service  # noqa: E402
from d3d_core.decoding.trace import MODES, traces_to_json  # noqa: E402
from d3d_core.measure.economics import race_economics  # noqa: E402
from d3d_core.measure.machine import cpu_model  # noqa: E402
from d3d_core.measure.reading import race_load  # noqa: E402


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (out or "unknown") + ("+dirty" if dirty else "")


def reading_of(traces: list) -> dict:
    """{mode: {"speedup", "lo", "hi", "tau", "reading": bool, "why"}} for one race (what its Race columns say)."""
    load = race_load(traces)
    busy = bool(load and load.busy)
    out = {}
    for e in race_economics(traces):
        if e.mode == "ar":
            continue
        why = ("machine busy" if busy else "too short to time" if e.too_short else
               "flagged implausible: " + "; ".join(e.flags) if e.flags else "no ar in the race" if e.speedup is None else "")
        out[e.mode] = {"speedup": e.speedup, "lo": e.speedup_lo, "hi": e.speedup_hi, "tau": round(e.tau, 3),
                       "reading": not why, "why": why}
    return out


def spread(values: list) -> float | None:
    """(max − min) / median of the runs' speedups, or None with fewer than two."""
    vals = [v for v in values if v is not None]
    return (max(vals) - min(vals)) / statistics.median(vals) if len(vals) >= 2 else None


def race_once(bundle: str, preset: dict, modes: list) -> list:
    """One race of ``preset`` (a ``lesson.PRESETS`` dict): every mode's finished Trace, in MODES order."""
    base = service.settings(modes[0], preset["block_size"], preset["temperature"], preset["max_new_tokens"],
                            preset["hypotheses"], preset["sampling"], preset["seed"], preset["verify"], preset["drafting"])
    final = {}
    for mode, tr, done in service.race(bundle, preset["prompt"], modes, base, cancel=threading.Event(), engine=preset["engine"]):
        if done:
            final[mode] = tr
    return [final[m] for m in MODES if m in final]


def record(bundle: str, preset_name: str, repeat: int, modes=None, max_new_tokens=None, log=print) -> dict:
    """Race ``preset_name`` ``repeat`` times; the recorded file's dict (``traces`` of the median race + ``recorded``).
    ``max_new_tokens``: overrides the preset's (a shorter race)."""
    preset = dict(lesson.PRESETS[preset_name])
    if max_new_tokens:
        preset["max_new_tokens"] = int(max_new_tokens)
    modes = service.check_modes(modes or list(MODES))
    races, readings = [], []
    for i in range(repeat):
        trs = race_once(bundle, preset, modes)
        races.append(trs)
        readings.append(reading_of(trs))
        load = race_load(trs)
        log(f"race {i + 1}/{repeat}: " + ", ".join(
            f"{m} {r['speedup']:.2f}×" if r["speedup"] is not None else f"{m} –" for m, r in readings[-1].items())
            + (f" · {load.status()}" if load else ""))
    seq = [r.get("d3d-seq", {}).get("speedup") for r in readings]
    order = sorted(range(repeat), key=lambda i: (seq[i] is None, seq[i] or 0.0))
    keep = order[(len([s for s in seq if s is not None]) - 1) // 2] if any(s is not None for s in seq) else 0
    loads = [race_load(t) for t in races]
    recorded = {
        "preset": preset_name, "bundle": bundle, "modes": modes,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "cpu": cpu_model(), "cores": os.cpu_count(),
        "commit": commit(), "torch_threads": __import__("torch").get_num_threads(),
        "max_new_tokens": preset["max_new_tokens"], "engine": preset["engine"],
        "command": f"scripts/record_race.py --preset {preset_name} --bundle {bundle} --repeat {repeat}"
                   + (f" --max-new-tokens {max_new_tokens}" if max_new_tokens else ""),
        "runs": [{"busy": bool(ld and ld.busy), "other_cores": round(ld.other_cores, 3) if ld else None,
                  "modes": r} for r, ld in zip(readings, loads)],
        "spread": {m: spread([r.get(m, {}).get("speedup") for r in readings]) for m in modes if m != "ar"},
        "kept": keep,
    }
    data = json.loads(traces_to_json(races[keep]))
    data["recorded"] = recorded
    return data


def table(rec: dict) -> str:
    modes = [m for m in rec["modes"] if m != "ar"]
    lines = ["| race | " + " | ".join(modes) + " | machine |", "|---" * (len(modes) + 2) + "|"]
    for i, run in enumerate(rec["runs"]):
        cells = []
        for m in modes:
            r = run["modes"].get(m, {})
            sp = f"{r['speedup']:.2f}×" if r.get("speedup") is not None else "–"
            cells.append(sp + ("" if r.get("reading") else f" (no reading: {r.get('why')})") + (" ← kept" if i == rec["kept"] and m == "d3d-seq" else ""))
        cells.append("busy" if run["busy"] else f"quiet ({run['other_cores']} other cores)")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("| spread (max − min) / median | " + " | ".join(
        f"{rec['spread'][m]:.1%}" if rec["spread"].get(m) is not None else "–" for m in modes) + " | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="lesson", choices=sorted(lesson.PRESETS))
    ap.add_argument("--bundle", default=service.app_bundle())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override the preset's")
    ap.add_argument("--out", default=None, help="write the median race here (refused when any race was busy)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    try:
        bundle = service.check_bundle(args.bundle)
        rec = record(bundle, args.preset, args.repeat, service.check_modes(args.modes), args.max_new_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = rec["recorded"]
    print(f"\n{r['preset']} preset on {r['bundle']}, {r['date']}, {r['cpu']}, {r['cores']} cores, commit {r['commit']}:\n")
    print(table(r))
    if args.out:
        if any(run["busy"] for run in r["runs"]):
            print(f"\nnot written: a race ran on a busy machine; pause other jobs and run again ({args.out} unchanged)",
                  file=sys.stderr)
            return 1
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
        print(f"\nwrote {args.out} ({Path(args.out).stat().st_size:,} bytes): race {r['kept'] + 1} (the median d3d-seq)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
