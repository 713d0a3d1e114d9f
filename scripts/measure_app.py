"""Measure the served app like a user: cold start to first page (fresh or warm weight cache),
time from Run to the first streamed round, wall time of a 4-mode race, peak RSS of the server — and whether the app
times the engine as the engine times itself (issue 33: the app's ``ar`` tokens/s within 10 % of in-process).

    .venv/bin/python scripts/measure_app.py [--fresh-cache] [--max-new-tokens 128] [--prompt TEXT] [--repeats 3]
                                            [--modes ar,dflash,d3d-seq,d3d-async]

Starts `python app.py` on a free port as a subprocess and drives it with gradio_client. Then, ``--repeats`` times,
the same race (same prompt, settings and modes) runs through the app (its traces downloaded from the session) and
in this process through ``service.race`` with no UI at all, alternately (app, in-process, app, …) so that a drift of
the machine's speed lands on both alike. Prints JSON: per repeat and as medians, each mode's tokens/s both ways,
``ar_app_over_inprocess`` (1.0: the app costs ar nothing; the bar is 0.9–1.1), the race's wall time in the app
against the sum of its modes' own decode times (what the UI and the turns between modes cost outside them), and the
machine's load during each race (a reading on a busy machine says so).
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
from d3d_core.measure.soak import free_port  # noqa: E402


def rss_kb(pid: int, field: str = "VmHWM") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


BUNDLE = "smollm2-135m"
SETTINGS = dict(block_size=8, temperature=0, hypotheses=4, sampling="match", seed=0, verify="adaptive", drafting="gated")  # the app's defaults


def race_readings(traces: list) -> dict:
    """{mode: tokens/s, decode s, rounds} of a race's finished traces, and the machine's load it recorded."""
    out = {}
    for t in traces:
        st = t.stats
        out[t.mode] = {"tokens_per_s": round(st.tokens_per_s, 2), "decode_s": round(st.decode_time_s, 3),
                       "wall_s": round(st.wall_time_s, 3), "rounds": st.n_rounds, "tokens": st.n_tokens,
                       "busy": bool(t.load.busy) if t.load else None,
                       "other_cores": t.load.other_cores if t.load else None}
    return out


def app_race(client, prompt: str, modes: list, max_new: int) -> tuple:
    """One race through the served app: (readings from the session's downloaded traces, wall s, status line)."""
    from d3d_core import service

    s = SETTINGS
    t = time.perf_counter()
    out = client.predict(prompt, BUNDLE, modes, s["block_size"], s["temperature"], max_new, s["hypotheses"], s["sampling"],
                         s["seed"], s["verify"], s["drafting"], False, api_name="/race")
    wall = time.perf_counter() - t
    path = client.predict(api_name="/download_traces")
    with open(path, "rb") as f:
        traces = service.read_traces(f.read())
    return race_readings(traces), wall, out[0]


def inprocess_race(prompt: str, modes: list, max_new: int) -> tuple:
    """The same race in this process through ``service.race`` (no UI): (readings, wall s)."""
    from d3d_core import service

    s = SETTINGS
    base = service.settings(modes[0], s["block_size"], s["temperature"], max_new, s["hypotheses"], s["sampling"], s["seed"],
                            s["verify"], s["drafting"])
    list(service.race(BUNDLE, prompt, modes, base, skip_layers=None))  # nothing timed: loads and warms every shape once
    t = time.perf_counter()
    done = [tr for _, tr, fin in service.race(BUNDLE, prompt, modes, base) if fin]
    return race_readings(done), time.perf_counter() - t


def compare(app_runs: list, inproc_runs: list) -> dict:
    """Medians over the repeats of each mode's tokens/s in the app and in-process, and their ratio."""
    import statistics

    out = {}
    for m in app_runs[0]:
        a = [r[m]["tokens_per_s"] for r in app_runs if m in r]
        b = [r[m]["tokens_per_s"] for r in inproc_runs if m in r]
        if a and b and statistics.median(b) > 0:
            out[m] = {"app_tokens_per_s": round(statistics.median(a), 2), "inprocess_tokens_per_s": round(statistics.median(b), 2),
                      "app_over_inprocess": round(statistics.median(a) / statistics.median(b), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh-cache", action="store_true", help="empty $D3D_CACHE: includes the one-time GGUF conversion")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="A bakery sells muffins for $3 each and cookies for $2 each. Maya buys 4 muffins and 6 cookies. How much does she spend? Please reason step by step.")
    ap.add_argument("--repeats", type=int, default=3, help="app / in-process race pairs for the tokens/s comparison (0: none)")
    ap.add_argument("--modes", default="ar,dflash,d3d-seq,d3d-async", help="modes of the compared races (ar first)")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "ar" not in modes:
        modes = ["ar"] + modes
    from d3d_core.measure.client import app_client

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
        c = app_client(url)
        t1 = time.perf_counter()
        c.predict(BUNDLE, api_name="/pruning_curve")  # what the page's load event does: loads the bundle
        res["bundle_ready_s"] = time.perf_counter() - t0
        res["bundle_load_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        job = c.submit(args.prompt, BUNDLE, ["ar", "dflash", "d3d-seq", "d3d-async"], 8, 0, args.max_new_tokens, 4,
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
        if args.repeats > 0:
            app_runs, inproc_runs, pairs = [], [], []
            for _ in range(args.repeats):  # alternately, so that a drift of the machine's speed lands on both alike
                a, a_wall, status = app_race(c, args.prompt, modes, args.max_new_tokens)
                b, b_wall = inprocess_race(args.prompt, modes, args.max_new_tokens)
                app_runs.append(a)
                inproc_runs.append(b)
                pairs.append({"app": a, "app_race_wall_s": round(a_wall, 2),
                              "app_modes_own_s": round(sum(r["wall_s"] for r in a.values()), 2),
                              "inprocess": b, "inprocess_race_wall_s": round(b_wall, 2),
                              "app_status_busy": "machine busy" in status})
            cmp = compare(app_runs, inproc_runs)
            res["app_vs_inprocess"] = {"prompt": args.prompt, "modes": modes, "max_new_tokens": args.max_new_tokens,
                                       "repeats": pairs, "median": cmp,
                                       "ar_app_over_inprocess": (cmp.get("ar") or {}).get("app_over_inprocess"),
                                       "any_busy": any(r.get("busy") for p in pairs for side in ("app", "inprocess")
                                                       for r in p[side].values())}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    from d3d_core.measure.machine import machine_info

    res["machine"] = machine_info()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
