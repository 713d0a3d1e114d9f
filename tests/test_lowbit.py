"""The low-bit kernel: what it computes, that a row's bits never depend on the row count, its refusals, and the
fallback to torch's int4 kernel where it cannot build or is switched off."""

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_verify_rows_are_steps, engine

from d3d_core import limits
from d3d_core.models import int4, lowbit

AVX2 = all(f in lowbit.cpu_flags() for f in lowbit.NEEDS)
needs_kernel = pytest.mark.skipif(not AVX2, reason="this CPU lacks AVX2 / FMA / F16C: the low-bit kernel falls back (tested below)")


def random_codes(n, k, planes=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw = k * planes
    return int4.Codes(torch.randint(0, 16, (n, kw), generator=g, dtype=torch.uint8),
                      torch.rand(n, kw // 32, generator=g) * 0.05 + 0.005, torch.randn(n, kw // 32, generator=g) * 0.2, planes)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh probe (built into an empty cache), restored for the next test."""
    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    lowbit.reset()
    yield
    lowbit.reset()


@needs_kernel
def test_kernel_builds_and_passes_its_self_test_here():
    st = lowbit.status()
    assert st.lowbit, st.reason
    assert "row-invariant on this machine" in st.reason and st.info()["kernel"] == lowbit.KERNEL_NAME


@needs_kernel
@pytest.mark.parametrize("n,k,planes", [(64, 96, 1), (44, 64, 1), (24, 128, 2), (3, 32, 1)])
def test_gemm_computes_its_definition(n, k, planes):
    """Against the fp64 oracle of the same arithmetic (8-bit block activations, integer dots): only fp32 rounding apart."""
    c = random_codes(n, k, planes)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)) * 3
    y = lowbit.LowbitLinear.from_codes(c)(x)
    assert y.shape == (9, n) and y.dtype == torch.float32
    ref = lowbit.reference(c, x)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # and the oracle is the weight times x up to the activations' 8-bit rounding (half a step of amax / 127 per input)
    w = lowbit.packed_weight(c)
    exact = x.double() @ w.T
    step = x.reshape(9, -1, 32).abs().amax(-1).double() / 127 / 2  # (9, K/32)
    bound = (step.repeat_interleave(32, 1) @ (w.abs() / 1).T) * 1.0001 + 1e-9
    assert ((ref - exact).abs() <= bound).all()


@needs_kernel
def test_packed_weights_are_the_fp16_block_values():
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)).numpy()
    for qt, codes_of in ((Q.Q4_1, int4.q4_1_codes), (Q.Q8_0, int4.q8_0_codes)):
        raw = quants.quantize(w, qt)
        c = codes_of(raw, w.shape[1])
        assert torch.equal(lowbit.packed_weight(c), int4.exact_weight(c))  # no bf16: the GGUF's own values
        assert torch.equal(int4.kernel_weight(c), lowbit.packed_weight(c))


@needs_kernel
@pytest.mark.parametrize("n,k,planes", [(72, 64, 1), (20, 96, 2)])
def test_every_row_count_gives_each_row_its_one_row_bits(n, k, planes):
    lin = lowbit.LowbitLinear.from_codes(random_codes(n, k, planes, seed=4))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(5))
    single = torch.cat([lin(x[i : i + 1]) for i in range(64)])
    for m in range(2, 65):
        assert torch.equal(lin(x[:m]), single[:m]), m
        assert torch.equal(lin(x[64 - m :]), single[64 - m :]), m  # whichever rows share the register blocks


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_matches_sdpa_and_is_row_invariant(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(6)
        nh, nkv, hd, cap = 9, 3, 64, 200
        kc, vc = torch.randn(1, nkv, cap, hd, generator=g), torch.randn(1, nkv, cap, hd, generator=g)
        qkv = torch.randn(20, (nh + 2 * nkv) * hd, generator=g)  # rows strided as the engine's qkv output
        qk = qkv[:, : (nh + nkv) * hd].view(20, nh + nkv, hd)
        for T in (0, 63, 121):
            y = lowbit.attention(qk, nh, kc, vc, T)
            q = qk[:, :nh].transpose(0, 1).reshape(nkv, nh // nkv * 20, hd)
            pos = torch.arange(T, T + 20)
            mask = torch.zeros(20, T + 20).masked_fill_(torch.arange(T + 20)[None] > pos[:, None], float("-inf")).repeat(nh // nkv, 1)
            ref = F.scaled_dot_product_attention(q[None], kc[:, :, : T + 20], vc[:, :, : T + 20], attn_mask=mask)
            ref = ref.reshape(nh, 20, hd).transpose(0, 1).reshape(20, -1)
            assert (y - ref).abs().max() <= 1e-5
            single = torch.cat([lowbit.attention(qk[i : i + 1], nh, kc, vc, T + i) for i in range(20)])
            for m in (1, 2, 3, 8, 11, 16, 20):
                assert torch.equal(lowbit.attention(qk[:m], nh, kc, vc, T), single[:m]), (T, m)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_glue_add_rmsnorm_and_swiglu_compute_their_definitions_row_by_row():
    """The residual add + RMSNorm and the SwiGLU product in C: torch's values to float rounding, the add exact, and a
    row's bits the same in a call of one row as in a call of many (what keeps a verify's rows equal to steps)."""
    lib = lowbit.library()
    g = torch.Generator().manual_seed(3)
    x, y, w = torch.randn(9, 64, generator=g) * 3, torch.randn(9, 64, generator=g), torch.rand(64, generator=g) + 0.5
    x0 = x.clone()
    h = lowbit.add_rmsnorm(lib, x, y, w, 1e-5)
    assert torch.equal(x, x0 + y)  # in place, exact
    torch.testing.assert_close(h, F.rms_norm(x0 + y, (64,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(lowbit.add_rmsnorm(lib, x[4:5].clone(), None, w, 1e-5)[0], lowbit.add_rmsnorm(lib, x.clone(), None, w, 1e-5)[4])
    gu = torch.randn(9, 2 * 48, generator=g) * 4
    gu[0, :4] = torch.tensor([100.0, -100.0, 0.0, 1e-8])
    a = lowbit.swiglu(lib, gu)
    torch.testing.assert_close(a, F.silu(gu[:, :48]) * gu[:, 48:], rtol=1e-5, atol=1e-5)
    assert torch.equal(lowbit.swiglu(lib, gu[6:7].contiguous())[0], a[6])
    with pytest.raises(ValueError, match="multiple of 8"):
        lowbit.add_rmsnorm(lib, torch.zeros(2, 12), None, torch.ones(12), 1e-5)
    with pytest.raises(ValueError, match="contiguous fp32"):
        lowbit.swiglu(lib, torch.zeros(2, 16, dtype=torch.float64))


@needs_kernel
def test_hostile_shapes_are_refused_with_a_message():
    with pytest.raises(ValueError, match="multiples of 32"):
        lowbit.LowbitLinear.from_codes(int4.Codes(torch.zeros(8, 40, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1)))
    lin = lowbit.LowbitLinear.from_codes(random_codes(16, 64))
    with pytest.raises(ValueError, match=r"got input of shape \(3, 32\)"):
        lin(torch.randn(3, 32))
    with pytest.raises(ValueError, match="got input of shape"):
        lin(torch.randn(64))
    with pytest.raises(ValueError, match="takes 1 to"):
        lin(torch.randn(0, 64))
    with pytest.raises(ValueError, match="takes 1 to"):
        lin(torch.empty(limits.LOWBIT_MAX_ROWS + 1, 64))
    with pytest.raises(ValueError, match="packed low-bit weight has shape"):
        lowbit.LowbitLinear(lin.packed[:1], 16, 64)
    with pytest.raises(ValueError, match="past the kernel's limits"):
        lowbit.LowbitLinear(lin.packed, limits.LOWBIT_MAX_N + 1, 64)
    # the C side refuses what the Python side would never pass, instead of reading out of bounds
    x, y = torch.randn(2, 64), torch.empty(2, 16)
    assert lowbit.library().lowbit_gemm(x.data_ptr(), 2, 48, lin.packed.data_ptr(), 16, 64, y.data_ptr(), 1) == -1
    kc = torch.zeros(1, 3, 8, 64)
    with pytest.raises(ValueError, match="low-bit attention refused"):
        lowbit.attention(torch.zeros(4, 12, 64), 9, kc, kc, 6)  # positions 6..9 past a capacity of 8


def test_switched_off_falls_back_to_torch_and_says_so(fresh, monkeypatch, toy):
    monkeypatch.setenv("D3D_LOWBIT", "off")
    st = lowbit.status()
    assert not st.lowbit and "D3D_LOWBIT=off" in st.reason and "torch" in st.kernel
    assert lowbit.library() is None
    w = int4.load(toy.target, int4.QUANTIZE_FP32)
    assert w.kernel == "torch" and isinstance(w.layers[0]["qkv"], int4.Int4Linear)
    assert "torch" in w.info["kernel"] and "D3D_LOWBIT=off" in w.info["kernel_reason"]
    assert int4.usable()[0]  # torch's kernel still runs the int4 engine
    with pytest.raises(RuntimeError, match="not available here"):
        lowbit.LowbitLinear.from_codes(random_codes(8, 32))(torch.randn(1, 32))


def test_no_compiler_or_no_avx2_falls_back_in_one_sentence(fresh, monkeypatch):
    monkeypatch.setattr(lowbit, "compiler", lambda: None)
    monkeypatch.setattr(lowbit, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    st = lowbit.status()
    assert not st.lowbit and st.reason.startswith("no C compiler") and "torch's int4 kernel runs instead" in st.reason
    lowbit.reset()
    monkeypatch.setattr(lowbit, "cpu_flags", lambda: {"sse2"})
    st = lowbit.status()
    assert not st.lowbit and "lacks avx2, fma, f16c" in st.reason


@needs_kernel
def test_a_build_that_fails_to_compile_falls_back(fresh, monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(lowbit, "SOURCE", bad)
    st = lowbit.status()
    assert not st.lowbit and "failed to compile" in st.reason


@needs_kernel
def test_the_engine_reports_the_kernel_it_runs(toy):
    t = toy.target
    with engine(t, "int4"):
        t.new_cache()
        info = t.int4_info()
    if t.int4_weights().kernel == "lowbit":
        assert info["kernel"] == lowbit.KERNEL_NAME and info["activations"].startswith("8-bit")
    else:
        assert "torch" in info["kernel"]


def test_kernel_threads_share_torchs_openmp_runtime():
    """The kernel's OpenMP threads are torch's own pool (one libgomp in the process), so they never oversubscribe."""
    if not lowbit.status().lowbit:
        pytest.skip(lowbit.status().reason)
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "gomp" in line.split("/")[-1]}
    assert len(gomp) <= 1, gomp
    assert isinstance(lowbit.library(), ctypes.CDLL)


# ----------------------------------------------------------------------------- the real bundle


@pytest.mark.slow
def test_real_bundle_verify_rows_are_one_row_steps_bitwise(smollm):
    """What lossless rests on, on the bundled model: verifies of 1..16 rows, with rollbacks, from position 55 past 64
    and 128 (the torch path's key-bucket edges), give every row exactly the logits one-row steps give it."""
    t = smollm.target
    seq = torch.randint(3, t.arch.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
    with engine(t, "int4"):
        a, b = t.new_cache(), t.new_cache()
        if a.int4 is None or a.int4.kernel != "lowbit":
            pytest.skip(f"the int4 engine runs {t.int4_info().get('kernel', 'no kernel')} here")
        t.prefill(a, seq[:55])
        t.prefill(b, seq[:55])
        pos = assert_verify_rows_are_steps(t, a, b, seq, 55, (16, 8, 1, 3, 16, 5, 12, 9, 2, 16, 7, 4, 13, 6, 11, 10, 14, 15))
        assert pos > 2 * 64 + 8  # crossed both edges


@pytest.mark.slow
def test_real_bundle_layer_stack_is_the_per_op_path_bitwise(smollm):
    """The layers in one C call (``lowbit.LayerStack``) compute what the same kernels called op by op from Python
    compute, bit for bit: logits, DFlash's feature layers and every K / V written, over a prompt and a verify."""
    t = smollm.target
    seq = torch.randint(3, t.arch.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    with engine(t, "int4"), torch.inference_mode():
        outs = []
        for use_stack in (True, False):
            c = t.new_cache()
            if c.int4 is None or c.int4.kernel != "lowbit":
                pytest.skip(f"the int4 engine runs {t.int4_info().get('kernel', 'no kernel')} here")
            stack = t._lowbit_stack(c.int4)
            assert stack is not None  # SmolLM2 (Llama layers, no biases) runs as one stack
            t._stack = (c.int4, stack if use_stack else None)
            try:
                o1 = t.forward(c, seq[:80], 80, (1, 8, 14))
                o2 = t.verify(c, seq[80:88], (1, 8, 14))
            finally:
                t._stack = None
            outs.append((o1.logits, o1.feats, o2.logits, o2.feats, [x[:, :, :88].clone() for x in (*c.k, *c.v)]))
    (a, b) = outs
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))


@needs_kernel
def test_layer_stack_refuses_what_it_cannot_run():
    lin = lowbit.LowbitLinear.from_codes(random_codes(16, 64))
    with pytest.raises(ValueError, match="is not a low-bit weight of"):
        lowbit.LayerStack([{"qkv": lin, "o": lin, "gate_up": lin, "down": lin}], [torch.ones(64)], [torch.ones(64)], 64, 2, 1, 32, 64, 1e-5)


@pytest.mark.slow
def test_real_bundle_packed_weights_are_the_ggufs(smollm):
    """The low-bit kernel multiplies by the GGUF's own dequantised values (fp16 d and m exactly, no bf16)."""
    from gguf import GGUFReader, quants

    t = smollm.target
    ts = {x.name: x for x in GGUFReader(str(t.int4_source.gguf)).tensors}
    for name in ("blk.7.ffn_gate.weight", "blk.29.attn_v.weight", "token_embd.weight"):
        x = ts[name]
        raw, k = np.asarray(x.data), int(x.shape[0])
        c = int4.q4_1_codes(raw, k) if x.tensor_type.name == "Q4_1" else int4.q8_0_codes(raw, k)
        assert torch.equal(lowbit.packed_weight(c), torch.from_numpy(quants.dequantize(raw, x.tensor_type)).double()), name
