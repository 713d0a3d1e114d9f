"""The fast CPU engine: same tokens as the eager Hugging Face path, clean fallback, and the
cost breakdown / quietness records the bench and the costs command write."""


import pytest
import torch
import torch.nn.functional as F
from conftest import engine

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.trace import MODES
from d3d_core.measure.machine import QuietWatch
from d3d_core.models import fastops
from d3d_core.models.target import StaticKV


@pytest.mark.parametrize("bundle_name", ["toy", "toy_qwen3"])
def test_fast_forward_matches_eager_through_prefill_verify_rollback(request, bundle_name):
    t = request.getfixturevalue(bundle_name).target
    assert t.engine == "fast", t.fast_reason()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, t.arch.vocab_size, (37,), generator=g)
    blocks = [torch.randint(3, t.arch.vocab_size, (B,), generator=g) for B in (1, 8, 3, 16, 1)]
    outs = {}
    for name in ("fast", "eager"):
        with engine(t, name):
            c = t.new_cache()
            assert isinstance(c, StaticKV) == (name == "fast")
            seq = [t.prefill(c, prompt, (0, 2))]
            for i, blk in enumerate(blocks):
                seq.append(t.verify(c, blk, (1,)))
                t.rollback(c, i % blk.shape[0])  # keep a varying prefix of each block
            outs[name] = (seq, t.cache_len(c))
    assert outs["fast"][1] == outs["eager"][1]
    for a, b in zip(outs["fast"][0], outs["eager"][0]):
        assert torch.allclose(a.logits, b.logits, atol=2e-4, rtol=1e-4)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
        assert torch.allclose(a.feats, b.feats, atol=2e-4, rtol=1e-4)


def test_static_cache_grows_past_its_first_capacity(toy):
    t = toy.target
    ids = torch.arange(3, 3 + 700) % t.arch.vocab_size
    with engine(t, "fast"):
        c = t.new_cache()
        first_cap = c.capacity
        fast = t.prefill(c, ids[:600]).logits
        fast2 = t.verify(c, ids[600:610]).logits
        assert c.capacity > first_cap >= 1 and t.cache_len(c) == 610
    with engine(t, "eager"):
        c = t.new_cache()
        eager = t.prefill(c, ids[:600]).logits
        eager2 = t.verify(c, ids[600:610]).logits
    assert torch.allclose(fast, eager, atol=2e-4) and torch.allclose(fast2, eager2, atol=2e-4)


def test_static_cache_crop_follows_hf_semantics():
    c = StaticKV(2, 1, 4, torch.float32, "cpu", capacity=8)
    c.length = 6
    c.crop(-2)
    assert c.get_seq_length() == 4
    c.crop(3)
    assert c.get_seq_length() == 3
    c.crop(10)
    assert c.get_seq_length() == 3


@pytest.mark.parametrize("bundle_name", ["toy", "toy_qwen3"])
def test_every_mode_same_tokens_on_fast_and_eager(request, bundle_name):
    bundle = request.getfixturevalue(bundle_name)
    ref = {}
    for name in ("eager", "fast"):
        with engine(bundle.target, name):
            for mode in MODES:
                tr = decode(bundle, "count: 1, 2, 3", DecodeConfig(mode=mode, max_new_tokens=30, block_size=4))
                ref.setdefault(mode, tr.output_ids)
                assert tr.output_ids == ref["ar"] == ref[mode], (name, mode)


def test_fallback_is_taken_and_said(toy, monkeypatch):
    monkeypatch.setitem(fastops._state, "ok", False)
    monkeypatch.setitem(fastops._state, "why", "oneDNN prepacked linear unavailable (test)")
    t = toy.target
    assert t.engine == "eager" and "unavailable (test)" in t.fast_reason()
    assert not isinstance(t.new_cache(), StaticKV)
    tr = decode(toy, "count: 1, 2, 3", DecodeConfig(mode="d3d-seq", max_new_tokens=20))
    monkeypatch.undo()
    assert t.engine == "fast"
    assert tr.output_ids == decode(toy, "count: 1, 2, 3", DecodeConfig(mode="ar", max_new_tokens=20)).output_ids


def test_switching_off_makes_every_linear_eager(toy, monkeypatch):
    monkeypatch.setitem(fastops._state, "enabled", False)
    assert fastops.status()["engine"] == "eager" and toy.target.engine == "eager"


def test_fused_linear_equals_separate_and_repacks_after_update():
    torch.manual_seed(0)
    owner = torch.nn.Module()
    mods = [torch.nn.Linear(16, n) for n in (8, 4, 4)]
    x = torch.randn(3, 16)
    with torch.inference_mode():
        outs = fastops.fused_linear(owner, "qkv", mods, x)
        for m, o in zip(mods, outs):
            assert torch.allclose(o, m(x), atol=1e-5)
    with torch.no_grad():
        mods[1].weight.mul_(2.0)  # an in-place update (an optimiser step) must be seen
    with torch.inference_mode():
        assert torch.allclose(fastops.fused_linear(owner, "qkv", mods, x)[1], mods[1](x), atol=1e-5)
    # with gradients the plain modules run, so training is untouched
    y = fastops.linear(mods[0], x.requires_grad_())
    assert y.requires_grad


def test_cost_breakdown_parts_add_up_to_wall(toy):
    from d3d_core.measure.costs import PARTS, breakdown

    res = breakdown(toy, ctx_len=32, block_sizes=(2, 4), hypotheses=(1, 2), threads=(1,), repeats=2, B_draft=4)
    names = [r["forward"] for r in res["rows"]]
    assert names[:3] == ["step", "verify(2)", "verify(4)"] and "d3d packed(H=2)" in names and "dflash draft(4)" in names
    for r in res["rows"]:
        parts = r["parts"]
        assert set(parts) == set(PARTS)
        assert abs(sum(p["share"] for p in parts.values()) - 1.0) < 1e-6
        assert abs(sum(p["ms"] for p in parts.values()) - r["wall_ms"]) <= 0.01 * r["wall_ms"]
        assert r["bytes"] > 0 and r["flops"] > 0 and r["bound"] in ("bandwidth", "compute")
    step = res["rows"][0]
    assert step["per_step"] == 1.0
    # a verify over 4 rows does 4x the layer FLOPs of a step and reads the same weights
    v4 = res["rows"][2]
    assert v4["bytes"] >= step["bytes"] and v4["flops"] > 3.5 * step["flops"]


def test_int8_drafter_reads_about_a_quarter_of_the_mlp_and_head_bytes(toy):
    from d3d_core.measure.costs import _attn_params, _mlp_params, work_of

    arch = toy.target.arch
    fp, q8 = work_of(arch, 9, 2, 8, 64, 32), work_of(arch, 9, 2, 8, 64, 32, int8=True)
    assert fp["flops"] == q8["flops"]  # int8 changes bytes, not work
    saved = fp["bytes"] - q8["bytes"]
    full = 4 * (2 * _mlp_params(arch) + 64 * arch.hidden_size)
    assert 0.5 * full < saved < 0.75 * full  # 3 of 4 bytes per weight, less the per-row scales
    assert work_of(arch, 9, 2, 8, 64, 32)["bytes"] - 4 * 2 * _attn_params(arch) > 0


def test_quiet_watch_flags_a_busy_machine(monkeypatch):
    import d3d_core.measure.machine as m

    w = QuietWatch()
    q = w.stop()
    assert q.wall_s >= 0 and q.other_cpu_s >= 0 and q.load_at_start >= 0
    busy = iter([100.0, 160.0])  # others used 60 CPU-seconds
    monkeypatch.setattr(m, "_busy_cpu_s", lambda: next(busy))
    monkeypatch.setattr(m, "_own_cpu_s", lambda: 0.0)
    w = QuietWatch()
    w.t0 -= 30.0  # 30 s of wall time: others kept 2 cores busy
    q = w.stop()
    assert q.noisy and "2.00 cores" in q.warning


def test_a_slow_step_flags_contention_from_outside_the_machine(monkeypatch):
    """Other processes idle, but the run's own step far slower than the quiet reference of the same
    CPU (a neighbour on the host's cores, invisible in /proc/stat): flagged, with both numbers."""
    import d3d_core.measure.machine as m

    monkeypatch.setattr(m, "cpu_model", lambda: "Test CPU")
    costs = {"rows": [{"forward": "step", "threads": 1, "wall_ms": 55.0}, {"forward": "step", "threads": 2, "wall_ms": 40.0}],
             "machine_info": {"cpu": "Test CPU"}, "quiet": {"noisy": False}}
    ref = m.step_reference(costs, 2)
    assert ref == {"cpu": "Test CPU", "threads": 2, "step_ms": 40.0}
    quiet = m.Quietness(0.1, 0.0, 30.0, 0.0, False, "")
    ok = quiet.against(48.0, ref)  # 1.2x: within SLOW_STEP
    assert not ok.noisy and ok.step_ms == 48.0 and ok.reference_step_ms == 40.0
    slow = quiet.against(64.0, ref)
    assert slow.noisy and "64 ms against 40 ms" in slow.warning and "1.60×" in slow.warning
    busy = m.Quietness(0.1, 9.0, 30.0, 0.3, True, "machine was not quiet: others; timings and speedups may be off")
    both = busy.against(64.0, ref)
    assert both.warning.count("machine was not quiet") == 1 and "64 ms" in both.warning
    # nothing to compare: another CPU model, a noisy reference, no AR step
    assert quiet.against(64.0, {**ref, "cpu": "Other CPU"}) == quiet
    assert m.step_reference({**costs, "quiet": {"noisy": True}}) is None
    assert m.step_reference(costs, 4) is None and m.step_reference(costs)["threads"] == 2
    assert m.step_reference({**costs, "engine": "fast"}, 2, "eager") is None  # an eager run is not judged by a fast step
    assert m.step_reference({**costs, "engine": "fast"}, 2, "fast")["step_ms"] == 40.0
    assert quiet.against(None, ref) == quiet


def test_peers_run_and_compare_with_ar(toy):
    from d3d_core.measure.datasets import Item
    from d3d_core.measure.peers import run_peer

    ids = toy.tokenizer.encode_prompt("count: 1, 2, 3")
    cfg = DecodeConfig(mode="ar", max_new_tokens=20, stop_at_eos=False)
    ref = decode(toy, ids, cfg).output_ids
    item = Item("toy", "0", [{"role": "user", "content": "count"}], {})
    for peer in ("hf-generate", "hf-prompt-lookup"):
        row = run_peer(toy, peer, ids, cfg, item, ref)
        assert row["mode"] == peer and row["n_tokens"] == 20 and row["lossless"] is True
        assert row["decode_time_s"] > 0 and row["tau"] is None


@pytest.mark.slow
def test_real_bundle_fast_and_eager_agree(smollm):
    prompts = ["What is 17 times 23? Think step by step.", "Write a Python function that reverses a string.",
               "Give me three tips for a good night's sleep."]
    for p in prompts:
        with engine(smollm.target, "eager"):
            ref = decode(smollm, p, DecodeConfig(mode="ar", max_new_tokens=48)).output_ids
        assert smollm.target.engine == "fast"
        assert decode(smollm, p, DecodeConfig(mode="ar", max_new_tokens=48)).output_ids == ref, p


def test_overlap_crossover_measures_every_depth(toy):
    from d3d_core.measure.costs import _crossing, overlap_crossover

    c = overlap_crossover(toy, depths=(1, 2, 4), B=4, ctx_len=16, repeats=2)
    assert [r["depth"] for r in c["rows"]] == [1, 2, 4]
    for r in c["rows"]:
        assert r["seq_round_ms"] == pytest.approx(r["verify_ms"] + r["draft_ms"])
        assert r["pays"] == (r["async_round_ms"] < r["seq_round_ms"])
    # the crossing is interpolated where the async/seq speed ratio passes 1
    rows = [{"draft_per_verify": 0.2, "async_over_seq": 0.8}, {"draft_per_verify": 0.6, "async_over_seq": 1.2}]
    assert _crossing(rows) == pytest.approx(0.4)
    assert _crossing(rows[:1]) is None


def test_row_buckets_are_few_cover_every_size_and_keep_results():
    """Padding rows to buckets bounds oneDNN's per-shape memory (see fastops.row_bucket) and does not
    change what a linear computes."""
    import torch.nn as nn

    from d3d_core.models import fastops

    sizes = {fastops.row_bucket(m) for m in range(1, 8193)}
    assert len(sizes) < 100 and all(fastops.row_bucket(m) == m for m in range(1, 33))
    assert all(fastops.row_bucket(m) >= m for m in range(1, 8193))
    assert all(fastops.row_bucket(m) <= 1.5 * m for m in range(33, 8193))
    if not fastops.enabled():
        pytest.skip(fastops.status()["reason"])
    lin = nn.Linear(64, 48)
    with torch.inference_mode():
        for m in (1, 17, 33, 47, 130, 700):
            x = torch.randn(m, 64)
            assert torch.allclose(fastops.linear(lin, x), lin(x), atol=1e-4), m


def _d3d_block_logits(d):
    with torch.inference_mode():
        _, h, _ = d.forward_packed(d.new_cache(), torch.tensor([3, 5, 7, 11, 2, 9]), [(4, 6)], 9)
        return d.draft_logits(h)[0]


def test_drafter_int8_runs_marked_modules_only_and_exact_drafters_restores_fp32(toy, monkeypatch):
    """The D3D drafter's MLPs and shortlist head run in int8 where the platform allows it; exact_drafters()
    (what offline τ, pruning and training use) and set_int8(False) give the fp32 path back exactly."""
    if fastops.int8_status()["drafter_int8"] != "on":
        pytest.skip(fastops.int8_status()["reason"])
    d = toy.drafter("d3d")
    marked = [n for n, m in d.named_modules() if getattr(m, "_d3d_int8", False)]
    assert "" in marked and all(n == "" or ".mlp" in n for n in marked) and not any("attn" in n for n in marked), marked
    assert not getattr(toy.drafter("dflash").layers[0].mlp, "_d3d_int8", False)
    q = _d3d_block_logits(d)
    with fastops.exact_drafters():
        exact = _d3d_block_logits(d)
    monkeypatch.setitem(fastops._state, "int8", False)
    off = _d3d_block_logits(d)
    assert torch.equal(exact, off)
    assert not torch.equal(q, exact)  # int8 did run
    assert (q - exact).abs().max() < 0.1 * exact.abs().max()  # and stayed close


def test_offline_tau_measures_stored_weights_unless_asked_for_int8(toy, monkeypatch):
    from d3d_core.training.offline_tau import calibration_set, offline_tau

    if fastops.int8_status()["drafter_int8"] != "on":
        pytest.skip(fastops.int8_status()["reason"])
    seqs = calibration_set(toy, max_new_tokens=24)[:3]
    d = toy.drafter("d3d")
    exact = offline_tau(d, seqs, B=4, stride=2)
    monkeypatch.setitem(fastops._state, "int8", False)
    assert offline_tau(d, seqs, B=4, stride=2) == exact == offline_tau(d, seqs, B=4, stride=2, int8=True)


def test_training_keeps_drafters_exact(toy):
    """train() (a frozen teacher drafter runs there under no_grad) keeps marked modules in fp32."""
    from d3d_core.training.train import train

    if fastops.int8_status()["drafter_int8"] != "on":
        pytest.skip(fastops.int8_status()["reason"])
    d = toy.drafter("d3d")
    assert fastops._int8(d) and not fastops.exact(lambda: fastops._int8(d))()
    assert train.__wrapped__ is not None  # train is wrapped by fastops.exact


def test_row_plan_pads_only_to_a_measurably_faster_width():
    times = {1: 34.1, 2: 38.3, 3: 34.0, 4: 33.5, 5: 32.8, 6: 32.7, 7: 36.8, 8: 38.1}  # measured, AVX-512 EPYC
    plan = fastops.plan_from_times(times)
    assert plan.rows[2] == 6 and plan.rows[1] == 1 and plan.rows[7] == 7 and plan.rows[8] == 8  # 1 -> 6 gains only 4 %
    assert plan.blas == ()
    assert fastops.plan_from_times({m: 10.0 for m in range(1, 9)}) == fastops.IDENTITY_PLAN
    assert fastops.plan_from_times({m: 10.0 - m for m in range(1, 9)}).rows[1:] == (8,) * 8
    assert fastops.fixed_plan(4).rows[1:] == (4, 4, 4, 4, 5, 6, 7, 8) and fastops.fixed_plan(0) == fastops.IDENTITY_PLAN


def test_row_plan_takes_blas_where_it_ran_faster():
    onednn = {1: 36.9, 2: 38.3, 3: 40.0, 4: 42.7, 5: 44.0, 6: 45.0, 7: 47.0, 8: 48.6}  # measured, AVX-512 Xeon, fp32 forward
    blas = {1: 28.8, 2: 30.6, 3: 35.0, 4: 37.0, 5: 42.0, 6: 44.0, 7: 46.0, 8: 47.2}
    plan = fastops.plan_from_times(onednn, blas)
    assert plan.blas == (1, 2, 3, 4) and plan.rows == fastops.IDENTITY_ROWS  # 5..8: BLAS under 5 % faster
    # BLAS competes with the best padded oneDNN width too: 2 rows pad to 3 when that beats BLAS at 2
    plan = fastops.plan_from_times({1: 40.0, 2: 40.0, 3: 30.0}, {1: 36.0, 2: 35.0, 3: 35.0})
    assert plan.rows[1] == 3 and plan.rows[2] == 3 and plan.blas == ()
    assert plan.info() == {"plan": list(plan.rows), "blas": []}
    assert fastops.BLAS_PLAN.onednn() == fastops.IDENTITY_PLAN and fastops.fixed_plan(4).onednn() == fastops.fixed_plan(4)


def test_blas_rows_equal_onednn_rows(toy):
    """The plain BLAS GEMM (a (K, N) copy of the fused weight, after prep) computes what the prepacked one does,
    bias included, and is rebuilt when the weight changes in place."""
    lin = torch.nn.Linear(32, 48)
    prep = lambda w, b: (w.flip(0), b.flip(0))  # noqa: E731 (a row reorder, as q|k|v's)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        a = fastops.packed_linear(lin, "w", [lin.weight], [lin.bias], x, prep)
        b = fastops.packed_linear(lin, "w", [lin.weight], [lin.bias], x, prep, plan=fastops.BLAS_PLAN)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(b, F.linear(x, lin.weight, lin.bias).flip(-1), atol=1e-5)
    with torch.no_grad():
        lin.weight.mul_(2)
    with torch.inference_mode():
        c = fastops.packed_linear(lin, "w", [lin.weight], [lin.bias], x, prep, plan=fastops.BLAS_PLAN)
    assert torch.allclose(c, F.linear(x, lin.weight, lin.bias).flip(-1), atol=1e-5)
    assert fastops.drop_blas(lin) == 32 * 48 * 4 and fastops.drop_blas(lin) == 0


def test_padded_rows_change_no_real_row(toy):
    lin = torch.nn.Linear(32, 48)
    x = torch.randn(2, 32)
    with torch.inference_mode():
        plain = fastops.packed_linear(lin, "w", [lin.weight], [lin.bias], x)
        padded = fastops.packed_linear(lin, "w", [lin.weight], [lin.bias], x, plan=fastops.fixed_plan(6))
    assert padded.shape == (2, 48) and torch.allclose(plain, padded, atol=1e-5)


@pytest.mark.parametrize("floor", ["4", "off", "blas"])
def test_every_mode_equals_ar_under_a_row_plan(toy, monkeypatch, floor):
    """The row plan is the target's, fixed before its first forward: AR and every drafting mode pad alike."""
    monkeypatch.setenv("D3D_ROW_PLAN", floor)
    monkeypatch.setattr(toy.target, "_row_plan", None)
    assert toy.target.row_plan() == {"4": fastops.fixed_plan(4), "off": fastops.IDENTITY_PLAN, "blas": fastops.BLAS_PLAN}[floor]
    assert toy.target.row_plan_info["setting"] == floor
    ref = decode(toy, "count: 1, 2, 3", DecodeConfig(mode="ar", max_new_tokens=24, block_size=4))
    for mode in MODES[1:]:
        assert decode(toy, "count: 1, 2, 3", DecodeConfig(mode=mode, max_new_tokens=24, block_size=4)).output_ids == ref.output_ids


def test_a_toy_target_is_too_small_to_measure(toy, monkeypatch):
    monkeypatch.delenv("D3D_ROW_PLAN", raising=False)
    monkeypatch.setattr(toy.target, "_row_plan", None)
    assert toy.target.row_plan() == fastops.IDENTITY_PLAN and "not measured" in toy.target.row_plan_info["why"]


@pytest.mark.parametrize("plan", ["blas", "off"])
def test_the_forward_follows_an_in_place_weight_change(toy, monkeypatch, plan):
    """Each layer's GEMM keeps the weight copy it last used (oneDNN pack or BLAS transpose) only while the weights'
    version counters stand still: an in-place change is seen by the next forward, and undoing it restores the bits."""
    t = toy.target
    monkeypatch.setattr(t, "_row_plan", fastops.BLAS_PLAN if plan == "blas" else fastops.IDENTITY_PLAN)
    ids = torch.tensor([5, 9, 11])

    def logits():
        c = t.new_cache()
        with torch.inference_mode():
            return t.forward(c, ids, 3).logits

    before = logits()
    w = t.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w.mul_(0.5)
    try:
        changed = logits()
    finally:
        with torch.no_grad():
            w.mul_(2)  # exact: a power of two
    assert not torch.equal(before, changed) and torch.equal(logits(), before)
    if plan == "blas":
        assert t.drop_blas() > 0 and not any("blas" in fl.down.held for fl in t._fast_layers)
        assert torch.equal(logits(), before)  # rebuilt on demand
