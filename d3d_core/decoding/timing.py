"""Synchronised span clocks and the drafter lane (worker thread / CUDA stream).

CPU: one ``perf_counter`` clock shared by both threads. CUDA: each lane has its own
stream; spans are CUDA events resolved against one base event after a final sync, so
the timeline shows when the GPU actually ran the work, not when Python launched it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .trace import Span


class Recorder:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []
        self._events: list = []
        self.t0 = time.perf_counter()
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()

    def now_ms(self) -> float:
        """Host wall clock (ms since start); on CUDA call after a sync to be meaningful."""
        return (time.perf_counter() - self.t0) * 1e3

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
            for lane, kind, rnd, s, e in self._events:
                self.spans.append(Span(lane, kind, rnd, self.base.elapsed_time(s), self.base.elapsed_time(e)))
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
        return self.pool.submit(run)

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
    """Set intra-op threads for the duration (process-wide in PyTorch), then restore."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
