"""The lesson's round-by-round sentences (app/lesson.py): each one says what its round did, from the round's own tokens."""

import dataclasses

import pytest

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
    assert "“b · c · d”" in s and "“b · c · i · j”" in s and "The first 2 guesses match" in s and "guess 3, “d”, differs from the target's “i”" in s
    assert "3 tokens committed, “b · c · i”" in s and "(ar needs 3)" in s
    # the target's token after the bonus followed the rejected guess: said to be discarded, so it is not read as the target failing
    assert "The target's tokens after that, “j”, continue the rejected guess" in s and "discarded too" in s
    allr = dataclasses.replace(base, target_ids=[2, 3, 4, 10], accepted=3, bonus=10, committed=[2, 3, 4, 10])
    assert "discarded too" not in lesson.round_sentence(allr, p, "dflash")  # nothing after the bonus to discard
    assert "All 3 guesses match" in lesson.round_sentence(allr, p, "dflash") and "“j”" in lesson.round_sentence(allr, p, "dflash")
    none = dataclasses.replace(base, target_ids=[7, 3, 4, 10], accepted=0, bonus=7, committed=[7])
    assert "“c · d · j”, continue the rejected guess" in lesson.round_sentence(none, p)
    assert "already differs from the target's “g”" in lesson.round_sentence(none, p) and "1 token committed" in lesson.round_sentence(none, p)
    skipped = dataclasses.replace(base, draft_ids=[], draft_probs=[], target_ids=[7], accepted=0, bonus=7, committed=[7],
                                  draft_source="skipped", gate_rate=0.8, gate_threshold=1.0)
    t = lesson.round_sentence(skipped, p, "d3d-seq")
    assert "No draft this round" in t and "earned 0.80 tokens per step of cost, below the 1.00" in t
    held = dataclasses.replace(base, held_back=[5, 6])
    assert "2 more guesses were drafted but held back" in lesson.round_sentence(held, p)
    ar = Round(0, 5, 1, [], [], [7], 0, 7, [7])
    assert lesson.round_sentence(ar, p, "ar").startswith("**ar**: one target forward")


def test_the_lesson_preset_is_the_first_visit_and_drafts_and_verifies_every_round(toy):
    """The page opens in the lesson (every round drafted, every draft verified); its race on the toy bundle has no
    undrafted round and no held-back draft in any mode, and each refinement switches exactly its own rule on."""
    from app import ui
    from d3d_core import service
    from d3d_core.decoding.trace import MODES

    demo = ui.build_demo()
    by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    by_label = {b.label: b for b in demo.blocks.values() if getattr(b, "label", None)}
    lesson_p = lesson.PRESETS["lesson"]
    assert by_id["prompt"].value == lesson.LESSON_PROMPT and by_id["engine"].value == lesson_p["engine"]
    assert by_label["Verify plan"].value == "full" and by_label["Drafting"].value == "always"
    assert by_label["Max new tokens"].value == lesson_p["max_new_tokens"]
    assert (lesson_p["drafting"], lesson_p["verify"], lesson_p["temperature"]) == ("always", "full", 0.0)
    out = ui.apply_preset("lesson")
    assert out[0] == lesson.LESSON_PROMPT and out[7:10] == ("full", "always", "fp32") and out[10] == list(MODES)
    assert ui.apply_preset("gate")[7:9] == ("full", "gated") and ui.apply_preset("adaptive")[7:9] == ("adaptive", "always")
    assert ui.apply_preset("fair")[7:10] == ("adaptive", "gated", "int4")
    base = service.settings("ar", 4, 0.0, 24, 2, "match", 0, lesson_p["verify"], lesson_p["drafting"])
    done = {m: tr for m, tr, fin in service.race("toy", "the cat sat on", list(MODES), base) if fin}
    for m in MODES[1:]:
        assert done[m].output_ids == done["ar"].output_ids, m
        assert not any(r.skipped for r in done[m].rounds), m
        assert all(not r.held_back and len(r.draft_ids) == 3 for r in done[m].rounds[:-1]), m


@pytest.mark.slow
def test_the_lesson_prompt_finishes_its_answer_on_the_real_bundle(smollm):
    """The lesson's race ends where the answer ends (its end-of-turn token), not mid-sentence."""
    from conftest import engine

    with engine(smollm.target, lesson.PRESETS["lesson"]["engine"] if lesson.PRESETS["lesson"]["engine"] != "fp32" else "fast"):
        tr = decode(smollm, lesson.LESSON_PROMPT, DecodeConfig(mode="ar", max_new_tokens=lesson.PRESETS["lesson"]["max_new_tokens"]))
    assert tr.finish_reason == "eos", (len(tr.output_ids), smollm.tokenizer.decode(tr.output_ids)[-120:])


def test_the_first_screen_says_what_each_preset_button_does():
    """Issue 46, the ninth reader's 2: the preset buttons are named under them in one compact line, each with a hover
    text (its title, set at load); the recorded race says it shows a race without running anything."""
    import json

    from app import ui

    demo = ui.build_demo()
    by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    assert by_id["preset-buttons"].value == lesson.PRESET_BUTTONS
    for elem_id, tip in lesson.PRESET_TIPS.items():
        label = by_id[elem_id].value  # every tip belongs to a button of the page, named in the line (but the lesson's own)
        assert tip and (elem_id == "preset-lesson" or label.split(" (")[0] in lesson.PRESET_BUTTONS), (elem_id, label)
    assert "nothing run" in lesson.PRESET_BUTTONS and "without running anything" in lesson.PRESET_TIPS["preset-recorded"]
    assert json.dumps(lesson.PRESET_TIPS) in ui.PRESET_TIPS_JS and "el.title = tip" in ui.PRESET_TIPS_JS
    assert len(lesson.PRESET_BUTTONS) < 220  # one compact line: the Race tab must stay under 2,000 px
    # the ninth reader's 26: the fair race's answer is int4's, which can differ from the fp32 lesson's, yet each mode
    # still prints its own engine's ar answer
    fair = lesson.PRESET_TIPS["preset-fair"]
    assert lesson.PRESETS["fair"]["engine"] == "int4" and lesson.PRESETS["lesson"]["engine"] == "fp32"
    assert "can differ from the lesson's" in fair and "exactly int4's own ar answer" in fair
