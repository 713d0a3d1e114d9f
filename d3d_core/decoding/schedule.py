"""How a race shares one machine between its modes: they take turns, one step (prefill, then one round) at a time.

Run one after another, the modes are timed at different moments, and any drift of the machine's speed (another
process, the CPU's clock, a neighbour on the host) lands on whichever mode ran then: identical races read 1.45× and
1.66×. Taking turns round by round spreads it over all of them, and the turn goes to the mode *furthest behind in
committed tokens* (ties: the order given, ar first), not simply to the next in line: ``ar`` needs two to three times
as many rounds as a drafting mode for the same tokens, so with plain round-robin the drafting modes would finish
halfway and ``ar`` would time its second half alone. Paced by tokens, every mode is at the same point of its output
at any moment, all columns grow together and all finish together, so every mode's tokens are timed across the same
stretch of the machine's history.

Each mode's times are its own (``Recorder.pause``: its clock stops while it waits for its turn), and a turn ends at a
quiescent point (``Lanes.quiesce``: d3d-async's drafter thread has no work in flight), so no mode's work runs
during another's turn.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional


def interleave(steps: dict, progress: Callable[[str, object], float], around: Optional[Callable] = None) -> Iterator[tuple]:
    """Drive the iterators ``steps`` (name -> iterator of items) in turns: each turn advances the one whose last
    item has the least ``progress(name, item)`` (before its first item: 0), ties to the earlier name in ``steps``;
    yields ``(name, item, False)`` after each turn and ``(name, last item, True)`` once an iterator is exhausted.
    ``around(name)``: a context manager wrapped around each turn (e.g. a load meter)."""
    last: dict = {n: None for n in steps}
    where: dict = {n: 0.0 for n in steps}
    live = list(steps)
    while live:
        name = min(live, key=lambda n: where[n])  # min keeps the first of equals: the earlier name
        with around(name) if around is not None else contextlib.nullcontext():
            try:
                item = next(steps[name])
            except StopIteration:
                item = StopIteration
        if item is StopIteration:
            live.remove(name)
            yield name, last[name], True
            continue
        last[name] = item
        where[name] = progress(name, item)
        yield name, item, False


def token_share(max_new_tokens: int) -> Callable[[str, object], float]:
    """``progress`` for traces: the share of the token budget a mode has committed; a finished trace (EOS, length,
    cancelled) reads -1 so that its iterator is closed at the next turn, not kept open until the others catch up."""
    def share(_name, trace) -> float:
        if trace.finish_reason:
            return -1.0
        return len(trace.output_ids) / max(1, max_new_tokens)
    return share


__all__ = ["interleave", "token_share"]
