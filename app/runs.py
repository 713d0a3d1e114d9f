"""Races in flight, owned by the server: run id -> cancel flag.

A visitor's ``gr.State`` holds only plain, picklable data (ZeroGPU pickles what crosses into its GPU worker,
and Gradio copies session state), so it keeps a race's *id*, a string, never the ``threading.Event`` that stops
it. The event lives here, behind a lock, from ``start`` until ``finish`` (called when the race ends, however it
ends); ``cancel`` sets it, and the decoder checks it before every round.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Optional

_LOCK = threading.Lock()
_RUNS: dict = {}  # run id -> RaceCancel


class RaceCancel:
    """A race's stop flag: set by ``cancel`` (the Stop button, a visitor who left) or, once the deadline passes,
    by the clock. ``is_set`` is what the decoder polls before every round (``iter_decode``'s ``cancel``)."""

    def __init__(self, deadline_s: Optional[float] = None):
        self.event = threading.Event()
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s

    def set(self) -> None:
        self.event.set()

    def start_clock(self, seconds: float) -> None:
        """The deadline counts from now (a race's clock starts once its bundle is loaded)."""
        self.deadline = time.monotonic() + seconds

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def is_set(self) -> bool:
        return self.event.is_set() or self.timed_out()


def start(deadline_s: Optional[float] = None) -> str:
    """Register a new race; returns its id (what the session state keeps)."""
    run_id = uuid.uuid4().hex
    with _LOCK:
        _RUNS[run_id] = RaceCancel(deadline_s)
    return run_id


def get(run_id) -> Optional[RaceCancel]:
    with _LOCK:
        return _RUNS.get(run_id) if isinstance(run_id, str) else None


def flag(run_id, deadline_s: Optional[float] = None) -> RaceCancel:
    """The race's flag; a fresh one (with ``deadline_s``) where this process has none — a GPU worker in another
    process, which then still stops at its deadline."""
    return get(run_id) or RaceCancel(deadline_s)


def cancel(run_id) -> bool:
    """Stop the race ``run_id`` at its next round; False when no such race is running."""
    f = get(run_id)
    if f is None:
        return False
    f.set()
    return True


def cancelled(run_id) -> bool:
    f = get(run_id)
    return f is not None and f.is_set()


def finish(run_id) -> None:
    """Forget a race that ended (its id may still sit in a session's state: cancelling it is then a no-op)."""
    with _LOCK:
        _RUNS.pop(run_id, None)


def active() -> int:
    """How many races are registered now (the registry must not grow: each race removes itself when it ends)."""
    with _LOCK:
        return len(_RUNS)
