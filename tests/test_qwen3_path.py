"""The qwen3-8b code path on CPU: a small random Qwen3 target built from a local directory, and
a synthetic checkpoint in the z-lab DFlash layout loaded into our drafter class."""

import json

import pytest
import torch

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.trace import MODES
from d3d_core.models.bundles import load_qwen3_bundle, register_bundle
from d3d_core.models.dflash import DFlashDrafter, load_zlab_dflash, save_zlab_dflash
from d3d_core.models.drafter import DrafterConfig, evenly_spaced

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
            "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["what is two plus two? the answer is four.", "tell me a story about a cat and a dog.", "hello there, how are you?"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|MASK|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>", pad_token="<unk>", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("qwen3")
    tok = _tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.mul_(12.0)  # structured greedy text from a random model
    m.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return root, tok


def _direct_dflash(bundle, mask_id, seed=1):
    """A DFlash drafter built directly with our class, random weights."""
    tgt = bundle.target
    cfg = DrafterConfig(kind="dflash", arch=tgt.arch, num_layers=2, block_size=16, target_layer_ids=evenly_spaced(3, 1, 5),
                        mask_token_id=mask_id)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg, tgt.shared)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.05)
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
        d.mask_embedding.copy_(tgt.shared.embed_tokens.weight[mask_id])
    return d.eval()


def test_zlab_checkpoint_loads_with_identical_logits(qwen_dirs):
    root, tok = qwen_dirs
    b = load_qwen3_bundle("qwen3-test", str(root / "target"), device="cpu")
    assert b.attention == "sdpa" and b.target.arch.qk_norm
    mask_id = tok.convert_tokens_to_ids("<|MASK|>")
    direct = _direct_dflash(b, mask_id)
    save_zlab_dflash(direct, root / "dflash", num_target_layers=8, mask_token_id=mask_id)
    cfg = json.loads((root / "dflash" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == mask_id and cfg["block_size"] == 16
    loaded = load_zlab_dflash(root / "dflash", b.target.shared, b.target.arch)
    feats = torch.randn(1, 12, 3 * 64, generator=torch.Generator().manual_seed(0))
    outs = []
    for d in (direct, loaded):
        c = d.new_cache()
        d.extend_context(c, feats)
        outs.append(d.logits(d.forward_blocks(c, [7], 16)))
    assert torch.equal(outs[0], outs[1])


def test_all_modes_lossless_through_the_qwen3_path(qwen_dirs):
    root, tok = qwen_dirs
    mask_id = tok.convert_tokens_to_ids("<|MASK|>")
    b0 = load_qwen3_bundle("qwen3-test", str(root / "target"), device="cpu")
    save_zlab_dflash(_direct_dflash(b0, mask_id), root / "dflash2", num_target_layers=8, mask_token_id=mask_id)
    b = load_qwen3_bundle("qwen3-local", str(root / "target"), dflash=str(root / "dflash2"), device="cpu")
    register_bundle(b)
    assert "z-lab" in b.drafter_info["dflash"]
    ids = b.tokenizer.encode_prompt("what is two plus two?")
    assert "<think>" in b.tokenizer.decode(ids)  # Qwen3 chat template with thinking disabled
    for B in (4, 16):
        ref = decode(b, ids, DecodeConfig(mode="ar", max_new_tokens=40, stop_at_eos=False))
        for mode in MODES[1:]:
            tr = decode(b, ids, DecodeConfig(mode=mode, block_size=B, max_new_tokens=40, stop_at_eos=False))
            assert tr.output_ids == ref.output_ids, (mode, B)


def test_clear_errors(qwen_dirs, tmp_path, monkeypatch):
    root, tok = qwen_dirs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not a local directory and the hub is offline"):
        load_qwen3_bundle("x", str(tmp_path / "nope"), device="cpu")
    b = load_qwen3_bundle("qwen3-test", str(root / "target"), device="cpu")
    # a DFlash2-style checkpoint (extra candidate selector) is refused by name
    mask_id = tok.convert_tokens_to_ids("<|MASK|>")
    d = _direct_dflash(b, mask_id)
    save_zlab_dflash(d, tmp_path / "v2", num_target_layers=8, mask_token_id=mask_id)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "v2" / "model.safetensors"))
    sd["candidate_selector.hidden_projection.weight"] = torch.zeros(4, 64)
    save_file(sd, str(tmp_path / "v2" / "model.safetensors"))
    with pytest.raises(ValueError, match="unsupported DFlash variant"):
        load_zlab_dflash(tmp_path / "v2", b.target.shared, b.target.arch)
    cfg = json.loads((tmp_path / "v2" / "config.json").read_text())
    cfg["num_target_layers"] = 36
    (tmp_path / "v2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="36-layer target"):
        load_zlab_dflash(tmp_path / "v2", b.target.shared, b.target.arch)


def test_the_qwen3_paths_default_d3d_drafter_is_the_shared_adapter_drafter(qwen_dirs):
    """Without a D3D drafter named, the Qwen3 path (``qwen3-8b``'s) builds no untrained copy: its D3D drafter is the
    target's own layers, shared (same storage), with zero-initialised adapters, and says so."""
    from d3d_core.models.adapter import SHARED_ADAPTER_INFO

    root, _ = qwen_dirs
    b = load_qwen3_bundle("qwen3-test", str(root / "target"), device="cpu")
    d = b.drafter("d3d")
    assert b.drafter_info["d3d"] == SHARED_ADAPTER_INFO and d.shares_base() and d.cfg.first_draft_is_targets()
    assert d.layers[3].mlp.up_proj.weight.data_ptr() == b.target.layers[3].mlp.up_proj.weight.data_ptr()
    assert d.layers[0].self_attn.q_norm.weight.data_ptr() == b.target.layers[0].self_attn.q_norm.weight.data_ptr()
    ids = b.tokenizer.encode_prompt("tell me a story about a cat")
    for mode in ("d3d-seq", "d3d-async"):
        tr = decode(b, ids, DecodeConfig(mode=mode, block_size=6, max_new_tokens=30, drafting="always", verify="full", stop_at_eos=False))
        assert all(r.accepted >= 1 for r in tr.rounds if r.draft_ids) and tr.stats.tau >= 2.0, mode


def test_the_memory_check_runs_before_any_weight_is_fetched(qwen_dirs, monkeypatch):
    """The Qwen3 path reads the target's config alone, checks memory, and only then resolves (downloads) the weights:
    a target that does not fit is refused with one sentence and nothing is fetched."""
    from d3d_core.models import hardware, sources

    root, _ = qwen_dirs

    def no_fetch(*a, **k):
        raise AssertionError("weights fetched before the memory check")

    monkeypatch.setattr(sources, "resolve", no_fetch)
    monkeypatch.setattr(hardware, "available_ram_bytes", lambda: 64 << 20)
    with pytest.raises(hardware.BundleUnavailable, match=r"not enough memory to load target .* [GM]iB of RAM"):
        load_qwen3_bundle("qwen3-test", str(root / "target"), device="cpu")
