"""What this host can load: whether it has a CUDA GPU, and whether a bundle's weights fit in its memory.

Asked before any bundle is downloaded or loaded (``bundles.get_bundle``, ``bundles.load_qwen3_bundle``), so a
visitor of a CPU server can neither start a multi-GB download of a GPU-only bundle nor run the machine out of
memory: the answer is one sentence (:class:`BundleUnavailable`, a ValueError every handler already turns into a
message). Nothing here initialises CUDA: ``torch.cuda.is_available()`` counts devices without creating a context
(``torch.cuda.is_initialized()`` stays False), and on ZeroGPU, where the main process must not touch CUDA at all,
the GPU is taken as present and its memory as ``limits.ZEROGPU_MEMORY_BYTES``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..limits import LOAD_MEMORY_MARGIN, LOAD_RESERVE_GPU_BYTES, LOAD_RESERVE_RAM_BYTES, ZEROGPU_MEMORY_BYTES


class BundleUnavailable(ValueError):
    """A bundle this host cannot load (no GPU for a GPU-only bundle, or not enough memory): the message says why."""


def on_zerogpu() -> bool:
    """True on a Hugging Face ZeroGPU Space (it sets ``SPACES_ZERO_GPU``): a GPU is lent per ``@spaces.GPU`` call."""
    return bool(os.environ.get("SPACES_ZERO_GPU"))


def gpu_available() -> bool:
    """Whether this host can run a CUDA bundle, without initialising CUDA in this process."""
    if on_zerogpu():
        return True
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver reads as no GPU
        return False


def _cgroup_free() -> Optional[int]:
    """Bytes left under this container's memory limit (cgroup v2 or v1), or None without one: on a Space,
    ``MemAvailable`` and psutil describe the whole host, not the container the app may use."""
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            lim = Path(limit).read_text().strip()
            cur = int(Path(used).read_text().strip())
        except (OSError, ValueError):
            continue
        if lim.isdigit() and int(lim) < 1 << 60:  # "max" or a huge number: no limit
            return max(0, int(lim) - cur)
    return None


def available_ram_bytes() -> int:
    """RAM a load may still use: the host's available memory, capped by the container's limit."""
    try:
        import psutil

        avail = int(psutil.virtual_memory().available)
    except ImportError:
        avail = None
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        if avail is None:
            avail = 1 << 62  # unknown platform: do not refuse on a guess
    cg = _cgroup_free()
    return min(avail, cg) if cg is not None else avail


def free_gpu_bytes(device="cuda") -> int:
    """Free memory of the GPU a bundle would load onto (on ZeroGPU: the assumed slice, without touching CUDA)."""
    if on_zerogpu():
        return ZEROGPU_MEMORY_BYTES
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def dtype_bytes(dtype) -> int:
    return torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8


def estimate_params(cfg) -> int:
    """Parameters of a decoder-only causal LM from its Hugging Face config (Llama / Qwen3 layout), without
    loading it: embedding and head (untied), and per layer q/k/v/o, the gated MLP and the norms."""
    h, L, V, I = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * I + 2 * h
    head = 0 if getattr(cfg, "tie_word_embeddings", False) else V * h
    return int(L * per_layer + V * h + head + h)


@dataclass(frozen=True)
class MemoryCheck:
    """Whether ``what`` (``params`` parameters of ``dtype_size`` bytes) fits where it would load."""

    what: str
    params: int
    dtype_size: int
    where: str  # "RAM" or "GPU memory"
    available: int  # bytes free there now
    reserve: int  # bytes that must stay free after the load

    @property
    def need(self) -> int:
        return int(self.params * self.dtype_size * LOAD_MEMORY_MARGIN)

    @property
    def fits(self) -> bool:
        return self.need + self.reserve <= self.available

    def message(self) -> str:
        return (f"not enough memory to load {self.what}: it needs about {_size(self.need)} of {self.where} "
                f"({_count(self.params)} parameters x {self.dtype_size} bytes, plus working room) and this server has "
                f"{_size(self.available)} free, of which {_size(self.reserve)} must stay free for the server itself")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else (f"{n / 1e6:.0f} M" if n >= 1e6 else f"{n:,}")


def memory_check(what: str, params: int, dtype, device) -> MemoryCheck:
    """The memory check of a load of ``params`` parameters in ``dtype`` onto ``device`` (CUDA: its GPU memory; else RAM)."""
    if str(device).startswith("cuda"):
        return MemoryCheck(what, int(params), dtype_bytes(dtype), "GPU memory", free_gpu_bytes(device), LOAD_RESERVE_GPU_BYTES)
    return MemoryCheck(what, int(params), dtype_bytes(dtype), "RAM", available_ram_bytes(), LOAD_RESERVE_RAM_BYTES)


def require_memory(what: str, params: int, dtype, device) -> MemoryCheck:
    """:func:`memory_check`, raising :class:`BundleUnavailable` with its message when the load would not fit."""
    check = memory_check(what, params, dtype, device)
    if not check.fits:
        raise BundleUnavailable(check.message())
    return check
