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
