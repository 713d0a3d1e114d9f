"""The test client waits out a closing event stream before each call (d3d_core.measure.client): gradio_client would
otherwise register a call on a stream the server is closing and cancel it (one soak failure, 2026-12-07)."""

import threading
import time

from d3d_core.measure.client import app_client, settle


class FakeClient:
    """gradio_client's stream state: stream_open, pending_event_ids under pending_lock."""

    def __init__(self, stream_open: bool, pending=()):
        self.pending_lock = threading.Lock()
        self.stream_open = stream_open
        self.pending_event_ids = set(pending)


def test_a_closing_stream_is_waited_for_until_the_reader_closes_it():
    c = FakeClient(stream_open=True)  # no call in flight, stream still open: the server is closing it

    def reader_reads_close_stream():
        time.sleep(0.2)
        with c.pending_lock:
            c.stream_open = False

    threading.Thread(target=reader_reads_close_stream).start()
    t0 = time.monotonic()
    assert settle(c, timeout=5.0)
    assert 0.15 <= time.monotonic() - t0 < 4.0


def test_no_wait_when_the_stream_is_closed_or_a_call_is_in_flight_and_a_bounded_wait_otherwise():
    t0 = time.monotonic()
    assert settle(FakeClient(stream_open=False))
    assert settle(FakeClient(stream_open=True, pending={"race-event"}))  # a Stop during a race: the stream stays open
    assert settle(object())  # not a gradio 6 client: nothing to wait for
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    assert not settle(FakeClient(stream_open=True), timeout=0.1)  # a server that never closes: the wait is bounded
    assert 0.09 <= time.monotonic() - t0 < 1.0


def test_every_call_of_the_app_client_settles_first(app_server, monkeypatch):
    from d3d_core.measure import client as mod

    calls = []
    real = mod.settle
    monkeypatch.setattr(mod, "settle", lambda c, timeout=mod.SETTLE_S: calls.append(c) or real(c, timeout))
    c = app_client(app_server[1])
    for _ in range(3):
        assert c.predict(api_name="/health")["status"] == "ok"
    assert len(calls) == 3 and all(x is c for x in calls)
    assert settle(c) and not c.pending_event_ids  # after the last answer the stream closes (or is closing) cleanly


class _SlowCloseJson:
    """json for gradio_client's stream reader that reads ``close_stream`` 0.4 s late: the loaded-machine timing
    that cancelled a soak call, made certain."""

    def __init__(self, real):
        self.real = real

    def loads(self, s, *a, **k):
        msg = self.real.loads(s, *a, **k)
        if isinstance(msg, dict) and msg.get("msg") == "close_stream":
            time.sleep(0.4)
        return msg

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_call_right_after_an_answer_survives_a_late_close_stream(app_server, monkeypatch):
    """With the reader late on close_stream, gradio_client's own Client cancels the next call (the soak failure); the
    app client waits out the closing stream and every call is answered."""
    import concurrent.futures
    import json

    import gradio_client.client as gc
    import pytest
    from gradio_client import Client

    monkeypatch.setattr(gc, "json", _SlowCloseJson(json))
    url = app_server[1]
    plain = Client(url, verbose=False)
    with pytest.raises(concurrent.futures.CancelledError):
        for _ in range(3):
            plain.predict(api_name="/race_views")
    c = app_client(url)
    for _ in range(3):
        c.predict(api_name="/race_views")
