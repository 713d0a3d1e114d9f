"""The ZeroGPU Space under its own rules (issue 47), on the CPU, through a stand-in for ``spaces`` that behaves as the
release the recipe pins was reviewed to (``spaces`` 0.51.3, ``zero/wrappers.py``, ``zero/client.py``): the GPU function
runs in a worker forked from the server, which runs the generator on its own, ahead of the reader, and pickles every
yield; the main side reads those in a thread; the reserved duration (times the GPU's duration factor) is refused up
front above the quota a visitor has left, and a worker still running when its reservation ends is killed ("GPU task
aborted"). Closing the stream in the main process does not stop the worker (the older release's behaviour, the
stricter one): it waits until the worker ends.
"""

import dataclasses
import importlib.machinery
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import gradio as gr
import pytest
import torch
import yaml

from app import runs, spaces_gpu
from d3d_core import service
from d3d_core.models import bundles

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "what is two plus two?"
FORK = multiprocessing.get_context("fork")


# ----------------------------------------------------------------------------- the stand-in


def _worker(fn, payload, conn):
    """The forked GPU worker: run the generator to its end (it never hears of the reader closing it), pickle each yield."""
    # This host's torch runs its CPU kernels on libgomp's OpenMP threads, which a forked child cannot use once the parent
    # has (the child hangs in its first parallel kernel); the real worker decodes on its GPU. One thread: no OpenMP.
    torch.set_num_threads(1)
    args, kwargs = pickle.loads(payload)
    try:
        for item in fn(*args, **kwargs):
            conn.send_bytes(pickle.dumps(("ok", pickle.dumps(item))))
    except Exception as e:  # noqa: BLE001 - as spaces: any exception crosses back as its class name and message
        conn.send_bytes(pickle.dumps(("exc", type(e).__name__, str(e))))
    conn.send_bytes(pickle.dumps(("end",)))


class StandIn:
    """``spaces`` as reviewed, for generator functions: ``quota_left`` seconds the visitor has; ``factor`` the GPU's
    duration factor (1.5 on the RTX Pro 6000 config of 0.51.3); ``enforce`` the seconds after which the worker is
    killed (default: the reserved duration)."""

    def __init__(self, quota_left=120.0, factor=1.5, enforce=None, held_at_fork=()):
        self.quota_left, self.factor, self.enforce = quota_left, factor, enforce
        self.held_at_fork = held_at_fork  # locks "another server thread" holds while the worker is forked
        self.asked, self.update_bytes, self.workers = [], [], []

    def module(self):
        mod = types.ModuleType("spaces")
        mod.GPU = self.GPU
        mod.__spec__ = importlib.machinery.ModuleSpec("spaces", None)
        return mod

    def GPU(self, task=None, *, duration=None, size=None):
        def deco(fn):
            def handler(*args, **kwargs):
                d = duration(*args, **kwargs) if callable(duration) else (duration or 60)
                asked = round(d * self.factor)
                self.asked.append(asked)
                if asked > self.quota_left:
                    raise gr.Error(f"You have exceeded your ZeroGPU quota ({asked}s requested vs. {self.quota_left:.0f}s left). "
                                   "Try again in 0:10:00.", title="ZeroGPU quota exceeded", print_exception=False)
                payload = pickle.dumps((args, kwargs))  # what crosses into the worker must pickle
                reader, writer = FORK.Pipe(duplex=False)
                proc = FORK.Process(target=_worker, args=(fn, payload, writer), daemon=True)
                for lock in self.held_at_fork:
                    lock.acquire()
                try:
                    proc.start()
                finally:
                    for lock in self.held_at_fork:
                        lock.release()
                writer.close()
                self.workers.append(proc)
                limit = self.enforce if self.enforce is not None else d

                def enforce():
                    proc.join(limit)
                    if proc.is_alive():
                        proc.kill()

                got: queue.Queue = queue.Queue()

                def read():  # spaces' fill_yield_queue: drains the worker whatever the handler does meanwhile
                    while True:
                        try:
                            r = pickle.loads(reader.recv_bytes())
                        except (EOFError, OSError):
                            got.put(None)  # the worker died without ending: aborted
                            return
                        got.put(r)
                        if r[0] in ("end", "exc"):
                            return

                threading.Thread(target=enforce, daemon=True).start()
                threading.Thread(target=read, daemon=True).start()
                t0 = time.monotonic()
                try:
                    while True:
                        r = got.get(timeout=600)
                        if r is None:
                            raise gr.Error("GPU task aborted", title="ZeroGPU worker error", print_exception=False)
                        if r[0] == "exc":
                            raise gr.Error(r[1], title="ZeroGPU worker error", print_exception=False)
                        if r[0] == "end":
                            break
                        item = pickle.loads(r[1])
                        self.update_bytes.append((len(r[1]), item))
                        yield item
                finally:
                    proc.join()  # closing waits for the worker: it ends on its own (or is killed at its time)
                    self.quota_left -= time.monotonic() - t0
            return handler
        return deco(task) if callable(task) else deco


@pytest.fixture
def zerogpu(monkeypatch, toy):
    """A ZeroGPU server: ``SPACES_ZERO_GPU`` set, the stand-in installed as ``spaces`` and the race's GPU function
    wrapped by it. Yields a factory: ``use(**standin_kwargs)`` -> the StandIn now in place."""
    import app.ui as ui

    monkeypatch.setenv("SPACES_ZERO_GPU", "true")

    def use(**kw):
        s = StandIn(**kw)
        monkeypatch.setitem(sys.modules, "spaces", s.module())
        monkeypatch.setattr(ui, "race_stream", spaces_gpu.maybe_gpu(ui._race_stream, duration=spaces_gpu.stream_duration))
        return s

    yield use
    for p in list(runs.__dict__.get("_RUNS", {})):
        runs.finish(p)


def race_args(**over):
    a = dict(prompt=PROMPT, bundle="toy", modes=["ar", "d3d-seq"], block_size=4, temperature=0, max_new_tokens=512, hypotheses=2,
             sampling="match", seed=0, verify="adaptive", drafting="always", use_pruned=False)
    a.update(over)
    return a


def slow_rounds(monkeypatch, log: Path, seconds: float):
    """Each decode step of the race takes at least ``seconds`` more, and the worker logs (monotonic time, mode, rounds)
    after each (CLOCK_MONOTONIC is one clock for every process of the machine)."""
    real = service.iter_decode

    def slowed(bundle, prompt, cfg, cancel=None, drafter=None):
        for tr in real(bundle, prompt, cfg, cancel=cancel, drafter=drafter):
            time.sleep(seconds)
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"{time.monotonic()} {cfg.mode} {len(tr.rounds)}\n")
            yield tr

    monkeypatch.setattr(service, "iter_decode", slowed)


def read_log(log: Path) -> list:
    if not log.exists():
        return []
    return [(float(t), m, int(n)) for t, m, n in (line.split() for line in log.read_text().splitlines())]


def prewarm(modes, tokens, block=4, hypotheses=2):
    """Warm this process for the race (a forked worker inherits it), so the worker starts decoding at once."""
    base = service.settings(modes[0], block, 0, tokens, hypotheses, "match", 0, "adaptive", "always")
    engine, _ = service.resolve_engine("toy", None)
    done = threading.Event()
    done.set()  # warm, then stop before the first decode
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # at the stand-in worker's thread count (a CPU warm-up is per thread count)
    try:
        list(service.race("toy", PROMPT, modes, base, cancel=done, engine=engine))
    finally:
        torch.set_num_threads(threads)


def budget_tokens(modes):
    return spaces_gpu.gpu_budget(len(modes), 512).tokens


# ----------------------------------------------------------------------------- 1. Stop ends the GPU work


def test_stop_ends_the_gpu_work_within_one_round_and_frees_the_lane(zerogpu, monkeypatch, tmp_path):
    import app.ui as ui

    standin = zerogpu()
    modes = ["ar", "d3d-seq"]
    prewarm(modes, budget_tokens(modes))
    log = tmp_path / "rounds.log"
    slow_rounds(monkeypatch, log, 0.05)
    before = runs.active()
    t_stop = None
    last = None
    for item in ui.run_race(*race_args(modes=modes).values(), ui.empty_state()):
        last = item
        if t_stop is None and str(item[0]).startswith("Running") and item[-1]["traces"]:
            t_stop = time.monotonic()
            assert ui.stop_race(item[-1]).startswith("Stopping")
    t_end = time.monotonic()
    status, *cols, state = last
    assert t_stop is not None and status.startswith("**Stopped**"), status
    rows = read_log(log)
    had, grew_after = {}, []
    for t, m, n in rows:  # the rounds each decode step added, and when
        if t > t_stop and n > had.get(m, 0):
            grew_after.append((t, m, n))
        had[m] = n
    assert len(grew_after) <= 1, grew_after  # at most the round in flight when Stop was pressed
    # the reservation is over a minute here: ending this soon means the Stop, not the deadline, ended the worker
    assert t_end - t_stop < 30 and not standin.workers[-1].is_alive()
    assert runs.active() == before and state["run"] is None
    for m in modes:  # every round the worker decoded reached the page
        assert state["traces"][m].finish_reason == "cancelled"
        assert len(state["traces"][m].rounds) == max(n for _, mm, n in rows if mm == m)
    assert not os.listdir(runs.STOP_DIR) if os.path.isdir(runs.STOP_DIR) else True  # the stop mark went with the race


def test_a_visitor_who_leaves_stops_the_worker_too(zerogpu, monkeypatch, tmp_path):
    import app.ui as ui

    standin = zerogpu()
    modes = ["ar"]
    prewarm(modes, budget_tokens(modes))
    log = tmp_path / "rounds.log"
    slow_rounds(monkeypatch, log, 0.05)
    before = runs.active()
    gen = ui.run_race(*race_args(modes=modes).values(), ui.empty_state())
    for item in gen:
        if str(item[0]).startswith("Running") and item[-1]["traces"]:
            break
    t_close = time.monotonic()
    gen.close()  # Gradio closes the handler when the visitor leaves: the worker must end within a round
    rows = read_log(log)
    assert not standin.workers[-1].is_alive() and time.monotonic() - t_close < 30
    assert len([r for r in rows if r[0] > t_close]) <= 2  # the round in flight, and the cancelled decode's last yield
    assert runs.active() == before


# ----------------------------------------------------------------------------- 2. the worker's deadline


def test_the_worker_stops_before_its_reservation_ends_on_its_own_clock(zerogpu, monkeypatch, tmp_path):
    import app.ui as ui

    standin = zerogpu()
    modes = ["ar"]
    tokens = budget_tokens(modes)
    prewarm(modes, tokens)
    log = tmp_path / "rounds.log"
    slow_rounds(monkeypatch, log, 0.1)  # 0.1 s a round: the request needs about half a minute
    reserved = spaces_gpu.MARGIN_S + 4  # so the worker may decode 4 s, and is killed at MARGIN_S + 4 s
    monkeypatch.setattr(ui, "gpu_budget", lambda m, n: spaces_gpu.Budget(min(n, tokens), reserved, 4.0, ""))
    out = list(ui.run_race(*race_args(modes=modes).values(), ui.empty_state()))
    status, *_, state = out[-1]
    assert standin.asked == [round(reserved * standin.factor)]  # the duration asked is the one the worker counts down
    assert "stopped at the end of the GPU time reserved for this race" in status, status
    assert "aborted" not in status and not standin.workers[-1].is_alive()
    rows = read_log(log)
    assert 3.5 <= rows[-1][0] - rows[0][0] <= 4.0 + 3.0  # its own 4 s (from its start, before its first round), not the kill
    assert state["traces"]["ar"].finish_reason == "cancelled" and 0 < len(state["traces"]["ar"].rounds) < tokens


def test_deadline_and_duration_are_one_number():
    b = spaces_gpu.gpu_budget(4, 96)
    assert b.deadline_s == b.seconds - spaces_gpu.MARGIN_S > 0
    assert spaces_gpu.stream_duration(PROMPT, "qwen3-8b", ["ar"], service.settings(max_new_tokens=96), None, "r", "d3d", "fp32", b.seconds) == b.seconds
    flag = runs.flag("f" * 32, b.deadline_s)  # a worker's flag: made there, its clock starts there
    assert flag.deadline - time.monotonic() == pytest.approx(b.deadline_s, abs=1.0) and flag.mark.endswith("f" * 32)


# ----------------------------------------------------------------------------- 3. the quota


def test_a_request_never_exceeds_the_unauthenticated_quota_by_default(zerogpu, monkeypatch):
    import app.ui as ui

    for m in range(1, 5):
        for n in (1, 8, 96, 150, 156, 157, 288, 512, 10_000):
            b = spaces_gpu.gpu_budget(m, n)
            assert b.seconds * spaces_gpu.DURATION_FACTOR <= spaces_gpu.QUOTA_SECONDS, (m, n, b)
            assert (b.tokens < n) == bool(b.note) and b.tokens <= n and b.tokens * m * spaces_gpu.SECONDS_PER_TOKEN_PER_MODE \
                <= b.seconds - spaces_gpu.BASE_SECONDS + 1
    standin = zerogpu(quota_left=120)  # a fresh visitor without an account, on the GPU with the largest factor
    modes = ["ar", "dflash", "d3d-seq", "d3d-async"]
    out = list(ui.run_race(*race_args(modes=modes, max_new_tokens=512).values(), ui.empty_state()))
    status, *_, state = out[-1]
    assert status.startswith("**Done**"), status
    assert standin.asked and max(standin.asked) <= 120
    cap = spaces_gpu.gpu_budget(4, 512).tokens
    assert f"{cap} new tokens per mode instead of 512" in status  # said in the UI
    assert any(f"{cap} new tokens per mode instead of 512" in str(o[0]) for o in out if str(o[0]).startswith("Running"))
    assert all(len(state["traces"][m].output_ids) <= cap for m in modes)
    monkeypatch.setenv("D3D_GPU_QUOTA_S", "300")  # a Space whose visitors sign in may ask more
    assert spaces_gpu.gpu_budget(4, 512).tokens == 512 and spaces_gpu.gpu_budget(4, 512).seconds <= 200
    monkeypatch.setenv("D3D_GPU_QUOTA_S", "lots")
    with pytest.raises(ValueError, match="D3D_GPU_QUOTA_S='lots' is not a whole number"):
        spaces_gpu.gpu_budget(1, 8)


# ----------------------------------------------------------------------------- 4. preload is mandatory


def test_no_bundle_is_loaded_from_a_request_on_zerogpu(zerogpu, monkeypatch):
    import app.ui as ui

    def boom(*a, **k):
        raise AssertionError("a bundle load was started from a request")

    def cuda(*a, **k):
        raise AssertionError("CUDA touched in the main process")

    zerogpu()
    monkeypatch.setattr(bundles, "_LOADED", {})  # preload off, or failed: nothing loaded
    monkeypatch.setattr(bundles, "_load", boom)
    for name in ("init", "mem_get_info", "Stream", "Event", "is_available"):
        monkeypatch.setattr(torch.cuda, name, cuda)
    monkeypatch.setattr(service, "_STARTUP_ONLY", False)
    service.load_at_startup_only()
    out = list(ui.run_race(*race_args().values(), ui.empty_state()))
    status = out[-1][0]
    assert status.startswith("**Error:** bundle 'toy' is not loaded, and this Space loads its bundles at start-up only"), status
    text, *_ = ui.measure_pruned("toy", ["L0 (initialised from target layer 0)"], ui.empty_state())
    assert "loads its bundles at start-up only" in text
    assert not torch.cuda.is_initialized()


PRELOAD_PROBE = """
import os, runpy, sys, torch
def boom(*a, **k):
    raise SystemExit("CUDA touched: " + repr(a)[:80])
torch.cuda.init = torch.cuda._lazy_init = torch.cuda.mem_get_info = boom  # (Stream/Event stay classes: code annotates with them)
sys.path.insert(0, os.getcwd())
try:
    runpy.run_path("app.py", run_name="space")
    from d3d_core import service
    print("started; loaded:", sorted(n for n, _ in __import__("d3d_core.models.bundles", fromlist=["x"])._LOADED))
    print("startup_only", service._STARTUP_ONLY)
except SystemExit as e:
    print("exit:", e)
print("cuda_initialized", torch.cuda.is_initialized())
"""


def probe(cwd, **env):
    e = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", **env)
    for k in ("D3D_BUNDLE", "D3D_BUNDLES"):
        if k not in env:
            e.pop(k, None)
    r = subprocess.run([sys.executable, "-c", PRELOAD_PROBE], cwd=cwd, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_preload_is_mandatory_on_zerogpu_and_a_failed_one_stops_the_space(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_space
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    make_space.write_space("zerogpu", tmp_path / "z")
    # the recipe with preload switched off in the Space's variables, the hub offline: it still tries, and stops
    out = probe(tmp_path / "z", SPACES_ZERO_GPU="true", D3D_PRELOAD="0")
    assert "exit: [d3d] ZeroGPU: bundle 'qwen3-8b' must load at start-up and could not:" in out and "hub is offline" in out, out
    assert "cuda_initialized False" in out and "started" not in out
    # preload off, a bundle that loads: loaded at start-up anyway, and requests may not load others
    out = probe(ROOT, SPACES_ZERO_GPU="true", D3D_PRELOAD="0", D3D_BUNDLE="toy", D3D_BUNDLES="toy")
    assert "started; loaded: ['toy']" in out and "startup_only True" in out and "cuda_initialized False" in out, out
    # off ZeroGPU nothing changes: no preload unless asked, and a failed one is a line in the log
    out = probe(ROOT, D3D_PRELOAD="0", D3D_BUNDLE="toy", D3D_BUNDLES="toy")
    assert "started; loaded: []" in out and "startup_only False" in out, out


# ----------------------------------------------------------------------------- 5. ZeroGPU's errors reach the status line


def test_an_aborted_worker_leaves_a_readable_status_and_the_partial_race(zerogpu, monkeypatch, tmp_path):
    import app.ui as ui

    standin = zerogpu(enforce=6.0)  # the worker is killed after 6 s, long before its race ends (as a reservation overrun)
    modes = ["ar", "d3d-seq"]
    prewarm(modes, budget_tokens(modes))
    slow_rounds(monkeypatch, tmp_path / "rounds.log", 0.1)
    before = runs.active()
    out = list(ui.run_race(*race_args(modes=modes).values(), ui.empty_state()))
    status, *cols, state = out[-1]
    assert status.startswith("**ZeroGPU worker error**: GPU task aborted — the GPU worker was stopped"), status
    n = sum(len(t.rounds) for t in state["traces"].values())
    assert n > 0 and f"the {n} rounds that reached this page are kept below" in status
    assert "Traceback" not in status and state["run"] is None and runs.active() == before
    assert all(state["traces"][m].rounds for m in modes) and any("tok" in c for c in cols)  # the columns show them
    pickle.dumps(state)
    assert not standin.workers[-1].is_alive()


@pytest.mark.parametrize("error, title, message", [
    (lambda: gr.Error("You have exceeded your ZeroGPU quota (80s requested vs. 41s left). Try again in 0:12:00.",
                      title="ZeroGPU quota exceeded"), "ZeroGPU quota exceeded", "80s requested vs. 41s left"),
    (lambda: gr.Error("No GPU was available", title="ZeroGPU client error"), "ZeroGPU client error", "every ZeroGPU GPU is busy"),
    (lambda: gr.Error("No GPU was available after 60s", title="ZeroGPU queue timeout"), "ZeroGPU queue timeout", "after 60s"),
    (lambda: RuntimeError("Connection closed by visitor while queueing"), "Error (RuntimeError)", "closed by visitor"),
])
def test_every_zerogpu_error_reaches_the_status_line(zerogpu, monkeypatch, error, title, message):
    import app.ui as ui

    zerogpu()
    def refused(*a, **k):  # what spaces raises in the handler when the GPU call is refused or fails
        raise error()
        yield

    monkeypatch.setattr(ui, "race_stream", refused)
    status, *_, state = list(ui.run_race(*race_args(modes=["ar"], max_new_tokens=16).values(), ui.empty_state()))[-1]
    assert status.startswith(f"**{title}**") and message in status and "no round had reached this page" in status, status
    assert state["run"] is None


def test_a_quota_refusal_from_the_stand_in_reaches_the_status_line(zerogpu):
    import app.ui as ui

    standin = zerogpu(quota_left=20)  # a visitor who has used most of the day's quota
    status, *_, state = list(ui.run_race(*race_args(modes=["ar"], max_new_tokens=96).values(), ui.empty_state()))[-1]
    assert status.startswith("**ZeroGPU quota exceeded**: You have exceeded your ZeroGPU quota") and "s left" in status, status
    assert standin.workers == [] and state["traces"] == {} and state["run"] is None


# ----------------------------------------------------------------------------- 6. warm-up: once per worker, trimmed on a GPU


def test_the_warm_up_is_paid_once_per_process_and_trimmed_off_the_cpu(monkeypatch, toy):
    import app.ui as ui

    monkeypatch.setattr(service, "_WARM", set())
    base = service.settings("ar", 4, 0, 8, 2, "match", 0, "adaptive", "always")
    first = list(ui._race_stream(PROMPT, "toy", ["ar", "d3d-seq"], base, None, None, "d3d", "fp32"))
    assert first[0][3]["warm_s"] > 0  # a new worker's first race warms, and says how long it took

    class NoLock:
        def __enter__(self):
            raise AssertionError("a lock was taken on a warm process's race path")

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(service, "_WARM_LOCK", NoLock())
    monkeypatch.setattr(bundles, "_LOCK", NoLock())  # nor the loader's: the bundle is loaded
    again = list(ui._race_stream(PROMPT, "toy", ["ar", "d3d-seq"], base, None, None, "d3d", "fp32"))
    assert again[0][3]["warm_s"] == 0.0  # cached: the same worker's next race skips it, without a lock
    assert service.warms_shapes("cpu") and not service.warms_shapes("cuda") and not service.warms_shapes(torch.device("meta"))
    # on a GPU only the bundle's warm-up runs, once: no per-shape sweep inside the paid window
    monkeypatch.setattr(service, "_WARM", set())
    monkeypatch.setattr(service, "_WARM_LOCK", threading.Lock())
    monkeypatch.setattr(service, "warms_shapes", lambda device: False)
    monkeypatch.setattr(service, "warm_shapes", lambda *a, **k: pytest.fail("per-shape warm-up on a GPU"))
    warmed = []
    real_warm_up = service.warm_up
    monkeypatch.setattr(service, "warm_up", lambda b, drafter=None: warmed.append(drafter) or real_warm_up(b, drafter=drafter))
    list(ui._race_stream(PROMPT, "toy", ["ar", "d3d-async"], base.with_(block_size=6), None, None, "d3d", "fp32"))
    list(ui._race_stream(PROMPT, "toy", ["dflash"], base.with_(block_size=5, hypotheses=3), None, None, "d3d", "fp32"))
    assert warmed == [None]


# ----------------------------------------------------------------------------- 7. concurrency


def test_concurrency_is_chosen_and_said(monkeypatch, toy):
    import app.ui as ui

    assert ui.decode_concurrency() == 1  # CPU: races share the cores
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    assert ui.decode_concurrency() == spaces_gpu.ZEROGPU_CONCURRENCY > 1
    note = ui.zerogpu_note()
    assert f"{spaces_gpu.ZEROGPU_CONCURRENCY} races run at once" in note and f"at most {spaces_gpu.max_duration()} s" in note
    wait = -(-16 // spaces_gpu.ZEROGPU_CONCURRENCY) * spaces_gpu.max_duration() / 60
    assert f"about {wait:.0f} min" in note
    monkeypatch.setenv("D3D_GPU_CONCURRENCY", "0")
    with pytest.raises(ValueError, match="D3D_GPU_CONCURRENCY=0 is out of range: use 1 to 16"):
        ui.decode_concurrency()


# ----------------------------------------------------------------------------- 8. front matter


# The Spaces configuration reference (hub-docs docs/hub/spaces-config-reference.md, August 2026): every accepted key,
# plus `license` (repositories-licenses.md: any repo's card); the valid hardware flavors; the ZeroGPU page's versions.
CONFIG_KEYS = {"title", "emoji", "colorFrom", "colorTo", "sdk", "python_version", "sdk_version", "suggested_hardware",
               "suggested_storage", "app_file", "app_build_command", "app_port", "base_path", "fullWidth", "header",
               "short_description", "models", "datasets", "tags", "thumbnail", "pinned", "hf_oauth", "hf_oauth_scopes",
               "hf_oauth_expiration_minutes", "hf_oauth_authorized_org", "disable_embedding", "startup_duration_timeout",
               "custom_headers", "preload_from_hub", "license"}
COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
HARDWARE = {"cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1", "l40sx4", "l40sx8", "a10g-small",
            "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large", "a100x4", "a100x8"}
ZEROGPU_PYTHON = {"3.12.12", "3.10.13"}
ZEROGPU_TORCH = {"2.8.0", "2.9.1", "2.10.0", "2.11.0"}


def test_the_recipes_front_matter_uses_documented_values_only(tmp_path):
    import re

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_space
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    for kind in make_space.KINDS:
        make_space.write_space(kind, tmp_path / kind)
        meta = yaml.safe_load((tmp_path / kind / "README.md").read_text(encoding="utf-8").split("---")[1])
        assert set(meta) <= CONFIG_KEYS, set(meta) - CONFIG_KEYS
        assert meta["sdk"] in ("gradio", "docker", "static") and {meta["colorFrom"], meta["colorTo"]} <= COLORS
        assert re.fullmatch(r"3\.\d+(\.\d+)?", str(meta["python_version"]))
        assert "suggested_hardware" not in meta or meta["suggested_hardware"] in HARDWARE
        assert "startup_duration_timeout" not in meta or re.fullmatch(r"\d+[hm]", meta["startup_duration_timeout"])
        if kind == "zerogpu":
            assert meta["python_version"] in ZEROGPU_PYTHON and "suggested_hardware" not in meta
            reqs = (tmp_path / kind / "requirements.txt").read_text().splitlines()
            assert next(r for r in reqs if r.startswith("torch==")).split("==")[1] in ZEROGPU_TORCH
            assert spaces_gpu.SPACES_PIN in reqs  # the release this code was checked against
            readme = (tmp_path / kind / "README.md").read_text(encoding="utf-8")
            assert "Pick *ZeroGPU* as this Space's hardware" in readme and f"at most {spaces_gpu.max_duration()} s" in readme


# ----------------------------------------------------------------------------- 9. fork-safe, and updates that do not grow


def test_a_worker_forked_while_the_loader_and_warm_locks_are_held_still_races(zerogpu):
    import app.ui as ui

    # another server thread holds the loader's, the warm-up's, live τ's and the run registry's locks when the worker is
    # forked: copies of held locks would stay held in the worker forever (until the reservation kills it), so the
    # worker must start with free ones (and this worker must warm up, so it takes the warm-up's)
    zerogpu(held_at_fork=(bundles._LOCK, service._WARM_LOCK, service._TAU_LOCK, runs._LOCK))
    status = list(ui.run_race(*race_args(modes=["ar", "d3d-seq"], max_new_tokens=24, block_size=3).values(), ui.empty_state()))[-1][0]
    assert status.startswith("**Done**"), status


def test_each_update_carries_only_the_new_rounds(zerogpu):
    import app.ui as ui

    standin = zerogpu()
    modes = ["ar", "d3d-async"]
    out = list(ui.run_race(*race_args(modes=modes, hypotheses=2).values(), ui.empty_state()))
    status, *_, state = out[-1]
    assert status.startswith("**Done**"), status
    seen, body = set(), {m: [] for m in modes}
    for size, (mode, update, done, info) in standin.update_bytes:
        if mode in seen and not done:  # not a mode's first update (its prompt) nor its last (its spans and stats, once)
            body[mode].append(size)
        seen.add(mode)
    n_rounds = len(state["traces"]["ar"].rounds)
    assert n_rounds > 100 and len(body["ar"]) >= n_rounds - 2  # one update per round
    steady = body["ar"][1:]  # from the second round on, an update holds the previous round again and the new one
    assert max(steady) - min(steady) <= 64, (steady[:5], steady[-5:])  # the 300th costs what the 3rd did
    early, late = body["d3d-async"][:20], body["d3d-async"][-20:]
    assert max(late) <= 2 * max(early), (early, late)
    whole = len(pickle.dumps(state["traces"]["ar"]))
    assert max(body["ar"]) * 10 < whole  # an update is a small part of a whole trace
    # the rebuilt traces are the engine's: lossless against each other, and valid traces
    a, d = state["traces"]["ar"], state["traces"]["d3d-async"]
    assert a.output_ids == d.output_ids and len(a.rounds) == len(a.output_ids) - 1
    assert sum(len(r.committed) for r in d.rounds) == len(d.output_ids) - 1
    service.read_traces(service.traces_json([a, d]))


def test_merge_refuses_updates_out_of_order(toy):
    from d3d_core.decoding.engine import decode

    tr = decode(toy, [5, 6, 7], service.settings("ar", 4, 0, 6))
    first, sent = spaces_gpu.trace_delta(dataclasses.replace(tr, rounds=tr.rounds[:2], output_ids=tr.output_ids[:3]), None)
    second, _ = spaces_gpu.trace_delta(tr, sent)
    assert spaces_gpu.merge_delta(spaces_gpu.merge_delta(None, first), second).output_ids == tr.output_ids
    with pytest.raises(ValueError, match="without the ones before it"):
        spaces_gpu.merge_delta(None, second)
    with pytest.raises(ValueError, match="does not follow the previous one"):
        spaces_gpu.merge_delta(spaces_gpu.merge_delta(None, first), (second[0], 99, second[2]))
