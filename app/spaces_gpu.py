"""Hugging Face ZeroGPU support, imported lazily: when the `spaces` package is importable (on a Space), the GPU work
of a handler is wrapped with ``@spaces.GPU`` and a duration sized from the request.

What ZeroGPU asks of an app (https://huggingface.co/docs/hub/spaces-zerogpu, and the ``spaces`` release the recipe
pins, :data:`SPACES_PIN`), and where this app does it:
- models load once, in the main process, at start-up, outside the GPU window: ``app.py`` preloads the bundle and, on
  ZeroGPU, stops the Space with the reason when it cannot (:func:`on_zerogpu`); a request never loads a bundle there
  (``service.load_at_startup_only``), since a request thread is outside ZeroGPU's CUDA emulation;
- CUDA is not initialised in the main process: nothing at import touches CUDA, and the decoder creates its streams
  and events per decode (``d3d_core.decoding.timing``), i.e. inside the wrapped function;
- what crosses into the GPU worker and back is picklable plain data: the request (strings, lists, a frozen
  ``DecodeConfig``, a run id, the reserved seconds) and, per streamed update, only what is new since the previous one
  (:func:`trace_delta`, merged back by :func:`merge_delta`), so the bytes of an update do not grow with the race;
- cancelling goes through a run id the server owns (``app.runs``): Stop leaves a mark the worker reads before every
  round, so the GPU work ends at its next round;
- the duration is computed from the request and fits the quota a visitor without an account has
  (:func:`gpu_budget`): the worker stops its race :data:`MARGIN_S` before the reservation ends, on its own clock.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import NamedTuple, Optional

from d3d_core.limits import APP_QUEUE_MAX

SPACES_PIN = "spaces==0.51.3"  # the release this module was checked against (scripts/make_space.py pins it)

# --- the GPU time a race asks for (seconds of the lent GPU)
SECONDS_PER_TOKEN_PER_MODE = 0.08  # generous for an 8B target on a ZeroGPU slice, incl. drafting (not measured yet)
WARM_SECONDS = 15  # inside the worker, on its clock: warm-up (once per worker) and the prefills
MARGIN_S = 15  # outside the worker's clock: starting the worker and moving the weights before, the last update after
BASE_SECONDS = WARM_SECONDS + MARGIN_S
# The daily quota of a visitor without an account (the docs' "Usage Tiers": unauthenticated 2 minutes, free account
# 5 minutes). A request above what a visitor has left is refused before it starts, so by default no race asks more
# than a fresh anonymous visitor has. A Space whose visitors sign in may raise it (D3D_GPU_QUOTA_S).
QUOTA_SECONDS = 120
# spaces 0.51.3 multiplies the asked duration by its GPU's duration_factor before asking (zero/client.py
# get_duration_seconds; configs.json: 1.0 for the H200, 1.5 for the RTX Pro 6000 the docs name): the largest counts
DURATION_FACTOR = 1.5
PRUNING_SECONDS = 60  # one offline-τ measurement on the calibration set
# races at once on ZeroGPU: each runs in its own GPU worker on its own lent GPU, so the decode lane is not one GPU
# there; ZeroGPU itself may still queue a call ("Waiting for a GPU slot on this Space"). D3D_GPU_CONCURRENCY overrides.
ZEROGPU_CONCURRENCY = 3


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number (between {lo} and {hi})") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range: use {lo} to {hi}")
    return value


def quota_seconds() -> int:
    """The quota a request must fit (``D3D_GPU_QUOTA_S``, default :data:`QUOTA_SECONDS`; at most 300 s, the longest
    ZeroGPU call its maintainers quote)."""
    return _env_int("D3D_GPU_QUOTA_S", QUOTA_SECONDS, 40, 300)


def max_duration() -> int:
    """The longest duration this app asks: what, times ``spaces``' duration factor, still fits the quota."""
    return int(quota_seconds() / DURATION_FACTOR)


def zerogpu_concurrency() -> int:
    return _env_int("D3D_GPU_CONCURRENCY", ZEROGPU_CONCURRENCY, 1, APP_QUEUE_MAX)


class Budget(NamedTuple):
    """What a race asks of ZeroGPU: ``tokens`` new tokens per mode (the request's, or fewer where they do not fit),
    ``seconds`` to reserve, ``deadline_s`` the worker's own limit (reservation less :data:`MARGIN_S`), and ``note``,
    a sentence for the status line when the tokens were capped ("" otherwise)."""

    tokens: int
    seconds: int
    deadline_s: float
    note: str


def gpu_budget(n_modes: int, max_new_tokens: int) -> Budget:
    """Size a race to the quota: seconds = :data:`BASE_SECONDS` + per token per mode, with tokens × modes capped so
    that the reservation (times the duration factor) never exceeds :func:`quota_seconds`."""
    m = max(1, int(n_modes))
    n = max(1, int(max_new_tokens))
    cap = max_duration()
    fit = max(1, int((cap - BASE_SECONDS) / (SECONDS_PER_TOKEN_PER_MODE * m)))  # tokens per mode that fit
    tokens = min(n, fit)
    seconds = int(min(cap, BASE_SECONDS + SECONDS_PER_TOKEN_PER_MODE * tokens * m + 0.999))
    note = ""
    if tokens < n:
        note = (f"{tokens} new tokens per mode instead of {n}: with {m} mode{'s' if m > 1 else ''} that is what fits in "
                f"the {cap} s of GPU a race may reserve here ({quota_seconds()} s is a visitor's daily ZeroGPU quota "
                "without an account); fewer modes leave room for more tokens")
    return Budget(tokens, seconds, float(seconds - MARGIN_S), note)


def race_duration(prompt=None, bundle=None, modes=None, block_size=None, temperature=None, max_new_tokens=128, *rest, **kw) -> int:
    """Seconds of GPU to reserve for one race (:func:`gpu_budget`), from the Race tab's arguments."""
    try:
        n = max(1, int(float(max_new_tokens)))
    except (TypeError, ValueError):
        n = 128
    m = len(modes) if isinstance(modes, (list, tuple)) and modes else 4
    return gpu_budget(m, n).seconds


def stream_duration(prompt=None, bundle=None, modes=None, base=None, skip=None, run_id=None, d3d_drafter=None, engine=None,
                    seconds=None, *rest, **kw) -> int:
    """The duration ``app.ui.race_stream`` asks: the ``seconds`` the handler reserved for it (:func:`gpu_budget`),
    so the worker's deadline and the reservation are one number; sized from the request where none was passed."""
    if seconds is not None:
        return int(seconds)
    return race_duration(prompt, bundle, modes, max_new_tokens=getattr(base, "max_new_tokens", 128))


def zerogpu_installed() -> bool:
    return importlib.util.find_spec("spaces") is not None


def on_zerogpu() -> bool:
    """On a ZeroGPU Space: ``SPACES_ZERO_GPU`` set the way ``spaces`` reads it ("1", "t", "true")."""
    return os.environ.get("SPACES_ZERO_GPU", "").strip().lower() in ("1", "t", "true")


def stream_is_remote() -> bool:
    """Whether the wrapped GPU function runs in another process (ZeroGPU's worker)."""
    return on_zerogpu() and zerogpu_installed()


def maybe_gpu(fn, duration=race_duration):
    """fn unchanged off Spaces; ``spaces.GPU(duration=...)(fn)`` when `spaces` is installed (outside ZeroGPU the
    decorator itself does nothing). ``duration``: seconds, or a callable of fn's arguments."""
    if not zerogpu_installed():
        return fn
    import spaces  # noqa: PLC0415  (lazy: only on Hugging Face Spaces)

    return spaces.GPU(duration=duration)(fn)


# --- what a failed GPU call says (spaces 0.51.3 raises gr.Error with a title, or RuntimeError, in the handler)

_EXPLAIN = {
    "GPU task aborted": ("the GPU worker was stopped before the race ended (ZeroGPU ends a call that runs past its "
                         "reserved time, or a worker that failed)"),
    "No GPU was available": "every ZeroGPU GPU is busy right now: try again in a minute",
}


def gpu_error_status(exc: BaseException, rounds_kept: int) -> str:
    """The status line for a GPU call that failed: ZeroGPU's own title and message, what it means where that is known,
    and what of the race was kept."""
    title = getattr(exc, "title", None)
    message = str(getattr(exc, "message", None) or exc) or type(exc).__name__
    head = f"**{title}**" if title and title != "Error" else f"**Error ({type(exc).__name__})**"
    extra = next((why for key, why in _EXPLAIN.items() if key in message), "")
    kept = (f" · the {rounds_kept} round{'s' if rounds_kept != 1 else ''} that reached this page are kept below"
            if rounds_kept else " · no round had reached this page")
    return f"{head}: {message}" + (f" — {extra}" if extra else "") + kept


# --- streamed updates: only what is new (the worker pickles each yield; a whole growing Trace is quadratic)


def trace_delta(tr, sent: Optional[tuple]):
    """(update, new ``sent``) for the Trace ``tr`` given ``sent`` = (rounds, output ids) already sent, None for the
    first update. The update is a Trace holding the rounds from the last one sent (which a later round may still
    change) and the new output ids; its prompt only on the first update; everything else as it is now (the spans
    and stats are filled only when the mode ends)."""
    r0 = 0 if sent is None else max(0, sent[0] - 1)
    o0 = 0 if sent is None else sent[1]
    upd = dataclasses.replace(tr, rounds=tr.rounds[r0:], output_ids=tr.output_ids[o0:])
    if sent is not None:
        upd = dataclasses.replace(upd, prompt_ids=[], prompt_text="")
    return (r0, o0, upd), (len(tr.rounds), len(tr.output_ids))


def merge_delta(prev, delta):
    """The whole Trace again from the previous one (None before the first update) and an update of :func:`trace_delta`."""
    r0, o0, upd = delta
    if prev is None:
        if r0 or o0:
            raise ValueError("a race update arrived without the ones before it")
        return dataclasses.replace(upd, rounds=list(upd.rounds), output_ids=list(upd.output_ids))
    if r0 > len(prev.rounds) or o0 != len(prev.output_ids):
        raise ValueError("a race update does not follow the previous one")
    return dataclasses.replace(upd, prompt_ids=prev.prompt_ids, prompt_text=prev.prompt_text,
                               rounds=prev.rounds[:r0] + list(upd.rounds), output_ids=prev.output_ids + list(upd.output_ids))


__all__ = ["gpu_budget", "race_duration", "stream_duration", "maybe_gpu", "on_zerogpu", "stream_is_remote", "trace_delta",
           "merge_delta", "gpu_error_status", "zerogpu_concurrency"]
