"""Issue 33, item 1 (fair timing): a race's modes take turns round by round, paced by committed tokens; each mode's
times are its own (its clock stops while it waits), it runs with its own threads, d3d-async's drafter thread never
runs during another mode's turn, every shape a race meets is warmed beforehand, and every mode stays lossless."""

import contextlib
import time

import pytest
import torch

from d3d_core import service
from d3d_core.decoding import engine
from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.schedule import interleave, token_share
from d3d_core.decoding.trace import MODES
from d3d_core.decoding.warm import row_counts, warm_shapes
from d3d_core.models import fastops

PROMPTS = ["what is two plus two?", "write a short poem about rain", "count: 1, 2, 3"]


class _T:  # the little of a Trace that token_share reads
    def __init__(self, n, finish=""):
        self.output_ids, self.finish_reason = [0] * n, finish


def test_interleave_gives_the_turn_to_the_mode_furthest_behind():
    # "fast" commits 4 tokens a turn, "slow" 1: slow takes about four turns for each of fast's, ties go to the first
    def gen(step, n):
        k = 0
        while k < n:
            k = min(n, k + step)
            yield _T(k, "length" if k == n else "")

    order = [(m, len(t.output_ids), done) for m, t, done in interleave({"slow": gen(1, 8), "fast": gen(4, 8)}, token_share(8))]
    assert order == [("slow", 1, False), ("fast", 4, False), ("slow", 2, False), ("slow", 3, False), ("slow", 4, False),
                     ("slow", 5, False), ("fast", 8, False), ("fast", 8, True), ("slow", 6, False), ("slow", 7, False),
                     ("slow", 8, False), ("slow", 8, True)]


def _race(name, modes, base, sleep=0.0):
    """The race's items as (mode, trace, done, tokens of every mode just before that turn, modes finished before it)
    (a trace is one object updated in place: what it held at each turn is copied out here)."""
    seen, finished, out = {}, set(), []
    for m, tr, done in service.race(name, PROMPTS[2], modes, base):
        out.append((m, tr, done, dict(seen), frozenset(finished)))
        seen[m] = len(tr.output_ids)
        if tr.finish_reason:
            finished.add(m)
        if sleep:
            time.sleep(sleep)
    return out


def test_race_takes_turns_paced_by_tokens_and_streams_every_column_together(toy):
    base = service.settings("ar", 4, 0.0, 32, 2, drafting="always")
    items = _race("toy", list(MODES), base)
    turns = 0
    for m, tr, done, before, finished in items:
        if not done and len(before) == len(MODES) and m not in finished:  # all started: the one furthest behind goes
            live = {k: v for k, v in before.items() if k not in finished}
            assert before[m] == min(live.values()), (m, before, finished)
            turns += 1
    assert turns >= 20
    first_done = next(i for i, it in enumerate(items) if it[2])
    for m in MODES:  # every column grew before any mode finished: they race, not queue
        assert sum(1 for it in items[:first_done] if it[0] == m) >= 4, m
    final = {m: tr for m, tr, done, *_ in items if done}
    assert set(final) == set(MODES)
    for m in MODES:
        assert final[m].output_ids == final["ar"].output_ids, m
        assert final[m].finish_reason == "length" and final[m].load is not None


def test_each_mode_is_timed_on_its_own_clock(toy):
    """The caller sleeps 50 ms after each streamed item (as a UI renders): no mode's decode time may count it."""
    base = service.settings("ar", 4, 0.0, 16, 2, drafting="always")
    list(service.race("toy", PROMPTS[2], list(MODES), base))  # its warm-up is not what this test times
    t0 = time.perf_counter()
    items = _race("toy", list(MODES), base, sleep=0.05)
    elapsed = time.perf_counter() - t0
    slept = 0.05 * len(items)
    final = [tr for m, tr, done, *_ in items if done]
    own = sum(tr.stats.wall_time_s for tr in final)
    assert own <= elapsed - 0.9 * slept, (own, elapsed, slept)
    for tr in final:
        assert max(s.t_end for s in tr.spans) <= tr.stats.wall_time_s * 1e3 + 1.0  # spans on the same clock
        assert tr.stats.decode_time_s > 0


def test_a_decode_suspended_between_rounds_does_not_count_the_wait(toy):
    gen = engine.iter_decode(toy, PROMPTS[0], DecodeConfig(mode="d3d-seq", max_new_tokens=6, block_size=4, drafting="always"))
    t0 = time.perf_counter()
    n = 0
    for tr in gen:
        n += 1
        time.sleep(0.2)
    elapsed = time.perf_counter() - t0
    assert n >= 3 and tr.stats.wall_time_s < elapsed - 0.9 * 0.2 * n, (tr.stats.wall_time_s, elapsed, n)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two intra-op threads to tell the modes' settings apart")
def test_each_turn_runs_with_its_own_modes_threads(toy, monkeypatch):
    """d3d-async verifies on one thread (the drafter lane has the other core); ar on every core, even when its
    rounds alternate with d3d-async's."""
    everyone = torch.get_num_threads()
    seen = []
    verify = toy.target.verify

    def spy(cache, ids, feature_layers=()):
        seen.append((turn[0], ids.shape[0], torch.get_num_threads()))
        return verify(cache, ids, feature_layers)

    monkeypatch.setattr(toy.target, "verify", spy)
    turn = [None]
    cfg = DecodeConfig(max_new_tokens=12, block_size=4, hypotheses=2, drafting="always")
    steps = {m: engine.iter_decode(toy, PROMPTS[1], cfg.with_(mode=m)) for m in ("ar", "d3d-async")}

    def around(m):
        turn[0] = m
        return contextlib.nullcontext()

    list(interleave(steps, token_share(cfg.max_new_tokens), around=around))
    assert torch.get_num_threads() == everyone
    ar = {t for m, k, t in seen if m == "ar"}
    assert ar == {everyone}, seen
    assert {t for m, k, t in seen if m == "d3d-async"} == {1}, seen  # drafting="always": every verify has a draft beside it


def test_async_drafter_thread_never_runs_during_another_modes_turn(toy, monkeypatch):
    turns, packed = [], []
    real = engine.d3d_packed

    def timed(*a, **k):
        t = time.perf_counter()
        time.sleep(0.01)  # long enough that a pass left running past its turn would be seen
        out = real(*a, **k)
        packed.append((t, time.perf_counter()))
        return out

    monkeypatch.setattr(engine, "d3d_packed", timed)
    cfg = DecodeConfig(max_new_tokens=16, block_size=4, hypotheses=2, drafting="always")
    steps = {m: engine.iter_decode(toy, PROMPTS[1], cfg.with_(mode=m)) for m in ("ar", "d3d-async", "d3d-seq")}

    class Turn:
        def __init__(self, m):
            self.m = m

        def __enter__(self):
            self.t = time.perf_counter()

        def __exit__(self, *e):
            turns.append((self.m, self.t, time.perf_counter()))

    out = {m: tr for m, tr, done in interleave(steps, token_share(16), around=Turn) if done}
    assert len(packed) >= 3 and out["d3d-async"].output_ids == out["ar"].output_ids
    for a, b in packed:  # each packed pass lies inside one of d3d-async's own turns
        assert any(m == "d3d-async" and t0 <= a and b <= t1 for m, t0, t1 in turns), (a, b)


def _shapes(toy, monkeypatch):
    """Record (what, GEMM rows, threads) of every decode-time forward: target verifies, D3D drafts and packed passes
    (not the prefill's, whose length is the prompt's), DFlash block passes."""
    seen = set()
    t, d3d, dfl = toy.target, toy.drafter("d3d"), toy.drafter("dflash")
    verify, packed, blocks = t.verify, d3d.forward_packed, dfl.forward_blocks

    def v(cache, ids, feature_layers=()):
        seen.add(("verify", fastops.row_bucket(ids.shape[0]), torch.get_num_threads()))
        return verify(cache, ids, feature_layers)

    def p(cache, ctx, blocks_, block_len, *a, **k):
        if blocks_:
            seen.add(("d3d", fastops.row_bucket(ctx.shape[0] + len(blocks_) * block_len), len(blocks_), torch.get_num_threads()))
        return packed(cache, ctx, blocks_, block_len, *a, **k)

    def b(cache, anchors, block_len):
        seen.add(("dflash", fastops.row_bucket(len(anchors) * block_len), torch.get_num_threads()))
        return blocks(cache, anchors, block_len)

    monkeypatch.setattr(t, "verify", v)
    monkeypatch.setattr(d3d, "forward_packed", p)
    monkeypatch.setattr(dfl, "forward_blocks", b)
    return seen


@pytest.mark.parametrize("drafting", ["always", "gated"])
def test_warm_up_covers_every_shape_a_race_meets(toy, monkeypatch, drafting):
    """Every (forward, row count, threads) a race's modes run was run by ``warm_shapes`` for that configuration first:
    no mode pays a first use (oneDNN builds a kernel per row count and thread count) inside its timed rounds."""
    seen = _shapes(toy, monkeypatch)
    cfg = DecodeConfig(max_new_tokens=24, block_size=4, hypotheses=3, drafting=drafting)
    for m in MODES:
        warm_shapes(toy, cfg.with_(mode=m))
    warmed = set(seen)
    seen.clear()
    for prompt in PROMPTS:
        for m in MODES:
            engine.decode(toy, prompt, cfg.with_(mode=m))
    assert seen and seen <= warmed, sorted(seen - warmed)


def test_row_counts_keep_one_per_gemm_size():
    assert row_counts(1, 40) == list(range(1, 34))  # 33..40 all run at 48 rows
    rc = row_counts(9, 145)
    assert rc[:24] == list(range(9, 33)) and [fastops.row_bucket(m) for m in rc[24:]] == [48, 64, 80, 96, 112, 128, 192]
    assert len({fastops.row_bucket(m) for m in rc}) == len(rc)


@pytest.mark.slow
def test_interleaved_race_is_lossless_on_the_real_bundle(smollm):
    """The real bundle, three prompts, all four modes taking turns: every mode emits exactly ar's tokens, ar's are
    those of ar decoded alone, and the columns grow together (every mode streamed rounds before any finished)."""
    base = service.settings("ar", 8, 0.0, 32, 4)
    for prompt in ("A bakery sells muffins for $3 each and cookies for $2 each. Maya buys 4 muffins and 6 cookies. "
                   "How much does she spend? Please reason step by step.",
                   "Write a Python function `is_palindrome(s)` that ignores case and spaces, with two examples.",
                   "What are three good habits for learning a new language? Answer briefly."):
        items = list(service.race("smollm2-135m", prompt, list(MODES), base))
        first_done = next(i for i, (m, tr, done) in enumerate(items) if done)
        for m in MODES:
            assert sum(1 for mm, _, done in items[:first_done] if mm == m) >= 2, (m, prompt)
        final = {m: tr for m, tr, done in items if done}
        with service.on_engine(smollm, service.check_engine(None)):  # alone on the engine the race ran on (the app's default)
            alone = engine.decode(smollm, prompt, base.with_(mode="ar"))
        assert final["ar"].output_ids == alone.output_ids, prompt
        for m in MODES[1:]:
            assert final[m].output_ids == alone.output_ids, (m, prompt, final[m].output_text, alone.output_text)
