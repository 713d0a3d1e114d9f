"""The app through gradio_client against a launched `demo` (toy bundle: fast and exact)."""

import json
import runpy
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.fixture(scope="module")
def client():
    from gradio_client import Client

    demo = runpy.run_path(str(ROOT / "app.py"), run_name="d3d_app")["demo"]
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, show_error=False)
    try:
        yield Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        demo.close()


RACE = dict(prompt="what is two plus two?", bundle="toy", modes=["ar", "dflash", "d3d-seq", "d3d-async"], block_size=4,
            temperature=0, max_new_tokens=32, hypotheses=8, sampling="match", seed=0, use_pruned=False)


def test_named_endpoints(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/race", "/stop", "/replay", "/rounds", "/pruning_curve", "/measure_pruned", "/download_traces", "/upload_trace"} <= names


def test_race_streams_and_finishes(client):
    job = client.submit(*RACE.values(), api_name="/race")
    res = job.result()
    assert len(job.outputs()) >= 3  # loading message, streamed rounds, final
    status, *cols = res[:5]
    assert status.startswith("✅ done")
    for c in cols:
        assert "done: 32 tokens" in c


def test_race_bad_input_gives_message(client):
    for key, bad, msg in [("prompt", "   ", "prompt is empty"), ("block_size", 40, "block size"), ("hypotheses", 99, "hypotheses"),
                          ("modes", [], "at least one mode"), ("temperature", -1, "temperature")]:
        args = dict(RACE, **{key: bad})
        res = client.predict(*args.values(), api_name="/race")
        assert msg in res[0], (key, res[0])


def test_download_rounds_and_upload_round_trip(client, tmp_path):
    client.predict(*RACE.values(), api_name="/race")
    path = client.predict(api_name="/download_traces")
    data = json.loads(Path(path).read_text())
    assert [t["mode"] for t in data["traces"]] == RACE["modes"]
    grid, table, caption = client.predict("d3d-async", 2, api_name="/rounds")
    assert "Round 2" in caption
    from gradio_client import handle_file

    msg = client.predict(handle_file(path), api_name="/upload_trace")[0]
    assert msg.startswith("✅ loaded 4 trace(s)")
    bad = tmp_path / "bad.json"
    bad.write_text('{"traces": [{"mode": "ar"}]}')
    msg = client.predict(handle_file(str(bad)), api_name="/upload_trace")[0]
    assert "could not read that trace" in msg and "missing field" in msg
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\xff\xfe not json")
    assert "could not read that trace" in client.predict(handle_file(str(junk)), api_name="/upload_trace")[0]


def test_pruning_endpoints(client):
    res = client.predict("toy", api_name="/pruning_curve")
    layers = res[0]
    msg, fig = client.predict("toy", ["L1 (from target layer 3)"], api_name="/measure_pruned")
    assert "offline τ" in msg and "1 of 2 layers removed" in msg
    msg, _ = client.predict("toy", [], api_name="/measure_pruned")
    assert "keep at least one" in msg


def test_stop_endpoint(client):
    assert "stopping" in client.predict(api_name="/stop")
