"""Offline τ drafts exactly what a decode drafts at the same anchors (no loop needed)."""

import pytest

from d3d_core.config import DecodeConfig
from d3d_core.engine import decode
from d3d_core.offline_tau import CalibSeq, d3d_block_logits, dflash_block_logits, greedy_continuations, offline_tau


@pytest.mark.parametrize("mode", ["d3d-seq", "dflash"])
def test_offline_drafts_equal_decode_drafts(toy, mode):
    B = 4
    seq = greedy_continuations(toy, ["what is two plus two?"], 60)[0]
    tr = decode(toy, "what is two plus two?", DecodeConfig(mode=mode, block_size=B, max_new_tokens=60))
    rounds = [r for r in tr.rounds if r.anchor_pos + B - 1 < len(seq.ids)]
    anchors = [r.anchor_pos for r in rounds]
    if mode == "dflash":
        lg = dflash_block_logits(toy.drafter("dflash"), toy.target, seq.ids, anchors, B)
    else:
        lg = d3d_block_logits(toy.drafter("d3d"), seq.ids, anchors, B)
    assert len(rounds) > 10
    for r, row in zip(rounds, lg.argmax(-1).tolist()):
        assert row == r.draft_ids


def test_offline_tau_counts_leading_matches(toy):
    seqs = greedy_continuations(toy, ["hello", "tell me a story"], 40)
    tau = offline_tau(toy.drafter("d3d"), seqs, B=4, stride=2)
    assert 1.0 <= tau <= 4.0
    with pytest.raises(ValueError, match="no usable anchors"):
        offline_tau(toy.drafter("d3d"), [CalibSeq([1, 2], [3])], B=4)


def test_cli_scores_drafters_and_pairs_them_with_the_first(toy, tmp_path, monkeypatch, capsys):
    import json

    from d3d_core.offline_tau import main

    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    seqs = greedy_continuations(toy, ["what is two plus two?", "tell me a story", "count to ten"], 40)
    f = tmp_path / "cache" / "eval" / "toy-n3-t40.json"  # the held-out set, as a first run would have cached it
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps([{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for s in seqs]))
    d = toy.drafter("d3d")
    d.save(tmp_path / "full")
    d.pruned([0]).save(tmp_path / "pruned")
    args = ["--bundle", "toy", "--n", "3", "--tokens", "40", "--block-size", "4", "--stride", "2"]
    assert main([str(tmp_path / "full"), str(tmp_path / "missing"), str(tmp_path / "pruned")] + args) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()[1:]
    assert "cannot load" in out.err and len(lines) == 2
    full, pruned = offline_tau(d, seqs, B=4, stride=2), offline_tau(d.pruned([0]), seqs, B=4, stride=2)
    assert lines[0].startswith(f"{full:.3f}") and "of the first" not in lines[0]
    assert lines[1].startswith(f"{pruned:.3f}") and f"({pruned / full:.1%} of the first, 95 % CI" in lines[1]
