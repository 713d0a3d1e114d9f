"""Soak and overload test of the served app, driven like real visitors through ``gradio_client``.

    python -m app.soak --races 500 --visitors 4                       # the real bundle, short generations
    python -m app.soak --races 60 --visitors 4 --bundle toy           # what the test suite runs
    python -m app.soak --races 0 --overload 40                        # only the overload phase

Starts ``app.py`` on a free loopback port (or drives ``--url``), with its own temporary directory so
every file the server writes is counted. N visitor threads, each its own session, run a mix of races
(mixed modes, block sizes, temperatures, prompt lengths; some stopped mid-run), trace downloads and
uploads, race exports and pruning measurements, until ``--races`` races or ``--minutes`` pass. A sampler
records the server's RSS, threads, open file descriptors, temporary files and disk use, and the queue
length from ``/health``, every second. Then an optional overload phase: ``--overload`` visitors at once
against the queue, one visitor who leaves mid-race, and the time until a lone race is as fast as before.
Writes ``soak.json`` and ``soak.html`` (a plot) to ``--out``; exit status 1 when a bar is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
MODES = ("ar", "dflash", "d3d-seq", "d3d-async")
WORDS = "the quick brown fox jumps over a lazy dog while seven bakers count muffins and cookies".split()
DONE_CODES = {"PROCESSING", "ITERATING", "PROGRESS", "FINISHED", "CANCELLED"}


@dataclass(frozen=True)
class SoakConfig:
    bundle: str = "smollm2-135m"
    visitors: int = 4
    races: int = 500
    minutes: float = 90.0
    max_new_tokens: int = 16
    max_prompt_words: int = 120  # prompts of 3..this many words
    stop_share: float = 0.1  # races stopped mid-run
    warmup_races: int = 100  # memory is compared from here on (per-shape kernel caches fill for ~90 races)
    overload: int = 0  # visitors arriving at once in the overload phase (0: skip it)
    temp_max_age_s: int = 60  # the server's temp-file age (D3D_TEMP_MAX_AGE_S), short so a soak sees the cleanup work
    seed: int = 0
    sample_every_s: float = 1.0
    url: Optional[str] = None  # drive a running server instead of starting app.py


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    """``python app.py`` on a free loopback port with private TMPDIR / GRADIO_TEMP_DIR."""

    def __init__(self, temp_max_age_s: int = 900):
        self.tmp = Path(tempfile.mkdtemp(prefix="d3d-soak-"))
        self.port = free_port()
        env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(self.port), TMPDIR=str(self.tmp),
                   GRADIO_TEMP_DIR=str(self.tmp / "gradio"), GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
                   D3D_TEMP_MAX_AGE_S=str(temp_max_age_s))
        self.log = open(self.tmp.parent / f"{self.tmp.name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/"

    def wait(self, timeout: float = 600) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                urllib.request.urlopen(self.url, timeout=2).read(1)
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"app.py did not answer within {timeout:.0f} s; log: {self.log.name}")

    def _walk(self):
        for dirpath, _, names in os.walk(self.tmp):
            for f in names:
                p = os.path.join(dirpath, f)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                yield p, st

    def files(self) -> tuple:
        """(count, bytes) of every file under the server's private temp directories."""
        stats = [st for _, st in self._walk()]
        return len(stats), sum(st.st_size for st in stats)

    def oldest(self, n: int = 10) -> list:
        """The n oldest temp files, [(age s, path under the temp root)]: what the cleanup missed, if anything."""
        now = time.time()
        rows = sorted((round(now - st.st_mtime, 1), os.path.relpath(p, self.tmp)) for p, st in self._walk())
        return rows[::-1][:n]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_DOWNLOADS = {"dir": None}  # one directory for every simulated visitor's downloads, removed by run()


def client(url):
    from gradio_client import Client

    if _DOWNLOADS["dir"] is None:
        _DOWNLOADS["dir"] = tempfile.mkdtemp(prefix="d3d-soak-client-")
    return Client(url, verbose=False, download_files=_DOWNLOADS["dir"])


def race_args(cfg: SoakConfig, rng: random.Random, max_new: Optional[int] = None) -> list:
    modes = rng.sample(MODES, rng.randint(1, 4))
    words = rng.randint(3, max(3, cfg.max_prompt_words))  # short and long prompts
    prompt = " ".join(rng.choice(WORDS) for _ in range(words)) + f" ({rng.randint(0, 10**6)})"
    temp = rng.choice([0.0, 0.0, 0.7])
    return [prompt, cfg.bundle, modes, rng.randint(2, 8), temp, max_new or cfg.max_new_tokens, rng.randint(1, 8),
            rng.choice(["match", "rejection"]), rng.randint(0, 1000), rng.choice(["adaptive", "full"]), rng.choice(["gated", "always"]), False]


def timed_race(c, args: list, stop_after: Optional[float] = None) -> dict:
    """Submit a race; returns wait (queued) and total seconds, and whether it was stopped."""
    t0 = time.perf_counter()
    job = c.submit(*args, api_name="/race")
    started = None
    while not job.done():
        code = getattr(job.status().code, "name", "")
        if started is None and code in DONE_CODES:
            started = time.perf_counter()
            if stop_after is not None:
                time.sleep(stop_after)
                c.predict(api_name="/stop")
        time.sleep(0.02)
    out = job.result()
    t1 = time.perf_counter()
    status = out[0] if isinstance(out, (list, tuple)) else str(out)
    # a race runs to "**Done**"; one stopped mid-run says "**Stopped**" (or "**Done**" if it finished first)
    ok = str(status).startswith(("**Done**", "**Stopped**") if stop_after is not None else "**Done**")
    return {"wait_s": (started or t1) - t0, "total_s": t1 - t0, "stopped": stop_after is not None, "ok": ok}


# ----------------------------------------------------------------------------- the soak


def _pct(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))], 3)


def soak(cfg: SoakConfig, url: str, server: Optional[Server]) -> dict:
    from gradio_client import handle_file

    lock = threading.Lock()
    races, errors, actions = [], [], {"race": 0, "stop": 0, "traces": 0, "export": 0, "prune": 0}
    file_times = []  # when a visitor made the server write files (a download + upload, an export)
    samples = []
    stop = threading.Event()
    t_start = time.time()
    deadline = t_start + cfg.minutes * 60
    health_c = client(url)

    def sample():
        import psutil

        proc = psutil.Process(server.proc.pid) if server else None
        while not stop.is_set():
            try:
                h = health_c.predict(api_name="/health")
            except Exception as e:  # the endpoint failed: an error of the soak's verdict, and sampling goes on
                with lock:
                    errors.append({"visitor": -1, "action": "health", "error": repr(e)[:300], "t": round(time.time() - t_start, 1)})
                stop.wait(cfg.sample_every_s)
                continue
            row = {"t": round(time.time() - t_start, 2), "races": len(races), "queue": h.get("queue_length"),
                   "rss_mib": h["rss_mib"], "threads": h["threads"], "fds": h["open_fds"], "app_temp_files": h["temp_files"]}
            if proc is not None:
                row["temp_files"], row["temp_bytes"] = server.files()
                row["rss_mib"] = round(proc.memory_info().rss / 2**20, 1)
            samples.append(row)
            stop.wait(cfg.sample_every_s)

    def visitor(v: int):
        rng = random.Random(cfg.seed * 1000 + v)
        c = client(url)
        while not stop.is_set():
            with lock:
                if len(races) >= cfg.races or time.time() > deadline:
                    return
            what = rng.choices(["race", "traces", "export", "prune"], [0.75, 0.1, 0.05, 0.1])[0]
            try:
                if what == "race" or not races:
                    stop_after = rng.uniform(0.05, 0.4) if rng.random() < cfg.stop_share else None
                    r = timed_race(c, race_args(cfg, rng), stop_after)
                    c.predict(api_name="/race_views")  # what the page draws after a race
                    with lock:
                        races.append(r)
                        actions["stop" if stop_after else "race"] += 1
                    if not r["ok"]:
                        raise RuntimeError("race returned no result")
                elif what == "traces":
                    path = c.predict(api_name="/download_traces")
                    msg = c.predict(handle_file(path), api_name="/upload_trace")[0]
                    if not str(msg).startswith("**Loaded**"):
                        raise RuntimeError(f"upload: {msg}")
                    os.unlink(path)
                    with lock:
                        actions["traces"] += 1
                        file_times.append(time.time())
                elif what == "export":
                    os.unlink(c.predict(api_name="/export_html"))
                    with lock:
                        actions["export"] += 1
                        file_times.append(time.time())
                else:
                    active = c.predict(cfg.bundle, api_name="/pruning_curve")[0]
                    if isinstance(active, dict):  # a component update: the ticked layers are its value
                        active = active.get("value") or []
                    if active:
                        c.predict(cfg.bundle, active[:-1] or active, api_name="/measure_pruned")
                    with lock:
                        actions["prune"] += 1
            except Exception as e:  # noqa: BLE001 - every error counts, none stops the soak
                with lock:
                    errors.append({"visitor": v, "action": what, "error": repr(e)[:300], "t": round(time.time() - t_start, 1)})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=visitor, args=(v,)) for v in range(cfg.visitors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(2 * cfg.sample_every_s)  # a last sample at rest
    stop.set()
    sampler.join(30)
    return {"races": races, "errors": errors, "actions": actions, "samples": samples, "wall_s": round(time.time() - t_start, 1),
            "file_times": [round(t - t_start, 2) for t in file_times]}


def verdict(res: dict, cfg: SoakConfig) -> dict:
    """The bars of the issue: flat memory after warm-up, flat threads / fds, bounded temp files, no errors."""
    s = res["samples"]
    warm = [r for r in s if r["races"] >= min(cfg.warmup_races, max(1, len(res["races"]) // 2))]
    base = warm[0] if warm else (s[0] if s else None)
    end = s[-1] if s else None
    out = {"races": len(res["races"]), "errors": len(res["errors"])}
    if base and end:
        # RSS swings by up to 25 % inside one race (its activations and buffers), so each end is the median
        # of every sample over a span of races — the first after warm-up against the last — not a few samples
        # that may fall inside one race.
        tail = s[-5:]
        n_races = len(res["races"])
        span = max(5, min(50, (n_races - base["races"]) // 2))
        first = [r["rss_mib"] for r in warm if r["races"] < base["races"] + span] or [base["rss_mib"]]
        last = [r["rss_mib"] for r in s if r["races"] >= n_races - span] or [end["rss_mib"]]
        rss_base, rss_end = statistics.median(first), statistics.median(last)
        out.update(rss_span_races=span)
        out.update(
            rss_after_warmup_mib=rss_base, rss_end_mib=rss_end, rss_max_mib=max(r["rss_mib"] for r in s),
            rss_growth=round((rss_end - rss_base) / rss_base, 4),
            rss_mib_per_race=round((rss_end - rss_base) / max(1, n_races - base["races"] - span), 3),  # between the spans' centres
            threads_after_warmup=base["threads"], threads_end=tail[-1]["threads"], threads_max=max(r["threads"] for r in s),
            fds_after_warmup=base["fds"], fds_end=tail[-1]["fds"], fds_max=max((r["fds"] or 0) for r in s),
            temp_files_max=max(r.get("temp_files", r["app_temp_files"]) for r in s),
            temp_files_end=tail[-1].get("temp_files", tail[-1]["app_temp_files"]),
        )
        # what may still be on disk: ≤ 4 files per file-writing action in the last cleanup window
        # (age + the check period), plus the first page's fixed files
        window = cfg.temp_max_age_s + max(10, cfg.temp_max_age_s // 3) + 5
        recent = [t for t in res.get("file_times", []) if t >= end["t"] - window]
        out["temp_files_bound"] = 4 * len(recent) + 20
        out["pass"] = {
            "no_errors": out["errors"] == 0,
            "rss_flat": out["rss_growth"] < 0.02,
            "threads_flat": out["threads_end"] <= out["threads_after_warmup"] + 2,
            "fds_flat": (out["fds_end"] or 0) <= (out["fds_after_warmup"] or 0) + 8,
            "temp_bounded": out["temp_files_end"] <= out["temp_files_bound"],
        }
    waits = [r["wait_s"] for r in res["races"]]
    totals = [r["total_s"] for r in res["races"]]
    out.update(wait_p50_s=_pct(waits, 0.5), wait_p95_s=_pct(waits, 0.95), wait_p99_s=_pct(waits, 0.99),
               race_p50_s=_pct(totals, 0.5), race_p95_s=_pct(totals, 0.95), race_p99_s=_pct(totals, 0.99))
    return out


# ----------------------------------------------------------------------------- overload


def overload(cfg: SoakConfig, url: str) -> dict:
    """``cfg.overload`` visitors at once; a visitor who leaves mid-race; recovery of a lone race."""
    from gradio_client.exceptions import AppError

    rng = random.Random(cfg.seed + 7)
    solo = client(url)
    fixed = [f"Count the muffins: {rng.randint(0, 99)} and then some more.", cfg.bundle, ["ar", "d3d-seq"], 4, 0.0,
             cfg.max_new_tokens, 4, "match", 0, "adaptive", "gated", False]
    base = [timed_race(solo, fixed)["total_s"] for _ in range(3)]
    baseline = statistics.median(base)
    outcomes = [None] * cfg.overload
    barrier = threading.Barrier(cfg.overload)

    def one(i: int):
        c = client(url)
        barrier.wait()
        t0 = time.perf_counter()
        try:
            r = timed_race(c, race_args(cfg, random.Random(i)))
            outcomes[i] = {"outcome": "result" if r["ok"] else "no result", **r}
        except Exception as e:  # noqa: BLE001 - classify every way a visitor can be answered
            msg = str(e)
            busy = "queue is full" in msg.lower() or type(e).__name__ == "QueueError"
            outcomes[i] = {"outcome": "busy" if busy else "error", "message": msg[:200], "total_s": time.perf_counter() - t0,
                           "app_error": isinstance(e, AppError)}

    ts = [threading.Thread(target=one, args=(i,)) for i in range(cfg.overload)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join(3600)
    load_s = time.perf_counter() - t0
    # a visitor who closes the page mid-race: how long until the next visitor's race starts
    leaver, next_c = client(url), client(url)
    long_args = list(fixed)
    long_args[5] = 400
    long_args[2] = list(MODES)
    job = leaver.submit(*long_args, api_name="/race")
    while getattr(job.status().code, "name", "") not in DONE_CODES:
        time.sleep(0.02)
    time.sleep(1.0)
    nxt = next_c.submit(*fixed, api_name="/race")
    time.sleep(0.5)
    t_leave = time.perf_counter()
    job.cancel()
    while getattr(nxt.status().code, "name", "") not in DONE_CODES:
        time.sleep(0.02)
        if time.perf_counter() - t_leave > 120:
            break
    lane_release_s = time.perf_counter() - t_leave
    nxt.result()
    # recovery: lone races until one is within 1.5x of the baseline
    t_end, recovery_s, after = time.perf_counter(), None, []
    while time.perf_counter() - t_end < 60:
        after.append(timed_race(solo, fixed)["total_s"])
        if after[-1] <= 1.5 * baseline:
            recovery_s = round(time.perf_counter() - t_end, 2)
            break
    kinds = [o["outcome"] for o in outcomes if o]
    waits = [o["wait_s"] for o in outcomes if o and "wait_s" in o]
    busy_msgs = sorted({o["message"] for o in outcomes if o and o["outcome"] == "busy"})
    busy_t = [o["total_s"] for o in outcomes if o and o["outcome"] == "busy"]
    return {
        "visitors": cfg.overload, "results": kinds.count("result"), "busy": kinds.count("busy"), "errors": kinds.count("error"),
        "no_result": kinds.count("no result"), "busy_messages": busy_msgs, "busy_answer_max_s": _pct(busy_t, 1.0),
        "wait_p50_s": _pct(waits, 0.5), "wait_p95_s": _pct(waits, 0.95), "wait_max_s": _pct(waits, 1.0),
        "load_s": round(load_s, 1), "baseline_race_s": round(baseline, 3), "lane_release_s": round(lane_release_s, 2),
        "recovery_s": recovery_s, "races_after": [round(x, 3) for x in after],
        "pass": {"everyone_answered": kinds.count("error") == 0 and len(kinds) == cfg.overload,
                 "recovered_within_30s": recovery_s is not None and recovery_s <= 30},
    }


# ----------------------------------------------------------------------------- the plot


def soak_figure(doc: dict):
    """RSS, threads / file descriptors, temporary files and queue length against races served."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    s = doc.get("soak", {}).get("samples", [])
    x = [r["races"] for r in s]
    fig = make_subplots(rows=2, cols=2, shared_xaxes=True, subplot_titles=(
        "server memory (RSS, MiB)", "threads and open file descriptors", "temporary files on disk", "queue length"))
    fig.add_trace(go.Scatter(x=x, y=[r["rss_mib"] for r in s], name="RSS MiB", mode="lines"), 1, 1)
    v = doc.get("verdict", {})
    if "rss_after_warmup_mib" in v:
        fig.add_hline(y=v["rss_after_warmup_mib"] * 1.02, line_dash="dot", row=1, col=1,
                      annotation_text="+2 %: the bar for growth after warm-up", annotation_position="bottom right")
        warm = doc.get("config", {}).get("warmup_races")
        if warm and x and warm < x[-1]:
            fig.add_vline(x=warm, line_dash="dash", line_color="grey", row=1, col=1,
                          annotation_text="warm-up ends", annotation_position="top left")
    if "temp_files_bound" in v and x:  # what the cleanup window may still hold at the end
        fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[v["temp_files_bound"]] * 2, name="temp-file bound", mode="lines",
                                 line=dict(dash="dot", color="grey")), 2, 1)
    fig.add_trace(go.Scatter(x=x, y=[r["threads"] for r in s], name="threads", mode="lines"), 1, 2)
    fig.add_trace(go.Scatter(x=x, y=[r["fds"] for r in s], name="open fds", mode="lines"), 1, 2)
    fig.add_trace(go.Scatter(x=x, y=[r.get("temp_files", r["app_temp_files"]) for r in s], name="temp files", mode="lines"), 2, 1)
    fig.add_trace(go.Scatter(x=x, y=[r["queue"] or 0 for r in s], name="queued", mode="lines"), 2, 2)
    fig.update_xaxes(title_text="races served", row=2)
    cfg = doc.get("config", {})
    fig.update_layout(height=620, title=f"Soak: {v.get('races', 0)} races, {cfg.get('visitors')} visitors, bundle {cfg.get('bundle')}, "
                                        f"{v.get('errors', 0)} errors", showlegend=True)
    return fig


# ----------------------------------------------------------------------------- CLI


def run(cfg: SoakConfig, out: Path) -> dict:
    from d3d_core.measure.machine import machine_info

    server = None if cfg.url else Server(cfg.temp_max_age_s)
    url = cfg.url or server.url
    try:
        if server:
            server.wait()
        doc = {"config": asdict(cfg), "machine": machine_info()}
        if cfg.races > 0:
            res = soak(cfg, url, server)
            doc["soak"] = res
            doc["verdict"] = verdict(res, cfg)
            if server:
                doc["oldest_temp_files"] = server.oldest()
        if cfg.overload > 0:
            doc["overload"] = overload(cfg, url)
        if server:
            doc["server_log_tail"] = Path(server.log.name).read_text()[-3000:]
    finally:
        if server:
            server.close()
        if _DOWNLOADS["dir"]:
            shutil.rmtree(_DOWNLOADS["dir"], ignore_errors=True)
            _DOWNLOADS["dir"] = None
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(doc, indent=1))
    if "soak" in doc:
        soak_figure(doc).write_html(str(out / "soak.html"), include_plotlyjs=True)
    return doc


def passed(doc: dict) -> bool:
    checks = {**doc.get("verdict", {}).get("pass", {}), **doc.get("overload", {}).get("pass", {})}
    return all(checks.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.soak", description=__doc__.split("\n\n")[0])
    for f, default in asdict(SoakConfig()).items():
        kind = str if default is None else type(default)
        ap.add_argument("--" + f.replace("_", "-"), type=kind, default=default)
    ap.add_argument("--out", default=None, help="directory for soak.json and soak.html (default $D3D_CACHE/soak/<time>)")
    args = ap.parse_args(argv)
    cfg = SoakConfig(**{f: getattr(args, f) for f in asdict(SoakConfig())})
    if cfg.visitors < 1 or cfg.races < 0 or cfg.overload < 0:
        print("error: --visitors must be ≥ 1, --races and --overload ≥ 0", file=sys.stderr)
        return 2
    from d3d_core.models.bundles import cache_dir

    out = Path(args.out) if args.out else cache_dir() / "soak" / time.strftime("%Y%m%d-%H%M%S")
    doc = run(cfg, out)
    summary = {k: doc[k] for k in ("verdict",) if k in doc}
    if "overload" in doc:
        summary["overload"] = {k: v for k, v in doc["overload"].items() if k != "races_after"}
    print(json.dumps(summary, indent=1))
    print(f"written: {out / 'soak.json'}" + (f", {out / 'soak.html'}" if "soak" in doc else ""), file=sys.stderr)
    return 0 if passed(doc) else 1


if __name__ == "__main__":
    sys.exit(main())
