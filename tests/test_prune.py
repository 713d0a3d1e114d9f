"""Progressive pruning on the toy bundle returns a well-formed curve."""

from d3d_core.offline_tau import greedy_continuations, offline_tau
from d3d_core.prune import best_within, progressive_prune


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
        assert p["removed"] == k and len(p["kept"]) == L - k and "tau_eval" in p
    assert set(c["marginal_cost"]) == {str(i) for i in range(L)}
    # the greedy choice at step 1 is the layer with the smallest marginal cost
    first = c["order"][0]
    assert c["marginal_cost"][str(first)] == min(c["marginal_cost"].values())
    assert best_within(c, keep=0.0)["removed"] == L - 1
