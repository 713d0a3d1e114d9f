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
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional, Union

import torch

from .config import DecodeConfig
from .drafters import D3DDrafter, DFlashDrafter, KVCache
from .sampling import accept_greedy, accept_match, accept_rejection, choose, probs
from .timing import Lanes, Recorder, cpu_threads
from .trace import Hypothesis, Round, Stats, Trace, overlap_share


@dataclass
class Draft:
    ids: list  # d_1..d_{B-1}
    q: torch.Tensor  # (B-1 [+1 lookahead], V) drafter distributions (temperature-scaled when T > 0)

    @property
    def probs(self) -> list:
        return [float(self.q[j, d]) for j, d in enumerate(self.ids)]


@dataclass
class PackedResult:
    hyps: list  # [(a, t, score)]
    drafts: list  # Draft per hypothesis
    new_kv: list  # provisional context KV of [x_s, d_1..d_{B-1}] per drafter layer


# ----------------------------------------------------------------------------- drafting


def _drafts_from_hidden(drafter, h_blocks: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator) -> list:
    """h_blocks: (nb, L, H) -> one Draft per block (positions 1..L-1)."""
    logits = drafter.logits(h_blocks[:, 1:]).float()  # (nb, L-1, V)
    out = []
    B = cfg.block_size
    for b in range(logits.shape[0]):
        q = probs(logits[b], cfg.temperature).cpu()
        ids = choose(logits[b, : B - 1], cfg.temperature, gen).tolist()
        out.append(Draft(ids, q))
    return out


@torch.inference_mode()
def d3d_draft(drafter: D3DDrafter, cache: KVCache, ctx_ids: list, anchor: int, cfg: DecodeConfig, gen) -> Draft:
    """Commit ctx_ids to the drafter's context and draft the block after them (one forward).
    The D3D block carries one extra mask slot (position s+B): the drafter's guess one past
    the block, used by the a = B-1 hypothesis of d3d-async."""
    ctx = torch.tensor(ctx_ids, dtype=torch.long, device=drafter.device)
    _, h_blocks, new_kv = drafter.forward_packed(cache, ctx, [(anchor, len(ctx_ids))], cfg.block_size + 1)
    drafter.commit_kv(cache, new_kv, len(ctx_ids))
    return _drafts_from_hidden(drafter, h_blocks, cfg, gen)[0]


@torch.inference_mode()
def d3d_prefill(drafter: D3DDrafter, cache: KVCache, prompt_ids: list) -> None:
    ctx = torch.tensor(prompt_ids, dtype=torch.long, device=drafter.device)
    _, _, new_kv = drafter.forward_packed(cache, ctx, [], 1)
    drafter.commit_kv(cache, new_kv, len(prompt_ids))


def make_hypotheses(draft: Draft, B: int, H: int) -> list:
    """The H most likely (a, t) outcomes of verifying [x_s, d_1..d_{B-1}], scored with the
    drafter's own distributions: P(a, t) ~ prod_{j<=a} q_j(d_j) * (1 - q_{a+1}(d_{a+1})) *
    q~_{a+1}(t), where q~ is q_{a+1} without d_{a+1}; for a = B-1, t comes from the
    lookahead slot q_B. Returns [(a, t, score)] best first."""
    q = draft.q
    eps = 1e-12
    d = draft.ids
    pd = torch.tensor([float(q[j, d[j]]) for j in range(B - 1)])
    prefix = torch.cat([torch.zeros(1), torch.cumsum(torch.log(pd + eps), 0)])  # prefix[a] = sum_{j<a+1..}
    cands = []
    for a in range(B - 1):
        row = q[a].clone()
        p_rej = 1.0 - float(row[d[a]])
        row[d[a]] = 0.0
        s = row.sum()
        if s <= 0:
            continue
        row = row / s
        top = torch.topk(row, min(H, row.numel()))
        base = float(prefix[a]) + math.log(max(p_rej, eps))
        for p, t in zip(top.values.tolist(), top.indices.tolist()):
            cands.append((base + math.log(p + eps), a, t))
    if q.shape[0] >= B:  # lookahead slot present (D3D)
        top = torch.topk(q[B - 1], min(H, q.shape[1]))
        base = float(prefix[B - 1])
        for p, t in zip(top.values.tolist(), top.indices.tolist()):
            cands.append((base + math.log(p + eps), B - 1, t))
    cands.sort(key=lambda c: -c[0])
    return [(a, t, math.exp(s)) for s, a, t in cands[:H]]


@torch.inference_mode()
def d3d_packed(drafter: D3DDrafter, cache: KVCache, anchor: int, draft: Draft, cfg: DecodeConfig, gen) -> PackedResult:
    """While the target verifies [anchor, d_1..d_{B-1}]: ONE forward holding the block as
    provisional causal context plus H hypothesis blocks, each anchored at s+a+1 and seeing
    the provisional context up to s+a (4-D mask, no hypothesis sees another)."""
    B = cfg.block_size
    hyps = make_hypotheses(draft, B, cfg.hypotheses)
    ctx = torch.tensor([anchor] + draft.ids, dtype=torch.long, device=drafter.device)
    _, h_blocks, new_kv = drafter.forward_packed(cache, ctx, [(t, a + 1) for a, t, _ in hyps], B + 1)
    drafts = _drafts_from_hidden(drafter, h_blocks, cfg, gen) if hyps else []
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


def decode(bundle, prompt, cfg: DecodeConfig = DecodeConfig(), cancel: Optional[Callable[[], bool]] = None, drafter=None) -> Trace:
    trace = None
    for trace in iter_decode(bundle, prompt, cfg, cancel=cancel, drafter=drafter):
        pass
    return trace


def iter_decode(bundle, prompt, cfg: DecodeConfig = DecodeConfig(), cancel=None, drafter=None) -> Iterator[Trace]:
    """Decode ``prompt`` with ``cfg.mode``. Yields the same Trace object after prefill and
    after each round; the last yield is complete (stats, spans, finish_reason).
    ``drafter`` overrides the bundle's drafter of the mode's kind (e.g. a pruned copy).
    ``cancel``: a callable or threading.Event; checked before every round."""
    cfg = cfg.validated()
    text, prompt_ids = prepare_prompt(bundle, prompt, cfg)
    mode = cfg.mode
    if drafter is None and mode != "ar":
        drafter = bundle.drafter("dflash" if mode == "dflash" else "d3d")
    if drafter is not None and mode != "ar":
        want = DFlashDrafter if mode == "dflash" else D3DDrafter
        if not isinstance(drafter, want):
            raise ValueError(f"mode {mode} needs a {want.__name__}, got {type(drafter).__name__}")
    is_cancelled = (cancel.is_set if hasattr(cancel, "is_set") else cancel) or (lambda: False)

    target = bundle.target
    device = target.device
    concurrent = mode == "d3d-async"
    threads = cfg.threads or (1 if (concurrent and device.type == "cpu") else torch.get_num_threads())
    trace = Trace(
        mode=mode, bundle=bundle.name, config=asdict(cfg), prompt_text=text, prompt_ids=prompt_ids,
        device=str(device),
    )
    lanes = Lanes(device, concurrent)
    try:
        with cpu_threads(threads) if device.type == "cpu" else contextlib.nullcontext():
            yield from _run(bundle, trace, cfg, drafter, lanes, is_cancelled)
    finally:
        lanes.close()


def _run(bundle, trace: Trace, cfg: DecodeConfig, drafter, lanes: Lanes, is_cancelled) -> Iterator[Trace]:
    mode, B = cfg.mode, cfg.effective_block
    target, tok = bundle.target, bundle.tokenizer
    eos = tok.eos_ids if cfg.stop_at_eos else frozenset()
    gen_t = torch.Generator().manual_seed(cfg.seed)  # target-side sampling (main thread)
    gen_d = torch.Generator().manual_seed(cfg.seed + 1)  # drafter-side sampling (drafter lane)
    rec = Recorder(target.device)
    wall0 = time.perf_counter()
    feat_layers = tuple(drafter.cfg.target_layer_ids) if mode == "dflash" else ()
    prompt = torch.tensor(trace.prompt_ids, dtype=torch.long)
    t_cache = target.new_cache()
    d_cache = drafter.new_cache() if drafter is not None else None
    n_target_fwd = n_draft_fwd = 0

    # ---- prefill (the standalone D3D drafter can prefill its context while the target does)
    d_prefill = None
    if mode == "d3d-async":
        def _dpre():
            with rec.span("drafter", "prefill", -1):
                d3d_prefill(drafter, d_cache, trace.prompt_ids)

        d_prefill = lanes.submit(_dpre)
    with lanes.target_ctx(), rec.span("target", "prefill", -1):
        out = target.prefill(t_cache, prompt, feat_layers)
        first = int(choose(out.logits[-1:], cfg.temperature, gen_t)[0])
    n_target_fwd += 1
    if d_prefill is not None:
        d_prefill.result()
        n_draft_fwd += 1
    elif mode == "d3d-seq":
        with rec.span("drafter", "prefill", -1):
            d3d_prefill(drafter, d_cache, trace.prompt_ids)
        n_draft_fwd += 1
    elif mode == "dflash":
        with rec.span("drafter", "prefill", -1), torch.inference_mode():
            drafter.extend_context(d_cache, out.feats)
    if lanes.cuda:
        torch.cuda.synchronize()
    t_decode0 = time.perf_counter()
    prefill_s = t_decode0 - wall0

    output = [first]
    trace.first_token = first
    trace.output_ids = output
    finish = ""
    if first in eos:
        finish = "eos"
    elif len(output) >= cfg.max_new_tokens:
        finish = "length"
    yield trace

    anchor, s = first, len(trace.prompt_ids)  # anchor token and its position
    pending_ctx: list = []  # d3d-seq: committed tokens the drafter has not seen yet
    pending_feats = None  # dflash: target features of committed tokens not yet in the drafter cache
    ready: Optional[Draft] = None  # d3d-async: the hit hypothesis's drafted block
    rnd = 0
    while not finish:
        if is_cancelled():
            finish = "cancelled"
            break
        # ---- draft this round's block (unless a hit already drafted it)
        draft, source = None, ""
        if mode != "ar":
            if ready is not None:
                draft, source = ready, "packed_draft"
                ready = None
            else:
                kind = "sync_draft" if (mode == "d3d-async" and rnd > 0) else "draft"
                with lanes.drafter_ctx(), rec.span("drafter", kind, rnd):
                    if mode == "dflash":
                        draft = dflash_draft(drafter, d_cache, pending_feats, anchor, cfg, gen_d)
                        pending_feats = None
                    else:
                        draft = d3d_draft(drafter, d_cache, pending_ctx, anchor, cfg, gen_d)
                        pending_ctx = []
                n_draft_fwd += 1
                source = kind
        drafts = draft.ids if draft is not None else []

        # ---- d3d-async: draft the successors while the target verifies
        packed = None
        if mode == "d3d-async":
            def _pk(anchor=anchor, draft=draft, rnd=rnd):
                with rec.span("drafter", "packed_draft", rnd):
                    return d3d_packed(drafter, d_cache, anchor, draft, cfg, gen_d)

            packed = lanes.submit(_pk)

        # ---- verify
        block = torch.tensor([anchor] + drafts, dtype=torch.long)
        with lanes.target_ctx(), rec.span("target", "verify", rnd):
            vout = target.verify(t_cache, block, feat_layers)
            if cfg.temperature <= 0:
                v = accept_greedy(drafts, vout.logits)
            elif cfg.sampling == "rejection" and drafts:
                v = accept_rejection(drafts, draft.q, vout.logits, cfg.temperature, gen_t)
            else:
                v = accept_match(drafts, vout.logits, cfg.temperature, gen_t)
            target.rollback(t_cache, len(drafts) - v.accepted)
        n_target_fwd += 1
        a, bonus = v.accepted, v.bonus

        # ---- commit a + 1 tokens (stop at max_new_tokens / EOS)
        committed = []
        for tkn in drafts[:a] + [bonus]:
            output.append(tkn)
            committed.append(tkn)
            if tkn in eos:
                finish = "eos"
                break
            if len(output) >= cfg.max_new_tokens:
                finish = "length"
                break

        # ---- bring the drafter's context up to date
        rd = Round(
            index=rnd, anchor_pos=s, anchor_id=anchor, draft_ids=list(drafts),
            draft_probs=draft.probs if draft is not None else [], target_ids=v.target_ids[: len(drafts) + 1],
            accepted=a, bonus=bonus, committed=committed, draft_source=source,
        )
        if mode == "dflash":
            pending_feats = vout.feats[:, : a + 1]  # anchor + accepted drafts, as the target saw them
        elif mode == "d3d-seq":
            pending_ctx = [anchor] + drafts[:a]
        elif mode == "d3d-async":
            pr = packed.result()
            n_draft_fwd += 1
            with lanes.drafter_ctx():  # every drafter-cache op stays on the drafter's stream (CUDA ordering)
                drafter.commit_kv(d_cache, pr.new_kv, a + 1)  # x_s, d_1..d_a are committed now
            rd.hit = False
            for (ha, ht, hs), hd in zip(pr.hyps, pr.drafts):
                hit = ha == a and ht == bonus
                rd.hypotheses.append(Hypothesis(ha, ht, hs, list(hd.ids), hit))
                if hit:
                    rd.hit = True
                    ready = hd
        trace.rounds.append(rd)
        s += a + 1
        anchor = bonus
        rnd += 1
        if not finish and s + B + 2 > target.max_positions:
            finish = "context"
        if finish:
            break
        yield trace

    # ---- close the run
    if lanes.cuda:
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    trace.spans = rec.finalize()
    trace.finish_reason = finish
    trace.output_text = tok.decode(output)
    trace.stats = _stats(trace, n_target_fwd, n_draft_fwd, prefill_s, t_end - t_decode0, t_end - wall0)
    yield trace


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
