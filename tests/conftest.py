import contextlib
import os
import runpy
from pathlib import Path

import pytest

from d3d_core.measure.soak import free_port  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parent.parent

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: uses the real smollm2-135m bundle (seconds to minutes); still runs in CI")
    config.addinivalue_line("markers", "browser: drives Debian chromium through playwright")


@pytest.fixture(scope="session")
def toy():
    from d3d_core.models.bundles import get_bundle

    return get_bundle("toy")


@pytest.fixture(scope="session")
def toy_qwen3():
    from d3d_core.models.bundles import get_bundle

    return get_bundle("toy-qwen3")


@pytest.fixture(scope="session")
def smollm():
    from d3d_core.models.bundles import get_bundle

    return get_bundle("smollm2-135m")




@pytest.fixture(scope="module")
def app_server():
    """`demo` from app.py, launched on a free loopback port for this test module: (demo, url)."""
    demo = runpy.run_path(str(ROOT / "app.py"), run_name="d3d_app")["demo"]
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, show_error=False)
    try:
        yield demo, f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def api_message(client, api_name: str, *args) -> str:
    """An endpoint's status text (first output), or the message of an error Gradio raised
    itself (e.g. slider bounds) — never a traceback."""
    from gradio_client.exceptions import AppError

    try:
        out = client.predict(*args, api_name=api_name)
        return out[0] if isinstance(out, (list, tuple)) else out
    except AppError as e:
        return "AppError: " + str(e)


@contextlib.contextmanager
def engine(target, name):
    """Decode through ``target`` on engine ``name`` (fast / eager / int4) inside the block."""
    old = target.engine_request
    target.engine_request = name
    try:
        yield
    finally:
        target.engine_request = old


def assert_verify_rows_are_steps(t, a, b, seq, pos: int, widths) -> int:
    """What lossless rests on: from position ``pos`` in two caches ``a`` and ``b`` of target ``t`` (both prefilled
    with ``seq[:pos]``), each verify of B rows in ``a`` gives every row exactly the logits B one-row steps give it in
    ``b``; after each, both roll back to B // 2 + 1 kept rows. Returns the position reached."""
    import torch

    for B in widths:
        blk = seq[pos : pos + B]
        v = t.verify(a, blk).logits
        s = torch.cat([t.verify(b, blk[i : i + 1]).logits for i in range(B)])
        assert torch.equal(v, s), (pos, B)
        keep = B // 2 + 1
        t.rollback(a, B - keep)
        t.rollback(b, B - keep)
        pos += keep
    return pos


TRAIN_PROMPTS = ["what is two plus two?", "tell me a story", "count to ten", "hello there", "abc abc", "name a color"]


def training_examples(bundle, prompts, max_new_tokens: int) -> list:
    """The bundle target's own greedy continuations of ``prompts``, as the example dicts the trainer reads."""
    from d3d_core.training.offline_tau import greedy_continuations

    seqs = greedy_continuations(bundle, prompts, max_new_tokens)
    return [{"id": f"toy/{i}", "prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for i, s in enumerate(seqs)]


def assert_all_modes_equal_ar(bundle, prompts, max_new_tokens=48, block_size=8):
    """At temperature 0 every drafting mode emits exactly the ``ar`` tokens on each prompt."""
    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import decode
    from d3d_core.decoding.trace import MODES

    for p in prompts:
        ref = decode(bundle, p, DecodeConfig(mode="ar", max_new_tokens=max_new_tokens))
        assert len(ref.output_ids) == max_new_tokens or ref.finish_reason == "eos"
        for mode in MODES[1:]:
            tr = decode(bundle, p, DecodeConfig(mode=mode, max_new_tokens=max_new_tokens, block_size=block_size))
            assert tr.output_ids == ref.output_ids, (mode, p, tr.output_text, ref.output_text)
