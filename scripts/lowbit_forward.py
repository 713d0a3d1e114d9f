"""The target's forward over m rows on the int4 engine with torch's int4 kernel and with the low-bit kernel (and on
the fp32 engine), the bundled SmolLM2-135M at a fixed context, engines and row counts interleaved in one process.

    .venv/bin/python scripts/lowbit_forward.py [--rows 1,2,4,8,16,32] [--ctx 300] [--reps 7] [--threads 2] [--clock wall|cpu]

A verify of m rows: prefill ``ctx`` tokens once, then per repetition feed m tokens and roll them back. ``--clock cpu``
(1 thread only) times this thread's CPU time, robust to other work on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--no-fp32", action="store_true")
    a = ap.parse_args(argv)
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu measures one thread's CPU time: use it with --threads 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    from d3d_core.models import int4, lowbit
    from d3d_core.models.bundles import get_bundle

    t = get_bundle("smollm2-135m").target
    t.engine_request = "int4"
    engines = {}
    os.environ["D3D_LOWBIT"] = "off"
    lowbit.reset()
    engines["int4 torch"] = int4.load(t, t.int4_source)
    del os.environ["D3D_LOWBIT"]
    lowbit.reset()
    if lowbit.status().lowbit:
        engines["int4 lowbit"] = int4.load(t, t.int4_source)
    if not a.no_fp32:
        engines["fp32"] = None
    t.engine_request = "fast"
    rows = [int(r) for r in a.rows.split(",")]
    ids = torch.randint(3, t.arch.vocab_size, (a.ctx + max(rows),), generator=torch.Generator().manual_seed(0))
    caches = {}
    for e, w in engines.items():
        c = t.new_cache()
        c.int4 = w
        t.forward(c, ids[: a.ctx], 1)
        caches[e] = c
    times = {(e, m): [] for e in engines for m in rows}
    with torch.inference_mode():
        for rep in range(a.reps + 1):
            for m in rows:
                for e, c in caches.items():
                    t0 = clock()
                    t.forward(c, ids[a.ctx : a.ctx + m], m)
                    if rep:
                        times[(e, m)].append((clock() - t0) * 1e3)
                    c.length = a.ctx
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu}, {a.threads} threads, torch {torch.__version__}, commit {commit}, "
          f"load average {os.getloadavg()[0]:.2f}; forward over m rows after {a.ctx} tokens, median of {a.reps}, {a.clock} ms")
    print("| rows | " + " | ".join(engines) + " |")
    print("|---|" + "---|" * len(engines))
    for m in rows:
        cells = []
        for e in engines:
            med, one = statistics.median(times[(e, m)]), statistics.median(times[(e, rows[0])])
            cells.append(f"{med:.1f} ({med / one:.2f}×)")
        print(f"| {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
