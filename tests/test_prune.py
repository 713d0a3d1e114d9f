"""Progressive pruning on the toy bundle returns a well-formed curve."""

from d3d_core.training.offline_tau import greedy_continuations, offline_tau
from d3d_core.training.prune import best_within, progressive_prune


def test_curve_is_well_formed(toy):
    d = toy.drafter("d3d")
    seqs = greedy_continuations(toy, ["what is two plus two?", "tell me a story", "hello", "count to ten"], 40)
    calib, evals = seqs[:2], seqs[2:]
    c = progressive_prune(d, calib, evals, B=4, stride=2)
    L = d.cfg.num_layers
    assert c["layers"] == L and len(c["curve"]) == L  # 0 .. L-1 removed
    assert c["curve"][0]["tau"] == offline_tau(d, calib, B=4, stride=2)  # first point = unpruned τ
    assert c["curve"][0]["tau_rel"] == 1.0 and c["curve"][0]["kept"] == list(range(L))
    assert sorted(c["order"] + c["curve"][-1]["kept"]) == list(range(L))
    for k, p in enumerate(c["curve"]):
        assert p["removed"] == k and len(p["kept"]) == L - k
        pruned = d.pruned([i for i in range(L) if i not in p["kept"]])  # each point re-measured on its own
        assert p["tau"] == offline_tau(pruned, calib, B=4, stride=2) and p["tau_eval"] == offline_tau(pruned, evals, B=4, stride=2)
        lo, hi = p["tau_eval_rel_ci"]  # a paired interval that holds its own point
        assert lo - 1e-9 <= p["tau_eval_rel"] <= hi + 1e-9
    assert c["curve"][0]["tau_eval_rel_ci"] == [1.0, 1.0] and c["ci"]["level"] == 0.95
    assert set(c["marginal_cost"]) == {str(i) for i in range(L)}
    # the greedy choice at step 1 is the layer with the smallest marginal cost
    first = c["order"][0]
    assert c["marginal_cost"][str(first)] == min(c["marginal_cost"].values())
    assert best_within(c, keep=0.0)["removed"] == L - 1


def test_healing_fine_tunes_only_the_kept_layers_against_a_control(toy, tmp_path):
    import torch

    from d3d_core.models.loader import load_drafter
    from d3d_core.training.prune import heal

    d = toy.drafter("d3d")
    seqs = greedy_continuations(toy, ["what is two plus two?", "tell me a story", "hello", "count to ten", "say hi", "abc"], 40)
    calib, evals = seqs[:2], seqs[2:4]
    examples = [{"id": f"toy/{i}", "prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for i, s in enumerate(seqs)]
    c = progressive_prune(d, calib, evals, B=4, stride=2)
    heal(toy, d, c, [1], examples, calib, evals, tmp_path, steps=6, lr=1e-3, B=4, stride=2, progress=False)
    h = c["curve"][1]["healed"]
    healed = load_drafter(tmp_path / "removed-1" / "final", toy.target.shared, toy.target.arch)
    control = load_drafter(tmp_path / "control" / "final", toy.target.shared, toy.target.arch)

    def tau(drafter, seqs):  # measured here, independently of heal()'s bookkeeping
        return offline_tau(drafter, seqs, B=4, stride=2, target=toy.target)

    assert h["steps"] == 6 and h["tau"] == tau(healed, calib) and h["tau_eval"] == tau(healed, evals)
    ctl = c["heal_control"]
    assert ctl["tau"] == tau(control, calib) and ctl["tau_eval"] == tau(control, evals)
    assert h["tau_rel"] == h["tau"] / ctl["tau"] and h["tau_eval_rel"] == h["tau_eval"] / ctl["tau_eval"]
    assert h["tau_eval_rel_ci"][0] - 1e-9 <= h["tau_eval_rel"] <= h["tau_eval_rel_ci"][1] + 1e-9
    assert c["heal_reference"] == "heal_control"
    gone = c["order"][0]
    assert list(healed.cfg.skip_layers) == [gone] and healed.cfg.training["fine_tuned_from"] is not None
    before, after = d.state_dict(), healed.state_dict()
    changed = {k for k in before if not torch.allclose(before[k].float(), after[k].float(), atol=2e-3)}
    assert changed, "healing changed nothing"
    assert not any(k.startswith(f"layers.{gone}.") for k in changed), "a skipped layer was trained"
    assert any(k.startswith("layers.") for k in changed)
    assert d.cfg.skip_layers == () and not d.training  # the bundle's drafter is untouched


def test_paired_ratio_ci():
    import pytest

    from d3d_core.training.offline_tau import paired_ratio_ci

    base = [(30.0, 20), (50.0, 20), (24.0, 12), (40.0, 16)]
    assert paired_ratio_ci(base, base) == [1.0, 1.0]
    up = [(s * 1.1, n) for s, n in base]  # 10 % better on every sequence: no doubt about it
    lo, hi = paired_ratio_ci(up, base)
    assert abs(lo - 1.1) < 1e-9 and abs(hi - 1.1) < 1e-9
    mixed = [(s * f, n) for (s, n), f in zip(base, (1.3, 0.8, 1.2, 0.85))]  # better on some, worse on others
    lo, hi = paired_ratio_ci(mixed, base)
    assert lo < 1.0 < hi and hi - lo > 0.1
    with pytest.raises(ValueError):
        paired_ratio_ci(base[:3], base)
    with pytest.raises(ValueError):
        paired_ratio_ci([(30.0, 19)] + base[1:], base)  # different anchors: not the same sequences


def test_held_out_intervals_can_be_added_to_an_older_curve(toy):
    import pytest

    from d3d_core.training.prune import add_held_out_ci

    d = toy.drafter("d3d")
    seqs = greedy_continuations(toy, ["what is two plus two?", "tell me a story", "hello", "count to ten"], 40)
    calib, evals = seqs[:2], seqs[2:]
    c = progressive_prune(d, calib, evals, B=4, stride=2)
    old = {**c, "curve": [{k: v for k, v in p.items() if k != "tau_eval_rel_ci"} for p in c["curve"]]}
    old.pop("ci")
    add_held_out_ci(old, d, evals, B=4, stride=2)
    assert [p["tau_eval_rel_ci"] for p in old["curve"]] == [p["tau_eval_rel_ci"] for p in c["curve"]]
    with pytest.raises(ValueError, match="not the curve's held-out set"):
        add_held_out_ci(old, d, calib, B=4, stride=2)


def _toy_seqs(toy):
    seqs = greedy_continuations(toy, ["what is two plus two?", "tell me a story", "hello", "count to ten"], 40)
    return seqs[:2], seqs[2:]


def test_prefix_reuse_gives_offline_taus_bits_on_a_deep_adapter_drafter(toy):
    """The search's fast path (layers below a removed one reused) is offline τ itself, bit for bit, on an adapter
    drafter over all of the target's layers (d3d-deep's kind) with trained-looking (non-zero) adapters."""
    import torch

    from d3d_core.models.adapter import shared_adapter_drafter
    from d3d_core.training.prune import PrefixTau

    t = toy.target
    d = shared_adapter_drafter(t.shared, t.arch, rank=4, block_size=4)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in d.own_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    calib, _ = _toy_seqs(toy)
    f = PrefixTau(d, calib, B=4, stride=2)
    L = d.cfg.num_layers
    assert f.settle([]) == offline_tau(d, calib, B=4, stride=2)
    for c in range(L):
        assert f.tau_without(c) == offline_tau(d.pruned([c]), calib, B=4, stride=2), c
    f.settle([1])
    for c in (0, L - 1):
        assert f.tau_without(c) == offline_tau(d.pruned([1, c]), calib, B=4, stride=2), c


def test_a_resumed_search_is_the_uninterrupted_one_and_the_shortlist_is_recorded(toy):
    d = toy.drafter("d3d")
    calib, evals = _toy_seqs(toy)
    whole = progressive_prune(d, calib, evals, B=4, stride=2, shortlist=2)
    saved = []
    part = progressive_prune(d, calib, evals, B=4, stride=2, shortlist=2, max_removed=1, save_state=saved.append)
    assert len(part["curve"]) == 2 and len(saved) == 1
    resumed = progressive_prune(d, calib, evals, B=4, stride=2, shortlist=2, state=saved[-1])
    assert resumed["order"] == whole["order"] and resumed["curve"] == whole["curve"]
    assert "shortlist" in whole["search"] and all(p["measured"] <= 2 for p in whole["curve"][2:])
    assert whole["curve"][1]["measured"] == d.cfg.num_layers  # step 1 measures every layer
