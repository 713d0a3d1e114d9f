"""Hugging Face ZeroGPU support, imported lazily: when the `spaces` package is importable (on a
Space), the GPU work of a handler is wrapped with ``@spaces.GPU`` and a duration sized from the request.

What ZeroGPU asks of an app (https://huggingface.co/docs/hub/spaces-zerogpu), and where this app does it:
- models load once, in the main process, outside the GPU window: ``app.ui.run_race`` loads the bundle
  (``service.bundle_summary``) before it calls the wrapped ``app.ui.race_stream``; a GPU Space also loads it at
  start-up (``D3D_PRELOAD=1``, ``app.py``);
- CUDA is not initialised in the main process: nothing at import touches CUDA, and the decoder creates its
  streams and events per decode (``d3d_core.decoding.timing``), i.e. inside the wrapped function;
- what crosses into the GPU worker and back is picklable plain data: the request (strings, lists, a frozen
  ``DecodeConfig``, a run id) and the streamed Traces; cancelling goes through a run id the server owns
  (``app.runs``), never an object kept in ``gr.State``;
- the duration is computed from the request (:func:`race_duration`, :func:`stream_duration`).
"""

from __future__ import annotations

import importlib.util

from d3d_core.limits import APP_RACE_SECONDS

SECONDS_PER_TOKEN_PER_MODE = 0.08  # generous for an 8B target on a ZeroGPU slice, incl. drafting
BASE_SECONDS = 30  # moving the weights onto the lent GPU + prefill + warm-up
MAX_SECONDS = 300
PRUNING_SECONDS = 60  # one offline-τ measurement on the calibration set


def race_duration(prompt=None, bundle=None, modes=None, block_size=None, temperature=None, max_new_tokens=128, *rest, **kw) -> int:
    """Seconds of GPU to reserve for one race: base + per token per mode, capped (the race itself stops at
    ``APP_RACE_SECONDS``, so more is never needed)."""
    try:
        n = max(1, int(float(max_new_tokens)))
    except (TypeError, ValueError):
        n = 128
    m = max(1, len(modes) if isinstance(modes, (list, tuple)) else 4)
    return int(min(MAX_SECONDS, BASE_SECONDS + APP_RACE_SECONDS, BASE_SECONDS + SECONDS_PER_TOKEN_PER_MODE * n * m))


def stream_duration(prompt=None, bundle=None, modes=None, base=None, *rest, **kw) -> int:
    """:func:`race_duration` for ``app.ui.race_stream``'s arguments (the settings come as one DecodeConfig)."""
    return race_duration(prompt, bundle, modes, max_new_tokens=getattr(base, "max_new_tokens", 128))


def zerogpu_installed() -> bool:
    return importlib.util.find_spec("spaces") is not None


def maybe_gpu(fn, duration=race_duration):
    """fn unchanged off Spaces; ``spaces.GPU(duration=...)(fn)`` when `spaces` is installed (outside ZeroGPU the
    decorator itself does nothing). ``duration``: seconds, or a callable of fn's arguments."""
    if not zerogpu_installed():
        return fn
    import spaces  # noqa: PLC0415  (lazy: only on Hugging Face Spaces)

    return spaces.GPU(duration=duration)(fn)
