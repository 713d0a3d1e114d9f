"""Standalone D3D drafters of their own shape (issue 34, item 1): the fixture tests/fixtures/d3d-qwen3-tiny (written by
transformers' own Qwen3ForCausalLM.save_pretrained, scripts/make_d3d_fixture.py) on the toy-qwen3 target."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.trace import MODES
from d3d_core.models import fastops
from d3d_core.models.d3d import D3DDrafter
from d3d_core.models.loader import load_drafter
from d3d_core.models.standalone import StandaloneError, load_standalone_d3d

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "d3d-qwen3-tiny"
sys.path.insert(0, str(ROOT / "scripts"))
import make_d3d_fixture  # noqa: E402

PROMPTS = ["hello world", "what is 2+2? tell me."]


@pytest.fixture(scope="module")
def standalone(toy_qwen3):
    t = toy_qwen3.target
    return load_drafter(FIXTURE, t.shared, t.arch, t.device, t.dtype)


def test_fixture_is_a_tiny_fp16_qwen3_checkpoint_of_its_own_shape(toy_qwen3):
    from safetensors import safe_open

    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["hidden_size"] != toy_qwen3.target.arch.hidden_size
    assert cfg["vocab_size"] == toy_qwen3.target.arch.vocab_size and isinstance(cfg["mask_token_id"], int)
    size = sum(p.stat().st_size for p in FIXTURE.iterdir())
    assert size < 256 * 1024, size
    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
        assert "lm_head.weight" in f.keys() and "model.embed_tokens.weight" in f.keys()


def test_standalone_drafter_has_its_own_shape_embedding_and_head(toy_qwen3, standalone):
    t = toy_qwen3.target
    assert isinstance(standalone, D3DDrafter) and standalone.cfg.standalone
    assert standalone.cfg.arch.hidden_size == 48 != t.arch.hidden_size and standalone.cfg.num_layers == 2
    assert standalone.cfg.arch.qk_norm and standalone.layers[0].self_attn.q_norm is not None
    assert standalone.shared.embed_tokens is not t.shared.embed_tokens and standalone.shared.lm_head is not t.shared.lm_head
    assert standalone.shared.embed_tokens.weight.shape == (t.arch.vocab_size, 48)
    assert "standalone" in standalone.describe() and "48" in standalone.describe()
    # the MASK slots' input is the mask token's own embedding row
    assert torch.equal(standalone.mask_embedding, standalone.shared.embed_tokens.weight[standalone.cfg.mask_token_id])


def test_context_stream_computes_what_transformers_computes(standalone):
    """The drafter's causal context stream is the checkpoint's own causal LM: its next-token logits equal
    transformers' Qwen3ForCausalLM forward over the same tokens (weights, q/k-norm, RoPE, head mapped one to one)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()
    ids = torch.tensor([2, 10, 11, 12, 30, 5, 7, 9, 3])
    with torch.inference_mode(), fastops.exact_drafters():
        ref = hf(ids[None]).logits[0]
        h_ctx, _, _ = standalone.forward_packed(standalone.new_cache(), ids, [], 1)
        mine = standalone.logits(h_ctx)
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()


def test_standalone_drafter_is_lossless_in_every_mode(toy_qwen3, standalone):
    """T = 0: every mode emits exactly the ar tokens, the D3D modes drafting with the standalone drafter (B 4 and 8, H 1 and 3)."""
    drafted = 0
    for p in PROMPTS:
        ref = decode(toy_qwen3, p, DecodeConfig(mode="ar", max_new_tokens=40))
        for mode in MODES[1:]:
            for B, H in ((4, 1), (8, 3)):
                dr = standalone if mode.startswith("d3d") else None
                tr = decode(toy_qwen3, p, DecodeConfig(mode=mode, max_new_tokens=40, block_size=B, hypotheses=H), drafter=dr)
                assert tr.output_ids == ref.output_ids, (mode, B, H, p)
                if dr is not None:
                    assert tr.drafter == standalone.describe()
                    drafted += sum(len(r.draft_ids) for r in tr.rounds)
    assert drafted > 0  # the standalone drafter did draft (every token was still the target's)


@pytest.mark.parametrize("mode,rule", [("d3d-seq", "rejection"), ("d3d-async", "rejection")])  # rejection sampling reads the drafter's q
def test_standalone_drafter_samples_the_target_distribution(toy_qwen3, standalone, mode, rule):
    """T > 0: the second output token over 600 seeds follows the target's exact distribution (chi-square)."""
    from test_sampling import _assert_second_token_matches_target

    _assert_second_token_matches_target(toy_qwen3, mode, rule, drafter=standalone)


def _copy(tmp_path, name="d"):
    out = tmp_path / name
    shutil.copytree(FIXTURE, out)
    return out


def test_loader_refuses_a_wrong_vocabulary(tmp_path, toy_qwen3):
    bad = make_d3d_fixture.make(tmp_path / "v", vocab=toy_qwen3.target.arch.vocab_size + 7)
    with pytest.raises(StandaloneError, match=r"vocabulary of 56 tokens but the target's has 49"):
        load_standalone_d3d(bad, toy_qwen3.target.arch.vocab_size)


def test_loader_refuses_a_missing_mask_token(tmp_path, toy_qwen3):
    bad = make_d3d_fixture.make(tmp_path / "m", mask=False)
    with pytest.raises(StandaloneError, match="names no mask token"):
        load_standalone_d3d(bad, toy_qwen3.target.arch.vocab_size)


def test_loader_reads_the_mask_token_from_the_tokenizer(tmp_path, toy_qwen3):
    d = make_d3d_fixture.make(tmp_path / "t", mask=False)
    (d / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<|mask|>", "added_tokens_decoder": {"5": {"content": "<|mask|>"}}}))
    dr = load_standalone_d3d(d, toy_qwen3.target.arch.vocab_size)
    assert dr.cfg.mask_token_id == 5


def test_loader_refuses_non_safetensors_weights(tmp_path, toy_qwen3):
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not read")  # never unpickled: refused by its name
    with pytest.raises(StandaloneError, match=r"non-safetensors format \(pytorch_model.bin\)"):
        load_standalone_d3d(d, toy_qwen3.target.arch.vocab_size)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(StandaloneError, match="has no weights"):
        load_standalone_d3d(d, toy_qwen3.target.arch.vocab_size)


def test_loader_refuses_truncated_weights_in_one_sentence(tmp_path, toy_qwen3):
    d = _copy(tmp_path)
    (d / "model.safetensors").write_bytes((FIXTURE / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(StandaloneError, match="could not be read as a causal-LM checkpoint"):
        load_standalone_d3d(d, toy_qwen3.target.arch.vocab_size)


def test_bench_races_the_standalone_drafter_lossless_and_says_why_it_refuses(tmp_path, capsys, toy_qwen3):
    from d3d_core.measure import bench

    out = tmp_path / "b.json"
    rc = bench.main(["--bundle", "toy-qwen3", "--d3d-drafter", str(FIXTURE), "--prompt", "hello world", "--n", "1",
                     "--max-new-tokens", "24", "--peers", "none", "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {s["mode"] for s in res["summary"]} == set(MODES)
    assert all(s["lossless_rate"] == 1.0 for s in res["summary"] if s["mode"] != "ar")
    assert "standalone" in res["config"]["drafters_run"]["d3d-seq"]
    bad = make_d3d_fixture.make(tmp_path / "v", vocab=60)
    capsys.readouterr()
    rc = bench.main(["--bundle", "toy-qwen3", "--d3d-drafter", str(bad), "--prompt", "hi", "--n", "1", "--peers", "none",
                     "--no-progress", "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "error: D3D drafter at" in err and "vocabulary of 60 tokens" in err


def test_loader_refuses_a_checkpoint_whose_weights_do_not_cover_the_model(tmp_path, toy_qwen3):
    """A checkpoint without some of its layers' tensors: transformers would leave them random, so the loader refuses
    instead of drafting from noise."""
    from safetensors.torch import load_file, save_file

    d = _copy(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.startswith("model.layers.1.mlp.")}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(StandaloneError, match=r"lacks 3 of its qwen3 weights \(e.g. model.layers.1.mlp"):
        load_standalone_d3d(d, toy_qwen3.target.arch.vocab_size)


def test_the_qwen3_bundle_takes_a_standalone_drafter_whose_mask_token_is_in_its_tokenizer(tmp_path):
    """The qwen3-8b code path (D3D_QWEN3_D3D=DIR) on small local directories: a standalone drafter half the target's
    width whose mask token comes from its saved tokenizer (a real one, <|MASK|>); every mode equals ar."""
    from test_qwen3_path import _tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from d3d_core.models.bundles import load_qwen3_bundle

    tok = _tokenizer()
    for name, shape, seed in (("target", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4), 0),
                              ("drafter", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2), 1)):
        cfg = Qwen3Config(vocab_size=len(tok), num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=0, **shape)
        torch.manual_seed(seed)
        m = Qwen3ForCausalLM(cfg)
        with torch.no_grad():
            m.lm_head.weight.mul_(12.0)
        m.to(torch.float16 if name == "drafter" else torch.float32).save_pretrained(tmp_path / name)
        if name == "drafter":
            tok.add_special_tokens({"mask_token": "<|MASK|>"})
        tok.save_pretrained(tmp_path / name)
    assert "mask_token_id" not in json.loads((tmp_path / "drafter" / "config.json").read_text())
    b = load_qwen3_bundle("qwen3-standalone-test", str(tmp_path / "target"), d3d=str(tmp_path / "drafter"), device="cpu")
    d = b.drafter("d3d")
    assert d.cfg.standalone and d.cfg.arch.hidden_size == 32 and d.cfg.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
    assert b.drafter_info["d3d"].endswith(str(tmp_path / "drafter"))
    ref = decode(b, "what is two plus two?", DecodeConfig(mode="ar", max_new_tokens=24, stop_at_eos=False))
    for mode in MODES[1:]:
        tr = decode(b, "what is two plus two?", DecodeConfig(mode=mode, max_new_tokens=24, block_size=4, stop_at_eos=False))
        assert tr.output_ids == ref.output_ids, mode


def test_a_standalone_drafter_is_not_resaved_in_the_project_layout(standalone, tmp_path):
    with pytest.raises(ValueError, match="not re-saved"):
        standalone.save(tmp_path / "x")
    assert not (tmp_path / "x").exists()
