"""The verify plan: how many of a block's drafts the target checks, chosen from what a verify costs.

A drafted block holds B-1 drafts, but checking them is not free. On a CPU a verify over k tokens
costs more than a step as k grows (measured on a 2-core AVX2 EPYC: verify(4) ≈ 1.14 steps,
verify(8) ≈ 1.5; on the AVX-512 EPYC about 1 step up to k = 6 and 1.18 at 8; on the AVX-512 Xeon, whose
step runs on plain BLAS, 1.25 at 4 and 1.42 at 8), and a weak drafter's late drafts are rarely accepted: the 6th draft of a block is
only reached when the first five were all right. So the engine verifies the prefix that pays:

    k* = argmax_k  E[tokens | verify k] / (draft + verify(k)),   k = 1..B
    E[tokens | verify k] = 1 + sum_{j=1}^{k-1} prod_{i<=j} q_i(d_i)

where q_i(d_i) is the drafter's own probability of its i-th draft (its estimate that the target
accepts it) and costs are in units of one target step. The drafts past k are *held back*: drafted,
shown in the trace, never verified.

Lossless: the width depends only on the drafter's side (its drafts and their probabilities), never on
the target's output, so at temperature 0 the committed tokens are still the target's greedy tokens, and
at temperature > 0 rejection sampling over a draft-chosen prefix keeps the target's distribution.

The costs come from the bundle's shipped cost breakdown (``python -m d3d_core.measure.costs``, which
records the CPU it ran on), at the thread count the run uses, made non-decreasing in k (a timing dip
between neighbouring widths is noise). A bundle without one (the toy bundles,
GPU bundles) gets the flat model, verify(k) = 1 step for every k, under which the whole block is always
worth verifying: the plan then changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

VERIFY_RULES = ("adaptive", "full")


@dataclass(frozen=True)
class CostModel:
    """What a verify of width k and a draft cost, in target steps, on one machine at one thread count."""

    widths: tuple = (1,)  # measured verify widths, ascending, starting at 1 (a step)
    verify: tuple = (1.0,)  # verify(width) / step(1), one per width
    draft: tuple = ()  # ((kind, draft / step), ...) for "d3d" and "dflash"
    source: str = "flat: every verify width costs one step (no cost breakdown for this bundle)"
    step_ms: tuple = ()  # ((threads, ms of one step), ...) for every thread count the breakdown measured
    draft_layers: tuple = ()  # ((kind, active layers of the drafter measured, share of its draft that is the head), ...)

    def step_speedup(self, threads: int, solo: int) -> float:
        """How many times faster a step runs on ``solo`` threads than on ``threads`` (1 when unmeasured): what a
        round the draft gate skips earns, in this model's steps, when it may use every core (d3d-async)."""
        ms = dict(self.step_ms)
        return ms[threads] / ms[solo] if threads in ms and solo in ms and ms[solo] > 0 else 1.0

    def verify_cost(self, k: int) -> float:
        """verify(k) / step: linear between measured widths; past the last one, the last segment's slope."""
        w, v = self.widths, self.verify
        if k <= w[0]:
            return v[0]
        for i in range(1, len(w)):
            if k <= w[i]:
                return v[i - 1] + (v[i] - v[i - 1]) * (k - w[i - 1]) / (w[i] - w[i - 1])
        if len(w) >= 2:  # extrapolate the last segment's slope, never below the last cost
            slope = max(0.0, (v[-1] - v[-2]) / (w[-1] - w[-2]))
            return v[-1] + slope * (k - w[-1])
        return v[-1]

    def draft_cost(self, kind: Optional[str], layers: Optional[int] = None) -> float:
        """A draft of ``kind`` in steps. With ``layers`` (the drafter that runs: pruned, or deeper than the one the
        breakdown measured) the measured cost scales with its active layers, the head's share held fixed: every
        per-layer part (GEMMs, attention, norms) grows with depth, the head does not."""
        cost = dict(self.draft).get(kind, 0.0) if kind else 0.0
        shape = {k: (n, head) for k, n, head in self.draft_layers}
        if not cost or layers is None or kind not in shape:
            return cost
        n, head = shape[kind]
        return cost * (head + (1.0 - head) * layers / n)

    def table(self, B: int) -> list:
        """[verify(1), ..., verify(B)] in steps (what the trace records and the app shows)."""
        return [round(self.verify_cost(k), 4) for k in range(1, B + 1)]

    @classmethod
    def from_breakdown(cls, costs: dict, threads: int) -> "CostModel":
        """From a cost breakdown (``costs.py`` JSON): its rows at ``threads`` (or the closest thread
        count it measured). Unusable input gives the flat model, never an error."""
        raw = costs.get("rows") if isinstance(costs, dict) else None
        rows = [r for r in (raw if isinstance(raw, list) else []) if isinstance(r, dict)
                and isinstance(r.get("threads"), int) and r["threads"] > 0
                and isinstance(r.get("per_step"), (int, float)) and 0 < r["per_step"] < 1e3]
        counts = sorted({r["threads"] for r in rows})
        if not counts:
            return cls()
        t = min(counts, key=lambda c: (abs(c - threads), -c))
        per = {str(r.get("forward", "")): float(r["per_step"]) for r in rows if r["threads"] == t}
        ver = {1: 1.0} if "step" in per else {}
        for name, v in per.items():
            m = re.fullmatch(r"verify\((\d+)\)", name)
            if m:
                ver[int(m.group(1))] = v
        if 1 not in ver:
            return cls()
        widths = tuple(sorted(ver))
        verify = monotone([max(1.0, ver[w]) for w in widths])  # a verify does a step's work and more: never under 1
        draft = tuple((kind, per[f"{kind} draft(8)"]) for kind in ("d3d", "dflash") if f"{kind} draft(8)" in per)
        layers = ()
        n_d3d = costs.get("d3d_active_layers")
        d3d_row = next((r for r in rows if r["threads"] == t and r.get("forward") == "d3d draft(8)"), None)
        if isinstance(n_d3d, int) and n_d3d > 0 and d3d_row is not None:
            parts = d3d_row.get("parts") if isinstance(d3d_row.get("parts"), dict) else {}
            head = parts.get("lm_head", {}).get("share") if isinstance(parts.get("lm_head"), dict) else None
            layers = (("d3d", n_d3d, float(head) if isinstance(head, (int, float)) and 0 <= head <= 1 else 0.0),)
        info = costs.get("machine_info")
        cpu = (info.get("cpu") if isinstance(info, dict) else None) or "an unnamed CPU"
        src = f"cost breakdown measured on {cpu} at {t} thread(s), context {costs.get('ctx_len', '?')} tokens"
        steps = tuple(sorted((r["threads"], float(r["wall_ms"])) for r in rows if r.get("forward") == "step"
                             and isinstance(r.get("wall_ms"), (int, float)) and r["wall_ms"] > 0))
        return cls(widths, tuple(verify), draft, src, steps, layers)


def monotone(costs: Sequence[float]) -> list:
    """The closest non-decreasing sequence (least squares, pool-adjacent-violators): a wider verify does
    the same work plus more, so a measured dip (verify(6) timed above verify(7) on a noisy host) is noise,
    and a plan read from it would flip between widths for no reason."""
    blocks = []  # [sum, count]
    for c in costs:
        blocks.append([float(c), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]


def expected_tokens(probs: Sequence[float], k: int) -> float:
    """E[tokens a verify of width k commits] when draft j is accepted with probability probs[j-1]
    (given the drafts before it were): 1 + sum_{j<k} prod_{i<=j} probs[i-1]."""
    e, run = 1.0, 1.0
    for j in range(min(k - 1, len(probs))):
        run *= min(1.0, max(0.0, float(probs[j])))
        e += run
    return e


def verify_width(probs: Sequence[float], costs: CostModel, draft_cost: float = 0.0) -> int:
    """The width k in 1..len(probs)+1 that maximises expected tokens per unit of round cost
    (ties go to the wider verify). ``probs``: q_j(d_j) of the block's drafts."""
    best_k, best = 1, -1.0
    for k in range(1, len(probs) + 2):
        rate = expected_tokens(probs, k) / max(1e-9, draft_cost + costs.verify_cost(k))
        if rate >= best - 1e-12:
            best_k, best = k, rate
    return best_k


# ----------------------------------------------------------------------------- the draft gate

DRAFTING_RULES = ("gated", "always")


def plan_of(settings: dict, verify: Optional[str] = None) -> tuple:
    """(verify rule, drafting rule) of a bench row or a decode config (as a dict); ``verify`` stands in where the
    row has none. Rows from before the draft gate drafted every round."""
    return settings.get("verify", verify), settings.get("drafting", "always")


def plan_label(plan: tuple) -> str:
    """How tables name a (verify rule, drafting rule) pair."""
    return f"verify {plan[0]}, drafting {plan[1]}"


@dataclass
class DraftGate:
    """Whether a round drafts at all. A round that skips the draft verifies the anchor alone: one step of
    cost for one token, AR's rate. A drafted round pays ``draft + verify(k)`` steps for ``accepted + 1``
    tokens, which on a CPU is below one token per step whenever the drafter keeps missing (mt_bench with
    the shipped drafters: the first draft is right about 1 time in 5). So the gate estimates what drafting
    yields, tokens per step of cost over the latest ``window`` drafted rounds (a ratio of sums), drafts while
    it is at least ``threshold`` (what a skipped round earns: 1, AR's rate; more in d3d-async, whose skipped
    rounds run on every core while its drafted rounds' verifies get one: ``CostModel.step_speedup``), and
    otherwise skips, with a probe draft after ``interval`` skipped rounds so that a stretch where drafting
    pays again is found. A probe that leaves the estimate low doubles the interval (up to ``probe_max``);
    an estimate back above the threshold resets it.

    Each drafted round counts the mean of the tokens it committed and the tokens its drafter expected
    (``expected_tokens`` of its own probabilities over the verified width), when the caller passes them: one
    accept-or-reject is a noisy signal, and the drafter's estimate halves that noise, while the committed
    half keeps an over-confident drafter from holding the gate open. Replayed over recorded always-drafting
    rounds (docs/ENGINE.md), the earlier rule (an average weighted ½ on the newest round, committed tokens
    only) closed on runs of two misses and lost 12–16 % of `d3d-seq`'s gsm8k speed; this one keeps it.

    Lossless: whether a round drafts depends on earlier rounds only, and a round without drafts commits the
    target's own token; at temperature 0 the output is the target's greedy tokens either way. Under the flat
    cost model (toy and GPU bundles: every verify one step, drafts free) a drafted round never yields less
    than one token per step, so the gate never closes and nothing changes."""

    threshold: float = 1.0
    window: int = 16
    probe_every: int = 4
    probe_max: int = 32
    history: list = field(default_factory=list)  # (tokens, cost) of the latest drafted rounds, oldest first
    skipped: int = 0  # rounds skipped since the last drafted one
    interval: int = 0  # skipped rounds before the next probe (0: probe_every)

    @property
    def rate(self) -> Optional[float]:
        """Tokens per step of cost over the window; None before the first drafted round."""
        if not self.history:
            return None
        return sum(t for t, _ in self.history) / max(1e-9, sum(c for _, c in self.history))

    def is_open(self) -> bool:
        r = self.rate
        return r is None or r >= self.threshold

    def wants_draft(self) -> bool:
        """Draft this round? Yes while open, and as a probe once ``interval`` rounds were skipped."""
        return self.is_open() or self.skipped >= (self.interval or self.probe_every)

    def drafted(self, tokens: float, cost: float, expected: Optional[float] = None) -> None:
        """A drafted round committed ``tokens`` for ``cost`` steps (draft + verify, in the cost model's units);
        ``expected``: the tokens its drafter expected (see the class note)."""
        was_open = self.is_open()
        y = tokens if expected is None else 0.5 * (tokens + expected)
        self.history = (self.history + [(float(y), float(cost))])[-self.window :]
        if self.is_open():
            self.interval = self.probe_every
        elif not was_open:  # a probe that failed: probe less often
            self.interval = min(self.probe_max, 2 * (self.interval or self.probe_every))
        self.skipped = 0

    def skip(self) -> None:
        self.skipped += 1
