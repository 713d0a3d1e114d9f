"""The packed hypothesis pass equals drafting each hypothesis block alone."""

import torch

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import d3d_draft, d3d_packed, d3d_prefill, decode, make_hypotheses
from d3d_core.models import fastops


@fastops.exact  # int8 activation scales are per GEMM, so in int8 hypotheses share one; the mask logic is what is tested
def test_packed_pass_equals_each_hypothesis_alone(toy):
    drafter = toy.drafter("d3d")
    B, H = 8, 6
    cfg = DecodeConfig(block_size=B, hypotheses=H)
    g = torch.Generator().manual_seed(0)
    prompt = toy.tokenizer.encode_prompt("hello there, how are you?")
    cache = drafter.new_cache()
    d3d_prefill(drafter, cache, prompt)
    anchor = 7
    draft = d3d_draft(drafter, cache, [], anchor, cfg, g)
    packed = d3d_packed(drafter, cache, anchor, draft, cfg, g)
    assert len(packed.hyps) == H
    ctx = [anchor] + draft.ids
    for (a, t, _), pd in zip(packed.hyps, packed.drafts):
        # alone: a fresh copy of the committed cache, the provisional context up to s+a, then block [t, MASK..]
        alone_cache = drafter.new_cache()
        d3d_prefill(drafter, alone_cache, prompt)
        alone = d3d_draft(drafter, alone_cache, ctx[: a + 1], t, cfg, g)
        assert torch.allclose(pd.q, alone.q, atol=1e-4), (a, t, (pd.q - alone.q).abs().max())
        assert pd.ids == alone.ids
    # the packed provisional KV equals the KV the context stream writes alone
    ref_cache = drafter.new_cache()
    d3d_prefill(drafter, ref_cache, prompt + ctx)
    for i, (k, v) in enumerate(packed.new_kv):
        rk, rv = ref_cache.get(i)
        assert torch.allclose(k, rk[:, :, len(prompt):], atol=1e-4)
        assert torch.allclose(v, rv[:, :, len(prompt):], atol=1e-4)


def test_hypotheses_are_scored_and_sorted():
    V, B = 10, 4
    q = torch.softmax(torch.randn(B, V, generator=torch.Generator().manual_seed(1)), -1)
    from d3d_core.decoding.engine import Draft

    d = Draft(q[: B - 1].argmax(-1).tolist(), q)
    hyps = make_hypotheses(d, B, 5)
    scores = [s for _, _, s in hyps]
    assert scores == sorted(scores, reverse=True)
    for a, t, _ in hyps:
        assert 0 <= a <= B - 1
        if a < B - 1:
            assert t != d.ids[a]  # a rejection means the target disagreed with d_{a+1}
    # all candidate outcomes together: probabilities sum to ~1 when H covers everything
    allh = make_hypotheses(d, B, V * B)
    assert abs(sum(s for _, _, s in allh) - 1.0) < 1e-4


def test_async_has_hits_and_misses(toy):
    hits = misses = 0
    for p in ["what is two plus two?", "abc abc abc", "tell me a story"]:
        tr = decode(toy, p, DecodeConfig(mode="d3d-async", max_new_tokens=60, block_size=4, hypotheses=16))
        hits += sum(1 for r in tr.rounds if r.hit)
        misses += sum(1 for r in tr.rounds if r.hit is False)
        # a hit's hypothesis draft is the next round's block
        for r, nxt in zip(tr.rounds, tr.rounds[1:]):
            if r.hit:
                h = [h for h in r.hypotheses if h.hit][0]
                assert nxt.draft_source == "packed_draft" and nxt.draft_ids == h.draft_ids
            else:
                assert nxt.draft_source == "sync_draft"
    assert hits > 0 and misses > 0
