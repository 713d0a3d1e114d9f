"""The decode loop: four modes, one code path.

``ar`` is the same loop with block size 1 and no drafter, so comparisons are fair.
A round = draft a block ``[anchor, d_1..d_{B-1}]`` + one target verify over it. What
differs between modes is only *when* and *how* the block is drafted:

- ``dflash``: after verify, from the target hidden states of the accepted tokens;
- ``d3d-seq``: after verify, by the standalone drafter (context stream + block);
- ``d3d-async``: during verify, one packed forward drafts the successor block for ``H``
  hypotheses ``(a, t)``; a hit is verified at once, a miss costs a synchronous draft.

``iter_decode`` yields the growing ``Trace`` after prefill and after every round
(streaming UIs); ``decode`` returns the finished one. Nothing here prints.

Host and device: drafts' distributions, the hypotheses' top-k and every vocabulary-size step stay on the models'
device; ids and positions go over without blocking (``drafters.to_device``), and what the loop needs back comes in
one ``sampling.to_host`` per verify and one per drafter forward (with the hypotheses' candidates on a GPU, see
``_eager_tops``). A tensor one lane hands to the other is ordered with ``wait_stream`` (``_hand_over``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional, Union

import torch

from ..models.d3d import D3DDrafter
from ..models.dflash import DFlashDrafter
from ..models.layers import KVCache, to_device
from . import sampling
from .config import DecodeConfig
from .plan import CostModel, DraftGate, expected_tokens, verify_width
from .sampling import accept, choose, probs, sample
from .timing import Lanes, Recorder, cpu_threads
from .trace import MODES, Hypothesis, Round, Stats, Trace, overlap_share


@dataclass
class Tops:
    """What ``make_hypotheses`` reads of a draft's distributions, on the host: per draft row a, the top tokens of q_a
    without d_a, renormalised (None where q_a holds nothing else), and per row, the top tokens of q_a as it is
    (the row past the verified drafts: the a = B-1 hypothesis)."""

    h: int  # how many tokens per row
    rejected: list  # row a -> ([p], [token]) or None
    lookahead: dict  # row -> ([p], [token])


@dataclass
class Draft:
    ids: list  # d_1..d_{B-1}
    q: torch.Tensor  # (B-1 [+1 lookahead], K) drafter distributions over `vocab` (temperature-scaled when T > 0), on the drafter's device
    vocab: Optional[torch.Tensor] = None  # (K,) ascending token ids of q's columns (a shortlist), on q's device; None: all V
    vocab_size: int = 0  # V
    cols: Optional[torch.Tensor] = None  # (B-1,) q's columns of the drafts, on q's device (None: found from ids)
    pd: Optional[list] = None  # q_j(d_j) of each draft, read with the ids (None: read on first use)
    tops: Optional[Tops] = None  # the hypotheses' candidates, read with the ids where that saves a wait (_eager_tops)

    @property
    def probs(self) -> list:
        """q_j(d_j) per draft, host floats (0 for a token off the shortlist)."""
        if self.pd is None:
            cols, present = self._cols()
            pd = self.q[: len(self.ids)].gather(1, cols[:, None]).squeeze(1) * present
            (self.pd,) = sampling.to_host(pd)
        return self.pd

    def _cols(self) -> tuple:
        """(q's columns of the drafts, whether the shortlist holds each) on q's device."""
        if self.cols is not None:
            return self.cols, torch.ones_like(self.cols, dtype=self.q.dtype)
        ids = to_device(torch.tensor(self.ids, dtype=torch.long), self.q.device)
        if self.vocab is None:
            return ids, torch.ones_like(ids, dtype=self.q.dtype)
        c = torch.searchsorted(self.vocab, ids).clamp(max=len(self.vocab) - 1)
        return c, (self.vocab[c] == ids).to(self.q.dtype)

    def truncated(self, n: int) -> "Draft":
        """The first n drafts (what a verify of width n + 1 checks); q keeps row n, the drafter's
        distribution one past them (the bonus position a d3d-async hypothesis guesses)."""
        return Draft(self.ids[:n], self.q[: n + 1], self.vocab, self.vocab_size,
                     None if self.cols is None else self.cols[:n], None if self.pd is None else self.pd[:n], self.tops)

    def dense(self) -> torch.Tensor:
        """(n, V) distributions, zero off the shortlist (what rejection sampling compares with p)."""
        if self.vocab is None:
            return self.q
        out = self.q.new_zeros(self.q.shape[0], self.vocab_size)
        out[:, self.vocab] = self.q
        return out


@dataclass
class PackedResult:
    hyps: list  # [(a, t, score)]
    drafts: list  # Draft per hypothesis
    new_kv: list  # provisional context KV of [x_s, d_1..d_{B-1}] per drafter layer


# ----------------------------------------------------------------------------- drafting


def _eager_tops(device: torch.device) -> bool:
    """Read the hypotheses' candidates of every drafted block with its ids (one wait), or only for the block that
    gets verified, when its packed pass forms them? Eager where reading costs a wait (a GPU: otherwise the packed
    pass would wait twice); lazy on the CPU, where a read costs nothing and the top-k of H blocks that will not be
    verified would (about 1 ms a packed pass at 8 K shortlist columns, 8 at 49 K)."""
    return device.type != "cpu"


def _tops(q: torch.Tensor, cols: torch.Tensor, vocab: Optional[torch.Tensor], h: int, look: slice,
          present: Optional[torch.Tensor] = None) -> list:
    """On q's device, for blocks q (nb, R, K) with drafts cols (nb, n): the top-h of each draft row without its draft,
    renormalised (values, token ids, whether the row has mass left), and the top-h of q's rows ``look`` as they are.
    ``present`` (nb, n): 0 where a draft is off the shortlist (its row then stays whole; its q is 0)."""
    n = cols.shape[-1]
    rest = q[:, :n].clone()
    drop = 0.0 if present is None else rest.gather(-1, cols[..., None]) * (1 - present[..., None])
    rest.scatter_(-1, cols[..., None], drop)
    mass = rest.sum(-1, keepdim=True)
    rv, ri = torch.topk(rest / mass, h, dim=-1)  # a row without mass gives NaN: flagged by mass > 0
    lv, li = torch.topk(q[:, look], h, dim=-1)
    if vocab is not None:
        ri, li = vocab[ri], vocab[li]
    return [rv, ri, mass.squeeze(-1) > 0, lv, li]


def _host_tops(h: int, look_rows: range, rv, ri, ok, lv, li) -> Tops:
    """One block's ``_tops``, read back, as ``Tops``."""
    return Tops(h, [(v, t) if k else None for v, t, k in zip(rv, ri, ok)], {r: (v, t) for r, v, t in zip(look_rows, lv, li)})


def _drafts_from_hidden(drafter, h_blocks: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator, hypotheses: int = 0) -> list:
    """h_blocks: (nb, L, H) -> one Draft per block (positions 1..L-1), computed over the shortlist's
    K columns when the drafter has one (softmax, argmax and sampling over K, not the whole V), on the drafter's
    device; one read brings back the drafts, their q_j(d_j) and, with ``hypotheses`` where ``_eager_tops``, the
    candidates of the hypotheses each block would form."""
    logits, vocab = drafter.draft_logits(drafter.draft_rows(h_blocks))  # (nb, L-1, K)
    logits = logits.float()
    nb, B = logits.shape[0], cfg.block_size
    if nb == 0:
        return []
    q = probs(logits, cfg.temperature)  # (nb, L-1, K)
    if cfg.temperature > 0:  # one draw per block, in block order (as the generator's stream always ran)
        cols = torch.stack([sample(q[b, : B - 1], gen) for b in range(nb)])
    else:
        cols = logits[:, : B - 1].argmax(-1)
    reads = [cols if vocab is None else vocab[cols], q[:, : B - 1].gather(-1, cols[..., None]).squeeze(-1)]
    h = min(hypotheses, q.shape[-1])
    eager = bool(h) and _eager_tops(q.device)
    if eager:
        reads += _tops(q, cols, vocab, h, slice(None))
    ids, pd, *tops = sampling.to_host(*reads)
    rows = range(q.shape[1])
    return [Draft(ids[b], q[b], vocab, drafter.cfg.arch.vocab_size, cols[b], pd[b],
                  _host_tops(h, rows, *(t[b] for t in tops)) if eager else None) for b in range(nb)]


@torch.inference_mode()
def d3d_draft(drafter: D3DDrafter, cache: KVCache, ctx_ids: list, anchor: int, cfg: DecodeConfig, gen, hypotheses: int = 0) -> Draft:
    """Commit ctx_ids to the drafter's context and draft the block after them (one forward).
    The D3D block carries one extra mask slot (position s+B): the drafter's guess one past
    the block, used by the a = B-1 hypothesis of d3d-async (``hypotheses``: H, when a packed pass will follow)."""
    ctx = to_device(torch.tensor(ctx_ids, dtype=torch.long), drafter.device)
    _, h_blocks, new_kv = drafter.forward_packed(cache, ctx, [(anchor, len(ctx_ids))], cfg.block_size + 1)
    drafter.commit_kv(cache, new_kv, len(ctx_ids))
    return _drafts_from_hidden(drafter, h_blocks, cfg, gen, hypotheses)[0]


@torch.inference_mode()
def d3d_prefill(drafter: D3DDrafter, cache: KVCache, prompt_ids: list) -> None:
    ctx = to_device(torch.tensor(prompt_ids, dtype=torch.long), drafter.device)
    _, _, new_kv = drafter.forward_packed(cache, ctx, [], 1)
    drafter.commit_kv(cache, new_kv, len(prompt_ids))


def _read_tops(draft: Draft, B: int, h: int) -> Tops:
    """The candidates a verify of width B needs, computed on q's device and read (the lazy path of ``_eager_tops``)."""
    cols, present = draft._cols()
    cols = cols[: B - 1]
    look = slice(B - 1, B) if draft.q.shape[0] >= B else slice(0, 0)
    reads = _tops(draft.q[None], cols[None], draft.vocab, h, look, present[None, : B - 1])
    return _host_tops(h, range(look.start, look.stop), *(t[0] for t in sampling.to_host(*reads)))


def make_hypotheses(draft: Draft, B: int, H: int) -> list:
    """The H most likely (a, t) outcomes of verifying [x_s, d_1..d_{B-1}] (B: the verify's width), scored with the
    drafter's own distributions: P(a, t) ~ prod_{j<=a} q_j(d_j) * (1 - q_{a+1}(d_{a+1})) *
    q~_{a+1}(t), where q~ is q_{a+1} without d_{a+1}; for a = B-1, t comes from the
    lookahead slot q_B. Returns [(a, t, score)] best first. The top-k ran on q's device (``_tops``); here only
    the few candidates are scored and sorted."""
    eps = 1e-12
    h = min(H, draft.q.shape[1])
    tops = draft.tops
    if tops is None or tops.h < h or len(tops.rejected) < B - 1 or (draft.q.shape[0] >= B and B - 1 not in tops.lookahead):
        tops = draft.tops = _read_tops(draft, B, h)  # kept: a caller timing packed passes over one draft reads once
    pd = draft.probs[: B - 1]
    prefix = [0.0]  # prefix[a] = sum_{j<a} log q_j(d_j)
    for p in pd:
        prefix.append(prefix[-1] + math.log(p + eps))
    cands = []
    for a in range(B - 1):
        if tops.rejected[a] is None:  # q_{a+1} holds nothing but d_{a+1}
            continue
        base = prefix[a] + math.log(max(1.0 - pd[a], eps))
        for p, t in zip(*(x[:h] for x in tops.rejected[a])):
            cands.append((base + math.log(p + eps), a, t))
    if draft.q.shape[0] >= B:  # lookahead slot present (D3D)
        for p, t in zip(*(x[:h] for x in tops.lookahead[B - 1])):
            cands.append((prefix[B - 1] + math.log(p + eps), B - 1, t))
    cands.sort(key=lambda c: -c[0])
    return [(a, t, math.exp(s)) for s, a, t in cands[:H]]


@torch.inference_mode()
def d3d_packed(drafter: D3DDrafter, cache: KVCache, anchor: int, draft: Draft, cfg: DecodeConfig, gen) -> PackedResult:
    """While the target verifies [anchor, d_1..d_{B-1}]: ONE forward holding the block as
    provisional causal context plus H hypothesis blocks, each anchored at s+a+1 and seeing
    the provisional context up to s+a (4-D mask, no hypothesis sees another)."""
    B = cfg.block_size
    hyps = make_hypotheses(draft, len(draft.ids) + 1, cfg.hypotheses)  # the verified width, which the plan may cut below B
    ctx = to_device(torch.tensor([anchor] + draft.ids, dtype=torch.long), drafter.device)
    _, h_blocks, new_kv = drafter.forward_packed(cache, ctx, [(t, a + 1) for a, t, _ in hyps], B + 1)
    drafts = _drafts_from_hidden(drafter, h_blocks, cfg, gen, cfg.hypotheses) if hyps else []  # a hit's block forms the next hypotheses
    return PackedResult(hyps, drafts, new_kv)


@torch.inference_mode()
def dflash_draft(drafter: DFlashDrafter, cache: KVCache, feats, anchor: int, cfg: DecodeConfig, gen) -> Draft:
    """Fuse the target features of newly committed positions into the drafter's context
    cache, then draft the block (queries from the block only)."""
    if feats is not None:
        drafter.extend_context(cache, feats)
    h = drafter.forward_blocks(cache, [anchor], cfg.block_size)
    return _drafts_from_hidden(drafter, h, cfg, gen)[0]


# ----------------------------------------------------------------------------- the loop


def prepare_prompt(bundle, prompt: Union[str, list], cfg: DecodeConfig) -> tuple:
    """Validate and tokenize. Returns (prompt_text, prompt_ids)."""
    if isinstance(prompt, str):
        text = prompt
        ids = bundle.tokenizer.encode_prompt(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = list(prompt)
        V = bundle.target.arch.vocab_size
        if any(not 0 <= i < V for i in ids):
            raise ValueError(f"prompt token ids must lie in [0, {V})")
        text = bundle.tokenizer.decode(ids)
    else:
        raise ValueError("prompt is empty: give text or a non-empty list of token ids")
    need = len(ids) + cfg.max_new_tokens + cfg.block_size + 2
    if need > bundle.target.max_positions:
        raise ValueError(
            f"prompt is too long for the context: {len(ids)} prompt tokens + {cfg.max_new_tokens} new tokens "
            f"+ one block exceed the target's {bundle.target.max_positions} positions"
        )
    return text, ids


def warm_up(bundle, drafter=None) -> float:
    """Run every mode once on a few tokens, so that one-time work (the fast engine packs each weight on
    its first use, allocators grow) is paid before a timed decode, never inside one. The app calls it
    before a bundle's first race; the bench warms up the same way. With ``drafter`` (a D3D drafter other
    than the bundle's default) only the D3D modes run, with it. Returns the seconds it took."""
    t = time.perf_counter()
    ids = list(range(3, 3 + min(8, bundle.target.arch.vocab_size - 3)))
    for mode in MODES:
        if drafter is not None and STRATEGIES[mode].drafter_kind != drafter.cfg.kind:
            continue
        decode(bundle, ids, DecodeConfig(mode=mode, max_new_tokens=3, block_size=4, hypotheses=2, stop_at_eos=False), drafter=drafter)
    return time.perf_counter() - t


def decode(bundle, prompt, cfg: DecodeConfig = DecodeConfig(), cancel: Optional[Callable[[], bool]] = None, drafter=None,
           costs: Optional[CostModel] = None) -> Trace:
    trace = None
    for trace in iter_decode(bundle, prompt, cfg, cancel=cancel, drafter=drafter, costs=costs):
        pass
    return trace


def iter_decode(bundle, prompt, cfg: DecodeConfig = DecodeConfig(), cancel=None, drafter=None, costs: Optional[CostModel] = None) -> Iterator[Trace]:
    """Decode ``prompt`` with ``cfg.mode``. Yields the same Trace object after prefill and
    after each round; the last yield is complete (stats, spans, finish_reason).
    ``drafter`` overrides the bundle's drafter of the mode's kind (e.g. a pruned copy).
    ``costs`` overrides the verify plan's cost model (default: the bundle's, at the run's threads).
    ``cancel``: a callable or threading.Event; checked before every round."""
    cfg = cfg.validated()
    text, prompt_ids = prepare_prompt(bundle, prompt, cfg)
    strategy_cls = STRATEGIES[cfg.mode]
    if drafter is None and strategy_cls.drafter_kind:
        drafter = bundle.drafter(strategy_cls.drafter_kind)
    if strategy_cls.drafter_kind and not isinstance(drafter, DRAFTER_CLASSES[strategy_cls.drafter_kind]):
        want = DRAFTER_CLASSES[strategy_cls.drafter_kind].__name__
        raise ValueError(f"mode {cfg.mode} needs a {want}, got {type(drafter).__name__}")
    is_cancelled = (cancel.is_set if hasattr(cancel, "is_set") else cancel) or (lambda: False)

    device = bundle.target.device
    threads, solo = mode_threads(cfg, device)
    costs = costs or CostModel.from_breakdown(getattr(bundle, "costs", None), threads)
    trace = Trace(
        mode=cfg.mode, bundle=bundle.name, config=asdict(cfg), prompt_text=text, prompt_ids=prompt_ids,
        device=str(device), verify_costs=costs.table(cfg.effective_block), cost_source=costs.source,
        drafter=drafter.describe() if drafter is not None else "", engine=bundle.target.engine,
    )
    lanes = Lanes(device, strategy_cls.concurrent)
    rec = Recorder(device)
    steps = None
    try:
        # Each step (prefill, then one round) runs with this mode's threads and on its own clock, and ends quiescent:
        # between two steps the decode may stay suspended while other modes of a race take their turn (service.race),
        # and neither their rounds nor the UI's work count in this decode's times, nor does its drafter thread run then.
        while True:
            with cpu_threads(threads) if device.type == "cpu" else contextlib.nullcontext(), rec.running():
                if steps is None:
                    run = Run(bundle.target, cfg, lanes, rec, costs, solo_threads=solo if device.type == "cpu" else None)
                    steps = _loop(run, strategy_cls(run, drafter), trace, bundle.tokenizer, is_cancelled)
                try:
                    out = next(steps)
                except StopIteration:
                    return
                finally:
                    lanes.quiesce()
            yield out
    finally:
        if steps is not None:
            steps.close()
        lanes.close()


def mode_threads(cfg: DecodeConfig, device) -> tuple:
    """(intra-op threads a decode of ``cfg.mode`` runs with, threads for its work while the other lane is idle):
    all cores, or one per lane where the drafter runs beside the target on a CPU (d3d-async)."""
    concurrent = STRATEGIES[cfg.mode].concurrent
    threads = cfg.threads or (1 if (concurrent and torch.device(device).type == "cpu") else torch.get_num_threads())
    return threads, cfg.threads or torch.get_num_threads()


# ----------------------------------------------------------------------------- the shared loop


@dataclass
class Run:
    """What every strategy of one decode shares: the target, settings, lanes, clock, the
    two seeded generators and the forward counters."""

    target: object
    cfg: DecodeConfig
    lanes: Lanes
    rec: Recorder
    costs: CostModel = CostModel()  # what verify widths cost: the verify plan's input
    gen_t: torch.Generator = field(default_factory=lambda: torch.Generator())  # target side (main thread)
    gen_d: torch.Generator = field(default_factory=lambda: torch.Generator())  # drafter side (drafter lane)
    n_target_fwd: int = 0
    n_draft_fwd: int = 0
    solo_threads: Optional[int] = None  # CPU threads for work while the other lane is idle (d3d-async's lanes get one each)

    def solo(self):
        """Run the enclosed forward on every core: only where the lanes split the cores (d3d-async) and the
        drafter lane is idle — a round the draft gate skipped, or a synchronous draft."""
        if self.solo_threads is None or not self.lanes.concurrent or self.solo_threads == torch.get_num_threads():
            return contextlib.nullcontext()
        return cpu_threads(self.solo_threads)

    def __post_init__(self):
        if torch.device(self.lanes.device).type != "cpu":  # sampling runs where the logits are: so do its generators
            self.gen_t, self.gen_d = torch.Generator(self.lanes.device), torch.Generator(self.lanes.device)
        self.gen_t.manual_seed(self.cfg.seed)
        self.gen_d.manual_seed(self.cfg.seed + 1)


def _loop(run: Run, mode, trace: Trace, tok, is_cancelled) -> Iterator[Trace]:
    """prefill -> (draft -> verify -> commit -> trace)*; ``mode`` decides how blocks are drafted. Each step is a named
    function below: ``_prefill``, ``_draft_block``, ``_verify``, ``_gate_verdict``, ``_commit``, ``_record``, ``_finish``."""
    cfg, rec = run.cfg, run.rec
    eos = tok.eos_ids if cfg.stop_at_eos else frozenset()
    wall0 = rec.now_s()  # the decode's own clock: it stops while the decode is suspended between two yields
    t_cache = run.target.new_cache()
    first = _prefill(run, mode, t_cache, trace.prompt_ids)
    t_decode0 = rec.now_s()
    trace.first_token, trace.output_ids = first, [first]
    finish = "eos" if first in eos else ("length" if cfg.max_new_tokens <= 1 else "")
    yield trace

    anchor, s, rnd = first, len(trace.prompt_ids), 0  # anchor token and its position
    gate = _draft_gate(run, mode)
    while not finish:
        if is_cancelled():
            finish = "cancelled"
            break
        block = _draft_block(run, mode, gate, rnd, anchor)
        v, vout = _verify(run, mode, t_cache, rnd, anchor, block)
        _gate_verdict(run, mode, gate, block, v)
        committed, finish = _commit(trace.output_ids, block.ids[: v.accepted] + [v.bonus], eos, cfg.max_new_tokens)
        rd = _record(rnd, s, anchor, block, v, committed)
        mode.after_verify(rd, anchor, block.ids, vout)
        trace.rounds.append(rd)
        s, anchor, rnd = s + v.accepted + 1, v.bonus, rnd + 1
        if not finish and s + cfg.effective_block + 2 > run.target.max_positions:
            finish = "context"
        if not finish:
            yield trace

    _finish(run, trace, tok, finish, wall0, t_decode0)
    yield trace


@dataclass
class Block:
    """What one round verifies: the drafted block cut to the verify plan's width (``draft`` None: the anchor alone)."""

    draft: Optional[Draft]
    source: str  # the round's draft_source: "", "draft", "sync_draft", "packed_draft" or "skipped"
    q: list  # q_j(d_j) of the drafts verified
    held: list  # drafts past the verify plan's width: drafted, never verified
    gate_rate: Optional[float]  # the draft gate's estimate before this round; None: no gate
    gate_threshold: Optional[float] = None  # what a round without a draft earns (the gate's threshold); None: no gate

    @property
    def ids(self) -> list:
        return self.draft.ids if self.draft is not None else []


def _prefill(run: Run, mode, t_cache, prompt_ids: list) -> int:
    """The target's prefill (the mode's drafter prefill beside or after it), ending quiescent -> the first token."""
    target = run.target
    mode.start_prefill(prompt_ids)
    with run.lanes.target_ctx(), run.rec.span("target", "prefill", -1):
        out = target.prefill(t_cache, to_device(torch.tensor(prompt_ids, dtype=torch.long), target.device), mode.feature_layers)
        ((first,),) = sampling.to_host(choose(out.logits[-1:], run.cfg.temperature, run.gen_t))
    run.n_target_fwd += 1
    mode.finish_prefill(prompt_ids, out)
    _sync(run)
    return first


def _draft_gate(run: Run, mode) -> Optional[DraftGate]:
    """The draft gate of a gated decode with a drafter (its threshold: what a step on every core is worth), else None."""
    if run.cfg.drafting != "gated" or mode.drafter is None:
        return None
    return DraftGate(threshold=run.costs.step_speedup(torch.get_num_threads(), run.solo_threads) if run.solo_threads else 1.0)


def _draft_block(run: Run, mode, gate: Optional[DraftGate], rnd: int, anchor: int) -> Block:
    """This round's block: the mode's draft (none where the draft gate skips the round), cut to the width the verify
    plan picks (``verify == "adaptive"``)."""
    gate_rate = gate.rate if gate is not None else None
    if gate is None or gate.wants_draft() or mode.has_ready_draft():
        draft, source = mode.draft(rnd, anchor)
    else:  # the draft gate: drafting has not paid lately, so this round is an AR step
        draft, source = None, "skipped"
    q_drafts, held = (draft.probs if draft is not None else []), []  # q_j(d_j), computed once per round
    if draft is not None and run.cfg.verify == "adaptive":
        k = verify_width(q_drafts, run.costs, mode.draft_cost())
        held, draft, q_drafts = draft.ids[k - 1 :], draft.truncated(k - 1), q_drafts[: k - 1]
    return Block(draft, source, q_drafts, held, gate_rate, gate.threshold if gate is not None else None)


def _verify(run: Run, mode, t_cache, rnd: int, anchor: int, block: Block) -> tuple:
    """One target forward over ``[anchor, drafts]`` while the mode works on the next block -> (verdict, verify output);
    the target's cache keeps the accepted prefix and the anchor."""
    cfg, target, draft, drafts = run.cfg, run.target, block.draft, block.ids
    reads_q = draft is not None and cfg.temperature > 0 and cfg.sampling == "rejection"  # only rejection sampling reads q
    if reads_q:  # before the packed pass is queued behind it on the drafter's stream
        _hand_over(run.lanes, "target")
    mode.during_verify(rnd, anchor, draft)
    with run.lanes.target_ctx(), run.rec.span("target", "verify", rnd), (run.solo() if draft is None else contextlib.nullcontext()):
        vout = target.verify(t_cache, to_device(torch.tensor([anchor] + drafts, dtype=torch.long), target.device), mode.feature_layers)
        q = draft.dense() if reads_q else None
        v = accept(drafts, q, vout.logits, cfg.temperature, cfg.sampling, run.gen_t)  # the target lane's one read
        target.rollback(t_cache, len(drafts) - v.accepted)
    run.n_target_fwd += 1
    return v, vout


def _gate_verdict(run: Run, mode, gate: Optional[DraftGate], block: Block, v) -> None:
    """Tell the draft gate what this round's draft bought (or that it was skipped)."""
    if gate is None:
        return
    if block.draft is None:
        gate.skip()
        return
    n = len(block.ids) + 1  # the verify's width
    gate.drafted(v.accepted + 1, mode.draft_cost() + run.costs.verify_cost(n), expected=expected_tokens(block.q, n))


def _record(rnd: int, s: int, anchor: int, block: Block, v, committed: list) -> Round:
    """The trace's record of one round."""
    return Round(
        index=rnd, anchor_pos=s, anchor_id=anchor, draft_ids=list(block.ids),
        draft_probs=block.q, target_ids=v.target_ids[: len(block.ids) + 1],
        accepted=v.accepted, bonus=v.bonus, committed=committed, draft_source=block.source, held_back=block.held,
        gate_rate=None if block.gate_rate is None else round(block.gate_rate, 4),
        gate_threshold=None if block.gate_threshold is None else round(block.gate_threshold, 4),
    )


def _finish(run: Run, trace: Trace, tok, finish: str, wall0: float, t_decode0: float) -> None:
    """Close the trace: spans, finish reason, text and stats."""
    _sync(run)
    t_end = run.rec.now_s()
    trace.spans = run.rec.finalize()
    trace.finish_reason = finish
    trace.output_text = tok.decode(trace.output_ids)
    if trace.rounds and trace.rounds[-1].hit is not None:
        # the decode ended with this round: no next block was needed, so its hypotheses get no verdict (hit None),
        # are not drawn as misses and do not count in the hit rate (issue 33, confusion 9)
        trace.rounds[-1].hit = None
    trace.stats = _stats(trace, run.n_target_fwd, run.n_draft_fwd, t_decode0 - wall0, t_end - t_decode0, t_end - wall0)


def _commit(output: list, tokens: list, eos, max_new_tokens: int) -> tuple:
    """Append the round's tokens, stopping at EOS or the length limit. Returns (committed, finish)."""
    committed = []
    for tkn in tokens:
        output.append(tkn)
        committed.append(tkn)
        if tkn in eos:
            return committed, "eos"
        if len(output) >= max_new_tokens:
            return committed, "length"
    return committed, ""


def _sync(run: Run) -> None:
    if run.lanes.cuda:
        torch.cuda.synchronize()


def _hand_over(lanes: Lanes, to: str) -> None:
    """Order a tensor one lane made before the other lane's use of it: the receiving lane's stream (``to``:
    "target" or "drafter") waits for the work queued on the giving lane's stream so far. On the GPU only, and only
    when the lanes have two streams; a CPU run does nothing here."""
    if lanes.cuda and lanes.drafter_stream is not lanes.target_stream:
        give, take = (lanes.drafter_stream, lanes.target_stream) if to == "target" else (lanes.target_stream, lanes.drafter_stream)
        take.wait_stream(give)


# ----------------------------------------------------------------------------- one strategy per mode


class Mode:
    """How a mode drafts. The base class is ``ar``: no drafter, B = 1, nothing to do."""

    drafter_kind: Optional[str] = None  # which of the bundle's drafters the mode uses
    concurrent = False  # does the drafter run on its own lane while the target verifies?

    def __init__(self, run: Run, drafter=None):
        self.run, self.drafter = run, drafter
        self.cache = drafter.new_cache() if drafter is not None else None
        self.feature_layers: tuple = ()  # target layers whose hidden states verify must return

    def start_prefill(self, prompt_ids: list) -> None:
        """Before the target's prefill (work that may overlap it)."""

    def finish_prefill(self, prompt_ids: list, out) -> None:
        """After the target's prefill; ``out`` holds its logits (and features when asked)."""

    def draft(self, rnd: int, anchor: int) -> tuple:
        """This round's block: (Draft or None, draft_source)."""
        return None, ""

    def has_ready_draft(self) -> bool:
        """Is a block already drafted for this round (free to verify, whatever the draft gate says)?"""
        return False

    def during_verify(self, rnd: int, anchor: int, draft) -> None:
        """Start work that runs while the target verifies this round's block (``draft`` None: the
        anchor alone, a round the draft gate skipped)."""

    def after_verify(self, rd: Round, anchor: int, drafts: list, vout) -> None:
        """Bring the drafter up to date with the verdict (``rd`` may be annotated). After a skipped round the
        committed tokens wait for the next draft, so what the drafter has not seen yet accumulates."""

    def draft_cost(self) -> float:
        """What drafting a block costs in target steps, as the verify plan counts it (its round's fixed cost)."""
        return self.run.costs.draft_cost(self.drafter_kind, self._layers())

    def _layers(self) -> Optional[int]:
        """Active layers of the D3D drafter that runs (pruned or deeper than the measured one); None otherwise."""
        return len(self.drafter.active_layers()) if self.drafter_kind == "d3d" and self.drafter is not None else None

    def _timed_draft(self, kind: str, rnd: int, fn):
        with self.run.lanes.drafter_ctx(), self.run.rec.span("drafter", kind, rnd):
            out = fn()
        self.run.n_draft_fwd += 1
        return out


class DFlashMode(Mode):
    """Target-conditioned: each block is drafted from the target's hidden states of the tokens
    the last verify accepted, so it can only start after that verify returns."""

    drafter_kind = "dflash"

    def __init__(self, run: Run, drafter):
        super().__init__(run, drafter)
        self.feature_layers = tuple(drafter.cfg.target_layer_ids)
        self.pending_feats = None  # features of committed tokens not yet in the drafter's cache

    def finish_prefill(self, prompt_ids, out):
        _hand_over(self.run.lanes, "drafter")  # the features come from the target's prefill
        with self.run.lanes.drafter_ctx(), self.run.rec.span("drafter", "prefill", -1), torch.inference_mode():
            self.drafter.extend_context(self.cache, out.feats)

    def draft(self, rnd, anchor):
        feats, self.pending_feats = self.pending_feats, None
        _hand_over(self.run.lanes, "drafter")  # the features come from the target's verify
        return self._timed_draft("draft", rnd, lambda: dflash_draft(self.drafter, self.cache, feats, anchor, self.run.cfg, self.run.gen_d)), "draft"

    def after_verify(self, rd, anchor, drafts, vout):
        new = vout.feats[:, : rd.accepted + 1]  # anchor + accepted drafts, as the target saw them
        if self.pending_feats is not None:  # a skipped round's features wait too: join them where the draft reads them
            _hand_over(self.run.lanes, "drafter")  # vout.feats were written on the target's stream
            with self.run.lanes.drafter_ctx():
                new = torch.cat([self.pending_feats, new], 1)
        self.pending_feats = new


class D3DSeqMode(Mode):
    """Standalone drafter, drafted after each verify (no overlap: isolates what asynchrony buys)."""

    drafter_kind = "d3d"

    def __init__(self, run: Run, drafter):
        super().__init__(run, drafter)
        self.pending_ctx: list = []  # committed tokens the drafter has not seen yet

    def finish_prefill(self, prompt_ids, out):
        with self.run.lanes.drafter_ctx(), self.run.rec.span("drafter", "prefill", -1):  # the cache is written where drafts read it
            d3d_prefill(self.drafter, self.cache, prompt_ids)
        self.run.n_draft_fwd += 1

    def draft(self, rnd, anchor):
        ctx, self.pending_ctx = self.pending_ctx, []
        return self._timed_draft("draft", rnd, lambda: d3d_draft(self.drafter, self.cache, ctx, anchor, self.run.cfg, self.run.gen_d)), "draft"

    def after_verify(self, rd, anchor, drafts, vout):
        self.pending_ctx += [anchor] + drafts[: rd.accepted]


class D3DAsyncMode(Mode):
    """Standalone drafter on its own lane: while the target verifies block k, one packed forward
    drafts the successor block for the H likeliest outcomes (a, t). A hit is verified next at
    once; a miss costs a synchronous draft from the bonus token."""

    drafter_kind = "d3d"
    concurrent = True

    def __init__(self, run: Run, drafter):
        super().__init__(run, drafter)
        self.ready: Optional[Draft] = None  # the hit hypothesis's drafted block
        self.packed = None  # future of this round's packed pass
        self._prefill = None
        self.pending_ctx: list = []  # anchors of skipped rounds (no packed pass committed them)
        self.hits = self.rounds = 0

    def draft_cost(self):
        """A block costs a synchronous draft only after a miss: the draft cost times the miss rate so
        far (even odds before the first verdict). Counted from the trace's own rounds: deterministic."""
        return self.run.costs.draft_cost("d3d", self._layers()) * (1.0 - (self.hits + 1) / (self.rounds + 2))

    def start_prefill(self, prompt_ids):
        def work():  # needs nothing from the target, so it runs while the target prefills
            with self.run.rec.span("drafter", "prefill", -1):
                d3d_prefill(self.drafter, self.cache, prompt_ids)

        self._prefill = self.run.lanes.submit(work)

    def finish_prefill(self, prompt_ids, out):
        self._prefill.result()
        self.run.n_draft_fwd += 1

    def has_ready_draft(self):
        return self.ready is not None

    def draft(self, rnd, anchor):
        if self.ready is not None:
            d, self.ready = self.ready, None
            return d, "packed_draft"
        kind = "sync_draft" if rnd > 0 else "draft"  # the packed passes committed the context, skipped rounds aside
        ctx, self.pending_ctx = self.pending_ctx, []
        with self.run.solo():  # nothing runs on the target lane meanwhile
            return self._timed_draft(kind, rnd, lambda: d3d_draft(self.drafter, self.cache, ctx, anchor, self.run.cfg, self.run.gen_d,
                                                                  self.run.cfg.hypotheses)), kind

    def during_verify(self, rnd, anchor, draft):
        if draft is None:  # a skipped round: nothing to draft successors from
            self.packed = None
            return

        def work():
            with self.run.rec.span("drafter", "packed_draft", rnd):
                return d3d_packed(self.drafter, self.cache, anchor, draft, self.run.cfg, self.run.gen_d)

        self.packed = self.run.lanes.submit(work)

    def after_verify(self, rd, anchor, drafts, vout):
        if self.packed is None:
            self.pending_ctx.append(anchor)
            return
        pr, self.packed = self.packed.result(), None
        self.run.n_draft_fwd += 1
        with self.run.lanes.drafter_ctx():  # every drafter-cache op stays on the drafter's stream (CUDA ordering)
            self.drafter.commit_kv(self.cache, pr.new_kv, rd.accepted + 1)  # x_s, d_1..d_a are committed now
        rd.hit = False
        for (ha, ht, hs), hd in zip(pr.hyps, pr.drafts):
            hit = ha == rd.accepted and ht == rd.bonus
            rd.hypotheses.append(Hypothesis(ha, ht, hs, list(hd.ids), hit))
            if hit:
                rd.hit, self.ready = True, hd
        self.rounds += 1
        self.hits += int(rd.hit)


STRATEGIES = {"ar": Mode, "dflash": DFlashMode, "d3d-seq": D3DSeqMode, "d3d-async": D3DAsyncMode}
DRAFTER_CLASSES = {"dflash": DFlashDrafter, "d3d": D3DDrafter}
assert set(STRATEGIES) == set(MODES)


def _stats(trace: Trace, n_t: int, n_d: int, prefill_s: float, decode_s: float, wall_s: float) -> Stats:
    rounds = trace.rounds
    n_tok = len(trace.output_ids)
    with_h = [r for r in rounds if r.hit is not None]
    busy = lambda lane: sum(sp.duration for sp in trace.spans if sp.lane == lane) / 1e3  # noqa: E731
    return Stats(
        tau=(sum(r.accepted + 1 for r in rounds) / len(rounds)) if rounds else 0.0,
        tokens_per_s=((n_tok - 1) / decode_s) if decode_s > 0 and n_tok > 1 else 0.0,
        target_forwards=n_t,
        drafter_forwards=n_d,
        hit_rate=(sum(bool(r.hit) for r in with_h) / len(with_h)) if with_h else None,
        overlap=overlap_share(trace.spans) if trace.mode == "d3d-async" else (0.0 if trace.mode != "ar" else None),
        wall_time_s=wall_s,
        prefill_time_s=prefill_s,
        decode_time_s=decode_s,
        n_rounds=len(rounds),
        n_tokens=n_tok,
        target_busy_s=busy("target"),
        drafter_busy_s=busy("drafter"),
    )
