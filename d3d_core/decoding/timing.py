"""Synchronised span clocks and the drafter lane (worker thread / CUDA stream).

CPU: one ``perf_counter`` clock shared by both threads. CUDA: each lane has its own
stream; spans are CUDA events resolved against one base event after a final sync, so
the timeline shows when the GPU actually ran the work, not when Python launched it.

A decode's clock is its own: it stops while the decode is suspended between two yields (``Recorder.pause`` /
``resume``), so in a race whose modes take turns round by round each mode's spans, decode time and tokens/s
count only its own rounds, never another mode's or the UI's work in between.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from .trace import Span


class Recorder:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []
        self._events: list = []
        self.t0 = time.perf_counter()
        self._paused_s = 0.0  # host seconds spent suspended so far
        self._pause_at = None  # perf_counter when the current suspension began (None: running)
        self._gaps: list = []  # CUDA: [pause event, resume event] of each suspension
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()

    def now_s(self) -> float:
        """This decode's own clock: host seconds since start, less the time it was suspended (``pause``);
        on CUDA call after a sync to be meaningful."""
        t = self._pause_at if self._pause_at is not None else time.perf_counter()
        return t - self.t0 - self._paused_s

    def now_ms(self) -> float:
        return self.now_s() * 1e3

    def pause(self) -> None:
        """Stop the clock (the decode is suspended: another mode's round or the UI runs). Call only at a quiescent
        point (no lane has work in flight); on CUDA it synchronises first, so no queued kernel of this decode runs
        on someone else's time."""
        if self._pause_at is not None:
            return
        if self.cuda:
            torch.cuda.synchronize()
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._gaps.append([e, None])
        self._pause_at = time.perf_counter()

    def resume(self) -> None:
        if self._pause_at is None:
            return
        self._paused_s += time.perf_counter() - self._pause_at
        self._pause_at = None
        if self.cuda and self._gaps and self._gaps[-1][1] is None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._gaps[-1][1] = e

    @contextlib.contextmanager
    def running(self):
        """The clock runs inside, and stops again on the way out."""
        self.resume()
        try:
            yield
        finally:
            self.pause()

    @contextlib.contextmanager
    def span(self, lane: str, kind: str, rnd: int):
        if self.cuda:
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            yield
            e.record()
            self._events.append((lane, kind, rnd, s, e))
        else:
            t = self.now_ms()
            yield
            self.spans.append(Span(lane, kind, rnd, t, self.now_ms()))

    def finalize(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            gaps = [(self.base.elapsed_time(p), self.base.elapsed_time(r)) for p, r in self._gaps if r is not None]

            def own(t):  # the GPU's clock less the suspensions that ended before t
                return t - sum(b - a for a, b in gaps if b <= t)

            for lane, kind, rnd, s, e in self._events:
                self.spans.append(Span(lane, kind, rnd, own(self.base.elapsed_time(s)), own(self.base.elapsed_time(e))))
            self._events.clear()
        self.spans.sort(key=lambda s: (s.t_start, s.lane))
        return self.spans


class Lanes:
    """Where each lane's work runs. ``concurrent=False``: everything inline on the caller.
    ``concurrent=True``: drafter work goes to one worker thread (and, on CUDA, its own
    stream); the target keeps the calling thread (own stream on CUDA too, because the
    legacy default stream would serialise with every other stream)."""

    def __init__(self, device: torch.device, concurrent: bool):
        self.device = device
        self.concurrent = concurrent
        self.cuda = device.type == "cuda"
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3d-drafter") if concurrent else None
        self._inflight: list = []  # drafter-lane jobs submitted and not yet known to be finished
        if self.cuda:
            self.target_stream = torch.cuda.Stream(device)
            self.drafter_stream = torch.cuda.Stream(device) if concurrent else self.target_stream
        else:
            self.target_stream = self.drafter_stream = None

    def target_ctx(self):
        return torch.cuda.stream(self.target_stream) if self.cuda else contextlib.nullcontext()

    def drafter_ctx(self):
        return torch.cuda.stream(self.drafter_stream) if self.cuda else contextlib.nullcontext()

    def submit(self, fn, *args):
        """Run fn on the drafter lane; returns a future (or an already-done result holder)."""

        def run():
            with torch.inference_mode(), self.drafter_ctx():
                out = fn(*args)
                if self.cuda:
                    self.drafter_stream.synchronize()
                return out

        if self.pool is None:
            return _Done(run())
        self._inflight = [f for f in self._inflight if not f.done()]
        fut = self.pool.submit(run)
        self._inflight.append(fut)
        return fut

    def quiesce(self) -> None:
        """Wait until no drafter-lane job is in flight (its result or error stays in its future for whoever reads
        it). A decode suspended between rounds calls this first, so its drafter thread never runs during another
        mode's turn; the loop's own yield points are quiescent already (every packed pass is joined before the round
        ends), this makes it a guarantee."""
        if self._inflight:
            wait(self._inflight)
            self._inflight = []

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


class _Done:
    def __init__(self, v):
        self.v = v

    def result(self):
        return self.v


@contextlib.contextmanager
def cpu_threads(n: int):
    """Set intra-op threads for the duration (process-wide in PyTorch), then restore (no call when already n)."""
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)
