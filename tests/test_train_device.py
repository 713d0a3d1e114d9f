"""Training and distillation on the bundle's device, with bf16 autocast and fp32 master weights (issue 34, item 6).

There is no GPU here, so the GPU configuration is reproduced on the CPU where it can be: autocast forced to bf16
(``amp="bf16"``), a toy target converted to bf16 (what a GPU bundle holds), the sequences of a step in one packed
forward (``pack="on"``, the CUDA default). Device placement is checked by hooks on every module (each tensor it is
handed lives where its weights do) and, for distillation, by a stub target on a second device ("meta") whose inputs
must be made there.
"""

import json
import random
from dataclasses import replace

import pytest
import torch
from conftest import TRAIN_PROMPTS as PROMPTS
from conftest import training_examples
from safetensors.torch import load_file

from d3d_core.models.bundles import Bundle
from d3d_core.models.sources import build_toy_target
from d3d_core.training.distill import generate_batch
from d3d_core.training.losses import HeadLoss
from d3d_core.training.train import PRESETS, TrainConfig, autocast, d3d_loss, for_training, fresh_drafter, master_dtype, packed_hidden, sample_anchors, to_seq, train


@pytest.fixture(scope="module")
def examples(toy):
    return training_examples(toy, PROMPTS, 32)


@pytest.fixture(scope="module")
def toy_bf16():
    """The toy bundle's target in bf16, as a GPU bundle holds its target (a new one: the shared toy stays fp32)."""
    target, tok = build_toy_target()
    target.model.to(torch.bfloat16)
    return Bundle("toy", target, tok, {})


def _cfg(**over) -> TrainConfig:
    return replace(PRESETS["toy"], **{**dict(steps=4, accum=2, anchors=4, eval_every=2, ckpt_every=2, eval_seqs=2), **over})


def test_a_bf16_autocast_step_keeps_fp32_master_weights(toy, examples):
    cfg = _cfg(amp="bf16")
    dev = toy.target.device
    d = for_training(fresh_drafter(toy, cfg), dev, master_dtype(cfg, toy.target.dtype, dev)).train()
    own = d.own_parameters()
    opt = torch.optim.AdamW(own, lr=1e-3)
    seen = []
    hook = d.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    seq = to_seq(examples[0], cfg.max_len)
    try:
        with autocast(cfg, dev):
            loss, block, ar = d3d_loss(d, seq, sample_anchors(seq, 4, random.Random(0)), cfg, random.Random(0))
    finally:
        hook.remove()
    assert seen == [torch.bfloat16]  # the forward ran under bf16 autocast
    assert torch.isfinite(loss) and loss.dtype == torch.float32 and block > 0
    loss.backward()
    opt.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in own)
    assert all(t.dtype == torch.float32 for st in opt.state.values() for k, t in st.items() if k != "step")


def test_training_a_bf16_target_keeps_the_base_shared_and_the_trained_weights_fp32(toy_bf16, examples):
    for rank in (0, 4):
        cfg = _cfg(amp="bf16", adapter_rank=rank)
        d = for_training(fresh_drafter(toy_bf16, cfg), toy_bf16.target.device, master_dtype(cfg, toy_bf16.target.dtype, "cpu"))
        assert {p.dtype for p in d.own_parameters()} == {torch.float32}
        if rank:  # the adapter drafter's base is the target's bf16 layers themselves, not an fp32 copy
            assert d.shares_base() and d.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # without autocast a bf16 target trains in its own dtype (nothing would reconcile fp32 weights with it)
    assert master_dtype(_cfg(amp="off"), torch.bfloat16, "cpu") == torch.bfloat16
    assert master_dtype(_cfg(), torch.bfloat16, "cuda") == torch.float32  # auto: autocast on CUDA, fp32 masters


@pytest.mark.parametrize("kind,rank", [("d3d", 0), ("d3d", 4), ("dflash", 0)])
def test_bf16_training_runs_end_to_end_and_resumes_exactly(toy_bf16, examples, tmp_path, kind, rank):
    cfg = _cfg(kind=kind, layers=1 if kind == "dflash" else 2, amp="bf16", pack="on", adapter_rank=rank)
    full = train(toy_bf16, examples, cfg, tmp_path / "full", progress=False)
    assert all(h["loss"] == h["loss"] and abs(h["loss"]) < 1e4 for h in full["history"][1:])  # finite
    train(toy_bf16, examples, cfg, tmp_path / "resumed", progress=False, stop_after=2)
    resumed = train(toy_bf16, examples, cfg, tmp_path / "resumed", progress=False)
    for f in ("drafter.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(tmp_path / "full" / "ckpt" / f)), load_file(str(tmp_path / "resumed" / "ckpt" / f))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f
        assert {t.dtype for t in a.values()} == {torch.float32}, f  # master weights and moments
    assert full["offline_tau"] == resumed["offline_tau"]  # evaluated under autocast too
    state = json.loads((tmp_path / "full" / "ckpt" / "state.json").read_text())
    assert state["train"]["amp"] == "bf16" and state["train"]["pack"] == "on"


@pytest.mark.parametrize("rank", [0, 4])
def test_one_packed_forward_over_several_sequences_equals_one_forward_each(toy, examples, rank):
    cfg = _cfg(adapter_rank=rank)
    d = fresh_drafter(toy, cfg).train()
    items = [(to_seq(e, cfg.max_len), None) for e in examples[:3]]
    items = [(s, sample_anchors(s, 4, random.Random(i))) for i, (s, _) in enumerate(items)]
    head = HeadLoss(d.cfg.arch.vocab_size)
    for (s, a), (hc, hb) in zip(items, packed_hidden(d, items, cfg.block_size)):
        hc1, hb1, _ = d.forward_packed(d.new_cache(), torch.tensor(s.ids), [(s.ids[p], p) for p in a], cfg.block_size + 1)
        assert torch.allclose(hc, hc1, atol=1e-5) and torch.allclose(hb, hb1, atol=1e-5)
        one = d3d_loss(d, s, a, cfg, random.Random(1), head=head)[0]
        packed = d3d_loss(d, s, a, cfg, random.Random(1), head=head, hidden=(hc, hb))[0]
        assert torch.allclose(one, packed, atol=1e-5)


def test_one_dflash_pass_over_several_sequences_equals_one_pass_each(toy, examples):
    from d3d_core.training.offline_tau import dflash_anchor_logits
    from d3d_core.training.train import dflash_feats, dflash_loss, dflash_packed_logits

    cfg = _cfg(kind="dflash", layers=1)
    d = fresh_drafter(toy, cfg).train()
    seqs = [to_seq(e, cfg.max_len) for e in examples[:3]]
    items = [(dflash_feats(d, toy.target, s.ids), s.ids, sample_anchors(s, 4, random.Random(i))) for i, s in enumerate(seqs)]
    for (feats, ids, a), s, lg in zip(items, seqs, dflash_packed_logits(d, items, cfg.block_size)):
        one = dflash_anchor_logits(d, feats, ids, a, cfg.block_size).float()
        assert lg.shape == one.shape and torch.allclose(lg, one, atol=1e-4)
        assert torch.allclose(dflash_loss(d, toy.target, s, a, cfg, logits=lg)[0], dflash_loss(d, toy.target, s, a, cfg)[0], atol=1e-5)


def _device_spy(wrong: list, *modules, calls=None) -> list:
    """Forward pre-hooks on every submodule holding weights: each tensor handed to it must be on its weights' device;
    ``wrong`` collects the offenders, ``calls`` (a list) one entry per call checked. Returns the hooks' handles."""
    handles = []

    def check(m, args, kwargs):
        if calls is not None:
            calls.append(type(m).__name__)
        dev = next(iter(list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))), None)
        for t in list(args) + list(kwargs.values()):
            if isinstance(t, torch.Tensor) and dev is not None and t.device != dev.device:
                wrong.append((type(m).__name__, t.device, dev.device))

    for mod in modules:
        for m in mod.modules():
            if list(m.parameters(recurse=False)) or list(m.buffers(recurse=False)):
                handles.append(m.register_forward_pre_hook(check, with_kwargs=True))
    return handles


@pytest.mark.parametrize("kind,pack", [("d3d", "on"), ("d3d", "off"), ("dflash", "on"), ("dflash", "off")])
def test_every_tensor_reaches_the_models_on_their_device(toy, examples, tmp_path, monkeypatch, kind, pack):
    import d3d_core.training.train as T

    cfg = _cfg(kind=kind, layers=1 if kind == "dflash" else 2, pack=pack, steps=1, eval_every=1, ckpt_every=1)
    wrong, calls = [], []
    handles = _device_spy(wrong, toy.target.model, calls=calls)
    placed = T.for_training

    def spied(d, device, dtype=torch.float32):  # the drafter train() builds, spied the same way
        d = placed(d, device, dtype)
        handles.extend(_device_spy(wrong, d, calls=calls))
        return d

    monkeypatch.setattr(T, "for_training", spied)
    try:
        train(toy, examples, cfg, tmp_path / kind, progress=False)
        generate_batch(toy.target, toy.tokenizer, [e["prompt_ids"] for e in examples[:2]], 4)
    finally:
        for h in handles:
            h.remove()
    assert not wrong, wrong[:3]
    assert {"Embedding", "Linear", "RMSNorm"} <= set(calls)  # the spies saw the target's and the drafter's modules run


class _StubTarget:
    """A target on another device than the CPU ("meta": the one a CPU-only host has), whose generate checks where
    its inputs were made and answers with host tensors (what a CUDA model's output looks like after .tolist())."""

    device = torch.device("meta")

    def __init__(self):
        self.seen = []
        self.model = self

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        self.seen += [input_ids.device, attention_mask.device]
        n, L = input_ids.shape
        new = torch.tensor([[5, 6, 1] + [0] * (max_new_tokens - 3)] * n)
        return torch.cat([torch.zeros(n, L, dtype=torch.long), new], dim=1)


def test_distillation_makes_the_prompts_ids_on_the_targets_device():
    stub = _StubTarget()

    class Tok:
        eos_ids = {1}

    out = generate_batch(stub, Tok(), [[3, 4, 5], [7]], 5)
    assert stub.seen and all(d == torch.device("meta") for d in stub.seen)
    assert out == [([5, 6, 1], "eos"), ([5, 6, 1], "eos")]


def test_bad_amp_or_pack_is_one_clear_sentence(capsys, tmp_path):
    from d3d_core.training.train import main

    with pytest.raises(ValueError, match="amp must be one of auto, bf16, off"):
        TrainConfig(amp="fp8")
    assert main(["--bundle", "toy", "--out", str(tmp_path / "x"), "--pack", "sometimes"]) == 2
    assert "pack must be one of auto, on, off" in capsys.readouterr().err
