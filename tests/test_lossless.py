"""Temperature 0: every mode emits exactly the AR tokens."""

import pytest

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
def test_real_bundle_all_modes_equal_ar(smollm):
    prompts = [
        "What is 17 times 23? Think step by step.",
        "Write a Python function that reverses a string.",
        "Give me three tips for a good night's sleep.",
    ]
    for p in prompts:
        ref = decode(smollm, p, DecodeConfig(mode="ar", max_new_tokens=48))
        assert len(ref.output_ids) == 48 or ref.finish_reason == "eos"
        for mode in MODES[1:]:
            tr = decode(smollm, p, DecodeConfig(mode=mode, max_new_tokens=48, block_size=8))
            assert tr.output_ids == ref.output_ids, (mode, p, tr.output_text, ref.output_text)


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
