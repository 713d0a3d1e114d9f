"""An external reference for the GPU path: a tiny checkpoint and the logits of a reference run made
with the public z-lab DFlash code (shared/fixtures/dflash-public-tiny, see its README). Our loader
and DFlashDrafter must reproduce both rounds' logits and argmaxes."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from d3d_core.models.dflash import load_zlab_dflash
from d3d_core.models.target import Target

FIX = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "dflash-public-tiny"
pytestmark = pytest.mark.skipif(not (FIX / "expected.safetensors").is_file(), reason="shared/fixtures/dflash-public-tiny not present")


@pytest.fixture(scope="module")
def ref():
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(FIX / "target"), attn_implementation="eager", dtype=torch.float32)
    target = Target(model.eval(), name="dflash-public-tiny")
    exp = load_file(str(FIX / "expected.safetensors"))
    return target, exp


def test_public_drafter_reproduces_both_rounds(ref):
    target, exp = ref
    d = load_zlab_dflash(FIX / "drafter", target.shared, target.arch, target_config=target.config)
    assert d.cfg.target_layer_ids == tuple(int(i) for i in exp["target_layer_ids"])
    # the features the reference used are the target's own hidden states of the prompt
    cache = target.new_cache()
    out = target.prefill(cache, exp["prompt_ids"].long(), d.cfg.target_layer_ids)
    assert torch.allclose(out.feats[0], exp["round1_target_features"].float(), atol=1e-4)
    c = d.new_cache()
    with torch.inference_mode():
        d.extend_context(c, exp["round1_target_features"].float()[None])
        l1 = d.logits(d.forward_blocks(c, [int(exp["round1_anchor"])], d.cfg.block_size)[0, 1:]).float()
        d.extend_context(c, exp["round2_new_features"].float()[None])
        l2 = d.logits(d.forward_blocks(c, [int(exp["round2_anchor"])], d.cfg.block_size)[0, 1:]).float()
    for mine, theirs in ((l1, exp["round1_logits"].float()), (l2, exp["round2_logits"].float())):
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max().item() < 1e-4 * max(1.0, theirs.abs().max().item())
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


def _variant(tmp_path, **changes) -> Path:
    d = tmp_path / "drafter"
    shutil.copytree(FIX / "drafter", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, words", [
    ({"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
])
def test_loader_refuses_what_it_does_not_implement(ref, tmp_path, changes, words):
    target, _ = ref
    with pytest.raises(ValueError, match=words):
        load_zlab_dflash(_variant(tmp_path, **changes), target.shared, target.arch, target_config=target.config)
