"""The engines yardstick (``measure.engines``) and the llama.cpp peer: parsing, skipping with a message when it
cannot run, the summary's ratios and agreement, and (where llama-cpp-python is installed) a real llama.cpp decode."""

import json
from pathlib import Path

import pytest

from d3d_core.measure import bench, engines, peers

FIX = Path(__file__).parent / "fixtures" / "datasets"


def test_parse_peers_expands_llama_cpp_and_refuses_unknown():
    assert peers.parse_peers("none") == [] and peers.parse_peers("") == []
    assert peers.parse_peers("hf-generate,llama-cpp") == ["hf-generate", "llama-cpp", "llama-cpp-lookup"]
    assert peers.parse_peers("llama-cpp-lookup,llama-cpp") == ["llama-cpp-lookup", "llama-cpp"]
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        peers.parse_peers("vllm")


def test_llama_peer_is_skipped_with_a_message_when_it_cannot_run(toy, monkeypatch):
    said = []
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    assert peers.usable_peers(toy, ["hf-generate", "llama-cpp", "llama-cpp-lookup"], warn=said.append) == ["hf-generate"]
    assert len(said) == 1 and "scripts/setup_venv.sh --llama-cpp" in said[0] and "llama-cpp-lookup" in said[0]
    said.clear()
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: True)  # installed, but the toy target has no GGUF
    assert peers.usable_peers(toy, ["llama-cpp"], warn=said.append) == []
    assert "has none" in said[0] and "GGUF" in said[0]
    assert peers.usable_peers(toy, ["hf-generate"], warn=said.append) == ["hf-generate"] and len(said) == 1


def test_bench_runs_on_without_llama_cpp(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    out = tmp_path / "r.json"
    assert bench.main(["--bundle", "toy", "--modes", "ar", "--data-dir", str(FIX), "--datasets", "gsm8k", "--n", "1",
                       "--max-new-tokens", "8", "--peers", "llama-cpp", "--out", str(out), "--no-progress"]) == 0
    assert "scripts/setup_venv.sh --llama-cpp" in capsys.readouterr().err
    assert {r["mode"] for r in json.loads(out.read_text())["rows"]} == {"ar"}


def test_engines_command_on_toy(tmp_path, capsys):
    """fp32 and int4 engines (the toy's int4 blocks are quantised from fp32) and the HF peer, on the same prompts:
    each prompt's order rotates, every runner decodes every prompt, and the summary's pairs are consistent."""
    out = tmp_path / "e.json"
    rc = engines.main(["--bundle", "toy", "--data-dir", str(FIX), "--datasets", "gsm8k,mt_bench", "--n", "2",
                       "--max-new-tokens", "12", "--engines", "fast,int4", "--peers", "hf-generate", "--out", str(out),
                       "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["runners"] == ["fast", "int4", "hf-generate"] and len(res["rows"]) == 4
    assert [r["order"][0] for r in res["rows"]] == ["fast", "int4", "hf-generate", "fast"]  # rotated per prompt
    for r in res["rows"]:
        assert set(r["runs"]) == {"fast", "int4", "hf-generate"}
        assert all(x["n_tokens"] >= 1 and x["decode_time_s"] > 0 for x in r["runs"].values())
        assert r["runs"]["fast"]["step_ms"] > 0 and r["runs"]["hf-generate"]["step_ms"] is None
        for e in ("fast", "int4"):  # a step is one of the decode's parts, in ms
            x = r["runs"][e]
            assert x["step_ms"] * (x["n_tokens"] - 1) <= 1000 * x["decode_time_s"] * 1.01
    s = res["summary"]
    assert set(s["runners"]) == {"fast", "int4", "hf-generate"}
    pair = {(p["a"], p["b"]): p for p in s["pairs"]}
    fh = pair[("fast", "hf-generate")]
    assert fh["identical"] == 1.0 and fh["shared_prefix_share"] == 1.0  # HF's eager forward prints the fast engine's tokens on the toy
    fi = pair[("fast", "int4")]
    want = s["runners"]["fast"]["tokens_per_s"] / s["runners"]["int4"]["tokens_per_s"]
    assert fi["speed_ratio"] == pytest.approx(want)
    assert fi["speed_ratio_min"] <= fi["speed_ratio_median"] <= fi["speed_ratio_max"]
    printed = capsys.readouterr().out
    assert "fast / int4" in printed and "tok/s" in printed


def test_engines_summary_agreement_counts_shared_prefix():
    rows = [{"runs": {"a": {"n_tokens": 4, "decode_time_s": 1.0, "tokens_per_s": 3.0, "step_ms": 1.0, "output_ids": [1, 2, 3, 4]},
                      "b": {"n_tokens": 4, "decode_time_s": 0.5, "tokens_per_s": 6.0, "step_ms": None, "output_ids": [1, 2, 9, 9]}}}]
    s = engines.summarize(rows, ["a", "b"])
    p = s["pairs"][0]
    assert p["speed_ratio"] == pytest.approx(0.5) and p["identical"] == 0.0
    assert p["shared_prefix_mean"] == 2 and p["shared_prefix_share"] == pytest.approx(0.5)


def test_engines_bad_arguments(tmp_path, capsys):
    assert engines.main(["--bundle", "toy", "--engines", "warp", "--out", str(tmp_path / "x.json")]) == 2
    assert "unknown engine" in capsys.readouterr().err


@pytest.mark.skipif(not peers.llama_cpp_available(), reason="llama-cpp-python not installed (scripts/setup_venv.sh --llama-cpp)")
def test_llama_cpp_peer_decodes_the_bundled_gguf(smollm):
    """llama.cpp on the same GGUF, greedy: a full row, our tokenizer's ids, and the same opening tokens as our ar
    (fp32 vs Q4_1 rounding may part them later; the bench reports where)."""
    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode
    from d3d_core.measure.datasets import prompt_items

    cfg = DecodeConfig(mode="ar", max_new_tokens=16, stop_at_eos=False)
    item = prompt_items("What is 12 times 7? Answer briefly.", 1)[0]
    ids = smollm.tokenizer.encode_messages(item.messages)
    ref = decode(smollm, ids, cfg).output_ids
    for name in peers.LLAMA_PEERS:
        row = peers.run_peer(smollm, name, ids, cfg, item, ref)
        assert row["mode"] == name and row["n_tokens"] == 16 and row["decode_time_s"] > 0 and row["tau"] is None
        assert row["same_prefix"] >= 4, smollm.tokenizer.decode(peers.peer_decode(smollm, name, ids, cfg)[0])


def test_cached_llama_models_are_closed_at_exit(monkeypatch):
    """Cached models are closed by close_llamas (registered with atexit), so none is left to a destructor that runs
    after llama-cpp-python's own globals are gone (it printed tracebacks after the bench's last line)."""
    closed = []

    class Model:
        def __init__(self, fail=False):
            self.fail = fail

        def close(self):
            closed.append(self)
            if self.fail:
                raise RuntimeError("already gone")

    monkeypatch.setattr(peers, "_LLAMAS", {"a": Model(), "b": Model(fail=True)})
    peers.close_llamas()
    assert len(closed) == 2 and peers._LLAMAS == {}


@pytest.mark.skipif(not peers.llama_cpp_available(), reason="llama-cpp-python not installed (scripts/setup_venv.sh --llama-cpp)")
def test_a_process_that_used_llama_cpp_exits_without_a_traceback(smollm):
    import subprocess
    import sys

    code = ("import sys; from d3d_core.measure import peers; from llama_cpp import Llama; "
            "peers._LLAMAS['k'] = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False); print('loaded')")
    r = subprocess.run([sys.executable, "-c", code, str(peers.gguf_of(smollm))], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "loaded" in r.stdout
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-600:]


def test_each_engine_reads_its_own_cost_table(toy):
    """The verify plan's costs follow the engine: a shipped int4 table on int4, the fp32 one otherwise (and where no
    int4 table is shipped)."""
    from dataclasses import replace

    from conftest import engine

    b = replace(toy, costs_fp32={"which": "fp32"}, costs_int4={"which": "int4"})
    assert b.costs["which"] == "fp32"
    with engine(b.target, "int4"):
        assert b.target.engine == "int4" and b.costs["which"] == "int4"
        assert replace(b, costs_int4={}).costs["which"] == "fp32"
    assert b.costs["which"] == "fp32"


def test_a_race_runs_every_mode_on_the_engine_asked_for(toy):
    """service.race(engine=...): every mode on that engine (recorded in each trace), lossless against ar there, and
    the target's own request restored afterwards; an unknown engine is refused with the choices."""
    from d3d_core import service
    from d3d_core.decoding.config import DecodeConfig

    base = DecodeConfig(block_size=4, max_new_tokens=16, stop_at_eos=False)
    before = toy.target.engine_request
    for eng, want, modes in (("int4", "int4", list(service.MODES)), ("fp32", "fast", ["ar", "d3d-seq"])):
        done = {m: tr for m, tr, fin in service.race("toy", "the cat sat on", modes, base, engine=eng) if fin}
        assert set(done) == set(modes)
        assert {tr.engine for tr in done.values()} == {want}
        assert all(tr.output_ids == done["ar"].output_ids for tr in done.values())
        assert toy.target.engine_request == before
    with pytest.raises(ValueError, match="unknown engine 'int8'; choose one of fp32, int4"):
        list(service.race("toy", "the cat", ["ar"], base, engine="int8"))


def test_the_apps_default_engine(monkeypatch):
    from d3d_core import service
    from d3d_core.limits import APP_ENGINE_DEFAULT

    monkeypatch.delenv("D3D_ENGINE", raising=False)
    assert service.default_engine() == APP_ENGINE_DEFAULT == "int4"  # the fastest ar: the fairest baseline
    for env, want in (("fast", "fp32"), ("FP32", "fp32"), ("int4", "int4"), ("eager", "fp32")):
        monkeypatch.setenv("D3D_ENGINE", env)
        assert service.default_engine() == want
    assert service.check_engine(None) == "fp32"  # None: the default, here D3D_ENGINE=eager's
    monkeypatch.delenv("D3D_ENGINE")
    assert service.check_engine(None) == "int4"


def test_a_host_without_int4_races_on_fp32_and_says_why(toy, monkeypatch):
    from d3d_core import service

    assert service.resolve_engine("toy", "int4") == ("int4", "")
    assert service.resolve_engine("toy", "fp32") == ("fp32", "")
    monkeypatch.setattr(type(toy.target), "int4_reason", lambda self: "the int4 kernel failed its self-test")
    eng, why = service.resolve_engine("toy", "int4")
    assert eng == "fp32" and "int4 is not available here (the int4 kernel failed its self-test)" in why
