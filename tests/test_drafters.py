"""Drafter building blocks: save/load, initialisation, pruning switches."""

import pytest
import torch

from d3d_core.models.bundles import BUNDLES
from d3d_core.models.drafter import evenly_spaced
from d3d_core.models.loader import init_drafter, load_drafter


def test_evenly_spaced_matches_dflash_choice():
    assert evenly_spaced(5, 1, 27) == (1, 8, 14, 20, 27)  # SmolLM2: 30 layers, 1 .. L-3 (round half to even)
    assert evenly_spaced(1, 0, 9) == (4,)
    assert evenly_spaced(0, 0, 9) == ()


def test_save_load_round_trip_gives_identical_logits(tmp_path, toy):
    for kind in ("d3d", "dflash"):
        d = init_drafter(kind, toy.target, BUNDLES["toy"], seed=3)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn_like(p) * 0.01)
            # fp16 storage: compare against the fp16-rounded weights
            for p in d.parameters():
                p.copy_(p.half().float())
        d.save(tmp_path / kind)
        back = load_drafter(tmp_path / kind, toy.target.shared, toy.target.arch)
        assert back.cfg == d.cfg
        x = torch.randn(1, 5, toy.target.arch.hidden_size)
        assert torch.equal(d.logits(x), back.logits(x))
        for (n1, p1), (n2, p2) in zip(d.state_dict().items(), back.state_dict().items()):
            assert n1 == n2 and torch.equal(p1, p2)


def test_drafter_initialised_from_target_layers(toy):
    d = toy.drafter("d3d")
    for i, src in enumerate(d.cfg.init_layers):
        a = d.layers[i].self_attn.q_proj.weight
        b = toy.target.layers[src].self_attn.q_proj.weight
        assert torch.equal(a, b)


def test_skip_layers_passes_residual_through(toy):
    d = toy.drafter("d3d")
    p = d.pruned(list(range(d.cfg.num_layers)))  # every layer skipped: blocks see only embeddings
    assert p.active_layers() == [] and d.active_layers() == list(range(d.cfg.num_layers))
    assert p.layers[0] is d.layers[0]  # pruning shares weights
    cache = p.new_cache()
    ctx = torch.tensor([5, 6, 7])
    _, hb, _ = p.forward_packed(cache, ctx, [(9, 3)], 4)
    emb = toy.target.shared.embed_tokens
    assert torch.allclose(hb[0, 0], emb(torch.tensor(9)))
    assert torch.allclose(hb[0, 1], d.mask_embedding)


def test_qwen3_drafter_has_qk_norm(toy_qwen3):
    d = toy_qwen3.drafter("d3d")
    assert d.layers[0].self_attn.q_norm is not None
    assert toy_qwen3.target.arch.qk_norm


def test_build_shortlist_keeps_the_most_frequent_and_end_tokens():
    from d3d_core.training.offline_tau import CalibSeq
    from d3d_core.training.shortlist import build_shortlist, coverage

    ex = [{"response_ids": [5, 5, 5, 7, 7, 9]}, {"response_ids": [5, 7, 11]}]
    ids = build_shortlist(ex, 2, always=[2])
    assert ids == (2, 5, 7)
    assert coverage(ids, [CalibSeq([1], [5, 7, 9, 2])]) == 0.75
    with pytest.raises(ValueError):
        build_shortlist(ex, 0)


def test_shortlist_round_trips_through_save_and_load(toy, tmp_path):
    from d3d_core.models.loader import load_drafter

    d = toy.drafter("d3d").shortlisted([1, 4, 9])
    d.save(tmp_path / "d")
    back = load_drafter(tmp_path / "d", toy.target.shared, toy.target.arch)
    assert back.cfg.vocab_shortlist == (1, 4, 9)


def test_rope_table_is_kept_per_dtype_and_does_not_grow_when_dtypes_alternate(toy):
    """fp32 features beside bf16 blocks once made the shared table double at every change of dtype until memory ran out."""
    shared = toy.target.shared
    pos = torch.arange(10)
    with torch.no_grad():
        for _ in range(8):
            for dt in (torch.float32, torch.bfloat16):
                cos, sin = shared.rope(pos, torch.zeros(1, dtype=dt))
                assert cos.dtype == sin.dtype == dt and cos.shape[1] == 10
        lengths = {k[0]: t[0].shape[1] for k, t in shared._rope_tables.items()}
        assert lengths == {torch.float32: 1024, torch.bfloat16: 1024}
        shared.rope(torch.tensor([1500]), torch.zeros(1))  # a longer context grows that dtype's table once
        assert shared._rope_tables[(torch.float32, torch.device("cpu"))][0].shape[1] == 2048
