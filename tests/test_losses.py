"""The training recipe's levers on the toy bundle: dense anchors, the shortlisted head, soft labels."""

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import TRAIN_PROMPTS as PROMPTS
from conftest import training_examples

from d3d_core.models.bundles import BUNDLES
from d3d_core.models.loader import init_drafter
from d3d_core.training.losses import HeadLoss, SoftTargets, block_targets
from d3d_core.training.softlabels import SoftLabelCache, soft_rows, target_topk
from d3d_core.training.train import PRESETS, d3d_block_terms, d3d_loss, head_shortlist, sample_anchors, to_seq, train


@pytest.fixture(scope="module")
def examples(toy):
    return training_examples(toy, PROMPTS, 40)


@pytest.fixture(scope="module")
def drafter(toy):
    torch.manual_seed(0)
    d = init_drafter("d3d", toy.target, BUNDLES["toy"], num_layers=2, block_size=4)
    with torch.no_grad():  # a drafter that is not the target's copy, so the losses are not trivial
        for p in d.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.float()


def test_dense_anchors_are_every_response_position(examples):
    seq = to_seq(examples[0], 96)
    dense = sample_anchors(seq, 0, random.Random(0))
    assert dense == list(range(len(seq.prompt_ids), len(seq.ids) - 1))


def test_dense_anchor_loss_is_the_sum_of_per_anchor_losses(toy, drafter, examples):
    """One packed pass over every anchor gives exactly the per-anchor passes' summed losses:
    blocks see the context and their own block only, never each other."""
    cfg = replace(PRESETS["toy"], block_size=4)
    head = HeadLoss(drafter.cfg.arch.vocab_size)
    seq = to_seq(max(examples, key=lambda e: len(e["response_ids"])), 96)
    anchors = sample_anchors(seq, 0, random.Random(0))
    assert len(anchors) >= 20
    with torch.no_grad():
        _, _, dense_ce, dense_w, _ = d3d_block_terms(drafter, seq, anchors, cfg, head)
        parts = [d3d_block_terms(drafter, seq, [p], cfg, head) for p in anchors]
    assert torch.allclose(dense_ce, sum(p[2] for p in parts), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dense_w, sum(p[3] for p in parts))


def test_shortlisted_loss_equals_full_when_the_shortlist_is_the_vocabulary(toy, drafter, examples):
    V = drafter.cfg.arch.vocab_size
    seq = to_seq(examples[2], 96)
    anchors = sample_anchors(seq, 6, random.Random(1))
    cfg = replace(PRESETS["toy"], block_size=4, ar_positions=0)
    full = d3d_loss(drafter, seq, anchors, cfg, random.Random(5), head=HeadLoss(V))[0]
    listed = d3d_loss(drafter, seq, anchors, cfg, random.Random(5), head=HeadLoss(V, range(V), other_samples=64))[0]
    assert torch.allclose(full, listed, rtol=1e-6, atol=1e-6)
    # and the full head is the plain cross-entropy of the drafter's logits
    h = torch.randn(7, drafter.cfg.arch.hidden_size)
    labels = torch.tensor([1, 2, 3, -100, 5, 6, 7])
    ce, _ = HeadLoss(V)(drafter, h, labels)
    ref = F.cross_entropy(drafter.logits(h).float(), labels, ignore_index=-100, reduction="none")
    assert torch.allclose(ce, ref, atol=1e-5)


def test_a_short_list_estimates_the_full_loss_and_keeps_label_logits_exact(toy, drafter):
    V = drafter.cfg.arch.vocab_size
    torch.manual_seed(0)
    h = torch.randn(64, drafter.cfg.arch.hidden_size)
    labels = torch.randint(0, V, (64,))
    full, _ = HeadLoss(V)(drafter, h, labels)
    half = HeadLoss(V, range(0, V, 2), other_samples=V)  # every other row sampled: exact again
    est, _ = half(drafter, h, labels, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(est, full, atol=1e-5)
    few = HeadLoss(V, range(0, V, 2), other_samples=8)
    est8, _ = few(drafter, h, labels, generator=torch.Generator().manual_seed(0))
    assert (est8 - full).abs().mean() < 0.25 * full.mean()  # an estimate, not a different loss
    assert len(few.rows_for(labels, None)) < V


def test_soft_labels_round_trip_through_the_cache(toy, examples, tmp_path):
    seq = to_seq(examples[3], 96)
    cache = SoftLabelCache(tmp_path, toy.target, k=5)
    idx, val = cache.get("toy/3", seq.ids)
    assert cache.misses == 1 and idx.shape == (len(seq.ids) - 1, 5) and idx.dtype == torch.int32 and val.dtype == torch.float16
    again = SoftLabelCache(tmp_path, toy.target, k=5)
    idx2, val2 = again.get("toy/3", seq.ids)
    assert again.hits == 1 and torch.equal(idx, idx2) and torch.equal(val, val2)
    ref_idx, ref_val = target_topk(toy.target, seq.ids, 5)
    assert torch.equal(ref_idx, idx) and torch.equal(ref_val, val)
    # the target's greedy response is its own top-1 at every response position
    P = len(seq.prompt_ids)
    assert idx[P - 1 : len(seq.ids) - 1, 0].tolist() == seq.response_ids
    # a changed sequence under the same key is recomputed, never misread
    other = SoftLabelCache(tmp_path, toy.target, k=5)
    other.get("toy/3", seq.ids[:-3])
    assert other.misses == 1
    st = soft_rows((idx, val), torch.tensor([P, -1]))
    assert st.valid.tolist() == [True, False] and torch.allclose(st.probs[0].sum(), torch.tensor(1.0))


def test_soft_label_term_is_the_soft_cross_entropy(toy, drafter):
    V = drafter.cfg.arch.vocab_size
    h = torch.randn(3, drafter.cfg.arch.hidden_size)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]])
    soft = SoftTargets(ids=ids, probs=probs, valid=torch.tensor([True, True, True]))
    _, s = HeadLoss(V)(drafter, h, torch.tensor([1, 3, 5]), soft)
    logq = F.log_softmax(drafter.logits(h).float(), -1)
    ref = -(probs * logq.gather(1, ids)).sum(-1)
    assert torch.allclose(s, ref, atol=1e-5)


def test_block_targets_stop_at_the_end():
    assert block_targets([10, 11, 12, 13], [1, 2], 3).tolist() == [[12, 13, -100], [13, -100, -100]]


def test_the_new_recipe_trains_and_resumes_exactly(toy, examples, tmp_path, monkeypatch):
    """Dense anchors + shortlisted head + soft labels: the loss falls and a resumed run is bit-exact."""
    cfg = replace(PRESETS["toy"], steps=12, ckpt_every=6, eval_every=12, anchors=0, ar_positions=0,
                  head_shortlist=20, other_samples=8, soft_k=4)
    assert 0 < len(head_shortlist(examples, 20)) <= 20
    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    full = train(toy, examples, cfg, tmp_path / "full", progress=False)
    train(toy, examples, cfg, tmp_path / "res", progress=False, stop_after=6)
    res = train(toy, examples, cfg, tmp_path / "res", progress=False)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "full" / "ckpt" / "drafter.safetensors"))
    b = load_file(str(tmp_path / "res" / "ckpt" / "drafter.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert full["offline_tau"] == res["offline_tau"]
    assert any((tmp_path / "cache" / "softlabels" / "toy" / "k4").glob("*.safetensors"))


def test_anchor_rule_trains_the_anchor_slot_for_position_one(toy, drafter, examples):
    """With first_draft='anchor' the block loss supervises position 1 at the anchor slot (what decoding
    reads), positions 2.. at their MASK slots; with 'mask' it is the MASK slots throughout."""
    cfg = replace(PRESETS["toy"], block_size=4)
    head = HeadLoss(drafter.cfg.arch.vocab_size)
    seq = to_seq(examples[1], 96)
    anchors = sample_anchors(seq, 5, random.Random(2))
    ids = seq.ids
    with torch.no_grad():
        _, raw, _ = drafter.forward_packed(drafter.new_cache(), torch.tensor(ids), [(ids[p], p) for p in anchors], 5)
        _, hm, ce_m, _, _ = d3d_block_terms(drafter, seq, anchors, cfg, head)
        _, ha, ce_a, _, _ = d3d_block_terms(drafter.with_first_draft("anchor"), seq, anchors, cfg, head)
    assert torch.allclose(hm, raw[:, 1:], atol=1e-6)
    assert torch.allclose(ha[:, 0], raw[:, 0], atol=1e-6) and torch.allclose(ha[:, 1:], raw[:, 2:], atol=1e-6)
    assert not torch.allclose(ce_a, ce_m)


def test_block_kl_with_a_shortlisted_teacher_is_finite_and_exact():
    """A shortlisted teacher's -inf logits (probability 0) add nothing to KL(teacher ‖ drafter); before
    this was guarded, 0 · ∞ made the healing loss NaN for the shipped (shortlisted) drafter."""
    from d3d_core.training.train import weighted_block_kl

    torch.manual_seed(0)
    student = torch.randn(2, 3, 10)
    teacher = torch.randn(2, 3, 10)
    teacher[..., 5:] = float("-inf")  # a shortlist of 5 tokens
    ids, anchors = list(range(20)), [2, 6]
    kl = weighted_block_kl(student, teacher, ids, anchors, gamma=4.0)
    assert torch.isfinite(kl)
    p = F.softmax(teacher[..., :5], -1)
    per = (p * (F.log_softmax(teacher[..., :5], -1) - F.log_softmax(student, -1)[..., :5])).sum(-1)
    w = torch.exp(-torch.arange(3).float() / 4.0).expand(2, 3)
    assert torch.allclose(kl, (per * w).sum() / w.sum(), atol=1e-5)
