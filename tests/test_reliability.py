"""Reliability and safety: bad input, concurrent users, cancellation, memory, network, determinism."""

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import api_message, engine, free_port

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.trace import MODES

ROOT = Path(__file__).resolve().parent.parent
RACE = dict(prompt="what is two plus two?", bundle="toy", modes=list(MODES), block_size=4, temperature=0, max_new_tokens=32,
            hypotheses=8, sampling="match", seed=0, verify="adaptive", drafting="gated", use_pruned=False)


@pytest.fixture(scope="module")
def server(app_server):
    return app_server


def _client(url):
    from d3d_core.measure.client import app_client

    return app_client(url)


# ----------------------------------------------------------------------------- 1. bad input


BAD_RACE_INPUTS = {
    "prompt": [("", "prompt is empty"), ("   \n\t", "prompt is empty"), ("x" * 100_000, "too long"),
               ("a" * 1500, "too long for the context"), ("\x00\x01\x02", "prompt is empty")],
    "numbers": [("block_size", 0), ("block_size", 17), ("block_size", "eight"), ("hypotheses", 0), ("hypotheses", 33),
                ("temperature", -0.5), ("temperature", 2.5), ("temperature", "hot"), ("max_new_tokens", 0), ("max_new_tokens", 100_000),
                ("max_new_tokens", "many"), ("seed", -3)],
    "names": [("bundle", "gpt-5"), ("modes", ["ar", "warp"]), ("modes", []), ("sampling", "nucleus"), ("drafting", "sometimes")],
}


def test_bad_race_inputs_get_messages_and_the_server_keeps_serving(server):
    _, url = server
    c = _client(url)
    handled = {}
    for prompt, expect in BAD_RACE_INPUTS["prompt"]:
        m = api_message(c, "/race", *dict(RACE, prompt=prompt).values())
        assert expect in m and "Traceback" not in m, (prompt[:20], m)
        handled["prompt"] = handled.get("prompt", 0) + 1
    for key, val in BAD_RACE_INPUTS["numbers"] + BAD_RACE_INPUTS["names"]:
        m = api_message(c, "/race", *dict(RACE, **{key: val}).values())
        assert ("Error" in m or "error" in m or "AppError" in m) and "Traceback" not in m, (key, val, m)
        handled[key] = handled.get(key, 0) + 1
    ok = c.predict(*RACE.values(), api_name="/race")[0]
    assert ok.startswith("**Done**")
    print("\nbad race inputs handled cleanly:", json.dumps(handled))


def test_lone_surrogates_and_control_characters_are_dropped(toy):
    """(A JSON client cannot even send lone surrogates; a browser can, escaped. The engine drops them.)"""
    tr = decode(toy, "\udc80hi\x07 there\ud800", DecodeConfig(mode="ar", max_new_tokens=4))
    assert tr.prompt_text == "\udc80hi\x07 there\ud800"  # what the user typed is kept for display...
    assert toy.tokenizer.encode_prompt("\udc80hi\x07 there\ud800") == toy.tokenizer.encode_prompt("hi there")  # ...not encoded
    from d3d_core.decoding.trace import Trace

    Trace.from_json(tr.to_json())  # and the trace still serialises


def test_emoji_and_rtl_survive_the_app(server):
    _, url = server
    c = _client(url)
    text = "hi 😀 שלום"
    c.predict(*dict(RACE, prompt=text, modes=["ar"]).values(), api_name="/race")
    path = c.predict(api_name="/download_traces")
    assert json.loads(Path(path).read_text(encoding="utf-8"))["traces"][0]["prompt_text"] == text


@pytest.mark.slow
def test_emoji_and_rtl_round_trip_through_the_real_tokenizer(smollm):
    text = "Translate 😀🚀 and שלום עולם and مرحبا"
    ids = smollm.tokenizer.encode_prompt(text)
    assert text in smollm.tokenizer.decode(ids)


HOSTILE_TRACES = {
    "non-JSON": b"this is not json",
    "invalid UTF-8": b"\xff\xfe\x00garbage",
    "wrong top-level type": b"[1, 2, 3]",
    "wrong field types": json.dumps({"mode": "ar", "bundle": 3, "config": [], "prompt_text": None, "prompt_ids": "x", "rounds": {},
                                     "spans": 1, "stats": "s"}).encode(),
    "huge arrays": json.dumps({"mode": "ar", "bundle": "b", "config": {}, "prompt_text": "", "prompt_ids": [1],
                               "output_ids": [1] * 200_000, "rounds": [], "spans": [], "stats": {}}).encode(),
    "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    "negative token ids": json.dumps({"mode": "ar", "bundle": "b", "config": {}, "prompt_text": "", "prompt_ids": [-5],
                                      "rounds": [], "spans": [], "stats": {}}).encode(),
    "span ends before start": json.dumps({"mode": "ar", "bundle": "b", "config": {}, "prompt_text": "", "prompt_ids": [1],
                                          "rounds": [], "spans": [{"lane": "target", "kind": "verify", "round": 0, "t_start": 5, "t_end": 1}],
                                          "stats": {}}).encode(),
}


def test_hostile_trace_uploads_get_messages(server, tmp_path):
    from gradio_client import handle_file

    _, url = server
    c = _client(url)
    for name, data in HOSTILE_TRACES.items():
        f = tmp_path / f"{name.replace(' ', '_')}.json"
        f.write_bytes(data)
        m = api_message(c, "/upload_trace", handle_file(str(f)))
        assert "Could not read that trace" in m and "Traceback" not in m, (name, m)
    assert c.predict(*RACE.values(), api_name="/race")[0].startswith("**Done**")
    print(f"\nhostile trace uploads handled cleanly: {len(HOSTILE_TRACES)}/{len(HOSTILE_TRACES)}")


def test_bad_drafter_files(toy, tmp_path):
    from d3d_core.models.loader import load_drafter

    d = toy.drafter("d3d")
    d.save(tmp_path / "ok")
    cases = {}
    (tmp_path / "missing").mkdir()
    cases["missing"] = tmp_path / "missing"
    import shutil

    shutil.copytree(tmp_path / "ok", tmp_path / "trunc")
    w = tmp_path / "trunc" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: len(w.read_bytes()) // 2])
    cases["truncated"] = tmp_path / "trunc"
    shutil.copytree(tmp_path / "ok", tmp_path / "shape")
    cfgj = json.loads((tmp_path / "shape" / "config.json").read_text())
    cfgj["num_layers"] = 3  # weights hold 2 layers
    (tmp_path / "shape" / "config.json").write_text(json.dumps(cfgj))
    cases["wrong shape"] = tmp_path / "shape"
    shutil.copytree(tmp_path / "ok", tmp_path / "arch")
    cfgj = json.loads((tmp_path / "arch" / "config.json").read_text())
    cfgj["arch"]["hidden_size"] = 96
    (tmp_path / "arch" / "config.json").write_text(json.dumps(cfgj))
    cases["other target"] = tmp_path / "arch"
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    cases["pickle only"] = tmp_path / "pickle"
    for name, path in cases.items():
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            load_drafter(path, toy.target.shared, toy.target.arch)
        assert str(e.value), name


# ----------------------------------------------------------------------------- 2. concurrency


def test_eight_users_three_runs_each_no_errors_no_cross_talk(server, toy):
    _, url = server
    users = []
    for u in range(8):
        runs = [dict(RACE, prompt=f"user {u} run {r}: tell me about {u * 3 + r}", modes=[MODES[(u + r) % 4], "ar"],
                     block_size=2 + (u + r) % 7, temperature=[0, 0.7][(u + r) % 2], sampling=["match", "rejection"][u % 2],
                     seed=u * 10 + r, max_new_tokens=24) for r in range(3)]
        users.append(runs)
    results, errors, lat = {}, [], []

    def work(u):
        c = _client(url)
        for r, req in enumerate(users[u]):
            t = time.perf_counter()
            try:
                c.predict(*req.values(), api_name="/race")
                lat.append(time.perf_counter() - t)
                path = c.predict(api_name="/download_traces")
                results[(u, r)] = json.loads(Path(path).read_text())["traces"]
            except Exception as e:  # noqa: BLE001 - every error counts
                errors.append((u, r, repr(e)))

    threads = [threading.Thread(target=work, args=(u,)) for u in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(results) == 24
    for (u, r), traces in results.items():
        req = users[u][r]
        for tr in traces:
            with engine(toy.target, tr["engine"] or "fast"):  # the app races on its default engine (int4): decode alone on the same
                alone = decode(toy, req["prompt"], DecodeConfig(mode=tr["mode"], block_size=req["block_size"], temperature=req["temperature"],
                                                                max_new_tokens=24, hypotheses=8, sampling=req["sampling"], seed=req["seed"]))
            assert tr["prompt_text"] == req["prompt"]  # no cross-talk between sessions
            assert tr["output_ids"] == alone.output_ids, (u, r, tr["mode"])
    q = sorted(lat)
    print(f"\n8 users x 3 runs: 0 errors, latency p50 {statistics.median(q):.2f} s, p95 {q[int(0.95 * (len(q) - 1))]:.2f} s")


def test_queue_is_bounded_and_reports_position(server):
    demo, url = server
    assert demo._queue.max_size == 16
    c = _client(url)
    jobs = [c.submit(*dict(RACE, max_new_tokens=200, modes=list(MODES)).values(), api_name="/race") for _ in range(4)]
    ranks = set()
    deadline = time.time() + 120
    while time.time() < deadline and not all(j.done() for j in jobs):
        for j in jobs:
            st = j.status()
            if getattr(st, "rank", None) is not None:
                ranks.add(st.rank)
        time.sleep(0.05)
    for j in jobs:
        j.result()
    assert any(r >= 1 for r in ranks), ranks  # a waiting user is told where they are


# ----------------------------------------------------------------------------- 3. cancellation


def test_cancel_frees_the_worker_thread(toy):
    before = threading.active_count()
    n = {"k": 0}

    def cancel():
        n["k"] += 1
        return n["k"] > 2

    for _ in range(5):
        n["k"] = 0
        tr = decode(toy, "hello", DecodeConfig(mode="d3d-async", max_new_tokens=200), cancel=cancel)
        assert tr.finish_reason == "cancelled"
    time.sleep(0.2)
    assert threading.active_count() <= before
    assert decode(toy, "hello", DecodeConfig(mode="d3d-async", max_new_tokens=20)).finish_reason == "length"


# ----------------------------------------------------------------------------- 4. memory


def test_fifty_runs_memory_and_threads(server):
    import psutil

    _, url = server
    c = _client(url)
    proc = psutil.Process()
    from app.health import _pool_of, thread_census

    rss, threads = [], []
    before = None
    for i in range(50):
        c.predict(*dict(RACE, prompt=f"run {i}: count with me", max_new_tokens=48).values(), api_name="/race")
        rss.append(proc.memory_info().rss / 2**20)
        threads.append(threading.active_count())
        if before is None:  # after the first race: the client's and the server's long-lived threads have started
            before = set(threading.enumerate())
    growth = (rss[-1] - rss[0]) / rss[0]
    print(f"\n50 runs: RSS after run 1 {rss[0]:.0f} MiB, after run 50 {rss[-1]:.0f} MiB ({growth:+.1%}); "
          f"curve every 10: {[round(x) for x in rss[::10]]}; threads {threads[0]} -> {threads[-1]}")
    assert growth < 0.10
    # threads, exactly rather than by count (pools grow and shrink on demand): every thread started since the first
    # race either belongs to a named pool within its maximum or ends once its job is done; a leaked one never ends
    census = thread_census()
    assert all(census["pools"].get(p, 0) <= census["pool_max"][p] for p in ("gradio-workers", "drafter-lane")), census
    new = [t for t in threading.enumerate() if t not in before and _pool_of(t) is None]
    for t in new:
        t.join(10)
    # a concurrent.futures pool (gradio_client's job pool here) keeps idle workers up to its max_workers: a pool
    pooled = [t for t in new if getattr(getattr(t, "_target", None), "__module__", "") == "concurrent.futures.thread"]
    executors: dict = {}
    for t in pooled:
        ex = t._args[0]()  # the worker's weak reference to its executor
        if ex is not None:
            executors.setdefault(id(ex), [ex, 0])[1] += 1
    assert all(n <= ex._max_workers for ex, n in executors.values()), executors
    assert not [t.name for t in new if t.is_alive() and t not in pooled], [t.name for t in new]


# ----------------------------------------------------------------------------- 5. network and files

AUDIT = r'''
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
attempts = []
_orig_connect = socket.socket.connect
def guarded(self, addr):
    host = addr[0] if isinstance(addr, tuple) else str(addr)
    if not (str(host).startswith("127.") or host in ("localhost", "::1") or self.family == socket.AF_UNIX):
        attempts.append(str(addr))
        raise OSError("outbound connection refused by the audit")
    return _orig_connect(self, addr)
socket.socket.connect = guarded
_orig_getaddrinfo = socket.getaddrinfo
def gai(host, *a, **k):
    if host not in ("127.0.0.1", "localhost", "::1", None):
        attempts.append("dns:" + str(host))
        raise OSError("dns refused by the audit")
    return _orig_getaddrinfo(host, *a, **k)
socket.getaddrinfo = gai
import torch
def no_pickle(*a, **k):
    raise RuntimeError("torch.load called: pickle weights are not allowed")
torch.load = no_pickle
os.environ.pop("HF_HUB_OFFLINE", None)  # nothing may *need* the hub, offline flag or not
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
from d3d_core.models.bundles import get_bundle
from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
b = get_bundle("smollm2-135m")
for m in ["ar", "dflash", "d3d-seq", "d3d-async"]:
    decode(b, "Say hello.", DecodeConfig(mode=m, max_new_tokens=8))
import runpy, urllib.request
demo = runpy.run_path(os.path.join(sys.argv[1], "app.py"), run_name="audit")["demo"]
demo.launch(server_name="127.0.0.1", server_port=int(sys.argv[2]), prevent_thread_lock=True)
url = f"http://127.0.0.1:{sys.argv[2]}/"
page = urllib.request.urlopen(url, timeout=30).status
codes = {}
for path in ["gradio_api/file=/etc/passwd", "file=/etc/passwd", "gradio_api/file=" + os.path.join(sys.argv[1], "d3d_core", "engine.py")]:
    try:
        codes[path] = urllib.request.urlopen(url + path, timeout=30).status
    except Exception as e:
        codes[path] = getattr(e, "code", str(e))
demo.close()
print(json.dumps({"attempts": attempts, "page": page, "codes": codes}))
'''


@pytest.mark.slow
def test_no_outbound_connections_no_pickle_no_stray_files(tmp_path):
    script = tmp_path / "audit.py"
    script.write_text(AUDIT)
    env = dict(os.environ)
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), str(ROOT), str(free_port())], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\noutbound-connection audit: {len(res['attempts'])} attempts {res['attempts'][:5]}; took {time.perf_counter() - t:.0f} s; files: {res['codes']}")
    assert res["attempts"] == []
    assert res["page"] == 200
    for path, code in res["codes"].items():
        assert code != 200, path  # nothing outside the app's own assets is served


def test_no_remote_code_and_no_pickle_loading_in_sources():
    src = "\n".join(p.read_text() for p in list((ROOT / "d3d_core").glob("*.py")) + list((ROOT / "app").glob("*.py")) + [ROOT / "app.py"])
    assert "trust_remote_code=True" not in src
    assert "torch.load(" not in src and "pickle.load" not in src


# ----------------------------------------------------------------------------- 6. determinism


def _strip_times(d):
    d = json.loads(json.dumps(d))
    # the same spans (lane, kind, round); their order by start time may differ between two async runs
    d["spans"] = sorted((s["lane"], s["kind"], s["round"]) for s in d["spans"])
    for k in ("tokens_per_s", "wall_time_s", "prefill_time_s", "decode_time_s", "target_busy_s", "drafter_busy_s", "overlap"):
        d["stats"].pop(k, None)
    return d


@pytest.mark.parametrize("temperature, rule", [(0.0, "match"), (0.9, "match"), (0.9, "rejection")])
def test_same_seed_same_tokens_and_trace(toy, temperature, rule):
    for m in MODES:
        cfg = DecodeConfig(mode=m, temperature=temperature, sampling=rule, seed=42, max_new_tokens=40, block_size=4, hypotheses=8)
        a, b = decode(toy, "determinism please", cfg), decode(toy, "determinism please", cfg)
        assert a.output_ids == b.output_ids
        da, db = _strip_times(a.to_dict()), _strip_times(b.to_dict())
        assert da == db, m
