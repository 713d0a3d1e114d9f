"""A ``gradio_client.Client`` that does not lose a call to its own stream's closing: what the soak, the app's
tests and ``scripts/measure_app.py`` drive the app with.

The race it closes (gradio_client of gradio 6, protocol sse_v3): one client keeps one event stream open while it has
calls in flight; when the server has answered the last of them it sends ``close_stream`` right after that call's
``process_completed``. A caller that submits its next call after the answer arrives but before the client's reader has
read ``close_stream`` registers the new call on the closing stream: the reader then ends, and the client cancels every
call of that stream, the new one too — ``predict`` raises ``concurrent.futures.CancelledError()`` although nothing
cancelled it, and the server runs the call with no one left to read its answer. It needs the server to send
``close_stream`` more than the client's 50 ms poll after the answer, so it shows only on a loaded machine: one prune
call of the 2026-12-07 soak runs (load 6–7 on a 2-core AMD EPYC, commit 6a15661) failed so.

``submit`` here first lets a closing stream close: while the client has no call in flight and its stream is still
open, the server is about to close it, so it waits (at most ``SETTLE_S``) for the reader to see ``close_stream``; the
next call then opens a stream of its own. Calls made while another is in flight (a Stop during a race) need no wait:
the server keeps the stream open for the one in flight.
"""

from __future__ import annotations

import time

SETTLE_S = 2.0  # the longest wait for a closing stream; a server that never closes it only costs this once


def settle(client, timeout: float = SETTLE_S) -> bool:
    """Wait until ``client``'s event stream is not about to close under a new call; True when settled in time."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lock = getattr(client, "pending_lock", None)
        if lock is None:  # not a gradio 6 client: nothing to wait for
            return True
        with lock:
            if not getattr(client, "stream_open", False) or getattr(client, "pending_event_ids", None):
                return True
        time.sleep(0.005)
    return False


def app_client(url: str, **kwargs):
    """A gradio_client ``Client`` for ``url`` whose every call waits out a closing stream first (``settle``)."""
    from gradio_client import Client

    class SettledClient(Client):
        def submit(self, *args, **kw):
            settle(self)
            return super().submit(*args, **kw)

    kwargs.setdefault("verbose", False)
    return SettledClient(url, **kwargs)
