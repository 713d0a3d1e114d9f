"""Before / after a change to the target's forward, in ONE process (separate processes on these VMs differ by up to
30 % from one start to the next, idle machine and all; interleaving in one process resolves a few per cent).

    git worktree add /tmp/old <commit>
    .venv/bin/python scripts/ab_forward.py /tmp/old            # --rounds 60 --ctx 300

The old checkout's ``d3d_core`` is copied under another package name, both versions load the bundle, and their
forwards (fp32 and int4 engines; 1 and 8 rows) alternate step by step, in alternating order, with the row plan off
so that both run the same kernels (``--row-plan auto``: each version measures its own, as the app does). Prints
medians and new / old.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/ab_forward.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="a checkout of the old commit (git worktree add DIR COMMIT)")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--bundle", default="smollm2-135m")
    ap.add_argument("--rows", default="1,8", help="comma list of forward widths")
    ap.add_argument("--row-plan", default="off", help="D3D_ROW_PLAN for both versions (off, auto, blas, or a floor)")
    a = ap.parse_args(argv)
    old = Path(a.old).resolve()
    if not (old / "d3d_core").is_dir():
        print(f"{old} holds no d3d_core/: give a checkout of the old commit", file=sys.stderr)
        return 2
    os.environ["D3D_ROW_PLAN"] = a.row_plan
    widths = [int(w) for w in a.rows.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="ab-forward-"))
    shutil.copytree(old / "d3d_core", tmp / "d3d_old")  # its imports are relative: it runs under another name
    (tmp / "assets").symlink_to(ROOT / "assets")  # bundles.py finds assets/ beside its package
    sys.path[:0] = [str(tmp), str(ROOT)]
    import d3d_old.models.bundles as old_bundles
    import torch

    import d3d_core.models.bundles as new_bundles

    targets = {"new": new_bundles.get_bundle(a.bundle).target, "old": old_bundles.get_bundle(a.bundle).target}
    caches = {}
    for version, t in targets.items():
        for engine in ("fp32", "int4"):
            t.engine_request = engine
            c = t.new_cache()
            t.forward(c, torch.arange(a.ctx) % 1000 + 100, 1)
            caches[(version, engine)] = (t, c)
    ids, times = torch.arange(16) + 500, {}
    with torch.inference_mode():
        for r in range(a.rounds + 4):
            for engine in ("fp32", "int4"):
                for n in widths:
                    for version in (("old", "new") if r % 2 else ("new", "old")):
                        t, c = caches[(version, engine)]
                        t0 = time.perf_counter()
                        t.forward(c, ids[:n], n)
                        c.length -= n
                        if r >= 4:  # the first rounds warm both up
                            times.setdefault((engine, n, version), []).append((time.perf_counter() - t0) * 1e3)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"{a.rounds} interleaved rounds, context {a.ctx}, {torch.get_num_threads()} threads, row plan {a.row_plan}")
    for version, t in targets.items():
        print(f"{version}: row plan {getattr(t, 'row_plan_info', {}).get('plan')} blas {getattr(t, 'row_plan_info', {}).get('blas')}")
    for engine in ("fp32", "int4"):
        for n in widths:
            o, nw = med(times[(engine, n, "old")]), med(times[(engine, n, "new")])
            print(f"{engine:>5} {n} row(s): old {o:7.2f} ms   new {nw:7.2f} ms   new / old {nw / o:.3f}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
