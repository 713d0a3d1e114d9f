"""The lesson's round-by-round sentences (app/lesson.py): each one says what its round did, from the round's own tokens."""

import dataclasses

from app import lesson
from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.trace import Round


def _pieces(bundle, trace):
    ids = {t for r in trace.rounds for t in [r.anchor_id, *r.draft_ids, *r.target_ids, *r.committed]}
    return {t: bundle.tokenizer.decode([t]) for t in ids}


def test_every_round_of_a_textbook_race_is_told_from_its_own_tokens(toy):
    tr = decode(toy, "the cat sat", DecodeConfig(mode="d3d-seq", block_size=4, max_new_tokens=24, drafting="always",
                                                 verify="full", stop_at_eos=False))
    pieces = _pieces(toy, tr)
    seen = set()
    for r in tr.rounds:
        s = lesson.round_sentence(r, pieces, "d3d-seq")
        assert "**1. Draft.**" in s and "**2. Verify.**" in s and "one** forward" in s, s
        k = len(r.committed)
        assert f"{k} token{'s' if k != 1 else ''} committed" in s and f"(ar needs {k})" in s
        if r.accepted == len(r.draft_ids):
            seen.add("all")
            assert "All" in s and "match" in s
        elif r.accepted == 0:
            seen.add("none")
            assert "already differs" in s
        else:
            seen.add("some")
            assert f"The first {r.accepted} guess" in s and f"guess {r.accepted + 1}" in s
    assert seen  # at least one kind of round was told


def test_the_three_kinds_of_round_and_the_skipped_one():
    p = {i: chr(96 + i) for i in range(1, 27)}
    base = Round(0, 5, 1, [2, 3, 4], [0.9, 0.5, 0.2], [2, 3, 9, 10], 2, 9, [2, 3, 9])
    s = lesson.round_sentence(base, p, "d3d-seq")
    assert "“bcd”" in s and "“bcij”" in s and "The first 2 guesses match" in s and "guess 3, “d”, differs from the target's “i”" in s
    assert "3 tokens committed, “bci”" in s and "(ar needs 3)" in s
    allr = dataclasses.replace(base, target_ids=[2, 3, 4, 10], accepted=3, bonus=10, committed=[2, 3, 4, 10])
    assert "All 3 guesses match" in lesson.round_sentence(allr, p, "dflash") and "“j”" in lesson.round_sentence(allr, p, "dflash")
    none = dataclasses.replace(base, target_ids=[7, 3, 4, 10], accepted=0, bonus=7, committed=[7])
    assert "already differs from the target's “g”" in lesson.round_sentence(none, p) and "1 token committed" in lesson.round_sentence(none, p)
    skipped = dataclasses.replace(base, draft_ids=[], draft_probs=[], target_ids=[7], accepted=0, bonus=7, committed=[7],
                                  draft_source="skipped", gate_rate=0.8, gate_threshold=1.0)
    t = lesson.round_sentence(skipped, p, "d3d-seq")
    assert "No draft this round" in t and "earned 0.80 tokens per step of cost, below the 1.00" in t
    held = dataclasses.replace(base, held_back=[5, 6])
    assert "2 more guesses were drafted but held back" in lesson.round_sentence(held, p)
    ar = Round(0, 5, 1, [], [], [7], 0, 7, [7])
    assert lesson.round_sentence(ar, p, "ar").startswith("**ar**: one target forward")
