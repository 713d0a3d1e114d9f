"""The soak's short version (400 races on the toy bundle through the served app, 4 visitors at once) and its verdict,
tested on recorded series: flat with the allocator's wander passes, a planted leak fails."""

import json
from pathlib import Path

import pytest

from d3d_core.measure.soak import SoakConfig, run, soak_figure


@pytest.mark.slow
def test_four_hundred_races_no_trend_in_memory_threads_files_or_temp_files(tmp_path):
    # Warm-up lasts 100 races because the per-shape kernel caches fill for ~90 (every new prompt length x block size
    # x pruning depth builds a GEMM primitive). After it, the server's RSS is a level that wanders and holds (a
    # 603-race toy soak: 715-733 MiB for 500 races, tests/fixtures/soak_toy600.json), so the verdict fits the trend of
    # the next 300 races rather than comparing two ends: the old 200-race two-ends verdict read that wander as
    # +3.2 % once in three runs. The verdict itself is tested on the recorded series below.
    # minutes: a cap for a hung server, not a speed bar — 400 races take 5–9 minutes on a quiet 2-core machine, and a
    # 20-minute cap failed this test once on an AMD EPYC that other jobs kept 4× oversubscribed (75 races by 1,044 s)
    cfg = SoakConfig(bundle="toy", visitors=4, races=400, minutes=60, warmup_races=100, max_prompt_words=12, max_new_tokens=12,
                     temp_max_age_s=15, sample_every_s=0.25)
    doc = run(cfg, tmp_path)
    v = doc["verdict"]
    print("\nsoak:", json.dumps({k: v[k] for k in v if k not in ("pass", "trends")}))
    assert v["races"] >= 400 and v["errors"] == 0, doc["soak"]["errors"][:5]
    assert all(doc["soak"]["actions"][k] > 0 for k in ("race", "stop")), doc["soak"]["actions"]
    # the leaks the soak found cost 4.0 MiB a race (oneDNN shapes), 0.8 (a plot component kept per race) and ~0.3
    # (oneDNN / ideep kernel caches filling with every prompt length), all fixed; the bar: < 2 % and < 0.2 MiB a race
    assert v["rss_growth"] < 0.02 and v["rss_mib_per_race"] < 0.2, v
    # every thread in a named pool within its maximum and every fd kind within its bound, at every sample (no trend)
    assert v["pass"]["threads_in_pools"] is True and v["pass"]["fds_in_bounds"] is True, v["census"]
    assert v["temp_files_end"] <= v["temp_files_bound"], v
    assert v["pass"]["heap_flat"] is not False and all(ok is not False for ok in v["pass"].values()), v["pass"]  # None: no heap off glibc
    # stray upload files are swept too; none left at all is the best case (max() of nothing failed run 1 of ten at 766c6b4)
    assert max((age for age, _ in doc["oldest_temp_files"]), default=0.0) < cfg.temp_max_age_s + 15
    assert (tmp_path / "soak.json").is_file() and (tmp_path / "soak.html").stat().st_size > 10_000
    assert not (tmp_path / "soak.raw.jsonl").exists()  # kept only when a step failed
    fig = soak_figure(doc)
    names = [t.name for t in fig.data]
    assert names[0] == "RSS MiB" and names[1].startswith("trend after warm-up") and names[2:] == ["temp-file bound", "threads", "open fds", "temp files", "queued"]
    assert len(fig.data[0].y) == len(doc["soak"]["samples"]) and fig.data[2].y[0] == v["temp_files_bound"]


@pytest.mark.slow
def test_planted_thread_fd_and_memory_leaks_each_fail_the_soak(tmp_path):
    """The instrument's calibration on a served app: a thread per race that never ends, a pipe per race never closed
    and 2 MiB kept per race, each planted in the server, each fail their own check of a short toy soak, naming what."""
    cfg = SoakConfig(bundle="toy", visitors=2, races=60, minutes=45, warmup_races=10, max_prompt_words=8, max_new_tokens=8,
                     temp_max_age_s=15, sample_every_s=0.25, stop_share=0.0, planted_leak_mib=2.0, planted_thread_leak=True,
                     planted_fd_leak=True)
    v = run(cfg, tmp_path)["verdict"]
    assert v["races"] >= 60 and v["errors"] == 0, v
    p = v["pass"]
    assert p["threads_in_pools"] is False and p["fds_in_bounds"] is False and p["rss_flat"] is False and p["heap_flat"] is False, p
    assert any(k.startswith("thread outside every pool: Thread-") for k in v["census"]["threads_excess"]), v["census"]
    assert "fds pipe above 8" in v["census"]["fds_excess"], v["census"]
    assert v["rss_mib_per_race"] > 1.0 and v["heap_mib_per_race"] > 1.0, v


def test_health_endpoint_answers_outside_the_queue(app_server):
    from d3d_core.measure.client import app_client as Client

    demo, url = app_server
    h = Client(url).predict(api_name="/health")
    assert h["status"] == "ok" and h["queue_max"] == 16 and h["rss_mib"] > 100 and h["threads"] >= 1
    assert set(h) >= {"uptime_s", "races_served", "queue_length", "open_fds", "temp_files"}
    c = Client(url)
    status = c.predict("what is two plus two?", "toy", ["ar"], 4, 0, 8, 4, "match", 0, "adaptive", "gated", False, api_name="/race")[0]
    assert status.startswith("**Done**"), status  # a finished race is not reported as stopped
    after = c.predict(api_name="/health")
    assert after["races_served"] == h["races_served"] + 1 and after["races_stopped"] == h["races_stopped"]
    from app.health import line

    assert "races served" in line(h) and "queue" in line(h)


def test_health_counts_temp_files_that_vanish_while_it_counts(tmp_path, monkeypatch):
    """A visitor's export can be swept between the listing and the stat: /health must count around it, not fail
    (a 200-race soak once lost its health sampler to exactly that FileNotFoundError)."""
    from pathlib import Path

    from app import health

    (tmp_path / "kept.json").write_text("x" * 10)
    (tmp_path / "gone.json").write_text("y")
    (tmp_path / "sub").mkdir()
    monkeypatch.setattr(health, "_TEMP", tmp_path)
    real_stat = Path.stat

    def stat(self, *a, **k):
        if self.name == "gone.json":
            raise FileNotFoundError(self)
        return real_stat(self, *a, **k)

    monkeypatch.setattr(Path, "stat", stat)
    assert health._temp_usage() == (1, 10)
    snap = health.snapshot()
    assert snap["status"] == "ok" and snap["temp_files"] == 1 and snap["temp_bytes"] == 10


# ----------------------------------------------------------------------------- the verdict itself, on recorded series

FIXTURE = Path(__file__).parent / "fixtures" / "soak_toy600.json"


def _recorded():
    d = json.loads(FIXTURE.read_text())
    return [dict(zip(d["columns"], r)) for r in d["rows"]], d["n_races"]


def _judge(samples, n_races, warmup=100):
    from d3d_core.measure.soak import SoakConfig, verdict

    cfg = SoakConfig(bundle="toy", warmup_races=warmup, temp_max_age_s=15)
    rows = [dict(r, t=i * 0.25, app_temp_files=0, queue=0) for i, r in enumerate(samples)]
    return verdict({"samples": rows, "races": [{"wait_s": 0.0, "total_s": 1.0}] * n_races, "errors": [], "file_times": []}, cfg)


def _windows(samples, width=400, step=20, **leak):
    """Every ``width``-race window of the recorded soak, re-based to race 0, with optional planted leaks per race."""
    n = max(r["races"] for r in samples)
    for r0 in range(0, n - width + 1, step):
        win = [dict(r, races=r["races"] - r0) for r in samples if r0 <= r["races"] < r0 + width]
        for r in win:  # a leak grows with every race the server has served
            for key, per_race in leak.items():
                r[key] = r[key] + (per_race * r["races"] if key in ("rss_mib", "heap_in_use_mib") else int(per_race * r["races"]))
        yield r0, win


def test_a_flat_recorded_soak_passes_in_every_window():
    """603 toy races with no leak: every 400-race window (100 warm-up + 300 judged), as the suite's soak runs it,
    passes every check — the level's wander (715-733 MiB) is not read as a trend."""
    samples, _ = _recorded()
    seen = 0
    for r0, win in _windows(samples):
        v = _judge(win, 400)
        assert v["pass"]["rss_flat"] and v["pass"]["heap_flat"] is None, (r0, v)  # no heap recorded: not judged
        assert v["pass"]["threads_in_pools"] is None and v["pass"]["fds_in_bounds"] is None, (r0, v)  # no census recorded
        assert abs(v["rss_growth"]) < 0.012 and abs(v["rss_mib_per_race"]) < 0.05, (r0, v)
        seen += 1
    assert seen >= 10


@pytest.mark.parametrize("mib", [0.8, 1.0])
def test_a_planted_heap_leak_fails_in_every_window(mib):
    """The recorded soak's RSS wander (715-733 MiB) moved down to a heap level of 315-333 MiB (a wider wander for its
    level than the heap showed): flat passes every window, a planted leak fails every window."""
    samples, _ = _recorded()
    with_heap = [dict(r, heap_in_use_mib=r["rss_mib"] - 400) for r in samples]
    for r0, win in _windows(with_heap):
        assert _judge(win, 400)["pass"]["heap_flat"], r0
    for r0, win in _windows(with_heap, heap_in_use_mib=mib):
        v = _judge(win, 400)
        assert not v["pass"]["heap_flat"] and v["heap_mib_per_race"] > 0.7, (r0, v)


@pytest.mark.parametrize("mib", [0.4, 0.5])
def test_a_planted_rss_leak_fails_in_every_window(mib):
    samples, _ = _recorded()
    for r0, win in _windows(samples, rss_mib=mib):
        v = _judge(win, 400)
        assert not v["pass"]["rss_flat"], (r0, v)
        lo, hi = v["rss_slope_ci90"]
        assert v["rss_growth"] > 0.1 and lo <= v["rss_mib_per_race"] <= hi and v["rss_mib_per_race"] > 0.3, (r0, v)


def _census_rows(n_races=60, per_race=None, **extra):
    """Samples of a served app's thread and fd census: the pools a toy soak showed (main, uvicorn, 2-6 AnyIO
    workers that come and go, the drafter lane now and then), native OpenMP workers, the fds it held; ``per_race``
    (race -> row) plants something."""
    import random

    rng, rows = random.Random(1), []
    for race in range(n_races):
        workers = rng.randint(2, 6)
        pools = {"main": 1, "gradio-server": 1, "gradio-workers": workers} | ({"drafter-lane": 1} if race % 3 == 0 else {})
        py = sum(pools.values())
        row = {"races": race, "thread_census": {"pools": pools, "unknown": [], "native": rng.randint(1, py), "native_max": py * 1 + 2,
                                                "pool_max": {"main": 1, "gradio-server": 1, "gradio-workers": 40, "asyncio-executor": 6,
                                                             "drafter-lane": 1, "probe-lane": 1}},
               "fds_by_kind": {"tcp-listen": 1, "tcp-open": rng.randint(2, 12), "tcp-closing": rng.randint(0, 3), "unix": 2,
                               "anon-inode": 2, "dev": 1, "file": 2}}
        if per_race:
            per_race(race, row)
        rows.append(row | extra)
    return rows


def test_threads_and_fds_are_judged_by_pool_and_kind_not_by_trend():
    """A pool that wanders within its maximum passes however it trends; a thread outside every pool, a pool above its
    maximum, native threads above theirs and an fd kind above its bound each fail, naming what and from which race."""
    from d3d_core.measure.soak import census_verdict, fd_bounds

    ok = census_verdict(_census_rows(), clients=5)
    assert ok["judged"] and not ok["threads_excess"] and not ok["fds_excess"], ok
    # AnyIO's pool climbing from 2 to 30 workers over the soak and keeping them: within launch(max_threads=40)
    climb = census_verdict(_census_rows(per_race=lambda r, row: row["thread_census"]["pools"].update({"gradio-workers": 2 + r // 2})), 5)
    assert not climb["threads_excess"], climb

    def leak_thread(r, row):
        if r >= 20:
            row["thread_census"]["unknown"] = [f"Thread-{k} (wait)" for k in range(20, r + 1)]
    v = census_verdict(_census_rows(per_race=leak_thread), 5)
    assert v["threads_excess"] == {"thread outside every pool: Thread-20 (wait)": 20} | {f"thread outside every pool: Thread-{k} (wait)": k for k in range(21, 60)}
    over = census_verdict(_census_rows(per_race=lambda r, row: row["thread_census"]["pools"].update({"drafter-lane": 2} if r == 33 else {})), 5)
    assert over["threads_excess"] == {"thread pool drafter-lane above its maximum 1": 33} and over["pools_max_seen"]["drafter-lane"] == 2
    native = census_verdict(_census_rows(per_race=lambda r, row: row["thread_census"].update(native=40) if r == 50 else None), 5)
    assert native["threads_excess"] == {"native threads above their maximum": 50} and native["native_max_seen"] == 40
    pipes = census_verdict(_census_rows(per_race=lambda r, row: row["fds_by_kind"].update(pipe=r // 4)), 5)
    assert pipes["fds_excess"] == {f"fds pipe above {fd_bounds(5)['pipe']}": 4 * (fd_bounds(5)["pipe"] + 1)} and pipes["fds_max_seen"]["pipe"] == 59 // 4
    assert not pipes["threads_excess"]
    # sockets are bounded by the clients the soak runs: 30 connections are a leak for 5 clients, not for 10
    socks = _census_rows(per_race=lambda r, row: row["fds_by_kind"].update({"tcp-closing": 30} if r == 40 else {}))
    assert census_verdict(socks, 5)["fds_excess"] and not census_verdict(socks, 10)["fds_excess"]
    assert census_verdict([{"races": 1, "rss_mib": 1.0}], 5) == {"judged": False}  # a soak recorded before the census


def test_the_verdict_names_an_unjudged_census_and_passes_only_what_was_judged():
    from d3d_core.measure.soak import passed

    samples, n = _recorded()
    v = _judge(samples[:2000], n)
    assert v["pass"]["threads_in_pools"] is None and v["pass"]["fds_in_bounds"] is None and "before it existed" in v["census_not_judged"]
    assert passed({"verdict": v}) == all(ok for ok in v["pass"].values() if ok is not None)
    assert not passed({"verdict": {"pass": {}}}) and not passed({"verdict": {"pass": {"rss_flat": True, "fds_in_bounds": False}}})


def test_the_verdict_on_synthetic_series_noise_passes_a_linear_leak_fails():
    """Seeded synthetic soaks: a level with sample noise, in-race swings and random steps within the recorded
    soak's range (715-733 MiB) passes every seed; the same with 0.4 MiB a race fails every seed. (This wander's
    judged growth spreads ±2.1 % over 40 seeds, about twice what the recorded soak's windows show.)"""
    import random

    def series(seed, leak):
        rng, level, rows = random.Random(seed), 724.0, []
        for race in range(400):
            if rng.random() < 0.02:  # the allocator's level moves, then stays (bounded)
                level = min(733.0, max(715.0, level + rng.uniform(-6, 6)))
            for _ in range(4):
                swing = rng.random() * 0.2 * level if rng.random() < 0.3 else 0.0  # a race's own buffers
                rows.append({"races": race, "rss_mib": level + swing + rng.gauss(0, 2) + leak * race, "threads": 10 + rng.randint(0, 4), "fds": 20})
        return rows

    for seed in range(20):
        assert _judge(series(seed, 0.0), 400)["pass"]["rss_flat"], seed
        assert not _judge(series(seed, 0.4), 400)["pass"]["rss_flat"], seed


def test_too_short_a_soak_is_not_passed():
    samples, _ = _recorded()
    v = _judge([r for r in samples if r["races"] < 3], 3)
    assert v["pass"]["rss_flat"] is False and "too few races" in v["not_judged"]  # nothing to fit is not "flat", and it says why


def test_sen_slope_and_its_interval():
    from d3d_core.measure.soak import sen_slope

    xs = list(range(20))
    slope, lo, hi = sen_slope(xs, [2.0 * x + (1 if x % 2 else -1) for x in xs])
    assert abs(slope - 2.0) < 0.2 and lo <= slope <= hi and hi - lo < 1.0
    assert all(v != v for v in sen_slope([0, 1], [0, 1]))  # nan under 3 points


def test_a_failing_verdict_keeps_the_measured_soak_on_disk(tmp_path, monkeypatch):
    """A soak whose verdict raises still writes soak.json with every sample, names the failed step, and fails."""
    from d3d_core.measure import soak as soak_mod

    samples, n = _recorded()
    rec = {"samples": [dict(r, t=i * 0.25, app_temp_files=0, queue=0) for i, r in enumerate(samples)],
           "races": [{"wait_s": 0.0, "total_s": 1.0, "stopped": False, "ok": True}] * n, "errors": [], "actions": {}, "file_times": []}

    class FakeServer:
        def __init__(self, *a, **k):
            self.url, self.log = "http://127.0.0.1:1/", type("L", (), {"name": str(tmp_path / "log")})()
            (tmp_path / "log").write_text("server log")

        def wait(self):
            pass

        def oldest(self):
            return []

        def close(self):
            pass

    def soak(cfg, url, server, raw):
        for r in rec["samples"][:5]:
            raw.write("sample", r)
        return rec

    def broken(*a, **k):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(soak_mod, "Server", FakeServer)
    monkeypatch.setattr(soak_mod, "soak", soak)
    monkeypatch.setattr(soak_mod, "verdict", broken)
    out = tmp_path / "out"
    doc = soak_mod.run(soak_mod.SoakConfig(bundle="toy", races=n), out)
    saved = json.loads((out / "soak.json").read_text())
    assert len(saved["soak"]["samples"]) == len(samples) and saved["failed_steps"][0]["step"] == "verdict"
    assert not soak_mod.passed(doc)
    assert len(soak_mod.RawLog.read(out / "soak.raw.jsonl")["samples"]) == 5  # the incremental log stays too
    # and the verdict can be given again from the record once it works
    monkeypatch.undo()
    assert soak_mod.main(["--rejudge", str(out / "soak.json")]) == 0
    assert json.loads((out / "soak.json").read_text())["verdict"]["pass"]["rss_flat"]
    # the raw log is judged beside the fuller soak.json, never over it; a stray line in it is skipped, not a traceback
    with open(out / "soak.raw.jsonl", "a") as f:
        f.write("7\n{not json\n")
    before = (out / "soak.json").read_text()
    assert soak_mod.main(["--rejudge", str(out / "soak.raw.jsonl")]) == 1  # 5 samples: too few to judge
    assert (out / "soak.json").read_text() == before and "not_judged" in json.loads((out / "soak.rejudged.json").read_text())["verdict"]


def test_a_socket_the_connection_table_missed_is_classified_by_its_own_type():
    """A TCP socket made but not connected yet (as a client's is while the census reads the connection table, then the
    fds) is not in the table: it counts as a connection being opened (tcp-open, bounded by the clients), not as an
    unbounded "socket-other"; a datagram socket stays socket-other; the fds stay open and usable. Soak run 9 of ten at
    0cf7269 failed on one sample with 5 such sockets against socket-other's bound of 4."""
    import socket

    from app.health import _unlisted_socket_kind, fd_census

    tcp, udp = socket.socket(socket.AF_INET, socket.SOCK_STREAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert _unlisted_socket_kind(tcp.fileno()) == "tcp-open" and _unlisted_socket_kind(udp.fileno()) == "socket-other"
        before = fd_census()
        extra = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(6)]
        after = fd_census()
        assert after.get("socket-other", 0) == before.get("socket-other", 0), (before, after)
        assert after.get("tcp-open", 0) >= before.get("tcp-open", 0) + 6, (before, after)
        for s in extra:  # still open and ours: the census closed nothing
            s.bind(("127.0.0.1", 0))
            s.close()
        udp.sendto(b"x", ("127.0.0.1", 9))
    finally:
        tcp.close()
        udp.close()
