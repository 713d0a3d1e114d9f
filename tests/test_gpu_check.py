"""scripts/gpu_check.py (issue 34, item 7): the pack stays under the GPU machine's 64 MiB and carries the wheels its
image lacks; --dry-run runs the whole check on the CPU, from that pack, with pydantic made unimportable as on that image."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    dest = tmp_path_factory.mktemp("gpu") / "pack"
    # --offline: wheels built from this venv's installed copies (hermetic and fast); the default fetches them for CPython 3.10-3.13
    r = subprocess.run([sys.executable, str(SCRIPT), "--pack", str(dest), "--offline"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return dest, r.stdout


def test_pack_is_under_64_mib_without_assets_and_lists_its_wheels(packed):
    dest, out = packed
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    assert total <= 64 * 2**20 and "MiB of 64 MiB" in out
    man = json.loads((dest / "MANIFEST.json").read_text())
    assert man["limit_bytes"] == 64 * 2**20 and man["total_bytes"] <= man["limit_bytes"]
    assert not (dest / "assets").exists() and (dest / "scripts" / "gpu_check.py").is_file()
    assert (dest / "d3d_core" / "decoding" / "engine.py").is_file()
    pk = {w["package"].lower(): w["version"] for w in man["wheels"]}
    assert set(pk) >= {"pydantic", "pydantic_core", "annotated_types", "typing_inspection"}
    assert all(pk[p] == v for p, v in man["pinned"].items())
    assert all((dest / "wheels" / w["file"]).is_file() for w in man["wheels"])


def test_pack_refuses_a_non_empty_folder_and_an_oversized_pack(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("x")
    assert gpu_check.pack(tmp_path / "x") == 2
    assert "not empty" in capsys.readouterr().err
    assert gpu_check.pack(tmp_path / "y", offline=True, limit=1024) == 2  # the code alone is over a 1 KiB limit
    err = capsys.readouterr().err
    assert "error: the code alone is" in err and "the GPU machine takes" in err and not (tmp_path / "y").exists()


def test_wheel_tags_pick_the_interpreters_wheel():
    tags = {("cp311", "cp311", "manylinux_2_17_x86_64"), ("py3", "none", "any")}
    assert gpu_check._wheel_fits("pydantic_core-2.50.5-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", tags)
    assert not gpu_check._wheel_fits("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", tags)
    assert gpu_check._wheel_fits("pydantic-2.14.4-py3-none-any.whl", tags)


def test_dry_run_from_the_pack_without_pydantic(packed, tmp_path):
    """The whole check end to end on the CPU (toy shapes), run from the pack with pydantic unimportable: the script
    unpacks the pack's wheels, and the JSON holds versions, costs, >= 4 oracle cells (seq and async, >= 3 repeats each),
    losslessness and peak memory."""
    dest, _ = packed
    block = tmp_path / "block"
    for m in gpu_check.VENDORED:
        (block / m).mkdir(parents=True)
        (block / m / "__init__.py").write_text("raise ImportError('no pydantic on the GPU image')\n")
    out = tmp_path / "dry.json"
    env = dict(os.environ, PYTHONPATH=str(block))
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out)], cwd=dest, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["pydantic"].startswith("wheels: ") and d["done"] and not d.get("failed_steps")
    assert d["versions"]["torch"] and d["versions"]["transformers"]
    assert len(d["oracle"]) >= 4
    for row in d["oracle"]:
        assert row["repeats"] >= 3 and len(row["seq_ms_per_token"]) == len(row["async_ms_per_token"]) == row["repeats"]
        assert row["seq_median"] > 0 and row["async_median"] > 0 and 0 <= row["overlap_median"] <= 1
    cells = {(r["drafter"], r["tau"], r["hit_rate"]) for r in d["oracle"]}
    assert {"standalone", "adapter"} <= {c[0] for c in cells} and {2, 4, 6} <= {c[1] for c in cells}
    # the forced hit rate is what the async rounds realised (10 rounds: 0, 5 and 9 hits)
    assert all(abs(r["realised_hit_rate"] - r["hit_rate"]) < 1e-9 for r in d["oracle"])
    c = d["costs"]
    assert c["step_ms"] > 0 and set(c["drafters"]) == {"standalone", "adapter"}
    assert all(x["concurrent_ms"]["1"]["clock"].startswith("cpu:") for x in c["drafters"].values())
    assert d["lossless"] and all(v["lossless"] for v in d["lossless"].values())
    assert d["peak_memory_gib"] > 0
    assert "standalone drafter" in d["models"]["standalone"] and "shared-weight adapter" in d["models"]["adapter"]


def test_the_gpu_check_refuses_to_run_without_cuda_unless_dry_run(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert gpu_check.run_check(tmp_path / "x.json", dry_run=False, device="cpu") == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_cpu_concurrency_probe_is_labelled_as_the_cpu_path():
    from d3d_core.measure.costs import _concurrent_ms

    r = _concurrent_ms(lambda: sum(range(2000)), lambda: sum(range(1000)), 3, device="cpu")
    assert r["clock"].startswith("cpu:") and "controls" not in r and r["round"] > 0


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the CUDA probe needs a CUDA device")
def test_cuda_concurrency_probe_times_two_streams_and_its_controls():
    """Two matmul chains on their own streams overlap; on one stream they cannot (its events never overlap), and the
    one-stream round is no shorter than the longer lane alone."""
    import torch

    from d3d_core.measure.costs import _concurrent_ms

    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(2048, 2048, device="cuda")
    work = lambda x: [x @ x for _ in range(20)]  # noqa: E731
    r = _concurrent_ms(lambda: work(a), lambda: work(b), 3, device="cuda")
    assert r["clock"].startswith("cuda:") and set(r["controls"]) == {"one_thread", "one_stream"}
    one = r["controls"]["one_stream"]
    assert one["overlap"] == 0.0 and one["events_round"] >= 0.9 * max(one["verify"], one["packed"])
    assert r["verify"] > 0 and r["packed"] > 0 and r["round"] > 0
