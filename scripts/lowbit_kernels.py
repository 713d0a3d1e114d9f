"""Low-bit GEMM kernels on this CPU: 30 layers of SmolLM2-135M's linears (+ its LM head), 2 threads, rows 1..32.

    .venv/bin/python scripts/lowbit_kernels.py [--rows 1,2,4,8,16,32] [--reps 7] [--threads 2] [--no-head]

Every candidate gets its own distinct random weights per layer (so they stream from memory, as a forward's do) and
is timed over the same inputs, candidates and row counts interleaved within one process (A, B, A, B, ...; medians),
because the machines this project runs on are shared. Per candidate and row count: median ms of one pass over the
30 layers' qkv | o | gate_up | down GEMMs (and the 49152 x 576 head with ``--head``), and whether every row of an
m-row pass equals, bit for bit, the same row run alone (what a lossless verify needs). Candidates:

- ``int4pack``: torch's ``_weight_int4pack_mm_for_cpu`` (the int4 engine's kernel before issue 44), bf16 activations;
- ``onednn_int8``: ``torch.ops.onednn.qlinear_prepack`` once, then ``qlinear_pointwise`` with uint8 activations
  (zero point 128) and fp32 output, per-channel int8 weights;
- ``int_mm``: ``torch._int_mm`` (int8 x int8 -> int32) on a (K, N) int8 weight;
- ``lowbit``: this project's kernel (``d3d_core.models.lowbit``), 4-bit codes x per-block 8-bit activations, when it
  builds here;
- ``lowbit@old``: with ``--ab FILE``, another ``lowbit.c`` (e.g. an earlier commit's: ``git show REV:d3d_core/models/lowbit.c
  > /tmp/old.c``) built the same way, to compare a change before and after in one process.

``--attention`` times the kernel's causal attention instead (30 layers, 300 keys, the bundle's 9 / 3 heads of 64; rows
are query rows), for ``lowbit`` and ``lowbit@old``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, INTER, NH, NKV, HD, LAYERS, VOCAB = 576, 1536, 9, 3, 64, 30, 49152
SHAPES = [((NH + 2 * NKV) * HD, HIDDEN), (HIDDEN, NH * HD), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (N, K) per layer


def weight_list(head: bool) -> list:
    """(N, K, planes) of every GEMM of one pass: 30 layers x 4, then the head (8-bit: two 4-bit planes)."""
    out = [(n, k, 1) for _ in range(LAYERS) for n, k in SHAPES]
    return out + ([(VOCAB, HIDDEN, 2)] if head else [])


def make_int4pack(n, k, planes, g):
    from d3d_core.models import int4

    c = int4.Codes(torch.randint(0, 16, (n, k * planes), generator=g, dtype=torch.uint8),
                   torch.rand(n, k * planes // 32, generator=g) * 0.02 + 0.001, torch.randn(n, k * planes // 32, generator=g) * 0.01, planes)
    return int4.Int4Linear.from_codes(c)


def make_onednn(n, k, planes, g):
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 0.001
    packed = torch.ops.onednn.qlinear_prepack(w, [1, k])

    def run(x):  # x (m, K) fp32 -> (m, N) fp32; per-row activation scale applied after
        s = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        xq = (x / s).round().add_(128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, scale, torch.zeros(n, dtype=torch.int), None, 1.0, 0,
                                               torch.float32, "none", [], "")
        return y * s

    return run


def make_int_mm(n, k, planes, g):
    w = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 0.001

    def run(x):
        s = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        xq = (x / s).round().to(torch.int8)
        if xq.shape[0] <= 16:  # _int_mm wants more than 16 rows
            xq = torch.cat([xq, xq.new_zeros(17 - xq.shape[0], k)])
        return torch._int_mm(xq, w)[: x.shape[0]].float() * s * scale

    return run


def make_lowbit(n, k, planes, g):
    from d3d_core.models import int4, lowbit

    c = int4.Codes(torch.randint(0, 16, (n, k * planes), generator=g, dtype=torch.uint8),
                   torch.rand(n, k * planes // 32, generator=g) * 0.02 + 0.001, torch.randn(n, k * planes // 32, generator=g) * 0.01, planes)
    return lowbit.LowbitLinear.from_codes(c)


CANDIDATES = {"int4pack": make_int4pack, "onednn_int8": make_onednn, "int_mm": make_int_mm, "lowbit": make_lowbit}
_OLD: dict = {}  # "lib": the --ab build


def build_other(src: str):
    """``src`` (another lowbit.c) compiled with the kernel's flags into a temporary file and loaded like the kernel."""
    import ctypes
    import tempfile

    from d3d_core.models import lowbit

    out = Path(tempfile.mkdtemp()) / "lowbit-old.so"
    r = subprocess.run([lowbit.compiler() or "cc", *lowbit.CFLAGS, src, "-o", str(out)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"error: --ab {src} did not compile: {r.stderr.strip()[:300]}")
    lib = ctypes.CDLL(str(out))
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.lowbit_gemm.argtypes = [p, i, i, p, i, i, p, i]
    lib.lowbit_attention.argtypes = [p, L, i, i, i, i, p, p, L, i, i, ctypes.c_float, p, i]
    return lib


def make_lowbit_old(n, k, planes, g):
    lin = make_lowbit(n, k, planes, g)
    return lambda x: lin.run(_OLD["lib"], x)


def attention_pass(lib_of):
    """(pass over 30 layers of attention for m query rows, the inputs) with the kernel ``lib_of()`` returns."""
    from d3d_core.models import lowbit

    g = torch.Generator().manual_seed(1)
    cap, T = 512, 300
    caches = [(torch.randn(1, NKV, cap, HD, generator=g), torch.randn(1, NKV, cap, HD, generator=g)) for _ in range(LAYERS)]

    def run(qk):
        return [lowbit.attention_into(lib_of(), qk, NH, kc, vc, T) for kc, vc in caches]

    return run, lambda m: torch.randn(m, NH + 2 * NKV, HD, generator=g)


def available(names: list) -> list:
    out = []
    for name in names:
        try:
            f = CANDIDATES[name](64, 64, 1, torch.Generator().manual_seed(0))
            f(torch.randn(3, 64))
            out.append(name)
        except Exception as e:
            print(f"# {name}: unavailable ({type(e).__name__}: {str(e)[:100]})", file=sys.stderr)
    return out


def one_pass(fns, xs, clock=time.perf_counter) -> float:
    t0 = clock()
    for f, x in zip(fns, xs):
        f(x)
    return (clock() - t0) * 1e3


def rows_identical(fns, shapes, m, g) -> bool:
    for f, (n, k, planes) in list(zip(fns, shapes))[:4] + list(zip(fns, shapes))[-1:]:
        x = torch.randn(m, k, generator=g)
        full = f(x)
        if not all(torch.equal(full[i : i + 1], f(x[i : i + 1])) for i in range(m)):
            return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", action="store_true", help="include the 49152 x 576 LM head (8-bit)")
    ap.add_argument("--only", default=",".join(CANDIDATES))
    ap.add_argument("--ab", default=None, metavar="FILE", help="also time another lowbit.c (candidate lowbit@old)")
    ap.add_argument("--attention", action="store_true", help="time the low-bit attention (lowbit, and lowbit@old with --ab)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (with --threads 1 only): robust to other work on a shared machine")
    a = ap.parse_args(argv)
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu measures one thread's CPU time: use it with --threads 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    if a.ab:
        _OLD["lib"] = build_other(a.ab)
        CANDIDATES["lowbit@old"] = make_lowbit_old
    if a.attention:
        from d3d_core.models import lowbit

        if lowbit.library() is None:
            raise SystemExit(f"error: the low-bit kernel does not run here ({lowbit.status().reason})")
        runs = {"lowbit": attention_pass(lowbit.library)}
        if a.ab:
            runs["lowbit@old"] = attention_pass(lambda: _OLD["lib"])
        return time_attention(runs, rows, a.reps, clock, a.threads)
    names = available(a.only.split(",") + (["lowbit@old"] if a.ab else []))
    shapes = weight_list(a.head)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        fns = {nm: [CANDIDATES[nm](n, k, p, g) for n, k, p in shapes] for nm in names}
        xs = {m: [torch.randn(m, k, generator=g) for n, k, p in shapes] for m in rows}
        ident = {(nm, m): rows_identical(fns[nm], shapes, m, g) for nm in names for m in rows if m > 1}
        times = {(nm, m): [] for nm in names for m in rows}
        for rep in range(a.reps + 1):
            for m in rows:
                for nm in names:
                    t = one_pass(fns[nm], xs[m], clock)
                    if rep:
                        times[(nm, m)].append(t)
    print(header(a.threads, f"{LAYERS} layers{' + head' if a.head else ''}", a.reps, a.clock))
    print("| rows | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for m in rows:
        cells = []
        for nm in names:
            med = statistics.median(times[(nm, m)])
            base = statistics.median(times[(nm, rows[0])])
            same = "" if m == 1 else ("" if ident[(nm, m)] else " ≠")
            cells.append(f"{med:.1f} ({med / base:.2f}×){same}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    print("# (×: against the same candidate's first row count; ≠: some row differs from that row run alone)")
    return 0


def header(threads: int, what: str, reps: int, clock: str) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f" {f}" in flags]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    return (f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu} ({' '.join(isa)}), {threads} threads, torch {torch.__version__}, "
            f"commit {commit}, load average {os.getloadavg()[0]:.2f}, {what}, median of {reps}, {'CPU' if clock == 'cpu' else 'wall'} ms")


def time_attention(runs: dict, rows: list, reps: int, clock, threads: int) -> int:
    """Median ms of a 30-layer attention pass per kernel and row count (interleaved), and whether the kernels agree."""
    with torch.inference_mode():
        qs = {m: runs["lowbit"][1](m) for m in rows}
        same = {m: all(torch.equal(x, y) for x, y in zip(runs["lowbit"][0](qs[m]), runs["lowbit@old"][0](qs[m]))) for m in rows} if len(runs) > 1 else {}
        times = {(nm, m): [] for nm in runs for m in rows}
        for rep in range(reps + 1):
            for m in rows:
                for nm, (run, _) in runs.items():
                    t0 = clock()
                    run(qs[m])
                    if rep:
                        times[(nm, m)].append((clock() - t0) * 1e3)
    print(header(threads, f"attention, {LAYERS} layers, 300 keys", reps, "cpu" if clock is time.thread_time else "wall"))
    print("| rows | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for m in rows:
        cells = [f"{statistics.median(times[(nm, m)]):.2f}" for nm in runs]
        print(f"| {m} | " + " | ".join(cells) + (f" | {'same bits' if same[m] else 'bits differ'}" if same else "") + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
