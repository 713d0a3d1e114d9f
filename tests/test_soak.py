"""The soak's short version (400 races on the toy bundle through the served app, 4 visitors at once) and its verdict,
tested on recorded series: flat with the allocator's wander passes, a planted leak fails."""

import json
from pathlib import Path

import pytest

from app.soak import SoakConfig, run, soak_figure


@pytest.mark.slow
def test_four_hundred_races_no_trend_in_memory_threads_files_or_temp_files(tmp_path):
    # Warm-up lasts 100 races because the per-shape kernel caches fill for ~90 (every new prompt length x block size
    # x pruning depth builds a GEMM primitive). After it, the server's RSS is a level that wanders and holds (a
    # 603-race toy soak: 715-733 MiB for 500 races, tests/fixtures/soak_toy600.json), so the verdict fits the trend of
    # the next 300 races rather than comparing two ends: the old 200-race two-ends verdict read that wander as
    # +3.2 % once in three runs. The verdict itself is tested on the recorded series below.
    cfg = SoakConfig(bundle="toy", visitors=4, races=400, minutes=20, warmup_races=100, max_prompt_words=12, max_new_tokens=12,
                     temp_max_age_s=15, sample_every_s=0.25)
    doc = run(cfg, tmp_path)
    v = doc["verdict"]
    print("\nsoak:", json.dumps({k: v[k] for k in v if k not in ("pass", "trends")}))
    assert v["races"] >= 400 and v["errors"] == 0, doc["soak"]["errors"][:5]
    assert all(doc["soak"]["actions"][k] > 0 for k in ("race", "stop")), doc["soak"]["actions"]
    # the leaks the soak found cost 4.0 MiB a race (oneDNN shapes), 0.8 (a plot component kept per race) and ~0.3
    # (oneDNN / ideep kernel caches filling with every prompt length), all fixed; the bar: < 2 % and < 0.2 MiB a race
    assert v["rss_growth"] < 0.02 and v["rss_mib_per_race"] < 0.2, v
    assert v["pass"]["threads_flat"] and v["pass"]["fds_flat"], v["trends"]
    assert v["temp_files_end"] <= v["temp_files_bound"], v
    assert all(v["pass"].values()), v["pass"]
    assert max(age for age, _ in doc["oldest_temp_files"]) < cfg.temp_max_age_s + 15  # stray upload files are swept too
    assert (tmp_path / "soak.json").is_file() and (tmp_path / "soak.html").stat().st_size > 10_000
    assert not (tmp_path / "soak.raw.jsonl").exists()  # kept only when a step failed
    fig = soak_figure(doc)
    names = [t.name for t in fig.data]
    assert names[0] == "RSS MiB" and names[1].startswith("trend after warm-up") and names[2:] == ["temp-file bound", "threads", "open fds", "temp files", "queued"]
    assert len(fig.data[0].y) == len(doc["soak"]["samples"]) and fig.data[2].y[0] == v["temp_files_bound"]


def test_health_endpoint_answers_outside_the_queue(app_server):
    from gradio_client import Client

    demo, url = app_server
    h = Client(url, verbose=False).predict(api_name="/health")
    assert h["status"] == "ok" and h["queue_max"] == 16 and h["rss_mib"] > 100 and h["threads"] >= 1
    assert set(h) >= {"uptime_s", "races_served", "queue_length", "open_fds", "temp_files"}
    c = Client(url, verbose=False)
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
    from app.soak import SoakConfig, verdict

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
                r[key] = r[key] + (per_race * r["races"] if key == "rss_mib" else int(per_race * r["races"]))
        yield r0, win


def test_a_flat_recorded_soak_passes_in_every_window():
    """603 toy races with no leak: every 400-race window (100 warm-up + 300 judged), as the suite's soak runs it,
    passes every check — the level's wander (715-733 MiB) is not read as a trend."""
    samples, _ = _recorded()
    seen = 0
    for r0, win in _windows(samples):
        v = _judge(win, 400)
        assert v["pass"]["rss_flat"] and v["pass"]["threads_flat"] and v["pass"]["fds_flat"], (r0, v)
        assert abs(v["rss_growth"]) < 0.012 and abs(v["rss_mib_per_race"]) < 0.05, (r0, v)
        seen += 1
    assert seen >= 10


@pytest.mark.parametrize("mib", [0.4, 0.5])
def test_a_planted_rss_leak_fails_in_every_window(mib):
    samples, _ = _recorded()
    for r0, win in _windows(samples, rss_mib=mib):
        v = _judge(win, 400)
        assert not v["pass"]["rss_flat"], (r0, v)
        lo, hi = v["rss_slope_ci90"]
        assert v["rss_growth"] > 0.1 and lo <= v["rss_mib_per_race"] <= hi and v["rss_mib_per_race"] > 0.3, (r0, v)


def test_a_thread_or_fd_leak_fails_and_a_pool_that_grows_then_holds_passes():
    samples, _ = _recorded()
    for r0, win in _windows(samples, step=100, threads=1 / 30):
        assert not _judge(win, 400)["pass"]["threads_flat"], r0
    for r0, win in _windows(samples, step=100, fds=1 / 30):
        assert not _judge(win, 400)["pass"]["fds_flat"], r0
    # AnyIO's worker pool: +6 threads on a burst of visitors, gone once idle; or +2 that stay
    for r0, win in _windows(samples, step=100):
        burst = [dict(r, threads=r["threads"] + (6 if 200 <= r["races"] < 240 else 0)) for r in win]
        assert _judge(burst, 400)["pass"]["threads_flat"], r0
        held = [dict(r, threads=r["threads"] + (2 if r["races"] >= 200 else 0)) for r in win]
        assert _judge(held, 400)["pass"]["threads_flat"], r0
        # a count that wanders up and back (the suite's soak once fitted +3.03 threads over 300 races: 15 after warm-up,
        # 19 at most, 16 at the end): a slope, but nothing kept
        wander = [dict(r, threads=r["threads"] + (5 if 230 <= r["races"] < 345 else 0)) for r in win]
        assert _judge(wander, 400)["pass"]["threads_flat"], r0
    from app.soak import _bounded

    assert _bounded({"growth": 3.03, "end_gain": 1.0}, 3) and _bounded({"growth": 1.0, "end_gain": 5.0}, 3)
    assert not _bounded({"growth": 3.5, "end_gain": 3.5}, 3) and not _bounded(None, 3)


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
    from app.soak import sen_slope

    xs = list(range(20))
    slope, lo, hi = sen_slope(xs, [2.0 * x + (1 if x % 2 else -1) for x in xs])
    assert abs(slope - 2.0) < 0.2 and lo <= slope <= hi and hi - lo < 1.0
    assert all(v != v for v in sen_slope([0, 1], [0, 1]))  # nan under 3 points


def test_a_failing_verdict_keeps_the_measured_soak_on_disk(tmp_path, monkeypatch):
    """A soak whose verdict raises still writes soak.json with every sample, names the failed step, and fails."""
    from app import soak as soak_mod

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
