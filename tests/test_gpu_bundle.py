"""No untrained D3D drafter on a GPU bundle (issue #34, item 2): until a trained one is named, its D3D drafter is the
shared-weight adapter drafter — the target's own layers (the same storage, no copy) plus zero-initialised adapters,
so draft 1 is the target's token. Checked on the toy Qwen3 target configured the way ``qwen3-8b`` is."""

from dataclasses import replace

import pytest
import torch

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.models import bundles
from d3d_core.models.adapter import SHARED_ADAPTER_INFO
from d3d_core.models.bundles import BUNDLES
from d3d_core.models.loader import DrafterSpec, init_drafter, load_drafter

PROMPTS = ["what is two plus two?", "tell me a story", "count to ten"]


@pytest.fixture(scope="module")
def gpu_way():
    """toy-qwen3 loaded the way a GPU bundle is: no shipped D3D drafter, its D3D spec with ``adapter_rank`` set (a fresh bundle,
    not the session's)."""
    spec = BUNDLES["toy-qwen3"]
    BUNDLES["toy-qwen3"] = replace(spec, drafters=(DrafterSpec("d3d", adapter_rank=4), spec.drafter("dflash")))
    try:
        yield bundles._load("toy-qwen3", "cpu")
    finally:
        BUNDLES["toy-qwen3"] = spec


def test_qwen3_8b_is_configured_for_the_shared_adapter_drafter():
    spec = BUNDLES["qwen3-8b"]
    assert spec.gpu_only and spec.drafter("d3d").adapter_rank > 0 and spec.params > 8e9


def test_the_gpu_way_d3d_drafter_shares_the_targets_weights(gpu_way):
    b = gpu_way
    d = b.drafter("d3d")
    tgt = b.target
    assert b.drafter_info["d3d"] == SHARED_ADAPTER_INFO and not b.drafter_info["d3d"].startswith("untrained")
    assert d.frozen_base and d.cfg.num_layers == tgt.num_layers and d.cfg.init_layers == tuple(range(tgt.num_layers))
    assert d.cfg.first_draft_is_targets()
    # every base weight is the target's own storage: same data_ptr, never a copy
    for mine, theirs in zip(d.layers, tgt.layers):
        ours = dict(mine.named_buffers())
        for name, t in theirs.named_parameters():
            assert ours[name].data_ptr() == t.data_ptr(), name
            assert ours[name].shape == t.shape
    assert d.norm.weight.data_ptr() == tgt.final_norm.weight.data_ptr()
    assert d.shares_base()
    # what the drafter owns is its adapters and mask embedding, a sliver of the target's layers
    own = sum(p.numel() for p in d.parameters())
    layers = sum(p.numel() for p in tgt.layers.parameters())
    assert {n.split(".")[-3] if n.startswith("layers.") else n for n, _ in d.named_parameters()} == {"adapter_attn", "adapter_mlp", "mask_embedding"}
    assert own < 0.5 * layers
    assert all(float(layer.adapter_attn.up.weight.detach().abs().max()) == 0 and float(layer.adapter_mlp.up.weight.detach().abs().max()) == 0 for layer in d.layers)
    # labelled as such in the app: the trace's drafter line
    assert "shared-weight adapter drafter" in d.describe() and "untrained adapters: draft 1 = target's token" in d.describe()
    tr = decode(b, PROMPTS[0], DecodeConfig(mode="d3d-seq", max_new_tokens=8, block_size=4))
    assert tr.drafter == d.describe()


@pytest.mark.parametrize("mode", ["d3d-seq", "d3d-async"])
def test_the_gpu_way_drafter_is_lossless_and_draft_one_is_always_accepted(gpu_way, mode):
    """Temperature 0: the same tokens as ar, and every drafted round accepts draft 1 (the target's own token), so τ ≥ 2."""
    b = gpu_way
    for prompt in PROMPTS:
        ref = decode(b, prompt, DecodeConfig(mode="ar", max_new_tokens=40, stop_at_eos=False))
        for B in (4, 8):
            tr = decode(b, prompt, DecodeConfig(mode=mode, max_new_tokens=40, block_size=B, drafting="always", verify="full", stop_at_eos=False))
            assert tr.output_ids == ref.output_ids, (mode, prompt, B)
            drafted = [r for r in tr.rounds if r.draft_ids]
            assert drafted and all(r.accepted >= 1 for r in drafted), [(r.accepted, r.draft_ids) for r in drafted]
            assert tr.stats.tau >= 2.0, tr.stats.tau


def test_adapter_drafters_share_without_ever_writing_into_the_target(toy, tmp_path):
    """A saved adapter drafter (``d3d-deep``'s kind) loads with its base shared, not copied; loading a full state
    dict never writes into the target; a dtype change gives the drafter its own copy and leaves the target as it was."""
    fresh = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=toy.target.num_layers, block_size=4, adapter_rank=4)
    assert fresh.shares_base()  # init_drafter with adapters: shared too (nothing copied, nothing allocated for the base)
    fresh.save(tmp_path / "ad")
    d = load_drafter(tmp_path / "ad", toy.target.shared, toy.target.arch)
    assert d.shares_base()
    q = toy.target.layers[0].self_attn.q_proj.weight
    before = q.detach().clone()
    sd = {k: (v + 1.0 if not d.is_own(k) else v) for k, v in d.state_dict().items()}
    d.load_state_dict(sd)  # base entries are left out: they are the target's weights
    assert torch.equal(q, before)
    with pytest.raises(RuntimeError, match="missing keys"):
        d.load_state_dict({k: v for k, v in sd.items() if k != "mask_embedding"})
    d64 = load_drafter(tmp_path / "ad", toy.target.shared, toy.target.arch).to(torch.float64)
    assert d64.layers[0].self_attn.q_proj.weight.dtype == torch.float64 and q.dtype == torch.float32
    assert not d64.shares_base() and torch.equal(q, before)
