"""Temperature 0: every mode emits exactly the AR tokens."""

import pytest
from conftest import assert_all_modes_equal_ar

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.trace import MODES

PROMPTS = ["what is two plus two?", "write a short poem about rain", "count: 1, 2, 3"]


@pytest.mark.parametrize("bundle_name", ["toy", "toy_qwen3"])
@pytest.mark.parametrize("B", [2, 3, 8, 16])
def test_all_modes_equal_ar_on_toy(request, bundle_name, B):
    bundle = request.getfixturevalue(bundle_name)
    for prompt in PROMPTS:
        ref = decode(bundle, prompt, DecodeConfig(mode="ar", max_new_tokens=40, block_size=B))
        assert len(ref.output_ids) == 40
        for mode in MODES[1:]:
            tr = decode(bundle, prompt, DecodeConfig(mode=mode, max_new_tokens=40, block_size=B, hypotheses=8))
            assert tr.output_ids == ref.output_ids, (mode, B, prompt)
            assert tr.finish_reason == ref.finish_reason


def test_ar_through_same_loop_equals_hf_generate(toy):
    """The AR baseline (block size 1 through the engine) equals transformers' greedy generate."""
    import torch

    ids = toy.tokenizer.encode_prompt(PROMPTS[0])
    tr = decode(toy, ids, DecodeConfig(mode="ar", max_new_tokens=30, stop_at_eos=False))
    out = toy.target.model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tr.output_ids == out[0, len(ids):].tolist()


def test_pruned_drafter_stays_lossless(toy):
    d = toy.drafter("d3d").pruned([0])
    ref = decode(toy, PROMPTS[1], DecodeConfig(mode="ar", max_new_tokens=30))
    for mode in ("d3d-seq", "d3d-async"):
        tr = decode(toy, PROMPTS[1], DecodeConfig(mode=mode, max_new_tokens=30), drafter=d)
        assert tr.output_ids == ref.output_ids


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["measured", "blas"])
def test_real_bundle_all_modes_equal_ar(smollm, monkeypatch, plan):
    """On the machine's own row plan, and with every small row count forced onto plain BLAS (which a machine whose
    plan keeps oneDNN would otherwise never run on the real bundle): steps and verifies then mix libraries."""
    from d3d_core.models import fastops

    if plan == "blas":
        smollm.target.row_plan()  # measured first, so the forced plan is not overwritten
        monkeypatch.setattr(smollm.target, "_row_plan", fastops.BLAS_PLAN)
    prompts = [
        "What is 17 times 23? Think step by step.",
        "Write a Python function that reverses a string.",
        "Give me three tips for a good night's sleep.",
    ]
    assert_all_modes_equal_ar(smollm, prompts)
    if plan == "blas" and not smollm.target.row_plan_info.get("blas"):
        smollm.target.drop_blas()  # the measured plan needs no BLAS copies: give their memory back


def test_shortlisted_drafters_stay_lossless(toy):
    import torch

    V = toy.target.arch.vocab_size
    keep = list(range(0, V, 3)) + [1]
    for kind, modes in (("d3d", ("d3d-seq", "d3d-async")), ("dflash", ("dflash",))):
        d = toy.drafter(kind).shortlisted(keep)
        h = torch.randn(2, 5, toy.target.arch.hidden_size)
        full, short = toy.drafter(kind).logits(h), d.logits(h)
        out = torch.ones(V, dtype=torch.bool)
        out[sorted(set(keep))] = False
        assert torch.isinf(short[..., out]).all() and torch.allclose(short[..., ~out], full[..., ~out], atol=1e-5)
        assert set(short.argmax(-1).flatten().tolist()) <= set(keep)
        for prompt in PROMPTS:
            ref = decode(toy, prompt, DecodeConfig(mode="ar", max_new_tokens=30))
            for mode in modes:
                tr = decode(toy, prompt, DecodeConfig(mode=mode, max_new_tokens=30), drafter=d)
                assert tr.output_ids == ref.output_ids, (kind, mode)


def test_anchor_first_draft_reads_the_anchor_slot_and_stays_lossless(toy):
    """first_draft='anchor': draft 1 is the anchor slot's argmax, drafts 2.. their MASK slots'; greedy output
    is still exactly ar's in both D3D modes."""
    import torch

    from d3d_core.decoding.engine import d3d_draft
    from d3d_core.models.drafter import DrafterConfig

    base = toy.drafter("d3d").with_first_draft("mask")
    d = base.with_first_draft("anchor")
    assert d.cfg.first_draft == "anchor" and base.cfg.first_draft == "mask"
    ids = toy.tokenizer.encode_prompt(PROMPTS[0])
    cfg = DecodeConfig(mode="d3d-seq", block_size=6)
    with torch.inference_mode():
        _, hb, _ = d.forward_packed(d.new_cache(), torch.tensor(ids[:-1]), [(ids[-1], len(ids) - 1)], 7)
        logits = d.logits(hb[0]).argmax(-1).tolist()  # slot j's own prediction
        got = d3d_draft(d, d.new_cache(), ids[:-1], ids[-1], cfg, None).ids
        old = d3d_draft(base, base.new_cache(), ids[:-1], ids[-1], cfg, None).ids
    assert got == [logits[0]] + logits[2:6] and old == logits[1:6]
    for B in (2, 8):
        ref = decode(toy, PROMPTS[1], DecodeConfig(mode="ar", max_new_tokens=30))
        for mode in ("d3d-seq", "d3d-async"):
            tr = decode(toy, PROMPTS[1], DecodeConfig(mode=mode, max_new_tokens=30, block_size=B), drafter=d)
            assert tr.output_ids == ref.output_ids, (mode, B)
    with pytest.raises(ValueError, match="first_draft"):
        d.with_first_draft("context")
    with pytest.raises(ValueError, match="D3D"):
        toy.drafter("dflash").with_first_draft("anchor")
    with pytest.raises(ValueError, match="first_draft"):
        DrafterConfig.from_json({**d.cfg.to_json(), "first_draft": "nope"})


def test_shipped_d3d_drafter_reads_draft_one_from_the_anchor_slot(smollm):
    assert smollm.drafter("d3d").cfg.first_draft == "anchor" and smollm.drafter("dflash").cfg.first_draft == "mask"


def test_causal_anchor_in_a_full_depth_drafter_drafts_the_targets_own_token(toy):
    """anchor_attention='causal': the anchor slot sees the context prefix and itself only, so a D3D drafter built
    from every target layer, reading draft 1 there, drafts exactly the target's greedy token (offline τ at B = 2
    is 2 at every anchor) before any training; both D3D modes stay exactly ar's."""
    from dataclasses import replace

    from d3d_core.models.bundles import BUNDLES
    from d3d_core.models.drafter import DrafterConfig
    from d3d_core.models.loader import init_drafter
    from d3d_core.training.offline_tau import greedy_continuations, offline_tau

    d = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=toy.target.num_layers)
    d.cfg = replace(d.cfg, first_draft="anchor", anchor_attention="causal")
    seqs = greedy_continuations(toy, PROMPTS, 24)
    assert offline_tau(d, seqs, B=2, stride=1) == 2.0
    block = d.with_first_draft("anchor")
    block.cfg = replace(block.cfg, anchor_attention="block")  # the shipped rule: the anchor also sees its MASK slots
    assert offline_tau(block, seqs, B=2, stride=1) < 2.0
    ref = decode(toy, PROMPTS[2], DecodeConfig(mode="ar", max_new_tokens=30))
    for mode in ("d3d-seq", "d3d-async"):
        tr = decode(toy, PROMPTS[2], DecodeConfig(mode=mode, max_new_tokens=30, block_size=4, drafting="always"), drafter=d)
        assert tr.output_ids == ref.output_ids, mode
        assert all(r.accepted >= 1 for r in tr.rounds if r.draft_ids), mode
    with pytest.raises(ValueError, match="anchor_attention"):
        DrafterConfig.from_json({**d.cfg.to_json(), "anchor_attention": "none"})
    with pytest.raises(ValueError, match="D3D"):
        replace(toy.drafter("dflash").cfg, anchor_attention="causal")
    assert DrafterConfig.from_json({k: v for k, v in d.cfg.to_json().items() if k != "anchor_attention"}).anchor_attention == "block"
