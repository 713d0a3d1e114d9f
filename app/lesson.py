"""The lesson: speculative decoding told round by round, in plain words, from a trace's own tokens.

Pure functions of a ``Round`` (and the readable pieces of its token ids), so the Rounds tab can say what happened
in the round a student is looking at — drafted, checked in one target forward, accepted up to the first
disagreement, the target's own token kept as the bonus — and tests can check each sentence against the round.
"""

from __future__ import annotations

from d3d_core.decoding.trace import Round


def _show(pieces: dict, ids: list, limit: int = 8) -> str:
    text = "".join(str(pieces.get(t, t)) for t in ids[:limit]).replace("\n", "⏎")
    return f"“{text}{'…' if len(ids) > limit else ''}”"


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
                 f"{_show(pieces, [r.bonus])} (red), so no guess is kept and the rest are thrown away. **4. Bonus.** The target's "
                 f"own token {_show(pieces, [r.bonus])} is kept — a round never commits less than ar's one token. ")
    else:
        said += (f"**3. Accept.** The first {a} guess{'es' if a != 1 else ''} match (green); guess {a + 1}, "
                 f"{_show(pieces, r.draft_ids[a:a + 1])}, differs from the target's {_show(pieces, [r.bonus])} (red), so it and "
                 f"everything after it are thrown away. **4. Bonus.** The target's own token there, {_show(pieces, [r.bonus])}, "
                 f"is kept. ")
    k = len(r.committed)
    said += (f"**Result:** {k} token{'s' if k != 1 else ''} committed, {_show(pieces, r.committed)}, for one target forward "
             f"(ar needs {k}). The output is exactly what ar prints: every kept token is one the target chose.")
    if r.held_back:
        said += (f" ({len(r.held_back)} more guess{'es' if len(r.held_back) != 1 else ''} were drafted but held back by the "
                 "adaptive verify plan — not worth checking; *Verify plan: full* checks them all.)")
    return said
