"""The lesson: speculative decoding told round by round, in plain words, from a trace's own tokens.

Pure functions of a ``Round`` (and the readable pieces of its token ids), so the Rounds tab can say what happened
in the round a student is looking at — drafted, checked in one target forward, accepted up to the first
disagreement, the target's own token kept as the bonus — and tests can check each sentence against the round.
"""

from __future__ import annotations

from d3d_core.decoding.trace import Round


def _word(piece: str) -> str:
    """One token in a sentence: its text without the space a word-token starts with (" calculate" reads "calculate");
    a token of spaces only as ␣, one without any text as ∅ (the Rounds tab's legend names both)."""
    if piece == "":
        return "∅"
    return piece.strip(" ") or "␣"


def _show(pieces: dict, ids: list, limit: int = 16) -> str:
    """Tokens as the reader sees them: one token plain, several separated by " · " so that a token without a
    leading space (" calculate", "smart") does not read as one word; newlines as ⏎."""
    text = " · ".join(_word(str(pieces.get(t, t))) for t in ids[:limit]).replace("\n", "⏎\u2009").replace("\u2009 ", " ").rstrip("\u2009")
    return f"“{text}{' …' if len(ids) > limit else ''}”"


def round_sentence(r: Round, pieces: dict, mode: str = "") -> str:
    """What happened in round ``r``, in words a newcomer can follow (a Markdown paragraph)."""
    if mode == "ar" or (not r.draft_ids and not r.skipped):
        return (f"**ar**: one target forward reads the anchor {_show(pieces, [r.anchor_id])} and predicts the next token, "
                f"{_show(pieces, r.committed)}: one token per forward — the baseline every other mode is raced against.")
    if r.skipped:
        bar = f"{r.gate_threshold:.2f}" if r.gate_threshold is not None else "1"
        rate = f"{r.gate_rate:.2f}" if r.gate_rate is not None else "too little"
        return (f"**No draft this round.** The draft gate saw that drafting had lately earned {rate} tokens per step of "
                f"cost, below the {bar} a round without a draft earns, so the target simply took one step like ar "
                f"and committed {_show(pieces, r.committed)}. (Run with *Drafting: always* to see every round drafted.)")
    n, a = len(r.draft_ids), r.accepted
    said = (f"**1. Draft.** The drafter guessed the next {n} token{'s' if n != 1 else ''} after the anchor "
            f"{_show(pieces, [r.anchor_id])}: {_show(pieces, r.draft_ids)}. "
            f"**2. Verify.** The target read the anchor and all {n} guesses in **one** forward and, at each position, "
            f"computed its own next token: {_show(pieces, r.target_ids)}. ")
    if a == n:
        said += (f"**3. Accept.** All {n} guesses match (green). **4. Bonus.** The target's token after the last guess, "
                 f"{_show(pieces, [r.bonus])}, comes free from the same forward. ")
    elif a == 0:
        said += (f"**3. Accept.** The first guess, {_show(pieces, r.draft_ids[:1])}, already differs from the target's "
                 f"{_show(pieces, [r.bonus])} (vermillion: the first mismatch), so no guess is kept and the rest are thrown away. **4. Bonus.** The target's "
                 f"own token {_show(pieces, [r.bonus])} is kept — a round never commits less than ar's one token. ")
    else:
        said += (f"**3. Accept.** The first {a} guess{'es' if a != 1 else ''} match (green); guess {a + 1}, "
                 f"{_show(pieces, r.draft_ids[a:a + 1])}, differs from the target's {_show(pieces, [r.bonus])} (vermillion: the first mismatch), so it and "
                 f"everything after it are thrown away. **4. Bonus.** The target's own token there, {_show(pieces, [r.bonus])}, "
                 f"is kept. ")
    after = r.target_ids[a + 1:] if a < n else []
    if after:  # the target's tokens past the bonus: predictions after a rejected guess, not after the kept text
        said += (f"(The target's tokens after that, {_show(pieces, after)}, continue the rejected guess, not the kept text, "
                 "so they are discarded too and can read as nonsense.) ")
    k = len(r.committed)
    said += (f"**Result:** {k} token{'s' if k != 1 else ''} committed, {_show(pieces, r.committed)}, for one target forward "
             f"(ar needs {k}). The output is exactly what ar prints: every kept token is one the target chose.")
    if r.held_back:
        said += (f" ({len(r.held_back)} more guess{'es' if len(r.held_back) != 1 else ''} were drafted but held back by the "
                 "adaptive verify plan — not worth checking; *Verify plan: full* checks them all.)")
    return said


# ----------------------------------------------------------------------------- presets: the lesson, then its refinements

# The textbook first race, the state a first visit opens in: every round drafts, every draft is verified, on the
# engine where a verify of 8 tokens costs about 1.4 ar steps (the regime speculative decoding was designed for), on
# a prompt the shipped D3D drafter predicts well, with room to finish its answer (163 tokens with the bundled model).
LESSON_PROMPT = ("A bakery sells muffins for $3 each and cookies for $2 each. Maya buys 4 muffins and 6 cookies. "
                 "How much does she spend? Please reason step by step.")
PRESETS = {
    "lesson": dict(prompt=LESSON_PROMPT, block_size=8, hypotheses=4, max_new_tokens=176, temperature=0.0, sampling="match",
                   seed=0, verify="full", drafting="always", engine="fp32"),
    # refinement 1: the draft gate, on the hard case (a chat prompt whose drafts mostly miss): it skips the draft while
    # drafting has not paid lately, so a bad drafter costs less
    "gate": dict(prompt="What are three good habits for learning a new language? Answer briefly.", block_size=8,
                 hypotheses=4, max_new_tokens=96, temperature=0.0, sampling="match", seed=0, verify="full",
                 drafting="gated", engine="fp32"),
    # refinement 2: the adaptive verify plan, on the lesson's prompt: verify only the drafts likely to pay
    "adaptive": dict(prompt=LESSON_PROMPT, block_size=8, hypotheses=4, max_new_tokens=176, temperature=0.0,
                     sampling="match", seed=0, verify="adaptive", drafting="always", engine="fp32"),
    # the tuned race on the fastest engine (int4): both refinements on — the fair test of whether speculation pays here
    "fair": dict(prompt=LESSON_PROMPT, block_size=8, hypotheses=4, max_new_tokens=176, temperature=0.0, sampling="match",
                 seed=0, verify="adaptive", drafting="gated", engine="int4"),
}

# what each preset button does, in one compact line under them (the first screen) and, longer, on hover (PRESET_TIPS:
# the buttons' elem_id -> title, set in the browser at load; Gradio's Button has no tooltip of its own)
PRESET_BUTTONS = ("**+ draft gate**, **+ adaptive verify**: one refinement each · **⚖ fair race**: both, on int4 · "
                  "**📼 Recorded race**: a race run elsewhere, nothing run here")
PRESET_TIPS = {
    "preset-lesson": "The first race: every round drafts, the target verifies every draft, fp32 engine (sets the controls; "
                     "then press ▶ Run race)",
    "preset-gate": "The lesson plus the draft gate, on a chat prompt the drafter mostly misses: rounds where drafting has "
                   "not paid lately skip the draft (sets the controls; then press ▶ Run race)",
    "preset-adaptive": "The lesson plus the adaptive verify plan: verify only the drafts likely to pay, hold back the rest "
                       "(sets the controls; then press ▶ Run race)",
    "preset-fair": "Both refinements on the int4 engine, this app's fastest ar: the honest test of whether speculation pays "
                   "here. int4 rounds differently from fp32, so its answer can differ from the lesson's; every mode still "
                   "prints exactly int4's own ar answer (sets the controls; then press ▶ Run race)",
    "preset-recorded": "Shows the lesson race recorded on another machine (its times are that machine's) in every tab at "
                       "once, without running anything here",
}

PRESET_NOTES = {
    "lesson": ("**Lesson: the textbook algorithm.** Every round drafts a block; the target verifies all of it in one forward "
               "(fp32 engine). Press **▶ Run race**, then step through rounds 0–3 in **Rounds**. Every mode prints exactly "
               "ar's tokens, no better: the 135 M target's arithmetic is often wrong."),
    "gate": ("**Refinement 1: the draft gate** (Drafting: gated), on the hard case — a chat prompt where the drafter "
             "mostly misses. The gate skips the draft while drafting has lately earned less than a plain step (pale "
             "blue *no draft* rows in Rounds). Race it, then switch Drafting to *always* and race again: compare d3d-seq's speedup."),
    "adaptive": ("**Refinement 2: the adaptive verify plan** (Verify plan: adaptive): verify only the drafts likely to "
                 "pay — a verify of fewer tokens costs less, and drafts the drafter itself doubts are held back (pale "
                 "yellow in Rounds). Race it and compare with the lesson's race."),
    "fair": ("**The fair race: the fastest engine, both refinements on.** int4 makes ar two to three times as fast, and on "
             "the measured CPUs a verify of 8 then costs about 2 plain steps (Benchmarks › Engines and int4 step costs): this is the honest test of whether "
             "speculation pays here."),
}
