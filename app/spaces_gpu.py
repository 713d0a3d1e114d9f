"""Hugging Face ZeroGPU support, imported lazily: when the `spaces` package is importable (on a
Space), the decode handler is wrapped with ``@spaces.GPU`` and a duration sized from the request."""

from __future__ import annotations

import importlib.util

SECONDS_PER_TOKEN_PER_MODE = 0.08  # generous for an 8B target on a ZeroGPU slice, incl. drafting
BASE_SECONDS = 30  # model move to GPU + prefill
MAX_SECONDS = 300


def race_duration(prompt=None, bundle=None, modes=None, block_size=None, temperature=None, max_new_tokens=128, *rest, **kw) -> int:
    """Seconds of GPU to reserve for one race: base + per token per mode, capped."""
    try:
        n = max(1, int(float(max_new_tokens)))
    except (TypeError, ValueError):
        n = 128
    m = max(1, len(modes) if isinstance(modes, (list, tuple)) else 4)
    return int(min(MAX_SECONDS, BASE_SECONDS + SECONDS_PER_TOKEN_PER_MODE * n * m))


def maybe_gpu(fn, duration=race_duration):
    """fn unchanged off Spaces; ``spaces.GPU(duration=...)(fn)`` when `spaces` is installed."""
    if importlib.util.find_spec("spaces") is None:
        return fn
    import spaces  # noqa: PLC0415  (lazy: only on Hugging Face Spaces)

    return spaces.GPU(duration=duration)(fn)
