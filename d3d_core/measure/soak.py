"""Soak and overload test of the served app, driven like real visitors through ``gradio_client``.

    python -m d3d_core.measure.soak --races 500 --visitors 4                       # the real bundle, short generations
    python -m d3d_core.measure.soak --races 60 --visitors 4 --bundle toy           # what the test suite runs
    python -m d3d_core.measure.soak --races 0 --overload 40                        # only the overload phase

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

from ..models.sources import cache_dir
from .machine import machine_info
from .rawfirst import Steps, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: app.py, served as a visitor meets it
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
    planted_leak_mib: float = 0.0  # a calibration run: the served app keeps this many MiB per race (the verdict must fail it)
    planted_thread_leak: bool = False  # a calibration run: the served app starts a thread per race that never ends
    planted_fd_leak: bool = False  # a calibration run: the served app opens a pipe per race and never closes it
    memory_census: bool = False  # the server reports what holds its heap (tensor bytes, live objects, caches) every 10 s
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


# The instrument's own calibration, never used by the app: leaks of known size that the verdict must catch.
# ``--planted-leak-mib X``: the served app holds X MiB more after every race (touched pages, so RSS sees them);
# ``--planted-thread-leak``: it starts a thread per race that never ends; ``--planted-fd-leak``: it opens a pipe
# per race and never closes it.
_LEAK_BOOT = """
import os, runpy, sys, threading
from app import health
kept, real, n = [], health.count, int(float(sys.argv[1]) * 2**20)
threads, fds = sys.argv[2] == "1", sys.argv[3] == "1"
forever = threading.Event()
def count(what):
    if what in ("races", "stopped"):
        kept.append(b"\\x01" * n)
        if threads:
            threading.Thread(target=forever.wait, daemon=True).start()
        if fds:
            kept.append(os.pipe())
    real(what)
health.count = count
sys.argv = sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Server:
    """``python app.py`` on a free loopback port with private TMPDIR / GRADIO_TEMP_DIR."""

    def __init__(self, temp_max_age_s: int = 900, planted_leak_mib: float = 0.0, planted_threads: bool = False, planted_fds: bool = False,
                 memory_census: bool = False):
        self.tmp = Path(tempfile.mkdtemp(prefix="d3d-soak-"))
        self.port = free_port()
        env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(self.port), TMPDIR=str(self.tmp),
                   GRADIO_TEMP_DIR=str(self.tmp / "gradio"), GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
                   D3D_TEMP_MAX_AGE_S=str(temp_max_age_s))
        if memory_census:
            env["D3D_MEMORY_CENSUS"] = "1"  # D3D_TRACEMALLOC=1 in the soak's own environment adds Python's allocation sites
        self.log = open(self.tmp.parent / f"{self.tmp.name}.log", "w")
        cmd = [sys.executable, str(ROOT / "app.py")]
        if planted_leak_mib > 0 or planted_threads or planted_fds:
            cmd = [sys.executable, "-c", _LEAK_BOOT, str(planted_leak_mib), str(int(planted_threads)), str(int(planted_fds)), str(ROOT / "app.py")]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
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
    from d3d_core.measure.client import app_client

    if _DOWNLOADS["dir"] is None:
        _DOWNLOADS["dir"] = tempfile.mkdtemp(prefix="d3d-soak-client-")
    return app_client(url, download_files=_DOWNLOADS["dir"])


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
    rec = {"wait_s": (started or t1) - t0, "total_s": t1 - t0, "stopped": stop_after is not None, "ok": ok}
    if not ok:  # what the visitor saw instead (e.g. the server's time limit on a starved machine)
        rec["status"] = str(status)[:200]
    return rec


# ----------------------------------------------------------------------------- the soak


def _pct(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))], 3)


class RawLog:
    """Append-only JSON lines, flushed per line: every sample and race reaches disk as it happens, so a soak
    that is killed (or whose verdict fails) keeps what it measured. ``read`` rebuilds a soak's record from it."""

    def __init__(self, path: Optional[Path]):
        self.path, self._lock = path, threading.Lock()
        self._f = open(path, "w", buffering=1) if path else None

    def write(self, kind: str, row: dict) -> None:
        if self._f:
            with self._lock:
                self._f.write(json.dumps({"kind": kind, **row}) + "\n")

    def close(self) -> None:
        if self._f:
            self._f.close()

    @staticmethod
    def read(path: Path) -> dict:
        """{"samples": [...], "races": [...], "errors": [...], "files": [...]} from a raw log (a torn last line is skipped)."""
        out: dict = {"samples": [], "races": [], "errors": [], "files": []}
        for line in Path(path).read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("kind"), str):  # anything else is not a line of this log
                out.setdefault(row.pop("kind") + "s", []).append(row)
        return out


def soak(cfg: SoakConfig, url: str, server: Optional[Server], raw: Optional[RawLog] = None) -> dict:
    from gradio_client import handle_file

    raw = raw or RawLog(None)

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
                    errors.append(err := {"visitor": -1, "action": "health", "error": repr(e)[:300], "t": round(time.time() - t_start, 1)})
                raw.write("error", err)
                stop.wait(cfg.sample_every_s)
                continue
            row = {"t": round(time.time() - t_start, 2), "races": len(races), "queue": h.get("queue_length"),
                   "rss_mib": h["rss_mib"], "threads": h["threads"], "fds": h["open_fds"], "app_temp_files": h["temp_files"],
                   "heap_in_use_mib": h.get("heap_in_use_mib"), "heap_free_mib": h.get("heap_free_mib"), "py_threads": h.get("py_threads"),
                   "thread_census": h.get("thread_census"), "fds_by_kind": h.get("fds_by_kind")}
            if h.get("memory_census"):
                row["memory_census"] = h["memory_census"]
            if proc is not None:
                row["temp_files"], row["temp_bytes"] = server.files()
                row["rss_mib"] = round(proc.memory_info().rss / 2**20, 1)
            samples.append(row)
            raw.write("sample", row)
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
                        n = len(races)
                    raw.write("race", dict(r, n=n))
                    if n % 25 == 0:
                        print(f"[soak] {n} races, {time.time() - t_start:.0f} s, RSS {samples[-1]['rss_mib'] if samples else '?'} MiB", file=sys.stderr)
                    if not r["ok"]:
                        raise RuntimeError(f"race returned no result: {r.get('status', '')!r}")
                elif what == "traces":
                    path = c.predict(api_name="/download_traces")
                    msg = c.predict(handle_file(path), api_name="/upload_trace")[0]
                    if not str(msg).startswith("**Loaded**"):
                        raise RuntimeError(f"upload: {msg}")
                    os.unlink(path)
                    with lock:
                        actions["traces"] += 1
                        file_times.append(time.time())
                    raw.write("file", {"t": round(time.time() - t_start, 2)})
                elif what == "export":
                    os.unlink(c.predict(api_name="/export_html"))
                    with lock:
                        actions["export"] += 1
                        file_times.append(time.time())
                    raw.write("file", {"t": round(time.time() - t_start, 2)})
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
                    errors.append(err := {"visitor": v, "action": what, "error": repr(e)[:300], "t": round(time.time() - t_start, 1)})
                raw.write("error", err)

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


# A leak is growth that goes on; the allocator's noise is a level that wanders and stays bounded. A 600-race toy
# soak (docs/RESULTS.md, Soak) held 715-733 MiB for 500 races after warm-up, with no trend; two 50-race ends 100
# races apart can still differ by 3 % on that wander, which is what made the old two-ends verdict flaky. So the
# verdict fits the trend of each resource after warm-up (a robust per-race slope, with an interval) over enough
# races that the wander cannot pass for a trend: 300 races put every flat window of that soak within ±1.1 % and
# ±0.03 MiB a race, and the same series with 0.4 MiB a race added at ≥ 13 % and ≥ 0.38 MiB a race.
RSS_GROWTH_BAR = 0.02  # trend growth over the post-warm-up races, as a share of the level after warm-up
RSS_SLOPE_BAR = 0.2  # MiB a race: a Space serving a thousand races a day must not keep 200 MiB of it
# The heap's bytes in use (glibc's mallinfo2) wander more than RSS relative to their level (a toy soak: 250-315 MiB
# after warm-up), and they count mmapped chunks whose untouched pages cost the host nothing (a Xeon's toy soak: heap
# +0.25 MiB a race with RSS flat). RSS is the bar that protects a host; the heap's bars are wider and catch what RSS
# would hide behind the allocator's reuse: a leak of 1 MiB a race fails both.
HEAP_GROWTH_BAR = 0.25
HEAP_SLOPE_BAR = 0.5
BIN_RACES = 10  # samples are pooled per this many races (a race's own buffers swing RSS by up to 25 %)


def sen_slope(xs: list, ys: list, conf: float = 0.9) -> tuple:
    """Theil–Sen slope of ys on xs (the median of all pairwise slopes) and Sen's distribution-free interval at
    ``conf`` (it assumes independent residuals, which pooled RSS only approximates). (nan, nan, nan) under 3 points."""
    import math
    from statistics import NormalDist

    n = len(xs)
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i])
    if n < 3 or not slopes:
        return (math.nan,) * 3
    N = len(slopes)
    c = NormalDist().inv_cdf(0.5 + conf / 2) * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    lo_rank, hi_rank = math.floor((N - c) / 2), math.ceil((N + c) / 2)  # 1-based ranks of the bounds
    return statistics.median(slopes), slopes[max(0, lo_rank - 1)], slopes[min(N - 1, hi_rank)]


def binned(samples: list, key: str, warm_from: int, bin_races: int = BIN_RACES) -> tuple:
    """(race at each bin's centre, median of the bin's samples of ``key``) for the samples from race ``warm_from`` on."""
    bins: dict = {}
    for r in samples:
        if r["races"] >= warm_from and r.get(key) is not None:
            bins.setdefault((r["races"] - warm_from) // bin_races, []).append(r[key])
    keys = sorted(k for k, v in bins.items() if len(v) >= 2)
    return [warm_from + (k + 0.5) * bin_races for k in keys], [statistics.median(bins[k]) for k in keys]


def trend(samples: list, key: str, warm_from: int, n_races: int, bin_races: int = BIN_RACES) -> Optional[dict]:
    """The post-warm-up trend of one sampled resource: slope a race with its 90 % interval, the level after warm-up,
    and the growth the trend implies from the end of warm-up to the last race (absolute and as a share of the
    level), and ``end_gain``: the last fifth of the bins' median minus the level (what the series actually kept).
    None when too few races came after warm-up to fit one."""
    xs, ys = binned(samples, key, warm_from, bin_races)
    slope, lo, hi = sen_slope(xs, ys)
    if slope != slope:  # nan
        return None
    fifth = max(2, len(ys) // 5)
    level, end = statistics.median(ys[:fifth]), statistics.median(ys[-fifth:])
    span = max(1, n_races - warm_from)
    rel = (lambda x: round(x * span / level, 4)) if level else (lambda x: None)
    return {"bins": len(xs), "races": span, "level": round(level, 2), "per_race": round(slope, 4), "per_race_ci90": [round(lo, 4), round(hi, 4)],
            "growth": round(slope * span, 2), "growth_share": rel(slope), "growth_share_ci90": [rel(lo), rel(hi)],
            "end_gain": round(end - level, 2)}


# Threads and fds are judged exactly (``app.health.thread_census`` / ``fd_census``): at every sample, every thread in a
# named pool within its maximum, the native threads within theirs, and every fd kind within its bound. No trend, so no
# wander can pass for a leak and no leak hides in one: a leaked thread is outside every pool (or overfills its own) at
# once, a leaked fd overfills its kind within a few races.
FD_CONNS_PER_CLIENT = 4  # a gradio_client Client holds its HTTP keep-alive connections, a queue-status stream and a job's
FD_BOUNDS = {            # fixed kinds: what the served app holds however long it runs (measured max, with its reason)
    "tcp-listen": 2,     # uvicorn's listening socket (IPv4, and IPv6 where bound)
    "unix": 8,           # the event loop's self-pipe socket pairs
    "pipe": 8, "anon-inode": 8,  # epoll / eventfd of the event loop and of the kernel libraries
    "dev": 4, "file": 8,  # stdin/out/err (redirected to the log), /dev/null, a temp file being written
    "socket-other": 4, "other": 4,  # datagram / netlink sockets of a name lookup (a TCP socket the table missed is tcp-open)
}


def fd_bounds(clients: int) -> dict:
    """Each fd kind's bound in a soak of ``clients`` gradio clients (visitors + the health sampler + overload)."""
    return {**FD_BOUNDS, "tcp-open": FD_CONNS_PER_CLIENT * clients, "tcp-closing": FD_CONNS_PER_CLIENT * clients}


def census_verdict(samples: list, clients: int) -> dict:
    """Threads by pool and fds by kind at every sample against their maxima: the most seen of each, and every
    excess with the race it was first seen at. ``judged`` False for a soak recorded before the census existed."""
    rows = [r for r in samples if r.get("thread_census")]
    if not rows:
        return {"judged": False}
    pool_max = rows[-1]["thread_census"]["pool_max"]
    bounds = fd_bounds(clients)
    seen_pools: dict = {}
    seen_fds: dict = {}
    native_seen = 0
    excess: dict = {}  # what went over -> the first race it was seen at (the most seen: pools_max_seen, fds_max_seen, ...)

    def over(what: str, race: int) -> None:
        excess.setdefault(what, race)

    for r in rows:
        c = r["thread_census"]
        for pool, n in c["pools"].items():
            seen_pools[pool] = max(seen_pools.get(pool, 0), n)
            if n > pool_max.get(pool, 0):
                over(f"thread pool {pool} above its maximum {pool_max.get(pool, 0)}", r["races"])
        for name in c["unknown"]:
            over(f"thread outside every pool: {name}", r["races"])
        if c.get("native") is not None:
            native_seen = max(native_seen, c["native"])
            if c["native"] > c["native_max"]:
                over("native threads above their maximum", r["races"])
        for kind, n in (r.get("fds_by_kind") or {}).items():
            seen_fds[kind] = max(seen_fds.get(kind, 0), n)
            if n > bounds.get(kind, 0):
                over(f"fds {kind} above {bounds.get(kind, 0)}", r["races"])
    threads_bad = {k: v for k, v in excess.items() if k.startswith(("thread", "native"))}
    fds_bad = {k: v for k, v in excess.items() if k.startswith("fds")}
    return {"judged": True, "samples": len(rows), "pools_max_seen": seen_pools, "pool_max": pool_max, "native_max_seen": native_seen,
            "fds_max_seen": seen_fds, "fd_bounds": bounds, "threads_excess": threads_bad, "fds_excess": fds_bad,
            "fds_judged": any(r.get("fds_by_kind") is not None for r in rows)}


def verdict(res: dict, cfg: SoakConfig) -> dict:
    """The bars of the issue: no RSS trend after warm-up, threads / fds bounded, bounded temp files, no errors."""
    s = res["samples"]
    n_races = len(res["races"])
    warm_from = min(cfg.warmup_races, max(1, n_races // 2))
    warm = [r for r in s if r["races"] >= warm_from]
    base = warm[0] if warm else (s[0] if s else None)
    end = s[-1] if s else None
    out = {"races": n_races, "errors": len(res["errors"]), "warmup_races": warm_from}
    if base and end:
        tail = s[-5:]
        # threads and fds are judged by pool and kind (census_verdict), not by a trend
        trends = {k: trend(s, k, warm_from, n_races) for k in ("rss_mib", "heap_in_use_mib")}
        census = census_verdict(s, cfg.visitors + 1 + cfg.overload)
        out["census"] = census
        if not census["judged"]:
            out["census_not_judged"] = "the samples carry no thread / fd census (a soak recorded before it existed)"
        out["trends"] = {k: t for k, t in trends.items() if t}
        rss = trends["rss_mib"] or {}
        heap_t = trends["heap_in_use_mib"]
        if heap_t:
            out.update(heap_mib_per_race=heap_t["per_race"], heap_slope_ci90=heap_t["per_race_ci90"], heap_growth=heap_t["growth_share"])
        out.update(rss_after_warmup_mib=rss.get("level"), rss_mib_per_race=rss.get("per_race"), rss_slope_ci90=rss.get("per_race_ci90"),
                   rss_growth=rss.get("growth_share"), rss_growth_ci90=rss.get("growth_share_ci90"))
        # the old two-ends reading, kept for the record: medians over the first and last spans of races
        span = max(5, min(50, (n_races - warm_from) // 2))
        first = [r["rss_mib"] for r in warm if r["races"] < warm_from + span] or [base["rss_mib"]]
        last = [r["rss_mib"] for r in s if r["races"] >= n_races - span] or [end["rss_mib"]]
        out["rss_growth_ends"] = round((statistics.median(last) - statistics.median(first)) / statistics.median(first), 4)
        out.update(
            rss_end_mib=end["rss_mib"], rss_max_mib=max(r["rss_mib"] for r in s),
            threads_after_warmup=base["threads"], threads_end=tail[-1]["threads"], threads_max=max(r["threads"] for r in s),
            fds_after_warmup=base["fds"], fds_end=tail[-1]["fds"], fds_max=max((r["fds"] or 0) for r in s),
            temp_files_max=max(r.get("temp_files", r["app_temp_files"]) for r in s),
            temp_files_end=tail[-1].get("temp_files", tail[-1]["app_temp_files"]),
        )
        heap = [r for r in warm if r.get("heap_in_use_mib") is not None]
        if len(heap) >= 2:
            out["heap_in_use_mib"] = [heap[0]["heap_in_use_mib"], heap[-1]["heap_in_use_mib"]]
            out["heap_free_mib"] = [heap[0].get("heap_free_mib"), heap[-1].get("heap_free_mib")]
        # what may still be on disk: ≤ 4 files per file-writing action in the last cleanup window
        # (age + the check period), plus the first page's fixed files
        window = cfg.temp_max_age_s + max(10, cfg.temp_max_age_s // 3) + 5
        recent = [t for t in res.get("file_times", []) if t >= end["t"] - window]
        out["temp_files_bound"] = 4 * len(recent) + 20
        if trends["rss_mib"] is None:  # a failed check below then means "not judged", not "leaks"
            out["not_judged"] = f"too few races after warm-up to fit a trend ({n_races - warm_from} races, {len(binned(s, 'rss_mib', warm_from)[0])} bins of {BIN_RACES})"
        out["pass"] = {
            "no_errors": out["errors"] == 0,
            "rss_flat": rss.get("growth_share") is not None and rss["growth_share"] < RSS_GROWTH_BAR and rss["per_race"] < RSS_SLOPE_BAR,
            # pools (AnyIO's workers, the drafter lane) grow on demand and then hold, and idle workers leave: a count that
            # wanders 15-19 can fit a slope of +3 over 300 races by chance (it did, once: threads 15 after warm-up, 16 at
            # the end). A leak both trends and keeps what it gained, so a count fails only when both pass the bar.
            # None where the server reported no heap (not glibc): not judged, and said so
            "heap_flat": None if heap_t is None else (heap_t["growth_share"] is not None and heap_t["growth_share"] < HEAP_GROWTH_BAR
                                                      and heap_t["per_race"] < HEAP_SLOPE_BAR),
            "threads_in_pools": (not census["threads_excess"]) if census["judged"] else None,
            "fds_in_bounds": (not census["fds_excess"]) if census["judged"] and census["fds_judged"] else None,  # no fd census off Linux
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
    if v.get("rss_after_warmup_mib"):
        fig.add_hline(y=v["rss_after_warmup_mib"] * 1.02, line_dash="dot", row=1, col=1,
                      annotation_text="+2 %: the bar for growth after warm-up", annotation_position="bottom right")
        warm = v.get("warmup_races", doc.get("config", {}).get("warmup_races"))
        t = v.get("trends", {}).get("rss_mib")
        if t and x:  # the fitted trend after warm-up: what the verdict judges
            x1 = warm + t["races"]
            fig.add_trace(go.Scatter(x=[warm, x1], y=[t["level"], t["level"] + t["per_race"] * t["races"]], mode="lines",
                                     name=f"trend after warm-up: {t['per_race']:+.3f} MiB a race", line=dict(color="black", width=2)), 1, 1)
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
    failed = [k for k, ok in v.get("pass", {}).items() if not ok]
    judged = ("not judged: " + v["not_judged"]) if v.get("not_judged") else ("failed: " + ", ".join(failed)) if failed else ("passed" if v.get("pass") else "not judged")
    fig.update_layout(height=620, title=f"Soak: {v.get('races', 0)} races, {cfg.get('visitors')} visitors, bundle {cfg.get('bundle')}, "
                                        f"{v.get('errors', 0)} errors · verdict {judged}", showlegend=True)
    return fig


# ----------------------------------------------------------------------------- CLI


def run(cfg: SoakConfig, out: Path) -> dict:
    """Soak (and overload) the served app; writes ``soak.json`` and ``soak.html`` to ``out``. Every sample and race
    goes to ``soak.raw.jsonl`` as it happens and the measured record to ``soak.json`` before the verdict, so neither
    a killed run nor a failing verdict or plot loses what was measured (``failed_steps`` names what failed)."""
    out.mkdir(parents=True, exist_ok=True)
    steps = Steps(raw=out / "soak.unwritten.json")  # where the record goes if soak.json cannot be written
    raw = RawLog(out / "soak.raw.jsonl")
    server = None if cfg.url else Server(cfg.temp_max_age_s, cfg.planted_leak_mib, cfg.planted_thread_leak, cfg.planted_fd_leak, cfg.memory_census)
    url = cfg.url or server.url
    doc = {"config": asdict(cfg), "machine": machine_info()}
    try:
        if server:
            server.wait()
        if cfg.races > 0:
            doc["soak"] = soak(cfg, url, server, raw)
            write_json_atomic(out / "soak.json", doc)  # the measurements, before any verdict
            doc["verdict"] = steps.run("verdict", verdict, doc["soak"], cfg, default={})
            if server:
                doc["oldest_temp_files"] = server.oldest()
        if cfg.overload > 0:
            doc["overload"] = steps.run("overload", overload, cfg, url, default={})
        if server:
            doc["server_log_tail"] = Path(server.log.name).read_text()[-3000:]
    finally:
        raw.close()
        if server:
            server.close()
        if _DOWNLOADS["dir"]:
            shutil.rmtree(_DOWNLOADS["dir"], ignore_errors=True)
            _DOWNLOADS["dir"] = None
    if "soak" in doc:
        with steps.step("plot"):
            soak_figure(doc).write_html(str(out / "soak.html"), include_plotlyjs=True)
    steps.finish(out / "soak.json", doc)
    if steps.ok:  # soak.json holds everything the log did
        (out / "soak.raw.jsonl").unlink(missing_ok=True)
    return doc


def rejudge(path: Path) -> int:
    """The verdict of a recorded soak, again (after the verdict changed, or for a run killed before its verdict)."""
    try:
        if path.suffix == ".jsonl":
            rec = RawLog.read(path)
            doc = {"config": asdict(SoakConfig()), "soak": {"races": rec["races"], "errors": rec["errors"], "samples": rec["samples"], "actions": {},
                                                            "file_times": [f["t"] for f in rec["files"]]}, "note": f"rebuilt from {path.name}"}
            if (path.parent / "soak.json").is_file():
                doc["config"] = json.loads((path.parent / "soak.json").read_text()).get("config", doc["config"])
        else:
            doc = json.loads(path.read_text())
        cfg = SoakConfig(**{k: v for k, v in doc.get("config", {}).items() if k in SoakConfig.__dataclass_fields__})
        soak_rec = doc["soak"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {path} is not a soak record ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    # a raw log is judged beside its run's soak.json, never over it (that record is the fuller one)
    target = path if path.suffix == ".json" else path.parent / ("soak.rejudged.json" if (path.parent / "soak.json").exists() else "soak.json")
    steps = Steps()
    doc["verdict"] = steps.run("verdict", verdict, soak_rec, cfg, default={})
    with steps.step("plot"):
        soak_figure(doc).write_html(str(target.with_suffix(".html")), include_plotlyjs=True)
    steps.finish(target, doc)
    print(f"written: {target}", file=sys.stderr)
    print(json.dumps({k: v for k, v in doc["verdict"].items() if k != "trends"}, indent=1))
    return 0 if passed(doc) else 1


def passed(doc: dict) -> bool:
    if doc.get("failed_steps"):
        return False
    checks = {**doc.get("verdict", {}).get("pass", {}), **doc.get("overload", {}).get("pass", {})}
    return bool(checks) and all(ok for ok in checks.values() if ok is not None)  # None: not judged (said in the verdict)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m d3d_core.measure.soak", description=__doc__.split("\n\n")[0])
    for f, default in asdict(SoakConfig()).items():
        if isinstance(default, bool):
            ap.add_argument("--" + f.replace("_", "-"), action="store_true")
            continue
        kind = str if default is None else type(default)
        ap.add_argument("--" + f.replace("_", "-"), type=kind, default=default)
    ap.add_argument("--out", default=None, help="directory for soak.json and soak.html (default $D3D_CACHE/soak/<time>)")
    ap.add_argument("--rejudge", default=None, metavar="PATH",
                    help="run nothing: judge a recorded soak again (its soak.json, or the soak.raw.jsonl a killed run left) and rewrite soak.json / soak.html beside it")
    args = ap.parse_args(argv)
    if args.rejudge:
        return rejudge(Path(args.rejudge))
    cfg = SoakConfig(**{f: getattr(args, f) for f in asdict(SoakConfig())})
    if cfg.visitors < 1 or cfg.races < 0 or cfg.overload < 0:
        print("error: --visitors must be ≥ 1, --races and --overload ≥ 0", file=sys.stderr)
        return 2
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
