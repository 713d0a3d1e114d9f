"""Property-based tests (hypothesis): untrusted traces and UI values never crash the parsers —
they either parse or raise the one documented error type with a message."""

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from d3d_core import service
from d3d_core.decoding.trace import Trace, TraceError, traces_from_json
from d3d_core.models.tokenizer import clean_prompt

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=12), kids, max_size=6),
    max_leaves=40,
)

TRACE_KEYS = ["mode", "bundle", "config", "prompt_text", "prompt_ids", "output_ids", "rounds", "spans", "stats", "finish_reason",
              "first_token", "version", "device", "output_text"]


@st.composite
def trace_like(draw):
    """Objects shaped like traces with random (often wrong) values in known fields."""
    d = {}
    for k in draw(st.lists(st.sampled_from(TRACE_KEYS), unique=True)):
        d[k] = draw(json_values)
    if draw(st.booleans()):
        d.update(mode=draw(st.sampled_from(["ar", "d3d-async", "x"])), bundle="b", config={}, prompt_text="p", prompt_ids=[1],
                 rounds=draw(st.lists(st.dictionaries(st.sampled_from(["index", "anchor_pos", "anchor_id", "draft_ids", "draft_probs",
                                                                        "target_ids", "accepted", "bonus", "committed", "hypotheses", "hit"]),
                                                      json_values, max_size=11), max_size=3)),
                 spans=draw(st.lists(st.dictionaries(st.sampled_from(["lane", "kind", "round", "t_start", "t_end"]), json_values), max_size=3)),
                 stats=draw(st.dictionaries(st.sampled_from(["tau", "n_rounds", "hit_rate"]), json_values)))
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace_like())
def test_trace_loader_parses_or_raises_trace_error(d):
    try:
        text = json.dumps(d)
    except ValueError:
        return
    try:
        t = Trace.from_json(text)
    except TraceError as e:
        assert str(e)
        return
    # whatever parsed is well-typed and survives a second round trip
    assert isinstance(t.rounds, list) and all(isinstance(i, int) for i in t.output_ids)
    assert Trace.from_json(t.to_json()).to_dict() == t.to_dict()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_trace_loader_on_arbitrary_bytes(b):
    try:
        traces_from_json(b)
    except TraceError as e:
        assert str(e)


@settings(max_examples=300, deadline=None)
@given(block=json_values, temp=json_values, n=json_values, h=json_values, seed=json_values)
def test_settings_validator_accepts_or_explains(block, temp, n, h, seed):
    try:
        cfg = service.settings("d3d-async", block, temp, n, h, "match", seed)
    except ValueError as e:
        assert str(e) and "Traceback" not in str(e)
        return
    assert 2 <= cfg.block_size <= 16 and 1 <= cfg.hypotheses <= 32 and 1 <= cfg.max_new_tokens <= 512
    assert 0 <= cfg.temperature <= 2 and math.isfinite(cfg.temperature)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_prompt_cleaner(text):
    try:
        out = clean_prompt(text)
    except ValueError as e:
        assert "prompt" in str(e)
        return
    out.encode("utf-8")  # always encodable: no lone surrogates
    assert out.strip()
    assert all(c in "\n\t" or ord(c) >= 32 and not 0x7F <= ord(c) < 0xA0 for c in out)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.lists(st.sampled_from(["ar", "dflash", "d3d-seq", "d3d-async", "turbo", ""]), max_size=6), st.text(max_size=30)))
def test_modes_validator(modes):
    try:
        out = service.check_modes(modes)
    except ValueError as e:
        assert "mode" in str(e)
        return
    assert out and set(out) <= {"ar", "dflash", "d3d-seq", "d3d-async"}
