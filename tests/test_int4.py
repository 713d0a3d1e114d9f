"""The int4 engine: the kernel's weight format, the GGUF blocks mapped onto it, and every mode lossless on it."""

import json

import numpy as np
import pytest
import torch
from conftest import assert_all_modes_equal_ar, assert_verify_rows_are_steps, engine

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.trace import MODES
from d3d_core.models import fastops, int4
from d3d_core.models.target import Target

PROMPTS = ["what is two plus two?", "write a short poem about rain", "count: 1, 2, 3"]




def random_codes(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return int4.Codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                      torch.rand(n, k // 32, generator=g) * 0.05 + 0.005, torch.randn(n, k // 32, generator=g) * 0.2)


def test_kernel_self_test_passes_here():
    ok, why = int4.self_test()
    assert ok, why


@pytest.mark.parametrize("n,k", [(64, 96), (72, 64)])  # 72 rows: padded to the kernel's blocks of 16
def test_int4_linear_matches_dequantise_then_matmul(n, k):
    c = random_codes(n, k)
    lin = int4.Int4Linear.from_codes(c)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    y = lin(x)
    assert y.shape == (5, n) and y.dtype == torch.bfloat16
    ref = x.bfloat16().double() @ int4.effective_weight(c).T  # bf16 input, fp64 product
    # fp32 accumulation, one rounding to bf16 at the end (relative 2^-9, 2^-8 with margin)
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()


def test_kernel_convention_is_q_minus_8_times_scale_plus_zero():
    """The identity probe: the kernel's output for e_k is exactly bf16 of (q - 8) * bf16(scale) + bf16(zero)."""
    c = random_codes(48, 64, seed=3)
    y = int4.Int4Linear.from_codes(c)(torch.eye(64))
    assert torch.equal(y.float(), int4.effective_weight(c).T.float().bfloat16().float())


def test_q4_1_and_q8_0_blocks_map_exactly_up_to_bf16_scales():
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)).numpy()
    for qt, codes_of, planes in ((Q.Q4_1, int4.q4_1_codes, 1), (Q.Q8_0, int4.q8_0_codes, 2)):
        raw = quants.quantize(w, qt)
        gguf_w = torch.from_numpy(quants.dequantize(raw, qt)).double()
        c = codes_of(raw, w.shape[1])
        assert c.planes == planes and int(c.q.max()) <= 15
        assert torch.equal(int4.exact_weight(c), gguf_w)  # the mapping itself is exact
        dev = (int4.effective_weight(c) - gguf_w).abs().max().item()
        assert 0 < dev <= int4.deviation_bound(c) * (1 + 1e-9)
        assert dev <= 2**-8 * gguf_w.abs().max().item()  # bf16 of scale and zero only
        # and through the kernel
        x = torch.randn(3, w.shape[1])
        ref = x.bfloat16().double() @ gguf_w.T
        assert ((int4.Int4Linear.from_codes(c)(x).double() - ref).abs() <= 0.01 * ref.abs().max()).all()


@pytest.mark.parametrize("bundle_name", ["toy", "toy_qwen3"])
def test_int4_engine_on_toy_is_lossless_in_every_mode(request, bundle_name):
    bundle = request.getfixturevalue(bundle_name)
    t = bundle.target
    with engine(t, "int4"):
        assert t.engine == "int4", t.int4_reason()
        assert t.new_cache().int4 is not None
        for prompt, B in zip(PROMPTS, (3, 8, 16)):
            ref = decode(bundle, prompt, DecodeConfig(mode="ar", max_new_tokens=30, block_size=B))
            for mode in MODES[1:]:
                tr = decode(bundle, prompt, DecodeConfig(mode=mode, max_new_tokens=30, block_size=B, hypotheses=4))
                assert tr.output_ids == ref.output_ids, (mode, B, prompt)


def test_int4_verify_rows_equal_one_row_steps_bitwise(toy):
    """What lossless rests on: a verify over B rows gives each row the bits B one-row steps give it, across
    rollbacks and the attention's key buckets."""
    t = toy.target
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, t.arch.vocab_size, (300,), generator=g)
    with engine(t, "int4"):
        a, b = t.new_cache(), t.new_cache()
        t.prefill(a, seq[:50])
        t.prefill(b, seq[:50])
        assert_verify_rows_are_steps(t, a, b, seq, 50, (8, 16, 3, 8, 16, 16, 5, 8))


def test_int4_engine_matches_a_dequantised_fp32_reference_on_toy(toy):
    """The int4 forward against the fp32 forward of the same model with the kernel's effective weights."""
    t = toy.target
    with engine(t, "int4"):
        t.new_cache()
        layers, head, _ = int4.codes_from_target(t)
    model = type(t.model)(t.model.config)  # a fresh copy (the original's modules hold packed-weight caches)
    model.load_state_dict(t.model.state_dict())
    base = model.get_decoder()
    with torch.no_grad():
        for layer, d in zip(base.layers, layers):
            for role, mod in (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj),
                              ("o", layer.self_attn.o_proj), ("gate", layer.mlp.gate_proj), ("up", layer.mlp.up_proj), ("down", layer.mlp.down_proj)):
                mod.weight.copy_(int4.kernel_weight(d[role]).float())
        model.get_output_embeddings().weight.copy_(int4.kernel_weight(head).float())
    ref_t = Target(model, name="toy-dequantised")
    ids = torch.randint(3, t.arch.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    with engine(t, "int4"):
        c = t.new_cache()
        got = torch.cat([t.prefill(c, ids[:32]).logits, t.verify(c, ids[32:]).logits])
    c = ref_t.new_cache()
    ref = torch.cat([ref_t.prefill(c, ids[:32]).logits, ref_t.verify(c, ids[32:]).logits])
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    # bf16 activations through 4 layers (torch's kernel, measured: 0.34 %); 8-bit block activations (lowbit: 1.4 %)
    assert err <= (0.03 if int4.kernel_status().lowbit else 0.01) * scale, (err, scale)
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err  # where the reference's choice is not a near-tie
    assert clear.sum() >= 5 and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_bench_accepts_engine_int4(tmp_path):
    from d3d_core.measure import bench

    assert bench.build_parser().parse_args(["--engine", "int4"]).engine == "int4"
    out = tmp_path / "r.json"
    try:
        rc = bench.main(["--bundle", "toy", "--modes", "ar,d3d-seq", "--data-dir", "tests/fixtures/datasets", "--datasets", "gsm8k", "--n", "1",
                         "--max-new-tokens", "12", "--block-size", "4", "--engine", "int4", "--peers", "none", "--out", str(out), "--no-progress"])
    finally:
        fastops.set_int4(False)
        fastops.set_enabled(True)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["engine"]["target"] == "int4" and res["engine"]["int4"]["lm_head"].startswith("int4")
    assert all(s["lossless_rate"] == 1.0 for s in res["summary"] if s["mode"] != "ar")


# ----------------------------------------------------------------------------- the real bundle


@pytest.mark.slow
def test_gguf_blocks_reproduce_the_dequantised_weights(smollm):
    """Q4_1 layer tensors and the Q8_0 head from the bundled GGUF: the codes mean exactly what gguf dequantises
    (and, in Hugging Face row order, the fp32 cache's weights); the kernel's weights are off by bf16 scales only."""
    from gguf import GGUFReader, quants

    t = smollm.target
    assert isinstance(t.int4_source, int4.GGUFSource)
    r = GGUFReader(str(t.int4_source.gguf))
    ts = {x.name: x for x in r.tensors}
    layer = t.layers[3]
    cases = [("blk.3.attn_q.weight", layer.self_attn.q_proj.weight, t.arch.num_attention_heads),
             ("blk.3.attn_k.weight", layer.self_attn.k_proj.weight, t.arch.num_key_value_heads),
             ("blk.3.ffn_down.weight", layer.mlp.down_proj.weight, None),
             ("token_embd.weight", t.shared.lm_head.weight, None)]
    for name, fp32, heads in cases:
        x = ts[name]
        raw, k = np.asarray(x.data), int(x.shape[0])
        c = int4.q4_1_codes(raw, k) if x.tensor_type.name == "Q4_1" else int4.q8_0_codes(raw, k)
        assert x.tensor_type.name == ("Q8_0" if name.startswith("token_embd") else "Q4_1")
        gguf_w = torch.from_numpy(quants.dequantize(raw, x.tensor_type)).double()
        assert torch.equal(int4.exact_weight(c), gguf_w)
        dev = (int4.effective_weight(c) - gguf_w).abs().max().item()
        assert dev <= int4.deviation_bound(c) * (1 + 1e-9) and dev <= 2**-8 * gguf_w.abs().max().item(), name
        hf = int4._unpermute(c, heads) if heads else c
        assert torch.equal(int4.exact_weight(hf).float(), fp32), name


@pytest.mark.slow
def test_real_bundle_int4_all_modes_equal_ar(smollm):
    prompts = [
        "What is 17 times 23? Think step by step.",
        "Write a Python function that reverses a string.",
        "Give me three tips for a good night's sleep.",
    ]
    t = smollm.target
    with engine(t, "int4"):
        assert t.engine == "int4", t.int4_reason()
        assert t.new_cache().int4 is not None
        info = t.int4_info()
        assert info["all_layer_linears_int4"] and info["int4_linears"] == 4 * t.num_layers and info["lm_head"].startswith("int4")
        assert_all_modes_equal_ar(smollm, prompts)


@pytest.fixture
def smollm_on_torch_kernel(smollm, monkeypatch):
    """The real bundle's int4 engine on torch's kernel (the fallback where the low-bit kernel cannot build), restored
    afterwards to whatever this host runs."""
    from d3d_core.models import lowbit

    t = smollm.target
    saved = (t._int4, t._int4_error, getattr(t.shared.lm_head, "_d3d_int4", None))
    monkeypatch.setenv("D3D_LOWBIT", "off")
    lowbit.reset()
    t._int4, t._int4_error = None, None
    try:
        with engine(t, "int4"):
            assert t.int4_weights() is not None, t.int4_reason()
            assert t.int4_info()["kernel"].startswith("torch"), t.int4_info()
        yield smollm
    finally:
        monkeypatch.delenv("D3D_LOWBIT")
        lowbit.reset()
        t._int4, t._int4_error = saved[0], saved[1]
        if saved[2] is not None:
            t.shared.lm_head._d3d_int4 = saved[2]


@pytest.mark.slow
def test_real_bundle_torch_kernel_verify_rows_are_one_row_steps_bitwise(smollm_on_torch_kernel):
    """The fallback is lossless by the same construction as the low-bit kernel: every verified row makes the very
    SDPA call a one-row step makes. Found broken on an AVX2 EPYC (rows grouped by key bucket in one SDPA call differed
    from lone rows by 1 ulp, and dflash / d3d-seq then left ar's tokens on a gsm8k prompt)."""
    t = smollm_on_torch_kernel.target
    seq = torch.randint(3, t.arch.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    with engine(t, "int4"):
        a, b = t.new_cache(), t.new_cache()
        assert a.int4.kernel == "torch"
        t.prefill(a, seq[:55])
        t.prefill(b, seq[:55])
        pos = assert_verify_rows_are_steps(t, a, b, seq, 55, (16, 8, 1, 3, 16, 5, 12, 9, 16, 7, 13, 16, 16, 16, 16, 16))
        assert pos > 2 * 64 + 8  # crossed two key-bucket edges


@pytest.mark.slow
def test_real_bundle_torch_kernel_all_modes_equal_ar(smollm_on_torch_kernel):
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?",
               "What is 17 times 23? Think step by step."]
    with engine(smollm_on_torch_kernel.target, "int4"):
        assert_all_modes_equal_ar(smollm_on_torch_kernel, prompts)
