"""Host syncs of the decode loop (issue 34, item 5): what the loop needs on the host comes back through
``sampling.to_host`` only — once per verify (the target lane) and once per drafter forward (the drafter lane) — and
nothing of the vocabulary's size or any other read of a tensor happens in the engine, the verify rules or the drafters.

On this CPU-only suite "a read" is what makes the host wait for the stream on a GPU: ``Tensor.item / tolist / cpu /
numpy`` and ``int() / float() / bool()`` of a tensor. A ``TorchFunctionMode`` in both lanes' threads catches every one
called from engine.py, sampling.py or the drafters' files (models/layers.py, drafter.py, d3d.py, dflash.py, adapter.py) outside ``to_host``. On a machine with CUDA the last test runs the
decodes there under CUDA's own sync detector.

Per lane and round, on a GPU (``_eager_tops``), before -> after this change: target lane, T = 0 one wait for the verify's
tokens (unchanged count, but the B x V probabilities no longer cross); T > 0 (match) 2-3 -> 1; T > 0 (rejection) a
B x V copy + per-position reads -> 1. Drafter lane: 2-3 reads per drafted block + a blocking copy of each of ids,
positions, mask and ``int(positions.max())`` (4-5 waits more) -> 1 per drafter forward, the packed pass's H blocks
and the hypotheses of each included. A d3d-async round after a miss runs two drafter forwards (the synchronous draft,
then the packed pass): two waits, one each.
"""

import sys
import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from d3d_core.decoding import engine, sampling, timing
from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.sampling import accept_rejection, probs, sample

MINE = ("d3d_core/decoding/engine.py", "d3d_core/decoding/sampling.py", "d3d_core/models/layers.py", "d3d_core/models/drafter.py",
        "d3d_core/models/d3d.py", "d3d_core/models/dflash.py", "d3d_core/models/adapter.py")
READS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}
TARGET_CALLERS = {"accept_match", "accept_rejection", "_prefill"}
DRAFTER_CALLERS = {"_drafts_from_hidden", "_read_tops"}


class _Reads(TorchFunctionMode):
    """Records each tensor read whose caller (the first frame outside torch) is one of MINE."""

    def __init__(self, log: "Log"):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS and not self.log.inside():
            f = sys._getframe(1)
            while f is not None and "/torch/" in f.f_code.co_filename:
                f = f.f_back
            if f is not None and f.f_code.co_filename.endswith(MINE):
                self.log.raw.append((f.f_code.co_filename.rsplit("/", 1)[-1], f.f_lineno, func.__name__))
        return func(*args, **(kwargs or {}))


class Log:
    def __init__(self):
        self.calls, self.raw, self._tls = [], [], threading.local()

    def inside(self) -> bool:
        return getattr(self._tls, "inside", False)

    def lane(self, lane: str) -> int:
        return sum(1 for c in self.calls if c == lane)


@pytest.fixture
def reads(monkeypatch):
    """Count ``to_host`` calls per lane (from the caller's name) and catch every other read, in both threads."""
    log = Log()
    real = sampling.to_host

    def to_host(*tensors):
        caller = sys._getframe(1).f_code.co_name
        lane = "target" if caller in TARGET_CALLERS else "drafter" if caller in DRAFTER_CALLERS else caller
        log.calls.append(lane)
        log._tls.inside = True
        try:
            return real(*tensors)
        finally:
            log._tls.inside = False

    monkeypatch.setattr(sampling, "to_host", to_host)
    real_submit = timing.Lanes.submit

    def submit(self, fn, *args):
        def watched(*a):
            with _Reads(log):
                return fn(*a)

        return real_submit(self, watched, *args)

    monkeypatch.setattr(timing.Lanes, "submit", submit)
    return log


def _decode(toy, log, cfg):
    with _Reads(log):
        return decode(toy, "hello there, how are you?", cfg)


CASES = [(0.0, "match"), (1.0, "match"), (1.0, "rejection")]


@pytest.mark.parametrize("temperature, rule", CASES)
@pytest.mark.parametrize("mode", ["ar", "dflash", "d3d-seq", "d3d-async"])
def test_one_read_per_verify_and_per_drafter_forward(toy, reads, monkeypatch, mode, temperature, rule):
    """The GPU's policy (``_eager_tops``: the hypotheses' candidates come back with each drafted block): the target lane
    reads once per verify (and once after prefill), the drafter lane once per drafter forward; nothing else reads."""
    monkeypatch.setattr(engine, "_eager_tops", lambda device: True)
    cfg = DecodeConfig(mode=mode, temperature=temperature, sampling=rule, max_new_tokens=24, block_size=4, hypotheses=3,
                       stop_at_eos=False, seed=1)
    tr = _decode(toy, reads, cfg)
    assert reads.raw == [], reads.raw[:10]
    assert set(reads.calls) <= {"target", "drafter"}, set(reads.calls)
    rounds = tr.rounds
    assert reads.lane("target") == 1 + len(rounds)  # the first token, then one per verify
    drafted = sum(r.draft_source in ("draft", "sync_draft") for r in rounds)  # a synchronous drafter forward
    packed = sum(r.draft_source != "skipped" for r in rounds) if mode == "d3d-async" else 0  # one packed pass per verified block
    assert reads.lane("drafter") == drafted + packed
    assert tr.stats.drafter_forwards == drafted + packed + (mode.startswith("d3d"))  # + the drafter's prefill, which reads nothing
    if mode == "d3d-async":  # one per round and lane, but for a round that drafts synchronously (the first, one after a miss)
        assert packed == len(rounds) and reads.lane("drafter") == len(rounds) + drafted
    else:
        assert reads.lane("drafter") <= len(rounds)


def test_a_hits_block_brings_its_hypotheses_with_it(toy, reads, monkeypatch):
    """After a hit the packed pass's own block is verified next: its hypotheses' candidates came back with it, so that
    round's drafter lane reads once (its packed pass) and nothing else."""
    monkeypatch.setattr(engine, "_eager_tops", lambda device: True)
    cfg = DecodeConfig(mode="d3d-async", temperature=1.0, max_new_tokens=24, block_size=4, hypotheses=8, stop_at_eos=False, seed=1)
    with _Reads(reads):
        tr = decode(toy, "abc abc abc", cfg)
    assert reads.raw == []
    hits = sum(r.draft_source == "packed_draft" for r in tr.rounds)
    assert hits > 0
    assert reads.lane("drafter") == len(tr.rounds) + (len(tr.rounds) - hits)  # a packed pass each, a sync draft but after a hit


def test_on_the_cpu_the_packed_pass_reads_the_verified_blocks_candidates_alone(toy, reads):
    """The CPU's policy: a packed pass forms the hypotheses of the one block being verified (a read that costs no wait
    there) instead of top-k over all H drafted blocks: one read more per packed pass, none anywhere else."""
    cfg = DecodeConfig(mode="d3d-async", max_new_tokens=24, block_size=4, hypotheses=3, stop_at_eos=False)
    tr = _decode(toy, reads, cfg)
    assert reads.raw == []
    packed = sum(r.draft_source != "skipped" for r in tr.rounds)
    drafted = sum(r.draft_source in ("draft", "sync_draft") for r in tr.rounds)
    assert reads.lane("drafter") == drafted + 2 * packed


@pytest.mark.parametrize("temperature, rule", CASES)
def test_eager_and_lazy_hypotheses_decode_alike(toy, monkeypatch, temperature, rule):
    """The GPU's and the CPU's policy form the same hypotheses and emit the same tokens."""
    cfg = DecodeConfig(mode="d3d-async", temperature=temperature, sampling=rule, max_new_tokens=32, block_size=5, hypotheses=4,
                       stop_at_eos=False, seed=2)
    lazy = decode(toy, "abc abc abc", cfg)
    monkeypatch.setattr(engine, "_eager_tops", lambda device: True)
    eager = decode(toy, "abc abc abc", cfg)
    assert eager.output_ids == lazy.output_ids
    for a, b in zip(eager.rounds, lazy.rounds):
        assert [(h.accepted, h.token, h.draft_ids, h.hit) for h in a.hypotheses] == [(h.accepted, h.token, h.draft_ids, h.hit) for h in b.hypotheses]
        assert [h.score for h in a.hypotheses] == pytest.approx([h.score for h in b.hypotheses], rel=1e-5)


def test_to_host_on_the_cpu_is_tolist():
    a, b = torch.tensor([3, 1, 2]), torch.tensor(0.5)
    assert sampling.to_host(a, b) == [[3, 1, 2], 0.5]


def test_sample_draws_what_multinomial_draws():
    """``sample`` is multinomial's one-sample draw without its checks: same tokens from the same generator state."""
    for s in range(20):
        p = torch.softmax(3 * torch.randn(3, 50, generator=torch.Generator().manual_seed(100 + s)), -1)
        g1, g2 = torch.Generator().manual_seed(s), torch.Generator().manual_seed(s)
        assert torch.equal(torch.multinomial(p, 1, generator=g1).squeeze(-1), sample(p, g2))
        assert torch.rand((), generator=g1).item() == torch.rand((), generator=g2).item()


def _rejection_loop(drafts, q, target_logits, temperature, gen):
    """The rejection sampler as it read the device before (a loop over positions, one uniform each): the reference."""
    p = probs(target_logits, temperature)
    for j, d in enumerate(drafts):
        pj, qj = p[j, d].item(), q[j, d].item()
        r = torch.rand((), generator=gen).item()
        if qj > 0 and r < min(1.0, pj / qj):
            continue
        resid = torch.clamp(p[j] - q[j], min=0)
        s = resid.sum()
        resid = resid / s if s > 0 else p[j]
        return j, int(torch.multinomial(resid, 1, generator=gen).item())
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen).item())


def test_one_pass_rejection_equals_the_loop_where_both_draw_the_same_numbers():
    """The one-pass sampler draws the B-1 uniforms at once. Where the loop drew them all too (every draft accepted, or
    the first rejection at the last draft) the verdict is the same, token for token; elsewhere only the generator's
    later stream differs (the chi-square tests in test_sampling check the distribution)."""
    V, B, same = 7, 4, 0
    for s in range(300):
        g = torch.Generator().manual_seed(s)
        tl = torch.randn(B, V, generator=g)
        q = torch.softmax(tl[: B - 1] + 0.3 * torch.randn(B - 1, V, generator=g), -1)
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(B - 1)]
        ref = _rejection_loop(drafts, q, tl, 1.0, torch.Generator().manual_seed(1000 + s))
        v = accept_rejection(drafts, q, tl, 1.0, torch.Generator().manual_seed(1000 + s))
        assert v.target_ids == probs(tl, 1.0).argmax(-1).tolist()
        if ref[0] >= B - 2:
            assert (v.accepted, v.bonus) == ref, s
            same += 1
    assert same > 50


def test_stream_hand_overs_come_before_the_other_lane_reads(toy, monkeypatch):
    """Where a lane's tensor crosses over (the drafter's q into rejection sampling; the target's features into a DFlash
    draft), the receiving stream waits for the giving one (``_hand_over``) before the reader is queued — for q, before
    the packed pass lands on the drafter's stream. A no-op on the CPU: recorded here through the call order."""
    events = []
    real = engine._hand_over
    monkeypatch.setattr(engine, "_hand_over", lambda lanes, to: (events.append(("hand_over", to)), real(lanes, to)))
    for name in ("during_verify", "draft"):
        for cls in (engine.D3DAsyncMode, engine.DFlashMode):
            orig = getattr(cls, name)
            monkeypatch.setattr(cls, name, lambda self, *a, _o=orig, _n=name: (events.append((_n,)), _o(self, *a))[1])
    cfg = DecodeConfig(mode="d3d-async", temperature=1.0, sampling="rejection", max_new_tokens=16, block_size=4, hypotheses=2,
                       stop_at_eos=False, drafting="always")
    decode(toy, "hi", cfg)
    for i, e in enumerate(events):
        if e == ("during_verify",):
            assert events[i - 1] == ("hand_over", "target"), events[max(0, i - 3): i + 1]
    events.clear()
    decode(toy, "hi", cfg.with_(mode="dflash"))
    drafts = [i for i, e in enumerate(events) if e == ("draft",)]
    assert drafts and all(events[i + 1] == ("hand_over", "drafter") for i in drafts)  # inside draft(), before the pass


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "waits for", other.name))


def test_hand_over_orders_the_receiving_stream_on_cuda_only():
    log = []

    class L:
        cuda, target_stream, drafter_stream = True, _Stream("target", log), _Stream("drafter", log)

    engine._hand_over(L, "target")
    engine._hand_over(L, "drafter")
    assert log == [("target", "waits for", "drafter"), ("drafter", "waits for", "target")]
    L.drafter_stream = L.target_stream  # one stream (dflash, d3d-seq): nothing to order
    L.cuda = False
    engine._hand_over(L, "target")
    assert len(log) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature, rule", CASES)
def test_on_cuda_no_sync_outside_to_host_and_lossless(temperature, rule, monkeypatch):
    """On a GPU: CUDA's sync detector (``set_sync_debug_mode('warn')``) sees no synchronising call from engine.py,
    sampling.py or the drafters' files except ``to_host``'s one wait, and every mode emits ar's tokens at T = 0."""
    import warnings

    from d3d_core.models.bundles import get_bundle

    toy = get_bundle("toy", "cuda")
    here = sampling.to_host.__code__
    lines = range(here.co_firstlineno, here.co_firstlineno + 40)
    outs = {}
    for mode in ("ar", "dflash", "d3d-seq", "d3d-async"):
        cfg = DecodeConfig(mode=mode, temperature=temperature, sampling=rule, max_new_tokens=24, block_size=4, hypotheses=3,
                           stop_at_eos=False)
        decode(toy, "hello there", cfg)  # warm: one-time allocations and tables
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs[mode] = decode(toy, "hello there", cfg).output_ids
        finally:
            torch.cuda.set_sync_debug_mode("default")
        bad = [(w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message)
               and w.filename.endswith(MINE) and not (w.filename.endswith("sampling.py") and w.lineno in lines)]
        assert bad == [], (mode, bad[:5])
    if temperature == 0:
        assert all(o == outs["ar"] for o in outs.values()), outs
