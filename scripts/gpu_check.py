"""GPU check: the CUDA path of D3D on one GPU, with no network, in about 7 minutes (issue 34, item 7).

    python scripts/gpu_check.py --pack DIR                  # here: write the folder to send to the GPU machine (<= 64 MiB)
    python scripts/gpu_check.py --out gpu_check.json        # there, from that folder: the check itself (CUDA, bf16)
    python scripts/gpu_check.py --dry-run --out F.json      # here: the same script end to end on the CPU, toy shapes

On the GPU it builds, from random weights (no download), a target of Qwen3-8B's shape, a *standalone* D3D drafter of
Qwen3-1.7B's shape (its own width, embedding and head: ``d3d_core.models.standalone``) and the *shared-weight adapter*
drafter (the target's own layers + MASK-slot adapters), then measures, writing the JSON after every step and every cell:

- versions (Python, torch, transformers, CUDA, the GPU) and where pydantic came from;
- costs, CUDA-synchronised: step, verify(B), each drafter's draft(B) and packed(H) pass, and verify ‖ packed on two
  streams timed by CUDA events, with the two controls (one issuing thread; one stream) — ``costs._concurrent_ms``;
- ``oracle``: d3d-seq against d3d-async with **oracle acceptance**: the real forwards run (their cost is real), but each
  round's accepted length and whether the packed pass hit are forced, to τ ∈ {2, 4, 6} × hit rate ∈ {0, 0.5, 0.9},
  per drafter; seq and async interleaved, ``--repeats`` times; the overlap share from the lanes' CUDA event spans;
- peak memory, and losslessness: every mode at temperature 0 against ``ar`` on the random target (bf16 included).

``--dry-run`` runs exactly this on the CPU with toy shapes (a minute or so): the suite runs it. Timings of a dry run are
not GPU figures. The GPU image has torch and transformers but no pydantic, which ``d3d_core`` imports: ``--pack`` adds
its wheels (and those of its own dependencies) for Linux x86_64 CPython 3.10-3.13, and this script unpacks the ones
that fit the interpreter into ``.vendor/`` before importing ``d3d_core`` (no pip, no network).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK_LIMIT_BYTES = 64 * 2**20
PACK_EXCLUDE = ("assets/", ".venv/", "results/", ".vendor/")  # code without assets/ (the drafters' safetensors are 83 MB)
# what d3d_core imports that the GPU image (torch 2.11, transformers 5.17 and their dependencies) lacks
VENDORED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection")
WHEEL_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
WHEEL_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


# ----------------------------------------------------------------------------- dependencies, before d3d_core is imported


def _wheel_fits(name: str, tags: set) -> bool:
    """Whether wheel file ``name`` (PEP 427) installs on this interpreter (any of its tag triples in ``tags``)."""
    parts = name[:-4].split("-")
    if len(parts) < 5:
        return False
    pys, abis, plats = parts[-3].split("."), parts[-2].split("."), parts[-1].split(".")
    return any((p, a, pl) in tags for p in pys for a in abis for pl in plats)


def ensure_vendored(root: Path = ROOT) -> str:
    """Make ``import pydantic`` work: as installed, or from the pack's wheels (unpacked once into ``.vendor/<tag>``).
    Returns where it came from; raises SystemExit with one sentence when neither is there."""
    try:
        import pydantic  # noqa: F401

        return "installed"
    except ImportError:
        pass
    wheels = sorted((root / "wheels").glob("*.whl"))
    try:
        from packaging.tags import sys_tags  # a dependency of transformers, so present wherever the check can run
    except ImportError:
        raise SystemExit("error: pydantic is not installed and the 'packaging' module needed to pick its wheel is missing") from None
    tags = {(t.interpreter, t.abi, t.platform) for t in sys_tags()}
    fit = [w for w in wheels if _wheel_fits(w.name, tags)]
    names = {w.name.split("-")[0].lower() for w in fit}
    missing = [m for m in VENDORED if m.lower() not in names]
    if missing:
        raise SystemExit(f"error: pydantic is not installed and {root / 'wheels'} holds no wheel of {', '.join(missing)} for "
                         f"Python {platform.python_version()} on {platform.machine()}: pack again with --pack (it fetches wheels for "
                         f"CPython {', '.join(WHEEL_PYTHONS)})")
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    dest = root / ".vendor" / tag
    if not (dest / ".done").is_file():
        try:
            dest.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only copy of the pack: unpack under the temporary directory instead
            import tempfile

            dest = Path(tempfile.gettempdir()) / "d3d-gpu-check-vendor" / tag
            dest.mkdir(parents=True, exist_ok=True)
        for w in fit:
            with zipfile.ZipFile(w) as z:
                z.extractall(dest)
        (dest / ".done").write_text("\n".join(w.name for w in fit))
    sys.path.insert(0, str(dest))
    return "wheels: " + ", ".join(w.name for w in fit)


# ----------------------------------------------------------------------------- --pack


def _tracked_files(root: Path) -> list:
    try:
        # tracked files and untracked ones git does not ignore (work not yet committed travels too)
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, capture_output=True,
                             check=True, timeout=60).stdout
        files = sorted({f for f in out.decode().split("\0") if f})
    except (OSError, subprocess.SubprocessError):  # not a git checkout (e.g. a pack itself): every file under the root
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [f for f in files if not f.startswith(PACK_EXCLUDE) and (root / f).is_file()]


def _download_wheels(dest: Path) -> list:
    """pip download of the VENDORED packages, at the versions installed here, for each CPython of WHEEL_PYTHONS on
    Linux x86_64 (binary wheels only, no dependencies resolved: the list is complete). Raises RuntimeError."""
    from importlib.metadata import version

    pins = [f"{m}=={version(m)}" for m in VENDORED]
    for py in WHEEL_PYTHONS:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
               "--python-version", py, "--implementation", "cp", "--abi", "cp" + py.replace(".", "")]
        for pl in WHEEL_PLATFORMS:
            cmd += ["--platform", pl]
        r = subprocess.run(cmd + pins, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise RuntimeError(f"pip download for CPython {py} failed: {last[:200]}")
    return sorted(dest.glob("*.whl"))


def _local_wheels(dest: Path) -> list:
    """Wheels built from the packages installed here (RECORD-listed files only): the offline fallback. The compiled
    ones (pydantic_core) then fit only this interpreter's Python and platform; the manifest says so."""
    from importlib.metadata import distribution

    out = []
    for m in VENDORED:
        dist = distribution(m)
        name, ver = dist.metadata["Name"].replace("-", "_"), dist.version
        compiled = any(str(f).endswith((".so", ".pyd")) for f in dist.files or [])
        if compiled:
            from packaging.tags import sys_tags

            t = next(iter(sys_tags()))
            tag = f"{t.interpreter}-{t.abi}-{t.platform}"
        else:
            tag = "py3-none-any"
        whl = dest / f"{name}-{ver}-{tag}.whl"
        with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
            for f in dist.files or []:
                p = Path(dist.locate_file(f))
                if p.is_file() and "__pycache__" not in p.parts:
                    z.write(p, str(f))
        out.append(whl)
    return out


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def pack(dest: Path, offline: bool = False, limit: int = PACK_LIMIT_BYTES) -> int:
    """Write the folder to send to the GPU machine: the tracked code without assets/, the wheels the GPU image lacks
    and MANIFEST.json (files, wheels with versions, sizes). Exit 2 with one sentence when it would exceed ``limit``."""
    from importlib.metadata import version

    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        print(f"error: {dest} exists and is not empty; give --pack a new folder", file=sys.stderr)
        return 2
    files = _tracked_files(ROOT)
    code_bytes = sum((ROOT / f).stat().st_size for f in files)
    if code_bytes > limit:
        print(f"error: the code alone is {code_bytes / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB the GPU machine takes", file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    wdir = dest / "wheels"
    wdir.mkdir()
    source = "PyPI (pip download, Linux x86_64, CPython " + ", ".join(WHEEL_PYTHONS) + ")"
    try:
        if offline:
            raise RuntimeError("--offline")
        wheels = _download_wheels(wdir)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        for w in wdir.glob("*.whl"):
            w.unlink()
        wheels = _local_wheels(wdir)
        source = (f"built from this machine's installed copies ({e}); pydantic_core fits CPython "
                  f"{platform.python_version()} on {platform.machine()} only")
    total = _dir_bytes(dest)
    manifest = {
        "what": "D3D Studio GPU check (scripts/gpu_check.py): code without assets/, plus the wheels the GPU image lacks",
        "run": "python scripts/gpu_check.py --out gpu_check.json",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": _git_commit(),
        "files": len(files), "code_bytes": code_bytes,
        "wheels": [{"file": w.name, "package": w.name.split("-")[0], "version": w.name.split("-")[1], "bytes": w.stat().st_size} for w in wheels],
        "wheels_source": source,
        "pinned": {m: version(m) for m in VENDORED},
        "expects_on_the_gpu_machine": "torch and transformers (tested with torch 2.11 / transformers 5.17 in mind), no network",
        "total_bytes": total, "limit_bytes": limit,
    }
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    total = _dir_bytes(dest)
    if total > limit:
        print(f"error: the pack {dest} is {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB the GPU machine takes", file=sys.stderr)
        return 2
    print(f"wrote {dest}: {len(files)} files, {len(wheels)} wheels ({source.split(';')[0]}), {total / 2**20:.1f} MiB of {limit / 2**20:.0f} MiB")
    return 0


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ----------------------------------------------------------------------------- the check

PROFILES = {
    # on the GPU: Qwen3-8B's shape for the target, Qwen3-1.7B's for the standalone drafter (Qwen's published configs)
    "gpu": dict(
        target=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, tie_word_embeddings=False),
        drafter=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=True),
        vocab=151936, ctx=512, B=8, H=(1, 2, 4), verify_B=(1, 2, 4, 8, 16), rounds=10, repeats=3, new_tokens=48, cost_repeats=5,
        adapter_rank=64, budget_s=390),
    # --dry-run: the same steps on toy shapes on the CPU
    "dry": dict(
        target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, tie_word_embeddings=False),
        drafter=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                     head_dim=16, tie_word_embeddings=True),
        vocab=256, ctx=48, B=8, H=(1, 2), verify_B=(1, 4, 8), rounds=10, repeats=3, new_tokens=24, cost_repeats=3,
        adapter_rank=8, budget_s=240),
}
TAUS = (2, 4, 6)
HIT_RATES = (0.0, 0.5, 0.9)


class Report:
    """The JSON, written (atomically) after every step and every oracle cell, so a run cut short keeps what it measured."""

    def __init__(self, out: Path, data: dict):
        self.out, self.data, self.t0 = Path(out), data, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        from d3d_core.measure.rawfirst import write_json_atomic

        self.data["elapsed_s"] = round(self.elapsed(), 2)
        write_json_atomic(self.out, self.data, indent=1)

    def step(self, name: str, fn, *args):
        t = time.perf_counter()
        try:
            val = fn(*args)
        except Exception as e:  # a failing step is recorded and the rest still runs
            self.data.setdefault("failed_steps", []).append({"step": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            self.save()
            print(f"step {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return None
        self.data.setdefault("step_s", {})[name] = round(time.perf_counter() - t, 2)
        self.save()
        return val


def versions() -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
            "platform": platform.platform(), "cpu_threads": torch.get_num_threads()}


def build_models(prof: dict, device: str, dtype):
    """(bundle, standalone drafter, adapter drafter): random weights built directly on the device."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from d3d_core.models.adapter import shared_adapter_drafter
    from d3d_core.models.bundles import BUNDLES, Bundle
    from d3d_core.models.loader import init_drafter
    from d3d_core.models.sources import choose_attention
    from d3d_core.models.standalone import standalone_from_hf
    from d3d_core.models.target import Target
    from d3d_core.models.tokenizer import CharTokenizer

    attn = choose_attention(device)

    def model(shape: dict, seed: int, sharpen: float):
        cfg = Qwen3Config(vocab_size=prof["vocab"], max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_id=1, pad_token_id=0, **shape)
        cfg._attn_implementation = attn
        torch.manual_seed(seed)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                m = Qwen3ForCausalLM(cfg)  # initialised on the device: seconds, not minutes
        finally:
            torch.set_default_dtype(old)
        if sharpen != 1.0 and not shape.get("tie_word_embeddings"):
            with torch.no_grad():
                m.lm_head.weight.mul_(sharpen)  # random logits are near flat; sharpen so greedy text has structure
        return m.eval()

    target = Target(model(prof["target"], 0, 30.0), name="qwen3-8b-shape-random")
    spec = BUNDLES["qwen3-8b"]
    standalone = standalone_from_hf(model(prof["drafter"], 1, 1.0), mask_token_id=prof["vocab"] - 1, block_size=prof["B"],
                                    source="random weights, Qwen3-1.7B shape" if device.startswith("cuda") else "random weights, toy shape")
    adapter = shared_adapter_drafter(target.shared, target.arch, prof["adapter_rank"], block_size=prof["B"])
    dflash = init_drafter("dflash", target, spec, num_layers=1).to(device)
    bundle = Bundle("gpu-check", target, CharTokenizer(), {"d3d": standalone, "dflash": dflash}, {}, "random weights", attention=attn)
    return bundle, standalone, adapter


def _count_params(m) -> int:
    return sum(t.numel() for t in list(m.parameters()) + list(m.buffers()))


def measure_costs(bundle, drafters: dict, prof: dict) -> dict:
    """step / verify(B) / draft(B) / packed(H), synchronised medians; verify ‖ packed per drafter and H (two streams, two
    controls on CUDA; two threads on a CPU)."""
    import torch

    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import d3d_draft, d3d_packed, d3d_prefill
    from d3d_core.measure.costs import _concurrent_ms, _interleaved_medians, _prefilled

    target, B, R = bundle.target, prof["B"], prof["cost_repeats"]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        ctx, verifier = _prefilled(target, prof["ctx"], g)
        widths = list(prof["verify_B"])
        walls = _interleaved_medians([verifier(b) for b in widths], R)
        out = {"ctx_len": prof["ctx"], "repeats": R, "B": B, "verify_ms": dict(zip(map(str, widths), walls)), "drafters": {}}
        out["step_ms"] = out["verify_ms"].get("1")
        for name, d in drafters.items():
            cache = d.new_cache()
            d3d_prefill(d, cache, ctx.tolist())
            cfg = DecodeConfig(block_size=B)
            draft = d3d_draft(d, cache, [], 5, cfg, g)
            fns = [lambda: d3d_draft(d, cache, [], 5, cfg, g)] + [
                (lambda H=H: d3d_packed(d, cache, 5, draft, cfg.with_(hypotheses=H), g)) for H in prof["H"]]
            ms = _interleaved_medians(fns, R)
            g_lane = torch.Generator().manual_seed(1)
            conc = {str(H): _concurrent_ms(verifier(B), lambda H=H: d3d_packed(d, cache, 5, draft, cfg.with_(hypotheses=H), g_lane), R,
                                           device=target.device) for H in prof["H"]}
            out["drafters"][name] = {"describe": d.describe(), "params": _count_params(d), "draft_ms": ms[0],
                                     "packed_ms": dict(zip(map(str, prof["H"]), ms[1:])), "concurrent_ms": conc,
                                     "draft_per_verify": ms[0] / out["verify_ms"][str(B)] if str(B) in out["verify_ms"] else None}
    return out


class OracleRound:
    """d3d-seq or d3d-async over real forwards, with each round's accepted length and hit forced (oracle acceptance)."""

    def __init__(self, bundle, drafter, prof: dict, ctx: list):
        self.b, self.d, self.prof, self.ctx = bundle, drafter, prof, ctx

    def run(self, mode: str, tau: int, hit_rate: float, H: int) -> dict:
        import torch

        from d3d_core.decoding.config import DecodeConfig
        from d3d_core.decoding.engine import d3d_draft, d3d_packed, d3d_prefill
        from d3d_core.decoding.timing import Lanes, Recorder
        from d3d_core.decoding.trace import overlap_share

        target, d, B, n = self.b.target, self.d, self.prof["B"], self.prof["rounds"]
        a = tau - 1  # accepted drafts per round: every round commits a + 1 = tau tokens
        dev = target.device
        cuda = dev.type == "cuda"
        cfg = DecodeConfig(block_size=B, hypotheses=H)
        g = torch.Generator().manual_seed(2)
        lanes, rec = Lanes(dev, mode == "d3d-async"), Recorder(dev)
        hits = [int((i + 1) * hit_rate + 1e-9) - int(i * hit_rate + 1e-9) == 1 for i in range(n)]
        try:
            with torch.inference_mode():
                t_cache, d_cache = target.new_cache(), d.new_cache()
                with lanes.target_ctx():
                    out = target.prefill(t_cache, torch.tensor(self.ctx, dtype=torch.long))
                    anchor = int(out.logits[-1].argmax())
                with lanes.drafter_ctx():
                    d3d_prefill(d, d_cache, self.ctx)
                    draft = d3d_draft(d, d_cache, [], anchor, cfg, g)
                if cuda:
                    torch.cuda.synchronize(dev)
                pending, n_hits = [], 0
                t0 = time.perf_counter()
                for i in range(n):
                    fut = None
                    if mode == "d3d-async":
                        fut = lanes.submit(lambda r=i, dr=draft, an=anchor: _span(rec, "drafter", "packed_draft", r,
                                                                                     lambda: d3d_packed(d, d_cache, an, dr, cfg, g)))
                    with lanes.target_ctx(), rec.span("target", "verify", i):
                        vout = target.verify(t_cache, torch.tensor([anchor] + draft.ids, dtype=torch.long))
                        y = vout.logits.argmax(-1).tolist()  # the one host sync a round needs (the verdict)
                        target.rollback(t_cache, len(draft.ids) - a)
                    bonus = y[a]
                    if mode == "d3d-async":
                        pr = fut.result()
                        with lanes.drafter_ctx():
                            d.commit_kv(d_cache, pr.new_kv, a + 1)
                        if hits[i] and pr.drafts:  # forced hit: the packed pass's block is verified next
                            draft, n_hits = pr.drafts[0], n_hits + 1
                        else:  # forced miss: a synchronous draft from the bonus token
                            with lanes.drafter_ctx(), rec.span("drafter", "sync_draft", i):
                                draft = d3d_draft(d, d_cache, [], bonus, cfg, g)
                    else:
                        pending = [anchor] + draft.ids[:a]
                        with lanes.drafter_ctx(), rec.span("drafter", "draft", i):
                            draft = d3d_draft(d, d_cache, pending, bonus, cfg, g)
                    anchor = bonus
                if cuda:
                    torch.cuda.synchronize(dev)
                wall = (time.perf_counter() - t0) * 1e3
                spans = rec.finalize()
        finally:
            lanes.close()
        return {"ms_per_token": wall / (n * tau), "ms_per_round": wall / n, "rounds": n, "hits": n_hits,
                "overlap": overlap_share(spans) if mode == "d3d-async" else 0.0}


def _span(rec, lane, kind, rnd, fn):
    with rec.span(lane, kind, rnd):
        return fn()


def run_oracle(rep: Report, bundle, drafters: dict, prof: dict, budget_s: float) -> None:
    """Every (drafter, τ, hit rate) cell, d3d-seq and d3d-async interleaved (their order alternates by repeat), ``repeats``
    times; the list ``oracle`` in the JSON grows after every cell."""
    import statistics

    import torch

    g = torch.Generator().manual_seed(3)
    V = prof["vocab"]
    ctx = torch.randint(10, V - 1, (prof["ctx"],), generator=g).tolist()
    H = max(prof["H"][:2])
    cells = [(name, tau, h) for name in drafters for tau in TAUS for h in HIT_RATES]
    rows = {c: {"drafter": c[0], "describe": drafters[c[0]].describe(), "tau": c[1], "hit_rate": c[2], "H": H, "B": prof["B"],
                "seq_ms_per_token": [], "async_ms_per_token": [], "overlap": [], "hits": []} for c in cells}
    rep.data["oracle"] = []
    runners = {name: OracleRound(bundle, d, prof, ctx) for name, d in drafters.items()}
    for name, r in runners.items():  # warm-up: one untimed pass of each mode
        r.run("d3d-seq", 2, 0.5, H)
        r.run("d3d-async", 2, 0.5, H)
    for rep_i in range(prof["repeats"]):
        for c in cells:
            if rep.elapsed() > budget_s:
                rep.data["oracle_stopped"] = f"time budget ({budget_s:.0f} s) reached in repeat {rep_i + 1}"
                rep.save()
                return
            row = rows[c]
            order = ("d3d-seq", "d3d-async") if rep_i % 2 == 0 else ("d3d-async", "d3d-seq")
            for mode in order:
                res = runners[c[0]].run(mode, c[1], c[2], H)
                if mode == "d3d-seq":
                    row["seq_ms_per_token"].append(res["ms_per_token"])
                else:
                    row["async_ms_per_token"].append(res["ms_per_token"])
                    row["overlap"].append(res["overlap"])
                    row["hits"].append(res["hits"] / res["rounds"])
            s, a = statistics.median(row["seq_ms_per_token"]), statistics.median(row["async_ms_per_token"])
            row.update(repeats=len(row["seq_ms_per_token"]), seq_median=s, async_median=a, async_over_seq_speed=s / a,
                       async_wins=a < s, realised_hit_rate=statistics.mean(row["hits"]), overlap_median=statistics.median(row["overlap"]))
            rep.data["oracle"] = [rows[k] for k in cells if rows[k]["async_ms_per_token"]]
            # the (drafter, τ, hit rate) region where d3d-async beats d3d-seq on this device, so far
            rep.data["async_beats_seq"] = [[r["drafter"], r["tau"], r["hit_rate"]] for r in rep.data["oracle"] if r["async_wins"]]
            rep.save()


def check_lossless(bundle, drafters: dict, prof: dict) -> dict:
    """Every mode at temperature 0 against ar on one random prompt (the D3D modes once per drafter)."""
    import torch

    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode

    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(10, prof["vocab"] - 1, (64,), generator=g).tolist()
    base = DecodeConfig(max_new_tokens=prof["new_tokens"], block_size=prof["B"], hypotheses=2, stop_at_eos=False)
    ref = decode(bundle, prompt, base.with_(mode="ar")).output_ids
    out = {}
    runs = [("dflash", None)] + [(m, n) for n in drafters for m in ("d3d-seq", "d3d-async")]
    for mode, name in runs:
        tr = decode(bundle, prompt, base.with_(mode=mode), drafter=drafters.get(name))
        ids = tr.output_ids
        out[f"{mode}/{name}" if name else mode] = {
            "lossless": ids == ref, "first_divergence": next((i for i, (x, y) in enumerate(zip(ids, ref)) if x != y), None),
            "tau": tr.stats.tau, "hit_rate": tr.stats.hit_rate, "overlap": tr.stats.overlap}
    return out


def summary_text(data: dict) -> str:
    lines = [f"{data['profile']} on {data['device']} ({data['versions'].get('gpu') or 'CPU'}), {data.get('elapsed_s', 0):.0f} s"]
    c = data.get("costs") or {}
    if c:
        lines.append(f"step {c.get('step_ms', float('nan')):.2f} ms | verify(B) " + ", ".join(f"{b}: {v:.2f}" for b, v in c["verify_ms"].items()))
        for name, d in c["drafters"].items():
            conc = d["concurrent_ms"]
            lines.append(f"  {name}: draft {d['draft_ms']:.2f} ms, packed(H) " + ", ".join(f"{h}: {v:.2f}" for h, v in d["packed_ms"].items())
                         + " | verify ‖ packed round " + ", ".join(f"H={h}: {v['round']:.2f}" for h, v in conc.items()))
    for r in data.get("oracle", []):
        lines.append(f"  oracle {r['drafter']:10s} tau {r['tau']} hit {r['hit_rate']:.1f}: seq {r['seq_median']:.2f} vs async "
                     f"{r['async_median']:.2f} ms/token ({r['async_over_seq_speed']:.2f}x, overlap {r['overlap_median']:.2f}, n {r['repeats']})")
    if data.get("lossless"):
        lines.append("lossless: " + ", ".join(f"{k} {'yes' if v['lossless'] else 'NO at ' + str(v['first_divergence'])}" for k, v in data["lossless"].items()))
    if data.get("peak_memory_gib") is not None:
        lines.append(f"peak memory {data['peak_memory_gib']:.2f} GiB")
    return "\n".join(lines)


def run_check(out: Path, dry_run: bool, device: str) -> int:
    pyd = ensure_vendored()
    import torch

    prof = PROFILES["dry" if dry_run else "gpu"]
    if not dry_run and not device.startswith("cuda"):
        print("error: the GPU check needs CUDA (torch.cuda.is_available() is False here); --dry-run runs it on the CPU with toy shapes",
              file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dry_run:  # toy shapes need no second thread, and a busy two-core machine stalls a parallel region on its other one
        torch.set_num_threads(1)
    rep = Report(out, {"profile": "dry-run (toy shapes on the CPU: not GPU figures)" if dry_run else "gpu",
                       "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # names the measured profile (latency)
                       "device": device, "dtype": str(dtype), "pydantic": pyd, "taus": list(TAUS), "hit_rates": list(HIT_RATES),
                       "shapes": {"target": prof["target"], "standalone_drafter": prof["drafter"], "vocab": prof["vocab"]},
                       "oracle": []})
    rep.data["versions"] = rep.step("versions", versions)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    built = rep.step("build", build_models, prof, device, dtype)
    if built is None:
        return 1
    bundle, standalone, adapter = built
    drafters = {"standalone": standalone, "adapter": adapter}
    rep.data["models"] = {"target_params": _count_params(bundle.target.model), "standalone": standalone.describe(),
                          "standalone_params": _count_params(standalone), "adapter": adapter.describe(),
                          "adapter_own_params": sum(p.numel() for p in adapter.own_parameters()), "attention": bundle.attention}
    rep.save()
    rep.data["costs"] = rep.step("costs", measure_costs, bundle, drafters, prof)
    rep.step("oracle", run_oracle, rep, bundle, drafters, prof, prof["budget_s"])
    rep.data["lossless"] = rep.step("lossless", check_lossless, bundle, drafters, prof)
    if device.startswith("cuda"):
        rep.data["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        import resource

        rep.data["peak_memory_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    rep.data["done"] = True
    rep.save()
    print(summary_text(rep.data))
    print(f"wrote {out}")
    ok = not rep.data.get("failed_steps") and len(rep.data["oracle"]) >= 4
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", metavar="DIR", default=None, help="write the folder to send to the GPU machine (<= 64 MiB) and stop")
    ap.add_argument("--offline", action="store_true", help="with --pack: no pip download; wheels built from this machine's installed copies")
    ap.add_argument("--dry-run", action="store_true", help="run the check on the CPU with toy shapes (what the suite runs)")
    ap.add_argument("--device", default=None, help="default: cuda when available (the check), cpu with --dry-run")
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args(argv)
    if args.pack:
        return pack(Path(args.pack), offline=args.offline)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.device is None:
        import torch

        args.device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    return run_check(Path(args.out), args.dry_run, args.device)


if __name__ == "__main__":
    sys.exit(main())
