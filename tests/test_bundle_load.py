"""A bundle loads in one pass (issue 43): followed call by call from the service to the loaded drafters, the loading
procedure — the module-level functions of d3d_core that run; the models' own constructors and methods are their
class's business — enters each file at most twice: bundles.py around the memory check, loader.py once per drafter."""

import collections
import sys
from dataclasses import replace

import pytest

from d3d_core import service
from d3d_core.models import bundles
from d3d_core.models.loader import DrafterSpec


def file_visits(fn) -> list:
    """The d3d_core files whose module-level functions run during fn(), in call order, consecutive calls in one file
    counted once (comprehensions run inside their function)."""
    seq = []

    def prof(frame, event, arg):
        code = frame.f_code
        if event != "call" or "/d3d_core/" not in code.co_filename or "." in code.co_qualname or code.co_name.startswith("<"):
            return
        rel = code.co_filename.split("/d3d_core/", 1)[1]
        if not seq or seq[-1] != rel:
            seq.append(rel)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seq


@pytest.mark.parametrize("way", ["untrained copies", "shared-weight adapter drafter"])
def test_a_bundles_load_enters_each_file_at_most_twice(monkeypatch, way):
    name = "toy"
    if way == "shared-weight adapter drafter":  # qwen3-8b's D3D spec on the toy Qwen3 target
        name, spec = "toy-qwen3", bundles.BUNDLES["toy-qwen3"]
        monkeypatch.setitem(bundles.BUNDLES, name, replace(spec, drafters=(DrafterSpec("d3d", adapter_rank=4), spec.drafter("dflash"))))
    monkeypatch.setattr(bundles, "_LOADED", {})  # a fresh load, not the session's bundle
    seq = file_visits(lambda: service.get_bundle(name))
    assert seq[0] == "models/bundles.py" and seq.count("models/loader.py") == 2, seq
    assert max(collections.Counter(seq).values()) <= 2, seq
