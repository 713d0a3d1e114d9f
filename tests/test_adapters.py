"""Adapter drafters (DrafterConfig.adapter_rank): frozen target layers + MASK-slot adapters, on the toy bundle."""

from dataclasses import replace

import pytest
import torch
from conftest import TRAIN_PROMPTS as PROMPTS
from conftest import training_examples
from safetensors.torch import load_file

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.models import fastops
from d3d_core.models.bundles import BUNDLES
from d3d_core.models.drafter import DrafterConfig
from d3d_core.models.layers import SharedParts
from d3d_core.models.loader import init_drafter, load_drafter
from d3d_core.training.offline_tau import greedy_continuations, load_any_drafter, offline_tau
from d3d_core.training.train import PRESETS, train


@pytest.fixture(scope="module")
def examples(toy):
    return training_examples(toy, PROMPTS, 40)


def adapter_cfg(toy, **over):
    base = dict(layers=toy.target.num_layers, adapter_rank=4, first_draft="anchor", anchor_attention="causal", ar_lambda=0.0, lr=3e-2,
                steps=6, ckpt_every=2, eval_every=6)
    return replace(PRESETS["toy"], **{**base, **over})


def test_cache_prefix_blocks_equal_the_packed_forward(toy):
    """Blocks run over a cache filled once with the whole sequence (cache_prefix) see exactly what the packed
    forward shows them: the same hidden states, for a plain and for an adapter drafter."""
    torch.manual_seed(0)
    ids = torch.tensor(greedy_continuations(toy, PROMPTS[:1], 20)[0].ids)
    plain = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=2, block_size=4)
    ad = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=toy.target.num_layers, block_size=4, adapter_rank=4)
    with torch.no_grad():
        for p in ad.own_parameters():
            p.add_(0.1 * torch.randn_like(p))
    for d in (plain, ad):
        blocks = [(int(ids[p]), p) for p in (3, 9, len(ids) - 2)]
        with torch.no_grad(), fastops.exact_drafters():  # fp32 MLPs, as in training
            _, packed, _ = d.forward_packed(d.new_cache(), ids, blocks, 5)
            cache = d.new_cache()
            _, _, kv = d.forward_packed(cache, ids, [], 5)
            d.commit_kv(cache, kv, len(ids))
            _, split, _ = d.forward_packed(cache, ids[:0], blocks, 5, cache_prefix=True)
        torch.testing.assert_close(split, packed, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cache_prefix"):
        plain.forward_packed(plain.new_cache(), ids, blocks, 5, cache_prefix=True)


def test_adapter_drafter_trains_only_its_adapters_keeps_draft_one_exact_and_stays_lossless(toy, examples, tmp_path):
    """A full-depth adapter drafter with a causal anchor slot: training moves the adapters and the mask embedding
    only, the saved file holds nothing else, it reloads from the target's layers, draft 1 is still the target's
    token at every anchor, and both D3D modes emit exactly ar's tokens."""
    res = train(toy, examples, adapter_cfg(toy), tmp_path / "ad", progress=False)
    saved = load_file(str(tmp_path / "ad" / "final" / "model.safetensors"))
    assert saved and all(".adapter_" in k or k == "mask_embedding" for k in saved)
    d = load_drafter(res["out"], toy.target.shared, toy.target.arch)
    assert d.cfg.adapter_rank == 4 and d.frozen_base
    assert any(float(d.layers[i].adapter_mlp.up.weight.detach().abs().max()) > 0 for i in range(d.cfg.num_layers))  # it trained
    for mine, theirs in zip(d.layers, toy.target.layers):  # the base is the target's, untouched
        torch.testing.assert_close(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight, atol=0, rtol=0)
    seqs = greedy_continuations(toy, PROMPTS[:3], 24)
    assert offline_tau(d, seqs, B=2, stride=1) == 2.0
    fresh = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=toy.target.num_layers, block_size=4, adapter_rank=4)
    fresh.cfg = replace(fresh.cfg, first_draft="anchor", anchor_attention="causal")
    with torch.no_grad():  # the adapters change what the MASK slots draft
        ids = torch.tensor(seqs[0].ids)
        a = d.forward_packed(d.new_cache(), ids, [(int(ids[5]), 5)], 5)[1]
        b = fresh.forward_packed(fresh.new_cache(), ids, [(int(ids[5]), 5)], 5)[1]
    assert torch.equal(a[0, 0], b[0, 0]) and not torch.allclose(a[0, 1:], b[0, 1:])
    ref = decode(toy, PROMPTS[1], DecodeConfig(mode="ar", max_new_tokens=30))
    for mode in ("d3d-seq", "d3d-async"):
        for B in (2, 6):
            tr = decode(toy, PROMPTS[1], DecodeConfig(mode=mode, max_new_tokens=30, block_size=B, drafting="always"), drafter=d)
            assert tr.output_ids == ref.output_ids, (mode, B)


def test_adapter_training_resumes_bit_exactly(toy, examples, tmp_path):
    cfg = adapter_cfg(toy, steps=4, eval_every=4)
    train(toy, examples, cfg, tmp_path / "once", progress=False)
    assert train(toy, examples, cfg, tmp_path / "twice", progress=False, stop_after=2)["stopped_at"] == 2
    mid, step = load_any_drafter(tmp_path / "twice", toy)  # a checkpoint holds the adapters only; the base is rebuilt
    assert step == 2 and mid.frozen_base
    assert offline_tau(mid, greedy_continuations(toy, PROMPTS[:2], 16), B=2, stride=1) == 2.0
    train(toy, examples, cfg, tmp_path / "twice", progress=False)
    one, two = (load_file(str(tmp_path / r / "final" / "model.safetensors")) for r in ("once", "twice"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_adapter_config_is_validated_and_needs_the_target(toy, tmp_path):
    d = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=2, block_size=4, adapter_rank=2)
    with pytest.raises(ValueError, match="adapter_rank"):
        DrafterConfig.from_json({**d.cfg.to_json(), "adapter_rank": -1})
    with pytest.raises(ValueError, match="D3D"):
        replace(toy.drafter("dflash").cfg, adapter_rank=4)
    assert DrafterConfig.from_json({k: v for k, v in d.cfg.to_json().items() if k != "adapter_rank"}).adapter_rank == 0
    d.save(tmp_path / "d")
    s = toy.target.shared
    bare = SharedParts(s.embed_tokens, s.lm_head, s.rotary_emb)  # no target layers to rebuild the base from
    with pytest.raises(ValueError, match="adapter drafter"):
        load_drafter(tmp_path / "d", bare, toy.target.arch)
    with pytest.raises(ValueError, match="adapter_rank"):
        train(toy, [], adapter_cfg(toy, adapter_rank=8), tmp_path / "x", progress=False, init=d)


def test_a_further_d3d_drafter_loads_on_first_use_and_races_lossless(toy, tmp_path):
    """A bundle's further D3D drafter (``assets/drafters/<bundle>/d3d-*``, here a toy adapter drafter) is loaded on a
    race's first use, races both D3D modes with exactly ar's tokens, is named in its traces, and bad requests get
    a clear message."""
    from d3d_core import service

    d = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=toy.target.num_layers, block_size=4, adapter_rank=4)
    d.cfg = replace(d.cfg, first_draft="anchor", anchor_attention="causal")
    with torch.no_grad():
        for p in d.own_parameters():
            p.add_(0.05 * torch.randn_like(p))
    d.save(tmp_path / "d3d-deep")
    toy.extra["d3d-deep"] = tmp_path / "d3d-deep"
    try:
        assert "d3d-deep" not in toy.drafters and "d3d-deep" in toy.drafter_names()
        base = service.settings("ar", block_size=4, max_new_tokens=24, drafting="always")
        done = {m: tr for m, tr, fin in service.race("toy", PROMPTS[2], ["ar", "d3d-seq", "d3d-async"], base, d3d_drafter="d3d-deep") if fin}
        assert toy.drafters["d3d-deep"].frozen_base  # loaded now, base rebuilt from the target
        for m in ("d3d-seq", "d3d-async"):
            assert done[m].output_ids == done["ar"].output_ids, m
            assert "rank-4 adapters" in done[m].drafter and f"{toy.target.num_layers} layers" in done[m].drafter
        assert done["ar"].drafter == ""
        with pytest.raises(ValueError, match="no D3D drafter 'd3d-nope'; it has: d3d, d3d-deep"):
            list(service.race("toy", PROMPTS[2], ["d3d-seq"], base, d3d_drafter="d3d-nope"))
        # the deep drafter pruned (the Pruning tab's choice for it): still ar's tokens, its layers skipped
        pruned = {m: tr for m, tr, fin in service.race("toy", PROMPTS[2], ["ar", "d3d-seq", "d3d-async"], base,
                                                       skip_layers=[0], d3d_drafter="d3d-deep") if fin}
        for m in ("d3d-seq", "d3d-async"):
            assert pruned[m].output_ids == pruned["ar"].output_ids, m
            assert f"layer [0] of {toy.target.num_layers} skipped" in pruned[m].drafter, pruned[m].drafter
        n = toy.target.num_layers
        with pytest.raises(ValueError, match=f"has layers 0..{n - 1}; cannot skip \\[{n}\\]"):
            list(service.race("toy", PROMPTS[2], ["d3d-seq"], base, skip_layers=[n], d3d_drafter="d3d-deep"))
        with pytest.raises(ValueError, match="keep at least one"):
            list(service.race("toy", PROMPTS[2], ["d3d-seq"], base, skip_layers=list(range(n)), d3d_drafter="d3d-deep"))
        # the Pruning tab on the deep drafter: one toggle per target layer, live τ on its live set
        from app import ui

        choices = ui.layer_choices("toy", "d3d-deep")
        assert len(choices) == n and choices[0] == "L0 (target layer 0, shared)"
        msg, _, state = ui.measure_pruned("toy", choices[1:], ui.empty_state(), "d3d-deep")
        assert f"1 of {n} layers removed" in msg and state["skips"] == {"d3d-deep": [0]}, msg
    finally:
        toy.extra.pop("d3d-deep", None)
        toy.drafters.pop("d3d-deep", None)
