"""The int4 engine's forward on the low-bit kernel three ways, interleaved in one process: the glue between the
kernels in torch ops, in C op by op (``lowbit.add_rmsnorm`` / ``swiglu``), and the whole layer stack in one C call
(``lowbit.LayerStack``) — the same kernels, so the difference is the Python and dispatch between them.

    .venv/bin/python scripts/lowbit_glue_ab.py [--rows 1,2,4,8,16] [--ctx 300] [--reps 42] [--threads 1]

With one thread it times this thread's CPU time (robust to other work on a shared machine), else wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--reps", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from d3d_core.measure.costs import _prefilled
    from d3d_core.models import lowbit
    from d3d_core.models import target as target_mod
    from d3d_core.models.bundles import get_bundle

    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    if not lowbit.status().lowbit:
        print(f"the low-bit kernel does not run here: {lowbit.status().reason}")
        return 1
    t = get_bundle("smollm2-135m").target
    t.engine_request = "int4"
    no_lib = types.SimpleNamespace(**{k: getattr(lowbit, k) for k in dir(lowbit) if not k.startswith("__")})
    no_lib.library = lambda: None  # target.py then runs its torch glue
    with torch.inference_mode():
        _, verifier = _prefilled(t, a.ctx, torch.Generator().manual_seed(0))
        verifier(1)()
        w4, stack = t._stack
        if stack is None:
            print("this target's layers do not run as one stack")
            return 1
        ways = {"torch glue": (no_lib, (w4, None)), "C glue": (lowbit, (w4, None)), "one call": (lowbit, (w4, stack))}
        try:
            for rows in (int(r) for r in a.rows.split(",")):
                v = verifier(rows)
                ts = {k: [] for k in ways}
                for k in range(a.reps + 3):
                    order = list(ways.items())
                    for name, (mod, st) in order[k % 3:] + order[: k % 3]:
                        target_mod.lowbit, t._stack = mod, st
                        t0 = clock()
                        v()
                        if k >= 3:
                            ts[name].append((clock() - t0) * 1e3)
                m = {k: statistics.median(x) for k, x in ts.items()}
                print(f"rows {rows}: " + ", ".join(f"{k} {x:.2f} ms" for k, x in m.items())
                      + f"; one call / torch glue {m['one call'] / m['torch glue']:.2f}", flush=True)
        finally:
            target_mod.lowbit, t._stack = lowbit, None
    return 0


if __name__ == "__main__":
    sys.exit(main())
