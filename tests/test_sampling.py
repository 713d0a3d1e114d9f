"""Temperature > 0: the output distribution equals the target's (chi-square, fixed seed)."""

import pytest
import torch
from scipy.stats import chisquare

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.sampling import accept_match, accept_rejection, probs


def _chi2(counts: dict, expected: dict, n: int) -> float:
    """p-value, bins with expected count < 5 merged into one."""
    big = [k for k, p in expected.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [expected[k] * n for k in big]
    rest_o = n - sum(obs)
    rest_e = n - sum(exp)
    if rest_e > 1e-6 * n:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)  # float rounding: make the totals agree exactly
    return chisquare(obs, [e * scale for e in exp]).pvalue


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_verify_rules_sample_the_target_distribution(rule):
    """One verify step on synthetic p, q: the first committed token ~ p_1 exactly."""
    g = torch.Generator().manual_seed(0)
    V, B, T = 6, 3, 1.0
    tl = torch.randn(B, V, generator=g) * 1.5  # target logits
    q = torch.softmax(torch.randn(B - 1, V, generator=g), -1)  # drafter distributions
    p1 = probs(tl, T)[0]
    n = 6000
    counts: dict = {}
    for _ in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(B - 1)]
        if rule == "match":
            v = accept_match(drafts, tl, T, g)
        else:
            v = accept_rejection(drafts, q, tl, T, g)
        first = drafts[0] if v.accepted >= 1 else v.bonus
        counts[first] = counts.get(first, 0) + 1
    assert _chi2(counts, {i: float(p1[i]) for i in range(V)}, n) > 1e-3


def _exact_second_token_dist(bundle, prompt_ids, T):
    """P(output[1]) = sum_t0 p(t0 | prompt) p(t1 | prompt, t0)."""
    m = bundle.target.model
    with torch.no_grad():
        p0 = torch.softmax(m(torch.tensor([prompt_ids])).logits[0, -1] / T, -1)
        V = p0.shape[0]
        batch = torch.tensor([prompt_ids + [t] for t in range(V)])
        p1 = torch.softmax(m(batch).logits[:, -1] / T, -1)  # (V, V)
    return (p0[:, None] * p1).sum(0)


def _assert_second_token_matches_target(toy, mode, rule, drafter=None, n=600, costs=None):
    """Chi-square: the engine's second output token over n seeds vs the target's exact distribution."""
    T = 1.0
    ids = toy.tokenizer.encode_prompt("ab")
    exact = _exact_second_token_dist(toy, ids, T)
    counts: dict = {}
    for seed in range(n):
        tr = decode(toy, ids, DecodeConfig(mode=mode, temperature=T, sampling=rule, seed=seed, max_new_tokens=2, block_size=3,
                                           stop_at_eos=False), drafter=drafter, costs=costs)
        counts[tr.output_ids[1]] = counts.get(tr.output_ids[1], 0) + 1
    assert _chi2(counts, {i: float(exact[i]) for i in range(exact.shape[0])}, n) > 1e-3


@pytest.mark.parametrize("mode", ["d3d-async", "dflash"])
@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_engine_output_distribution_matches_target(toy, mode, rule):
    _assert_second_token_matches_target(toy, mode, rule)


def test_sampling_is_seeded(toy):
    cfg = DecodeConfig(mode="d3d-async", temperature=0.8, sampling="rejection", seed=5, max_new_tokens=30)
    a = decode(toy, "hello", cfg)
    b = decode(toy, "hello", cfg)
    assert a.output_ids == b.output_ids
    others = [decode(toy, "hello", cfg.with_(seed=s)).output_ids for s in range(6, 10)]
    assert any(o != a.output_ids for o in others)  # the seed actually drives sampling


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_shortlisted_drafter_still_samples_the_target_distribution(toy, rule):
    """A drafter restricted to half the vocabulary (q = 0 elsewhere) keeps the output exact."""
    V = toy.target.arch.vocab_size
    d = toy.drafter("d3d").shortlisted(range(0, V, 2))
    _assert_second_token_matches_target(toy, "d3d-seq", rule, drafter=d)


@pytest.mark.parametrize("mode", ["d3d-seq", "d3d-async"])
def test_anchor_first_draft_still_samples_the_target_distribution(toy, mode):
    """Draft 1 read from the anchor slot (first_draft='anchor') keeps rejection sampling exact."""
    _assert_second_token_matches_target(toy, mode, "rejection", drafter=toy.drafter("d3d").with_first_draft("anchor"))
