"""Write a Hugging Face Space of D3D Studio into a folder, to be pushed as is (``git push`` or ``hf upload``).

    python scripts/make_space.py --kind cpu     --out ../d3d-space-cpu
    python scripts/make_space.py --kind zerogpu --out ../d3d-space-zerogpu
    python scripts/make_space.py --kind gpu     --out ../d3d-space-gpu

- ``cpu``: this repository as it is (the files git tracks or would add, as in the working tree): the README's front matter makes it
  a CPU Space serving the bundled SmolLM2-135M with its shipped drafters, offline.
- ``zerogpu``: a ZeroGPU Space on ``qwen3-8b`` (Qwen3-8B, bf16). Its own front matter (Python 3.12.12, one of the
  two the ZeroGPU page lists; no ``suggested_hardware``: the configuration reference lists no ZeroGPU value, so
  ZeroGPU is picked in the Space's settings; the models preloaded at build time) and requirements (a torch ZeroGPU
  supports, plus the ``spaces`` release this code was checked against, which wraps the race's GPU part in
  ``@spaces.GPU``); ``space-defaults.env`` opens the app on ``qwen3-8b``, offers only it, and loads it at start-up,
  in the main process (on ZeroGPU that load is mandatory: a Space that cannot load it stops with the reason).
- ``gpu``: the same app for a dedicated GPU (suggested hardware ``a100-large``; no ``spaces``).

The GPU recipes copy the code and the small JSON assets, not ``assets/drafters/`` (the CPU bundle's trained
drafters, 80 MB, which a GPU Space that offers only ``qwen3-8b`` never loads), nor tests or docs. Only the files of
this repository are read; nothing is downloaded. Exit status 2 with one line when the folder cannot be written.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from app.spaces_gpu import DURATION_FACTOR, MARGIN_S, QUOTA_SECONDS, SPACES_PIN, ZEROGPU_CONCURRENCY  # noqa: E402  (one pin, read by the code it was checked against)

sys.path.remove(str(ROOT))
KINDS = ("cpu", "zerogpu", "gpu")

# ZeroGPU runs torch 2.8 to 2.11 on Python 3.12.12 / 3.10.13 (its page's "Supported Versions"; no torch.compile, no
# nvcc: prebuilt wheels only); this repository pins torch 2.13 on Python 3.11 for the CPU, so a GPU Space gets its own pins
GPU_TORCH = "torch==2.9.1"
GPU_PYTHON = "3.12.12"
# the Space's suggested hardware, from the configuration reference's list of valid flavors (which has no ZeroGPU
# value: a ZeroGPU Space says none and is switched to ZeroGPU in its settings)
HARDWARE = {"zerogpu": None, "gpu": "a100-large"}
GPU_MODELS = ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
GPU_ENV = {"D3D_BUNDLE": "qwen3-8b", "D3D_BUNDLES": "qwen3-8b", "D3D_PRELOAD": "1"}
# what a GPU Space runs: the app, the engine and the small JSON assets (tests, docs and the CPU drafters stay behind)
GPU_KEEP = ("app.py", "app/", "d3d_core/", "assets/", "LICENSE")
GPU_SKIP = ("assets/drafters/",)


def repo_files(root: Path = ROOT) -> list:
    """The repository's files as git sees them (tracked, plus new ones not ignored), read from the working tree,
    paths relative to root; without git, every file outside hidden folders, caches and run outputs."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
        files = [f for f in out.decode("utf-8").split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        skip = {".venv", "__pycache__", "results", "runs", "out", ".git", ".pytest_cache", ".hypothesis", ".gradio"}
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not (set(p.relative_to(root).parts) & skip)
                 and not any(part.startswith(".") for part in p.relative_to(root).parts[:-1])]
    return sorted(f for f in files if (root / f).is_file())


def front_matter(kind: str) -> str:
    """The GPU recipes' README front matter (the CPU recipe keeps the repository's own)."""
    lines = [
        "---",
        "title: D3D Studio (GPU)" if kind == "gpu" else "title: D3D Studio (ZeroGPU)",
        "emoji: ⚡",
        "colorFrom: green",
        "colorTo: blue",
        "sdk: gradio",
        f"sdk_version: {gradio_version()}",
        "app_file: app.py",
        f'python_version: "{GPU_PYTHON}"',
        *([f"suggested_hardware: {HARDWARE[kind]}"] if HARDWARE[kind] else []),
        "startup_duration_timeout: 1h",
        "models:",
        *[f"  - {m}" for m in GPU_MODELS],
        "preload_from_hub:",
        *[f"  - {m}" for m in GPU_MODELS],
        "pinned: false",
        "license: apache-2.0",
        "short_description: Async speculative decoding (D3D) on Qwen3-8B, on a GPU",
        "---",
    ]
    return "\n".join(lines) + "\n"


def gradio_version() -> str:
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("gradio=="):
            return line.strip().split("==", 1)[1]
    raise ValueError("requirements.txt does not pin gradio")


def gpu_requirements(kind: str) -> str:
    """requirements.txt of a GPU recipe: the repository's runtime pins, with a GPU torch instead of the CPU one, without
    gguf (only the CPU bundle's GGUF conversion needs it), plus psutil (the memory check) and, on ZeroGPU, spaces."""
    keep = []
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        name = line.split("#")[0].strip()
        if not name or name.startswith(("torch", "gguf")):
            continue
        keep.append(name)
    head = [f"# {kind} Space of D3D Studio (written by scripts/make_space.py): a torch {('ZeroGPU supports' if kind == 'zerogpu' else 'with CUDA')}",
            GPU_TORCH]
    tail = ["psutil>=5.9"] + ([SPACES_PIN] if kind == "zerogpu" else [])
    return "\n".join(head + keep + tail) + "\n"


def gpu_readme(kind: str) -> str:
    where = ("ZeroGPU: a GPU is lent to each race (`@spaces.GPU`, duration sized from the request)" if kind == "zerogpu"
             else "a dedicated GPU")
    cap = int(QUOTA_SECONDS / DURATION_FACTOR)
    zero = (f"""
**ZeroGPU.** Pick *ZeroGPU* as this Space's hardware in its settings (the configuration reference has no
`suggested_hardware` value for it). The bundle loads at start-up, always: if it cannot, the Space stops with the
reason in its log. Each race reserves at most {cap} s of GPU (times `spaces`' duration factor of up to {DURATION_FACTOR},
within the {QUOTA_SECONDS} s a visitor without an account has a day; `D3D_GPU_QUOTA_S` raises it for visitors who sign
in), with new tokens × modes capped to fit and the cap said in the status line; the worker stops its race {MARGIN_S} s
before its reservation ends. {ZEROGPU_CONCURRENCY} races run at once (`D3D_GPU_CONCURRENCY`). Stop ends the GPU work at
its next round.
""" if kind == "zerogpu" else "")
    return front_matter(kind) + f"""# D3D Studio on a GPU

This Space is D3D Studio's GPU recipe for {where}: it serves the `qwen3-8b` bundle — `Qwen/Qwen3-8B` in bf16,
the public `z-lab/Qwen3-8B-DFlash-b16` drafter for `dflash`, and for `d3d-seq` / `d3d-async` the **shared-weight
adapter drafter** (the target's own layers, no copy, with untrained adapters: draft 1 is the target's token, so
τ ≥ 2 at temperature 0; name a trained D3D drafter with the variable `D3D_QWEN3_D3D`).

`space-defaults.env` sets the defaults (`D3D_BUNDLE=qwen3-8b`, `D3D_BUNDLES=qwen3-8b`, `D3D_PRELOAD=1`); a variable
of the same name in the Space's settings overrides each. The models are downloaded when the Space is built
(`preload_from_hub`) and loaded once at start-up. Written by `scripts/make_space.py --kind {kind}`; the source,
the CPU Space and the documentation are in the D3D Studio repository.
{zero}"""


def write_space(kind: str, out: Path, root: Path = ROOT, force: bool = False) -> list:
    """Write the recipe into ``out`` (created; an existing non-empty folder only with ``force``, and then replaced).
    Returns the written paths, relative to out."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    out = Path(out)
    if out.resolve() == root.resolve() or root.resolve() in out.resolve().parents:
        raise ValueError(f"{out} is inside the repository: write the Space somewhere else")
    if out.resolve() in root.resolve().parents or out.resolve() == Path.home().resolve():
        raise ValueError(f"{out} holds the repository (or is your home folder): write the Space somewhere else")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ValueError(f"{out} exists and is not empty (pass --force to replace it)")
        if not ((out / "app.py").is_file() and (out / "d3d_core").is_dir()):  # --force replaces an earlier recipe, nothing else
            raise ValueError(f"{out} is not an earlier Space recipe (no app.py and d3d_core/): not replacing it")
        shutil.rmtree(out)
    files = repo_files(root)
    if kind != "cpu":
        files = [f for f in files if f.startswith(GPU_KEEP) and not f.startswith(GPU_SKIP) and f not in ("README.md", "requirements.txt")]
    written = []
    for f in files:
        dst = out / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dst)
        written.append(f)
    if kind != "cpu":
        (out / "README.md").write_text(gpu_readme(kind), encoding="utf-8")
        (out / "requirements.txt").write_text(gpu_requirements(kind), encoding="utf-8")
        (out / "space-defaults.env").write_text("".join(f"{k}={v}\n" for k, v in GPU_ENV.items()), encoding="utf-8")
        written += ["README.md", "requirements.txt", "space-defaults.env"]
    return sorted(written)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=KINDS, required=True, help="cpu: this repository as is; zerogpu / gpu: the qwen3-8b GPU Space")
    ap.add_argument("--out", required=True, help="folder to write (created; must be empty unless --force)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    args = ap.parse_args(argv)
    try:
        written = write_space(args.kind, Path(args.out), force=args.force)
    except (ValueError, OSError) as e:
        print(f"make_space: {e}", file=sys.stderr)
        return 2
    size = sum((Path(args.out) / f).stat().st_size for f in written)
    print(f"wrote the {args.kind} Space to {args.out}: {len(written)} files, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
