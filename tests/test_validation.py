"""Bad input gives a clear ValueError, never a traceback from deep inside."""

import pytest

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.models.bundles import get_bundle


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(block_size=0), "block size must be between"),
        (dict(block_size=65), "block size must be between"),
        (dict(block_size=2.5), "block size must be an integer"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(mode="turbo"), "unknown mode"),
        (dict(hypotheses=0), "hypotheses"),
        (dict(max_new_tokens=0), "max new tokens"),
        (dict(max_new_tokens=10_000), "max new tokens"),
        (dict(sampling="nucleus"), "sampling rule"),
    ],
)
def test_bad_config(toy, kw, msg):
    with pytest.raises(ValueError, match=msg):
        decode(toy, "hello", DecodeConfig(**kw))


@pytest.mark.parametrize("prompt", ["", "   \n\t ", "\x00\x01"])
def test_empty_prompt(toy, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        decode(toy, prompt, DecodeConfig(mode="ar"))


def test_prompt_too_long_for_context(toy):
    with pytest.raises(ValueError, match="too long"):
        decode(toy, "a" * 1100, DecodeConfig(mode="ar"))
    with pytest.raises(ValueError, match="too long"):
        decode(toy, "a" * 100_000, DecodeConfig(mode="ar"))


def test_unknown_bundle():
    with pytest.raises(ValueError, match="unknown bundle 'nope'; available bundles: smollm2-135m"):
        get_bundle("nope")


def test_bad_token_ids(toy):
    with pytest.raises(ValueError, match="token ids"):
        decode(toy, [1, 2, 10_000], DecodeConfig(mode="ar"))


def test_emoji_and_rtl_survive(toy):
    tr = decode(toy, "hi 😀 שלום", DecodeConfig(mode="ar", max_new_tokens=3))
    assert tr.prompt_text == "hi 😀 שלום"


def test_missing_and_broken_drafter_files(tmp_path, toy):
    from d3d_core.models.loader import load_drafter

    with pytest.raises(FileNotFoundError, match="missing config.json, model.safetensors"):
        load_drafter(tmp_path, toy.target.shared, toy.target.arch)
    d = toy.drafter("d3d")
    d.save(tmp_path / "d")
    w = tmp_path / "d" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ValueError, match="unreadable"):
        load_drafter(tmp_path / "d", toy.target.shared, toy.target.arch)
