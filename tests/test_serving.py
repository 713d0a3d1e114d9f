"""Hardware-aware serving and Spaces that work per their documentation (issue #34, items 3 and 4), on this CPU host:
no GPU-only bundle offered or loaded without CUDA, a memory check before every load, session state that pickles,
cancelling through a run id the server owns, the bundle loaded before the GPU window, no CUDA at import, and the
deployment recipes of scripts/make_space.py."""

import importlib.machinery
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from d3d_core import service
from d3d_core.models import bundles, hardware, sources

ROOT = Path(__file__).resolve().parent.parent
ARGS = dict(prompt="what is two plus two?", bundle="toy", modes=["ar", "dflash", "d3d-seq", "d3d-async"], block_size=4, temperature=0,
            max_new_tokens=24, hypotheses=4, sampling="match", seed=0, verify="adaptive", drafting="gated", use_pruned=False)


def race(ui, state=None, **over):
    """Every (status, state) the race handler yields, called the way Gradio calls it."""
    a = dict(ARGS, **over)
    out = []
    for item in ui.run_race(*a.values(), state if state is not None else ui.empty_state()):
        out.append((item[0], pickle.loads(pickle.dumps(item[-1]))))  # each state as Gradio gets it then: it must pickle
    return out


@pytest.fixture
def no_load(monkeypatch):
    """Any load or download fails the test."""

    def boom(*a, **k):
        raise AssertionError("a bundle load or download was started")

    for name in ("_load", "load_bundle", "load_qwen3_bundle"):
        monkeypatch.setattr(bundles, name, boom)
    for name in ("resolve", "target_config", "load_smollm2", "load_target"):
        monkeypatch.setattr(sources, name, boom)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", boom)


# ----------------------------------------------------------------------------- item 3: hardware-aware serving


def test_this_cpu_host_offers_no_gpu_bundle():
    assert not torch.cuda.is_available()  # the premise: this host has no CUDA
    import gradio as gr

    from app.ui import build_demo

    names = service.bundle_names()
    assert "qwen3-8b" not in names and "smollm2-135m" in names
    demo = build_demo()
    dropdown = next(b for b in demo.blocks.values() if isinstance(b, gr.Dropdown) and str(b.label).startswith("Bundle"))
    assert [v for _, v in dropdown.choices] == names
    assert service.app_bundle() == "smollm2-135m"


def test_a_gpu_host_offers_it(monkeypatch, no_load):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "qwen3-8b" in service.bundle_names()
    monkeypatch.setenv("D3D_BUNDLES", "qwen3-8b")
    monkeypatch.setenv("D3D_BUNDLE", "qwen3-8b")
    assert service.bundle_names() == ["qwen3-8b"] and service.app_bundle() == "qwen3-8b"


def test_zerogpu_counts_as_a_gpu_without_touching_cuda(monkeypatch):
    def boom():
        raise AssertionError("CUDA was asked in ZeroGPU's main process")

    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(torch.cuda, "mem_get_info", boom)
    assert hardware.gpu_available() and "qwen3-8b" in service.bundle_names()
    check = hardware.memory_check("qwen3-8b", bundles.BUNDLES["qwen3-8b"].params, torch.bfloat16, "cuda")
    assert check.fits and check.where == "GPU memory"


def test_a_gpu_only_bundle_is_refused_on_cpu_before_any_load(no_load, tmp_path):
    import app.ui as ui

    msg = "runs on a CUDA GPU only and this server has none"
    with pytest.raises(hardware.BundleUnavailable, match=msg):
        bundles.get_bundle("qwen3-8b")
    for call in (lambda: service.bundle_summary("qwen3-8b"), lambda: service.pieces("qwen3-8b", []), lambda: service.check_bundle("qwen3-8b"),
                 lambda: list(service.race("qwen3-8b", "hi", ["ar"], service.settings("ar")))):
        with pytest.raises(ValueError, match="CUDA GPU only"):
            call()
    # the app's handlers (and so their API endpoints) answer with the sentence, no traceback
    (status, _), = race(ui, bundle="qwen3-8b")
    assert status.startswith("**Error:**") and "CUDA GPU only" in status and "Traceback" not in status
    _, text, *_ = ui.load_pruning("qwen3-8b", ui.empty_state())
    assert text.startswith("**Error:**") and "CUDA GPU only" in text
    text, *_ = ui.measure_pruned("qwen3-8b", ["L0 (initialised from target layer 0)"], ui.empty_state())
    assert "CUDA GPU only" in text
    # an uploaded trace naming the GPU bundle shows ids instead of loading it
    from d3d_core.decoding.trace import traces_from_json

    fixture = (ROOT / "tests" / "fixtures" / "toy_traces.json").read_text()
    trace_file = tmp_path / "t.json"
    trace_file.write_text(fixture.replace('"bundle": "toy"', '"bundle": "qwen3-8b"'))
    assert traces_from_json(trace_file.read_text())[0].bundle == "qwen3-8b"
    assert ui.upload_traces(str(trace_file), ui.empty_state())[0].startswith("**Loaded**")


def test_the_memory_check_refuses_a_load_that_does_not_fit(monkeypatch, no_load):
    import app.ui as ui

    monkeypatch.setattr(bundles, "_LOADED", {})  # nothing loaded yet: the next race must load its bundle
    monkeypatch.setattr(hardware, "available_ram_bytes", lambda: 50 << 20)
    with pytest.raises(hardware.BundleUnavailable) as e:
        bundles.get_bundle("toy")
    msg = str(e.value)
    assert msg.startswith("not enough memory to load bundle 'toy'") and "of RAM" in msg and "has 50 MiB free" in msg, msg
    statuses = [s for s, _ in race(ui)]
    assert statuses[-1].startswith("**Error:** not enough memory to load bundle 'toy'") and "Traceback" not in statuses[-1]
    # on a GPU the check reads the free GPU memory
    monkeypatch.setattr(hardware, "free_gpu_bytes", lambda device="cuda": 8 << 30)
    check = hardware.memory_check("bundle 'qwen3-8b'", bundles.BUNDLES["qwen3-8b"].params, torch.bfloat16, "cuda")
    assert not check.fits and "GiB of GPU memory" in check.message() and "8.0 GiB free" in check.message()


def test_parameter_estimate_matches_qwen3_8b():
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    assert abs(hardware.estimate_params(cfg) - 8.19e9) < 0.01 * 8.19e9


# ----------------------------------------------------------------------------- item 4: Spaces per their documentation


def test_race_state_pickles_and_the_run_registry_empties(toy):
    import app.runs as runs
    import app.ui as ui

    before = runs.active()
    out = race(ui)
    assert out[-1][0].startswith("**Done**")
    assert out[-1][1]["run"] is None and isinstance(out[1][1]["run"], str)
    assert runs.active() == before
    assert pickle.loads(pickle.dumps(ui.empty_state())) == ui.empty_state()


def test_stop_stops_a_running_race_through_its_run_id(toy):
    import app.runs as runs
    import app.ui as ui

    gen = ui.run_race(*dict(ARGS, modes=["ar", "d3d-async"], max_new_tokens=400, drafting="always").values(), ui.empty_state())
    stopped_at = None
    last = None
    for item in gen:
        last = item
        if stopped_at is None and str(item[0]).startswith("Running"):
            state = item[-1]
            assert runs.get(state["run"]) is not None
            assert ui.stop_race(state).startswith("Stopping")
            stopped_at = len(state["traces"]["ar"].output_ids)
    status, *cols, state = last
    assert stopped_at is not None and status.startswith("**Stopped**")
    for m in ("ar", "d3d-async"):  # the modes race at once, taking turns: a stop ends every one within a round
        tr = state["traces"][m]
        assert tr.finish_reason == "cancelled" and len(tr.output_ids) < 400, m
    assert state["run"] is None
    assert ui.stop_race(ui.empty_state()).startswith("Stopping") and not runs.cancel("no-such-run")


def test_zerogpu_shape_bundle_loads_before_the_gpu_function_and_what_crosses_pickles(monkeypatch, toy):
    """With a stand-in ``spaces`` package (what ZeroGPU does at its boundary: pickle the arguments and every streamed
    item, ask the duration of the arguments), a race loads its bundle before entering the GPU function."""
    import app.ui as ui
    from app.spaces_gpu import maybe_gpu, stream_duration

    seen = []

    def GPU(duration=60):
        def deco(fn):
            def wrapper(*a, **k):
                seen.append({"loaded": ("toy", "cpu") in bundles._LOADED, "duration": duration(*a, **k) if callable(duration) else duration})
                pickle.dumps((a, k))
                for item in fn(*a, **k):
                    pickle.loads(pickle.dumps(item))
                    yield item
            return wrapper
        return deco

    fake = types.ModuleType("spaces")
    fake.GPU = GPU
    fake.__spec__ = importlib.machinery.ModuleSpec("spaces", None)
    monkeypatch.setitem(sys.modules, "spaces", fake)
    monkeypatch.setattr(ui, "race_stream", maybe_gpu(ui._race_stream, duration=stream_duration))
    monkeypatch.setattr(bundles, "_LOADED", {})  # so the race has to load the toy bundle itself
    out = race(ui, max_new_tokens=16)
    assert out[-1][0].startswith("**Done**"), out[-1][0]
    assert seen == [{"loaded": True, "duration": stream_duration(None, None, ARGS["modes"], service.settings(max_new_tokens=16))}]
    pickle.dumps(out[-1][1])


def test_gpu_duration_is_sized_from_the_request():
    from app.spaces_gpu import BASE_SECONDS, max_duration, race_duration, stream_duration

    small = stream_duration("p", "qwen3-8b", ["ar"], service.settings(max_new_tokens=32))
    big = stream_duration("p", "qwen3-8b", ["ar", "dflash", "d3d-seq", "d3d-async"], service.settings(max_new_tokens=256))
    assert BASE_SECONDS < small < big <= max_duration()
    assert race_duration("p", "b", ["ar"], 8, 0, 10_000) == max_duration()  # capped to the quota (tests/test_zerogpu.py)


CUDA_PROBE = """
import os, runpy, sys, torch
def boom(*a, **k):
    raise SystemExit("CUDA touched at import: " + repr(a)[:80])
torch.cuda.Stream = torch.cuda.Event = torch.cuda.init = torch.cuda.mem_get_info = boom
sys.path.insert(0, os.getcwd())
import app, app.ui  # noqa: E401
ns = runpy.run_path("app.py", run_name="space")
from d3d_core import service
print("bundles", ",".join(service.bundle_names()))
print("home", service.app_bundle())
print("cuda_initialized", torch.cuda.is_initialized())
"""


def probe(cwd, **env):
    e = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", **env)
    e.pop("D3D_BUNDLE", None), e.pop("D3D_BUNDLES", None)
    r = subprocess.run([sys.executable, "-c", CUDA_PROBE], cwd=cwd, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_importing_and_building_the_app_initialises_no_cuda():
    out = probe(ROOT)
    assert "cuda_initialized False" in out and "home smollm2-135m" in out and "qwen3-8b" not in out


def test_make_space_writes_each_recipe(tmp_path):
    import yaml

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_space
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    gradio = next(line.split("==")[1] for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("gradio=="))
    for kind in make_space.KINDS:
        out = tmp_path / kind
        assert make_space.main(["--kind", kind, "--out", str(out)]) == 0
        readme = (out / "README.md").read_text(encoding="utf-8")
        meta = yaml.safe_load(readme.split("---")[1])
        assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py" and str(meta["sdk_version"]) == gradio
        reqs = (out / "requirements.txt").read_text().splitlines()
        torch_pin = next(r for r in reqs if r.startswith("torch=="))
        if kind == "cpu":  # this repository as it is
            assert readme == (ROOT / "README.md").read_text(encoding="utf-8")
            assert (out / "assets" / "drafters" / "smollm2-135m" / "d3d" / "model.safetensors").is_file()
            assert not (out / "space-defaults.env").exists() and torch_pin == "torch==2.13.0"
            continue
        assert meta["python_version"] in ("3.10.13", "3.12.12") and meta.get("suggested_hardware") == make_space.HARDWARE[kind]
        assert "Qwen/Qwen3-8B" in meta["preload_from_hub"]
        major, minor = (int(x) for x in torch_pin.split("==")[1].split(".")[:2])
        assert (major, minor) >= (2, 8) and (major, minor) <= (2, 11), torch_pin  # what ZeroGPU runs
        assert any(r.startswith("spaces==") for r in reqs) == (kind == "zerogpu") and not any(r.startswith("gguf") for r in reqs)
        env = dict(line.split("=", 1) for line in (out / "space-defaults.env").read_text().splitlines())
        assert env["D3D_BUNDLE"] == "qwen3-8b" and env["D3D_PRELOAD"] == "1"
        assert (out / "d3d_core" / "models" / "hardware.py").is_file() and (out / "app" / "runs.py").is_file()
        assert not (out / "assets" / "drafters").exists() and not (out / "tests").exists()
        assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 5 * 2**20
    assert make_space.main(["--kind", "gpu", "--out", str(tmp_path / "gpu")]) == 2  # not empty: refused, one line
    assert make_space.main(["--kind", "gpu", "--out", str(ROOT / "out-space")]) == 2  # inside the repository


def test_the_zerogpu_recipe_starts_without_cuda_and_offers_qwen3(tmp_path):
    """The ZeroGPU recipe run as ZeroGPU's main process would (``SPACES_ZERO_GPU`` set, CUDA off limits): it offers and
    opens on qwen3-8b and builds the app without initialising CUDA; its start-up preload is mandatory there, so with the
    hub offline it stops with the reason in one line (tests/test_zerogpu.py runs the rest)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_space
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    make_space.write_space("zerogpu", tmp_path / "z")
    e = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", SPACES_ZERO_GPU="true")
    e.update(line.split("=", 1) for line in (tmp_path / "z" / "space-defaults.env").read_text().splitlines())  # as app.py reads it
    r = subprocess.run([sys.executable, "-c", CUDA_PROBE.replace('ns = runpy.run_path("app.py", run_name="space")', "")],
                       cwd=tmp_path / "z", env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bundles qwen3-8b\n" in r.stdout and "home qwen3-8b" in r.stdout and "cuda_initialized False" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "app.py"], cwd=tmp_path / "z", env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "ZeroGPU: bundle 'qwen3-8b' must load at start-up and could not" in r.stderr, r.stderr[-2000:]
    assert "hub is offline" in r.stderr and "Traceback" not in r.stderr
