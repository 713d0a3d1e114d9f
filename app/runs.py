"""Races in flight, owned by the server: run id -> cancel flag.

A visitor's ``gr.State`` holds only plain, picklable data (ZeroGPU pickles what crosses into its GPU worker,
and Gradio copies session state), so it keeps a race's *id*, a string, never the ``threading.Event`` that stops
it. The event lives here, behind a lock, from ``start`` until ``finish`` (called when the race ends, however it
ends); ``cancel`` sets it, and the decoder checks it before every round.

A race on ZeroGPU decodes in a GPU worker, a process forked from this one, which never sees the event: ``cancel``
therefore also leaves a mark on disk (a file named after the run id in :data:`STOP_DIR`), and the worker's flag
(:func:`flag`, a :class:`RaceCancel` made in another process) reads that mark before every round. A Stop thus ends
the GPU work at its next round whatever the worker or its ``spaces`` release does with the stream.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
import uuid
from typing import Optional

_LOCK = threading.Lock()
_RUNS: dict = {}  # run id -> RaceCancel
# where cancel() marks a stopped race for a GPU worker in another process (same machine, same /tmp)
STOP_DIR = os.path.join(tempfile.gettempdir(), f"d3d-stops-{os.getuid() if hasattr(os, 'getuid') else 0}")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _fresh_lock_in_child() -> None:
    """A GPU worker forked while a server thread held the registry's lock would wait on its copy forever: the child,
    where only the forking thread exists, starts with a free one."""
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _mark(run_id) -> Optional[str]:
    """The stop mark's path for a well-formed run id (uuid4 hex), else None."""
    return os.path.join(STOP_DIR, run_id) if isinstance(run_id, str) and _RUN_ID.match(run_id) else None


class RaceCancel:
    """A race's stop flag: set by ``cancel`` (the Stop button, a visitor who left) or, once the deadline passes,
    by the clock. ``is_set`` is what the decoder polls before every round (``iter_decode``'s ``cancel``)."""

    def __init__(self, deadline_s: Optional[float] = None, run_id: Optional[str] = None):
        self.event = threading.Event()
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.pid = os.getpid()  # the process that made it: a forked worker's copy is not the server's flag
        self.mark = _mark(run_id)  # the stop mark this flag also reads (a flag made in a GPU worker), or None

    def set(self) -> None:
        self.event.set()

    def start_clock(self, seconds: float) -> None:
        """The deadline counts from now (a race's clock starts once its bundle is loaded)."""
        self.deadline = time.monotonic() + seconds

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def stopped(self) -> bool:
        """Stopped by a visitor (the event here, or the mark ``cancel`` left for a worker in another process)."""
        if self.event.is_set():
            return True
        if self.mark is not None and os.path.exists(self.mark):
            self.event.set()
            return True
        return False

    def is_set(self) -> bool:
        return self.stopped() or self.timed_out()


def start(deadline_s: Optional[float] = None) -> str:
    """Register a new race; returns its id (what the session state keeps)."""
    run_id = uuid.uuid4().hex
    with _LOCK:
        _RUNS[run_id] = RaceCancel(deadline_s)
    return run_id


def get(run_id) -> Optional[RaceCancel]:
    with _LOCK:
        f = _RUNS.get(run_id) if isinstance(run_id, str) else None
    return f if f is not None and f.pid == os.getpid() else None


def flag(run_id, deadline_s: Optional[float] = None) -> RaceCancel:
    """The race's flag in this process; where this process did not start the race (a GPU worker, forked from the
    server before or during the race), a fresh one that reads the race's stop mark and stops at ``deadline_s``
    counted from now. The worker never reads the registry: a forked copy of it is not the server's."""
    return get(run_id) or RaceCancel(deadline_s, run_id=run_id)


def cancel(run_id) -> bool:
    """Stop the race ``run_id`` at its next round (here, and in a GPU worker through its stop mark); False when no
    such race is running."""
    f = get(run_id)
    if f is None:
        return False
    f.set()
    path = _mark(run_id)
    with _LOCK:  # not after finish() removed the mark of a race that just ended
        if path is not None and run_id in _RUNS:
            try:
                os.makedirs(STOP_DIR, exist_ok=True)
                with open(path, "w", encoding="utf-8"):
                    pass
            except OSError:  # no writable temp dir: the race still stops here, and its worker at its deadline
                pass
    return True


def cancelled(run_id) -> bool:
    f = get(run_id)
    return f is not None and f.is_set()


def finish(run_id) -> None:
    """Forget a race that ended (its id may still sit in a session's state: cancelling it is then a no-op)."""
    path = _mark(run_id)
    with _LOCK:
        _RUNS.pop(run_id, None)
        if path is not None:
            try:
                os.remove(path)
            except OSError:  # never marked (not stopped), or already gone
                pass


def active() -> int:
    """How many races are registered now (the registry must not grow: each race removes itself when it ends)."""
    with _LOCK:
        return len(_RUNS)
