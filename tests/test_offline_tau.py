"""Offline τ drafts exactly what a decode drafts at the same anchors (no loop needed)."""

import pytest

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.models import fastops
from d3d_core.training.offline_tau import CalibSeq, d3d_block_logits, dflash_block_logits, greedy_continuations, offline_tau


@pytest.mark.parametrize("mode", ["d3d-seq", "dflash"])
@fastops.exact  # offline τ runs the stored fp32 weights; int8 decoding drafts differ by its activation scales
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
    """The value, computed independently: at every anchor a fresh drafter cache holds the committed
    context, the engine's own d3d_draft drafts the block, and leading matches + 1 are averaged."""
    from d3d_core.decoding.engine import d3d_draft, d3d_prefill
    from d3d_core.training.offline_tau import anchors_for

    seqs = greedy_continuations(toy, ["hello", "tell me a story"], 40)
    d, B = toy.drafter("d3d"), 4
    tau = offline_tau(d, seqs, B=B, stride=2)
    scores = []
    for s in seqs:
        for p in anchors_for(s, B, 2):
            cache = d.new_cache()
            d3d_prefill(d, cache, s.ids[:p])
            draft = d3d_draft(d, cache, [], s.ids[p], DecodeConfig(block_size=B), None).ids
            lead = 0
            while lead < B - 1 and draft[lead] == s.ids[p + 1 + lead]:
                lead += 1
            scores.append(lead + 1)
    assert len(scores) > 20
    assert tau == pytest.approx(sum(scores) / len(scores), abs=1e-9)


def test_offline_tau_on_sequences_built_to_accept_k_drafts(toy):
    """One anchor per sequence whose continuation agrees with the drafter's own block for exactly
    k tokens (k = 0 … B-1): offline τ must be the mean of k + 1, i.e. 2.5 for B = 4."""
    from d3d_core.decoding.engine import d3d_draft, d3d_prefill

    d, B = toy.drafter("d3d"), 4
    prompt, anchor = toy.tokenizer.encode_prompt("count: 1, 2, 3"), 7
    cache = d.new_cache()
    d3d_prefill(d, cache, prompt)
    draft = d3d_draft(d, cache, [], anchor, DecodeConfig(block_size=B), None).ids  # d_1..d_{B-1}
    seqs = []
    for k in range(B):
        wrong = [] if k == B - 1 else [next(t for t in range(3, 40) if t != draft[k])]
        resp = [anchor] + draft[:k] + wrong
        resp += [5] * (B - len(resp))  # exactly B tokens: the anchor is the only one with B-1 tokens after it
        seqs.append(CalibSeq(prompt, resp))
    assert offline_tau(d, seqs, B=B, stride=1) == pytest.approx(2.5, abs=1e-9)
    with pytest.raises(ValueError, match="no usable anchors"):
        offline_tau(toy.drafter("d3d"), [CalibSeq([1, 2], [3])], B=4)


def test_cli_scores_drafters_and_pairs_them_with_the_first(toy, tmp_path, monkeypatch, capsys):
    import json

    from d3d_core.training.offline_tau import main

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
