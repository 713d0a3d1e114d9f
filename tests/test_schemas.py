"""The declared shapes (d3d_core/schemas.py): shipped files fit them, broken ones are named, settings explain themselves."""

import json

import pytest

from d3d_core import service
from d3d_core.limits import APP_LIMITS
from d3d_core.models import bundles
from d3d_core.models.bundles import ASSETS
from d3d_core.schemas import AppSettings, checked


@pytest.mark.parametrize("kind, path", [("pruning curve", "pruning/smollm2-135m.json"), ("bench result", "bench/smollm2-135m.json"),
                                        ("bench result", "bench/smollm2-135m-block-sweep.json")])
def test_shipped_files_fit_their_schema(kind, path):
    d = json.loads((ASSETS / path).read_text())
    assert checked(kind, d) is d  # returned unchanged: the UI keeps reading plain JSON


def test_broken_files_are_named():
    curve = json.loads((ASSETS / "pruning/smollm2-135m.json").read_text())
    del curve["curve"][2]["tau"]
    with pytest.raises(ValueError, match=r"^pruning curve: missing field 'curve.2.tau'$"):
        checked("pruning curve", curve)
    curve["curve"] = curve["curve"][3:]
    with pytest.raises(ValueError, match="must start with the unpruned drafter"):
        checked("pruning curve", curve)
    bench = json.loads((ASSETS / "bench/smollm2-135m.json").read_text())
    bench["summary"][0]["speedup"] = "fast"
    with pytest.raises(ValueError, match=r"^bench result: summary.0.speedup: input should be a valid number"):
        checked("bench result", bench)


def test_app_loaders_refuse_a_shipped_file_that_does_not_fit(tmp_path, monkeypatch):
    (tmp_path / "pruning").mkdir()
    (tmp_path / "pruning" / "x.json").write_text(json.dumps({"layers": 8}))
    monkeypatch.setattr(bundles, "ASSETS", tmp_path)  # the one reader of shipped assets: bundles.asset_json
    with pytest.raises(ValueError, match="pruning curve: missing field 'block_size'"):
        service.pruning_curve("x")
    assert service.pruning_curve("absent") is None


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(block_size=17), "block size must be between 2 and 16, got 17"),
        (dict(block_size=2.5), "block size must be a whole number, got 2.5"),
        (dict(block_size=True), "block size must be a whole number"),
        (dict(temperature="warm"), "temperature must be a number, got 'warm'"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature=2.5), "temperature must be between 0 and 2, got 2.5"),
        (dict(hypotheses=0), "hypotheses H must be between 1 and 32, got 0"),
        (dict(seed=-1), "seed must be 0 or more, got -1"),
        (dict(mode="turbo"), "mode must be one of 'ar', 'dflash', 'd3d-seq' or 'd3d-async', got 'turbo'"),
        (dict(sampling="nucleus"), "sampling must be one of 'match' or 'rejection'"),
    ],
)
def test_settings_say_what_is_wrong(kw, msg):
    with pytest.raises(ValueError, match="^" + msg.replace("(", r"\(")):
        AppSettings.parse(**kw)


def test_settings_from_widget_values():
    cfg = service.settings("d3d-seq", "8", 0.7, 64.0, 2, "rejection", "3")
    assert (cfg.mode, cfg.block_size, cfg.temperature, cfg.max_new_tokens, cfg.hypotheses, cfg.sampling, cfg.seed) == \
        ("d3d-seq", 8, 0.7, 64, 2, "rejection", 3)


def test_settings_ranges_are_the_app_limits():
    """The sliders (APP_LIMITS) and the validator read one limits module: their ends agree."""
    for name, lo, hi in [("block_size", "block_min", "block_max"), ("hypotheses", "h_min", "h_max"), ("max_new_tokens", None, "max_new_max")]:
        AppSettings.parse(**{name: APP_LIMITS[hi]})
        with pytest.raises(ValueError):
            AppSettings.parse(**{name: APP_LIMITS[hi] + 1})
        low = APP_LIMITS[lo] if lo else 1
        AppSettings.parse(**{name: low})
        with pytest.raises(ValueError):
            AppSettings.parse(**{name: low - 1})
