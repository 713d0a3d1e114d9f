"""Measure the served app like a user: cold start to first page (fresh or warm weight cache),
time from Run to the first streamed round, wall time of a 4-mode race, peak RSS of the server.

    .venv/bin/python scripts/measure_app.py [--fresh-cache] [--max-new-tokens 128]

Starts `python app.py` on a free port as a subprocess, drives it with gradio_client, prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from app.soak import free_port  # noqa: E402


def rss_kb(pid: int, field: str = "VmHWM") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh-cache", action="store_true", help="empty $D3D_CACHE: includes the one-time GGUF conversion")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="A bakery sells muffins for $3 each and cookies for $2 each. Maya buys 4 muffins and 6 cookies. How much does she spend? Please reason step by step.")
    args = ap.parse_args()
    from gradio_client import Client

    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    if args.fresh_cache:
        env["D3D_CACHE"] = tempfile.mkdtemp(prefix="d3d-cache-")
    port = free_port()
    env["GRADIO_SERVER_PORT"] = str(port)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    res = {"fresh_cache": args.fresh_cache}
    try:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("server did not come up in 300 s")
        res["first_page_s"] = time.perf_counter() - t0
        c = Client(url, verbose=False)
        t1 = time.perf_counter()
        c.predict("smollm2-135m", api_name="/pruning_curve")  # what the page's load event does: loads the bundle
        res["bundle_ready_s"] = time.perf_counter() - t0
        res["bundle_load_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        job = c.submit(args.prompt, "smollm2-135m", ["ar", "dflash", "d3d-seq", "d3d-async"], 8, 0, args.max_new_tokens, 4,
                       "match", 0, "adaptive", "gated", False, api_name="/race")
        first_round = None
        while not job.done():
            outs = job.outputs()
            if first_round is None and any(isinstance(o, (list, tuple)) and len(o) > 1 and "rounds <b>" in str(o[1])
                                           and "rounds <b>0<" not in str(o[1]) for o in outs):
                first_round = time.perf_counter() - t2  # the ar column shows its first finished round
            time.sleep(0.02)
        out = job.result()
        res["race_wall_s"] = time.perf_counter() - t2
        res["run_to_first_streamed_round_s"] = first_round
        res["race_status"] = out[0]
        res["server_peak_rss_mb"] = rss_kb(proc.pid) / 1024
        res["server_rss_mb"] = rss_kb(proc.pid, "VmRSS") / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
