"""Training on the toy bundle: the loss falls, checkpoints resume exactly, the result loads."""

from dataclasses import replace

import pytest
import torch
from conftest import training_examples

from d3d_core.models.loader import load_drafter
from d3d_core.training.train import PRESETS, d3d_loss, sample_anchors, to_seq, train

PROMPTS = ["what is two plus two?", "tell me a story", "count to ten", "hello there", "abc abc", "name a color",
           "how are you?", "write a poem", "what is one plus one?", "say hi"]


@pytest.fixture(scope="module")
def examples(toy):
    return training_examples(toy, PROMPTS, 48)


def _mean_block_loss(drafter, toy, examples, cfg, teacher=None):
    """Mean block loss over the examples; with a teacher and kd_alpha = 1 that is the mean KL."""
    import random

    from d3d_core.training.train import dflash_loss

    tot = 0.0
    with torch.no_grad():
        for i, e in enumerate(examples):
            seq = to_seq(e, cfg.max_len)
            anchors = sample_anchors(seq, 8, random.Random(i))
            if cfg.kind == "d3d":
                tot += d3d_loss(drafter, seq, anchors, cfg, random.Random(i), teacher)[1]
            else:
                tot += dflash_loss(drafter, toy.target, seq, anchors, cfg)[1]
    return tot / len(examples)


@pytest.mark.parametrize("kind", ["d3d", "dflash"])
def test_loss_falls_and_tau_is_recorded(toy, examples, tmp_path, kind):
    from d3d_core.models.bundles import BUNDLES
    from d3d_core.models.loader import init_drafter

    cfg = replace(PRESETS["toy"], kind=kind, layers=1 if kind == "dflash" else 2, steps=40, lr=1e-3, eval_every=20, ckpt_every=20)
    res = train(toy, examples, cfg, tmp_path / kind, progress=False)
    hist = res["history"]
    assert [h["step"] for h in hist] == [0, 20, 40]
    init = init_drafter(kind, toy.target, BUNDLES["toy"], num_layers=cfg.layers, block_size=cfg.block_size)
    trained = load_drafter(tmp_path / kind / "final", toy.target.shared, toy.target.arch)
    before, after = _mean_block_loss(init, toy, examples, cfg), _mean_block_loss(trained, toy, examples, cfg)
    assert after < before * 0.8, (before, after)
    assert hist[-1]["offline_tau"] > hist[0]["offline_tau"]
    assert trained.cfg.training["steps"] == 40 and "offline_tau" in trained.cfg.training


def test_resume_continues_exactly(toy, examples, tmp_path):
    cfg = replace(PRESETS["toy"], steps=20, ckpt_every=10, eval_every=20)
    full = train(toy, examples, cfg, tmp_path / "full", progress=False)
    part = train(toy, examples, cfg, tmp_path / "resumed", progress=False, stop_after=10)  # a session that ends early
    assert part["stopped_at"] == 10 and not (tmp_path / "resumed" / "final").exists()
    assert part["history"][-1]["step"] == 10  # the τ it reports is measured where it stopped
    resumed = train(toy, examples, cfg, tmp_path / "resumed", progress=False)  # picks up at step 10
    from safetensors.torch import load_file

    # the fp32 checkpoints (what resuming reads) are bit-identical, and so is the τ measured at the end
    a = load_file(str(tmp_path / "full" / "ckpt" / "drafter.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "ckpt" / "drafter.safetensors"))
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    for f in ("optimizer.safetensors",):
        oa, ob = load_file(str(tmp_path / "full" / "ckpt" / f)), load_file(str(tmp_path / "resumed" / "ckpt" / f))
        assert all(torch.equal(oa[k], ob[k]) for k in oa), f
    assert full["offline_tau"] == resumed["offline_tau"]


def test_dflash_feature_cache_gives_the_same_loss(toy, examples):
    """The cached (fp16) target features give the loss a fresh target forward gives."""
    import random

    from d3d_core.models.bundles import BUNDLES
    from d3d_core.models.loader import init_drafter
    from d3d_core.training.train import dflash_loss

    cfg = replace(PRESETS["toy"], kind="dflash", layers=1)
    drafter = init_drafter("dflash", toy.target, BUNDLES["toy"], num_layers=1, block_size=cfg.block_size)
    seq = to_seq(examples[0], cfg.max_len)
    anchors = sample_anchors(seq, 8, random.Random(0))
    cache: dict = {}
    fresh = dflash_loss(drafter, toy.target, seq, anchors, cfg)[1]
    first = dflash_loss(drafter, toy.target, seq, anchors, cfg, cache, "k")[1]
    assert list(cache) == ["k"] and cache["k"].dtype == torch.float16
    second = dflash_loss(drafter, toy.target, seq, anchors, cfg, cache, "k")[1]  # from the cache
    assert first == pytest.approx(fresh, rel=1e-3) and second == pytest.approx(fresh, rel=1e-3)


def test_distillation_from_a_teacher_pulls_the_pruned_drafter_towards_it(toy, examples, tmp_path):
    """kd_alpha = 1 trains on KL(teacher ‖ drafter) alone: zero against itself, and a pruned
    drafter fine-tuned that way moves towards the unpruned teacher's block distributions."""
    import random

    from d3d_core.models.bundles import BUNDLES
    from d3d_core.models.loader import init_drafter

    cfg = replace(PRESETS["toy"], steps=30, lr=1e-3, kd_alpha=1.0, ar_lambda=0.0, eval_every=30, ckpt_every=30)
    teacher = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=cfg.layers, block_size=cfg.block_size)
    seq = to_seq(examples[0], cfg.max_len)
    anchors = sample_anchors(seq, 8, random.Random(0))
    assert d3d_loss(teacher, seq, anchors, cfg, random.Random(0), teacher=teacher)[1] == pytest.approx(0.0, abs=1e-5)
    pruned = teacher.pruned([0])
    before = _mean_block_loss(pruned, toy, examples, cfg, teacher)
    train(toy, examples, cfg, tmp_path / "kd", progress=False, init=pruned, teacher=teacher)
    healed = load_drafter(tmp_path / "kd" / "final", toy.target.shared, toy.target.arch)
    after = _mean_block_loss(healed, toy, examples, cfg, teacher)
    assert after < 0.7 * before, (before, after)
    assert healed.cfg.training["train_config"]["kd_alpha"] == 1.0


def test_cli_fine_tunes_a_saved_drafter(toy, examples, tmp_path, capsys):
    import json

    from d3d_core.training.train import main

    data = tmp_path / "distill"
    data.mkdir()
    (data / "shard_00000.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    start = toy.drafter("d3d")
    start.save(tmp_path / "start")
    args = ["--bundle", "toy", "--preset", "toy", "--data", str(data), "--steps", "4", "--eval-every", "4", "--lr", "1e-3"]
    assert main(args + ["--out", str(tmp_path / "ft"), "--init", str(tmp_path / "start")]) == 0
    ft = load_drafter(tmp_path / "ft" / "final", toy.target.shared, toy.target.arch)
    assert ft.cfg.training["fine_tune_note"] == f"fine-tuned from {tmp_path / 'start'}"
    assert ft.cfg.num_layers == start.cfg.num_layers and ft.cfg.init_layers == start.cfg.init_layers
    before, after = start.state_dict(), ft.state_dict()
    assert any(not torch.allclose(before[k].float(), after[k].float()) for k in before)  # it was trained from there
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "bad"), "--init", str(tmp_path / "missing")]) == 2
    assert "cannot load --init" in capsys.readouterr().err


def test_recipe_rules_reach_the_drafter_survive_resume_and_fine_tuning(toy, examples, tmp_path):
    """TrainConfig.first_draft / anchor_attention set the fresh drafter's rules, are saved with it and kept on
    resume; a fine-tune keeps its init's rules unless the recipe names others."""
    cfg = replace(PRESETS["toy"], layers=4, steps=4, ckpt_every=2, eval_every=4, first_draft="anchor", anchor_attention="causal")
    assert train(toy, examples, cfg, tmp_path / "deep", progress=False, stop_after=2)["stopped_at"] == 2
    train(toy, examples, cfg, tmp_path / "deep", progress=False)
    d = load_drafter(tmp_path / "deep" / "final", toy.target.shared, toy.target.arch)
    assert (d.cfg.first_draft, d.cfg.anchor_attention, d.cfg.num_layers) == ("anchor", "causal", 4)
    ft = replace(PRESETS["toy"], layers=4, steps=2, ckpt_every=2, eval_every=2)
    train(toy, examples, ft, tmp_path / "ft", progress=False, init=d)
    kept = load_drafter(tmp_path / "ft" / "final", toy.target.shared, toy.target.arch)
    assert (kept.cfg.first_draft, kept.cfg.anchor_attention) == ("anchor", "causal")
    train(toy, examples, replace(ft, first_draft="mask", anchor_attention="block"), tmp_path / "ft2", progress=False, init=d)
    moved = load_drafter(tmp_path / "ft2" / "final", toy.target.shared, toy.target.arch)
    assert (moved.cfg.first_draft, moved.cfg.anchor_attention) == ("mask", "block")
    from d3d_core.training.levers import recipe_config

    assert recipe_config("deep30-anchor").layers == 30 and recipe_config("deep30-anchor", layers=2).layers == 2
    with pytest.raises(ValueError, match="anchor_attention"):
        train(toy, examples, replace(ft, anchor_attention="sideways"), tmp_path / "bad", progress=False)
