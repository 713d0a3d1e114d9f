"""The drafters shipped in assets/ for smollm2-135m: they load as trained, fp16, small, and
reach an offline τ floor on the shipped calibration set (teacher-forced, a few seconds)."""

import json

import pytest

from d3d_core.models.bundles import ASSETS
from d3d_core.training.offline_tau import calibration_set, offline_tau

pytestmark = pytest.mark.slow

# measured when the drafters were shipped (docs/RESULTS.md, training section), minus a margin for float
# differences between machines: an untrained drafter scores ~1.0 here. D3D: 2.292 for the fine-tune shipped in commit 7232bdb (2026-12-04) on
# the calibration set shipped with it, whose floor sits above the drafter it replaced (2.114 on the same set),
# so a revert to the old weights fails. DFlash: 1.732 for the fine-tune shipped in commit 6490180 (2026-12-04; the drafter it replaced: 1.622).
# d3d-deep (the adapter drafter, 2026-12-04, commit 6490180): 3.326, where the checkpoint of commit 197633d it continues scores 3.106
TAU_FLOOR = {"d3d": 2.24, "dflash": 1.68, "d3d-deep": 3.25}


def test_assets_stay_small():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total < 100 * 2**20, f"assets/ is {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("kind", ["d3d", "dflash"])
def test_shipped_drafter_loads_trained_and_reaches_tau_floor(smollm, kind):
    d = ASSETS / "drafters" / "smollm2-135m" / kind
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["training"]["steps"] > 0 and cfg["training"]["offline_tau"] > 1.0
    assert smollm.drafter_info[kind].startswith("trained")
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}
    drafter = smollm.drafter(kind)
    if kind == "d3d":
        drafter = drafter.pruned([])  # every layer: the floor is the unpruned drafter's
    tau = offline_tau(drafter, calibration_set(smollm), B=8, stride=4, target=smollm.target)
    assert tau >= TAU_FLOOR[kind], tau


def test_shipped_deep_drafter_is_the_target_at_draft_one_clears_its_floor_and_stays_lossless(smollm):
    """``d3d-deep``: the target's 30 layers, frozen, plus trained rank-64 adapters (9 MB of fp16). It loads on first
    use with its base rebuilt from the target, its draft 1 is the target's own greedy token at (almost) every
    anchor, it reaches its τ floor on the calibration set, and both D3D modes print exactly ar's tokens with it."""
    from safetensors import safe_open

    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode

    d = ASSETS / "drafters" / "smollm2-135m" / "d3d-deep"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}
        assert all(".adapter_" in k or k == "mask_embedding" for k in f.keys())
    deep = smollm.drafter("d3d-deep")
    assert deep.frozen_base and deep.cfg.num_layers == smollm.target.num_layers and deep.cfg.anchor_attention == "causal"
    calib = calibration_set(smollm)
    assert offline_tau(deep, calib, B=2, stride=4, target=smollm.target) >= 1.99  # draft 1 = the target's token
    tau = offline_tau(deep, calib, B=8, stride=4, target=smollm.target)
    assert tau >= TAU_FLOOR["d3d-deep"], tau
    prompt = "What is 17 times 23? Think step by step."
    ref = decode(smollm, prompt, DecodeConfig(mode="ar", max_new_tokens=48))
    for mode in ("d3d-seq", "d3d-async"):
        tr = decode(smollm, prompt, DecodeConfig(mode=mode, max_new_tokens=48, block_size=8, drafting="always"), drafter=deep)
        assert tr.output_ids == ref.output_ids, mode


def test_projection_starts_from_the_shipped_bench_rows_that_drafted_every_round():
    """The projection models rounds that all draft: its starting τ is d3d-async's gsm8k τ with drafting always,
    not the gated table's (which counts undrafted rounds as 1)."""
    from d3d_core import service
    from d3d_core.decoding.plan import plan_of

    res = service.bench_result("smollm2-135m")
    dec = res["config"]["decode"]
    every = [r for r in res["rows"] if r["mode"] == "d3d-async" and r["dataset"] == "gsm8k" and plan_of(r) == (dec["verify"], "always")]
    assert every
    tau, hit, B = service.measured_point("smollm2-135m")
    assert tau == round(sum(r["tau"] * r["rounds"] for r in every) / sum(r["rounds"] for r in every), 2) and B == dec["block_size"]
    gated = next(s for s in res["summary"] if s["mode"] == "d3d-async" and s["dataset"] == "gsm8k")
    assert tau > gated["tau"] and 0 < hit < 1


def test_example_prompt_labels_quote_the_shipped_drafter_tau(smollm):
    """The app's example prompts carry a τ label ("math · τ ≈ 2.6"): each must be what the shipped D3D drafter
    gives on that prompt in d3d-seq (B = 8, 96 new tokens, drafting every round, temperature 0), run the way the app
    runs it (int8 MLPs and head where the platform has the kernel), within 0.15: the labels must hold on every CPU
    the suite meets, and the fp32 kernels differ per CPU (oneDNN / BLAS on AVX-512 or AVX2), which flips near-ties.
    The second math prompt was labelled 2.7 from an AVX-512 Xeon and read 2.57 on an AVX2 EPYC (2026-12-07, the
    same code as then); its label is now 2.6, and the others read within 0.09 of their labels on that EPYC."""
    import re

    from app.ui import EXAMPLES
    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode

    cfg = DecodeConfig(mode="d3d-seq", block_size=8, max_new_tokens=96, drafting="always", verify="full")
    for prompt, label in EXAMPLES:
        quoted = float(re.search(r"τ ≈ ([0-9.]+)", label).group(1))
        tau = decode(smollm, prompt, cfg).stats.tau
        assert abs(tau - quoted) <= 0.15, (label, round(tau, 2))


def test_the_deep_drafter_text_quotes_its_shipped_bench():
    """How it works' d3d-deep section quotes the shipped deep bench (assets/bench/<bundle>-d3d-deep.json, the Pruning
    tab's Raced table) beside the 8-layer drafter's bench on the same engine: pooled τ and speedups, read, not written."""
    from app import explain
    from d3d_core import service

    deep = service.deep_benches("smollm2-135m")
    assert deep and not deep[0]["config"]["skip_layers"] and deep[0]["config"]["d3d_drafter"] == "d3d-deep"
    got = {r["mode"]: r for r in deep[0]["summary"] if r["dataset"] == "average"}
    engine = deep[0]["config"]["engine"]
    eight = {r["mode"]: r for r in service.engine_runs("smollm2-135m")[1][engine]["summary"] if r["dataset"] == "average"}
    text = explain.depth(service.cost_breakdown("smollm2-135m"), deep, service.engine_runs("smollm2-135m")[1][engine])
    assert f"reached τ **{got['d3d-seq']['tau']:.2f}**" in text and f"**{got['d3d-seq']['speedup']:.2f}×** `ar`" in text
    assert f"`d3d-async` {got['d3d-async']['speedup']:.2f}×" in text
    assert f"reached τ {eight['d3d-seq']['tau']:.2f} and {eight['d3d-seq']['speedup']:.2f}×" in text
    assert all(r["lossless_rate"] == 1.0 for d in deep for r in d["summary"] if r["mode"] != "ar")  # pruned or not, lossless
