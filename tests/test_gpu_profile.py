"""A GPU check's JSON as a **measured** GPU profile of the latency model (issue 34, item 7's last sentence).

``python scripts/gpu_check.py`` writes a JSON; committed under ``docs/gpu/`` it becomes a cost profile named after the
GPU it ran on, offered (service.cost_profiles, the Timeline's clocks, the projection) before the assumed GPU profiles.
A dry run (toy shapes, on the CPU) is never offered as one, and a malformed file is one sentence, not a traceback.
No GPU has run the check yet: the GPU file here is a dry run's output with its device rewritten.
"""

import contextlib
import json
import os
import time

import pytest

from d3d_core import service
from d3d_core.measure import latency
from d3d_core.measure.latency import GPU_DOCS, PRESETS, load_gpu_check, measured_gpu_profiles, per_token_ms

# ``python scripts/gpu_check.py --dry-run --out F.json`` on this machine (floats rounded, the oracle cut to one cell)
DRY_RUN = json.loads(
    '{"profile": "dry-run (toy shapes on the CPU: not GPU figures)", "device": "cpu", "dtype": "torch.float32", '
    '"shapes": {"target": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, '
    '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": false}, '
    '"standalone_drafter": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, '
    '"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": true}, "vocab": '
    '256}, "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.23.0", "cuda": null, "gpu": '
    'null, "gpu_memory_gib": null, "platform": "Linux-x86_64", "cpu_threads": 1}, "costs": {"ctx_len": 48, '
    '"repeats": 3, "B": 8, "verify_ms": {"1": 3.644, "4": 4.264, "8": 4.277}, "drafters": {"standalone": '
    '{"describe": "D3D standalone drafter, 2 layers (own width 48, embedding and LM head)", "params": 52592, '
    '"draft_ms": 3.118, "packed_ms": {"1": 3.12, "2": 3.97}, "concurrent_ms": {"1": {"verify": 9.489, "packed": '
    '8.175, "round": 9.56, "clock": "cpu: perf_counter, two host threads"}, "2": {"verify": 7.894, "packed": 3.362,'
    ' "round": 7.938, "clock": "cpu: perf_counter, two host threads"}}, "draft_per_verify": 0.729}, "adapter": '
    '{"describe": "D3D shared-weight adapter drafter, 4 layers (the target\'s own, + rank-8 adapters, untrained '
    'adapters: draft 1 = target\'s token)", "params": 156416, "draft_ms": 7.726, "packed_ms": {"1": 4.071, "2": '
    '8.175}, "concurrent_ms": {"1": {"verify": 2.455, "packed": 3.851, "round": 10.496, "clock": "cpu: '
    'perf_counter, two host threads"}, "2": {"verify": 2.442, "packed": 3.942, "round": 10.273, "clock": "cpu: '
    'perf_counter, two host threads"}}, "draft_per_verify": 1.806}}, "step_ms": 3.644}, "async_beats_seq": [], '
    '"done": true, "oracle": [{"drafter": "standalone", "describe": "D3D standalone drafter, 2 layers (own width '
    '48, embedding and LM head)", "tau": 2, "hit_rate": 0.0, "H": 2, "B": 8, "seq_ms_per_token": [1.989, 2.086, '
    '3.011], "async_ms_per_token": [3.079, 3.353, 4.536], "overlap": [0.522, 0.477, 0.471], "hits": [0.0, 0.0, '
    '0.0], "repeats": 3, "seq_median": 2.086, "async_median": 3.353, "async_over_seq_speed": 0.622, "async_wins": '
    'false, "realised_hit_rate": 0.0, "overlap_median": 0.477}]}'
)

H100 = "NVIDIA H100 80GB HBM3"


def as_gpu_run(data: dict, gpu: str = H100, date: str = "2026-12-06T12:00:00Z") -> dict:
    """The dry run as the GPU check writes it on a GPU: profile "gpu", a CUDA device, the GPU's name and a date."""
    d = json.loads(json.dumps(data))
    d.update(profile="gpu", device="cuda", dtype="torch.bfloat16", created_utc=date)
    d["versions"].update(gpu=gpu, cuda="12.8", torch="2.11.0+cu128")
    return d


def _write(folder, name: str, data) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_a_gpu_checks_json_is_a_measured_profile_named_after_its_gpu(tmp_path):
    folder = tmp_path / "docs" / "gpu"
    _write(folder, "h100.json", as_gpu_run(DRY_RUN))
    profiles, notes = measured_gpu_profiles(folder)
    assert notes == []
    (name, p), = profiles.items()
    assert name == p.name == f"{H100} (measured, gpu_check 2026-12-06)"
    assert p.measured and p.extra["gpu"] == H100 and p.extra["gpu_check"] == "h100.json"
    assert "measured: python scripts/gpu_check.py on NVIDIA H100" in p.source and "derived" not in p.source
    c = DRY_RUN["costs"]
    sd = c["drafters"]["standalone"]
    assert p.t_step_ms == c["step_ms"] and p.t_verify_ms == {int(k): v for k, v in c["verify_ms"].items()}
    assert p.t_packed_ms == {1: sd["packed_ms"]["1"], 2: sd["packed_ms"]["2"]} and p.packed_block == c["B"]
    assert set(p.t_draft_d3d_ms.values()) == {sd["draft_ms"]}  # timed at B = 8, standing for every B
    # the DFlash draft is not timed by the check: the step scaled by weight bytes, here 4 toy layers (of the target's 4)
    # + the feature projection + the head over 4 layers + the head: (4·36864 + 4·64² + 256·64) / (4·36864 + 256·64) = 1.1
    assert p.at(p.t_draft_dflash_ms, 8) == pytest.approx(c["step_ms"] * 1.1)
    assert "not timed by the check" in p.assumptions
    assert p.extra["contention"][1] == pytest.approx({"verify": sd["concurrent_ms"]["1"]["verify"] / c["verify_ms"]["8"],
                                                      "packed": sd["concurrent_ms"]["1"]["packed"] / sd["packed_ms"]["1"]})
    assert per_token_ms(p, "d3d-async", 8, 3.0, 0.5, 2) > 0
    # the adapter drafter's costs price it instead when asked
    a = load_gpu_check(folder / "h100.json", drafter="adapter")
    assert a.at(a.t_draft_d3d_ms, 8) == c["drafters"]["adapter"]["draft_ms"]


def test_the_gpu_name_may_be_the_device_field_and_the_date_the_files(tmp_path):
    d = as_gpu_run(DRY_RUN)
    d["device"], d["versions"]["gpu"] = H100, None
    del d["created_utc"]  # a check written before the field existed: the file's date
    p = _write(tmp_path, "old.json", d)
    t = time.mktime((2026, 12, 1, 12, 0, 0, 0, 0, -1))
    os.utime(p, (t, t))
    assert load_gpu_check(p).name == f"{H100} (measured, gpu_check 2026-12-01)"


def test_a_dry_run_is_refused_with_a_clear_reason(tmp_path):
    folder = tmp_path / "gpu"
    _write(folder, "dry.json", DRY_RUN)
    profiles, notes = measured_gpu_profiles(folder)
    assert profiles == {}
    assert notes == ["dry.json is not offered as a GPU profile: a dry run of scripts/gpu_check.py (toy shapes on the CPU): "
                     "its timings are not GPU figures"]
    # toy shapes stay toy shapes even on a CUDA device (--dry-run --device cuda), and a CPU run is no GPU run
    on_cuda = {**DRY_RUN, "device": "cuda"}
    with pytest.raises(ValueError, match="a dry run .*toy shapes on cuda"):
        latency.profile_from_gpu_check(on_cuda, "x.json")
    with pytest.raises(ValueError, match="ran on the CPU, not on a GPU"):
        latency.profile_from_gpu_check({**as_gpu_run(DRY_RUN), "device": "cpu"}, "x.json")


@pytest.mark.parametrize("text,why", [
    ("{not json", "bad.json is not valid JSON"),
    ("[1, 2]", "bad.json is not a gpu_check result (a JSON object expected)"),
    (json.dumps({"profile": "gpu", "device": "cuda", "versions": {"gpu": H100}, "failed_steps": [{"step": "build", "error": "OOM"}]}),
     "bad.json has no cost table (costs.verify_ms): the check stopped before measuring costs (failed steps: build)"),
    (json.dumps({**as_gpu_run(DRY_RUN), "costs": {"verify_ms": {"1": 2.0}, "drafters": {}}}), "bad.json is a malformed gpu_check result"),
    (json.dumps({**as_gpu_run(DRY_RUN), "costs": {"verify_ms": {"one": 2.0}}}), "bad.json is a malformed gpu_check result"),
])
def test_a_malformed_file_is_one_clear_sentence(tmp_path, text, why):
    folder = tmp_path / "gpu"
    _write(folder, "bad.json", text)
    _write(folder, "good.json", as_gpu_run(DRY_RUN))  # a bad file costs nothing to the good one beside it
    profiles, notes = measured_gpu_profiles(folder)
    assert len(profiles) == 1 and len(notes) == 1
    assert notes[0].startswith(why) and "\n" not in notes[0] and "Traceback" not in notes[0]
    with pytest.raises(ValueError) as e:
        load_gpu_check(folder / "bad.json")
    assert str(e.value) == notes[0]  # the same sentence, raised alone (the loader never chains the parse error)
    assert e.value.__cause__ is None


def test_this_repo_offers_no_measured_gpu_profile_yet_and_the_assumed_ones_say_so():
    assert GPU_DOCS.parts[-2:] == ("docs", "gpu")
    gpu_files = sorted(GPU_DOCS.glob("*.json")) if GPU_DOCS.is_dir() else []
    assert len(latency.GPU_MEASURED) + len(latency.GPU_PROFILE_NOTES) == len(gpu_files)
    assumed = [p for p in PRESETS.values() if not p.measured]
    assert assumed and all(p.source.startswith("assumed, not measured") for p in assumed)


@contextlib.contextmanager
def _offered(profile):
    """PRESETS (the one dict the service and the app read) with ``profile`` where the loader puts a measured GPU
    profile: after this CPU's, before the assumed ones."""
    before = dict(PRESETS)
    cpu = {k: v for k, v in before.items() if v.measured}
    PRESETS.clear()
    PRESETS.update({**cpu, profile.name: profile, **{k: v for k, v in before.items() if k not in cpu}})
    try:
        yield
    finally:
        PRESETS.clear()
        PRESETS.update(before)


def test_a_measured_gpu_profile_is_offered_before_the_assumed_ones_everywhere(tmp_path):
    p = load_gpu_check(_write(tmp_path, "h100.json", as_gpu_run(DRY_RUN)))
    with _offered(p):
        names = list(service.cost_profiles())
        assert names.index(p.name) < min(i for i, n in enumerate(names) if "(derived)" in n)
        clocks = service.clock_names()
        assert clocks[1] == p.name and all("(derived)" in n for n in clocks[2:])  # the CPU profile is "measured here"
        assert "measured: python scripts/gpu_check.py" in service.clock_assumptions(p.name)
        assert service.retimed([], p.name) == ([], p.name)
        assert [r["mode"] for r in service.project(p.name, 8, 3.0, 0.5, 2)][0] == "ar"
        from app.ui import project_speedups

        fig, src = project_speedups(p.name, 8, 1.0, 0.5, 2, 1.0, 1.0, 1.0)
        assert src.startswith(f"**{p.name}** — source: measured")  # sliders at 1: the profile itself, not "(scaled)"
        fig, src = project_speedups(p.name, 8, 1.0, 0.5, 2, 1.5, 1.0, 1.0)
        assert src.startswith(f"**{p.name} (scaled)** — source: measured")  # the what-if sliders scale a copy
    assert p.name not in service.cost_profiles()
