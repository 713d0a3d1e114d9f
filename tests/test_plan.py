"""The verify plan: the width rule, the cost model read from a breakdown, and that a cut verify stays lossless."""

import itertools

import pytest
from test_sampling import _assert_second_token_matches_target

from d3d_core.decoding.config import DecodeConfig
from d3d_core.decoding.engine import decode
from d3d_core.decoding.plan import CostModel, DraftGate, expected_tokens, monotone, verify_width
from d3d_core.decoding.trace import Trace
from d3d_core.models.bundles import shipped_costs

STEEP = CostModel(widths=(1, 2, 3, 8), verify=(1.0, 1.25, 1.6, 3.0), draft=(("d3d", 0.3), ("dflash", 0.1)), source="test")


def test_expected_tokens_is_the_prefix_product_sum():
    p = [0.5, 0.4, 1.0]
    assert expected_tokens(p, 1) == 1.0
    assert expected_tokens(p, 2) == pytest.approx(1.5)
    assert expected_tokens(p, 3) == pytest.approx(1.7)
    assert expected_tokens(p, 4) == pytest.approx(1.9)
    assert expected_tokens(p, 9) == pytest.approx(1.9)  # past the drafts: nothing more to gain


def test_width_maximises_tokens_per_cost_by_brute_force():
    for probs in itertools.product([0.0, 0.2, 0.6, 0.95], repeat=4):
        for draft in (0.0, 0.3, 1.0):
            k = verify_width(probs, STEEP, draft)
            rates = [expected_tokens(probs, j) / (draft + STEEP.verify_cost(j)) for j in range(1, 6)]
            assert rates[k - 1] == pytest.approx(max(rates))
            assert 1 <= k <= 5


def test_flat_costs_verify_the_whole_block():
    flat = CostModel()
    for probs in ([0.0] * 7, [0.01] * 7, [0.9, 0.0, 0.3]):
        assert verify_width(probs, flat, 0.5) == len(probs) + 1


def test_measured_dips_are_smoothed_away():
    assert monotone([1.0, 1.2, 1.1, 1.5]) == pytest.approx([1.0, 1.15, 1.15, 1.5])
    assert monotone([1.0, 0.96, 1.05]) == pytest.approx([0.98, 0.98, 1.05])
    assert monotone([1.0, 1.1, 1.2]) == [1.0, 1.1, 1.2]
    rows = [{"forward": f, "threads": 2, "per_step": v} for f, v in (("step", 1.0), ("verify(6)", 1.5), ("verify(7)", 1.3))]
    assert CostModel.from_breakdown({"rows": rows}, 2).verify == pytest.approx((1.0, 1.4, 1.4))


def test_interpolation_and_extrapolation():
    assert STEEP.verify_cost(1) == 1.0
    assert STEEP.verify_cost(2) == 1.25
    assert STEEP.verify_cost(5) == pytest.approx(1.6 + (3.0 - 1.6) * 2 / 5)
    assert STEEP.verify_cost(9) == pytest.approx(3.0 + (3.0 - 1.6) / 5)
    assert STEEP.table(3) == [1.0, 1.25, 1.6]


def test_cost_model_from_the_shipped_breakdown():
    costs = shipped_costs("smollm2-135m")
    two, one = CostModel.from_breakdown(costs, 2), CostModel.from_breakdown(costs, 1)
    assert two.widths[0] == 1 and two.verify[0] == 1.0 and len(two.widths) >= 3
    assert all(b >= a for a, b in zip(two.verify, two.verify[1:]))  # wider verifies cost more here
    assert two.draft_cost("d3d") > two.draft_cost("dflash") > 0
    assert one.verify_cost(8) != two.verify_cost(8)  # each thread count has its own rows
    assert "thread" in two.source
    odd = dict(costs, machine_info="not a dict")
    assert CostModel.from_breakdown(odd, 2).verify == two.verify and "unnamed CPU" in CostModel.from_breakdown(odd, 2).source
    assert CostModel.from_breakdown(costs, 64).widths == two.widths  # the closest thread count measured


def test_draft_cost_scales_with_the_drafters_active_layers():
    """A pruned (or deeper) D3D drafter is charged for the layers it runs; the head's share stays fixed."""
    costs = shipped_costs("smollm2-135m")
    two = CostModel.from_breakdown(costs, 2)
    n = costs["d3d_active_layers"]
    full = two.draft_cost("d3d")
    assert two.draft_cost("d3d", n) == pytest.approx(full)
    assert 0 < two.draft_cost("d3d", n // 2) < 0.6 * full and two.draft_cost("d3d", 2 * n) > 1.9 * full
    assert two.draft_cost("dflash", 1) == two.draft_cost("dflash")  # no layer count measured for it: unscaled
    assert CostModel().draft_cost("d3d", 4) == 0.0  # the flat model: drafts free at any depth
    broken = dict(costs, d3d_active_layers="eight")
    assert CostModel.from_breakdown(broken, 2).draft_cost("d3d", 2) == full


def test_the_engine_charges_a_pruned_drafter_less(smollm):
    from d3d_core.decoding.config import DecodeConfig
    from d3d_core.decoding.engine import D3DSeqMode, Run
    from d3d_core.decoding.timing import Lanes, Recorder

    dev = smollm.target.device
    run = Run(smollm.target, DecodeConfig(mode="d3d-seq"), Lanes(dev, False), Recorder(dev),
              CostModel.from_breakdown(shipped_costs("smollm2-135m"), 2))
    full = D3DSeqMode(run, smollm.drafter("d3d")).draft_cost()
    pruned = D3DSeqMode(run, smollm.drafter("d3d").pruned([0, 1, 2, 3])).draft_cost()
    assert 0 < pruned < 0.6 * full


@pytest.mark.parametrize("bad", [None, {}, {"rows": "x"}, {"rows": [{"forward": "verify(4)", "threads": 2, "per_step": 1.2}]},
                                 {"rows": [1, None, {"threads": "a"}]}, {"rows": [{"forward": "verify(2)", "threads": 2, "per_step": "x"}]}])
def test_unusable_breakdowns_give_the_flat_model(bad):
    try:
        m = CostModel.from_breakdown(bad, 2)
    except Exception as e:  # pragma: no cover - the failure this test exists to catch
        pytest.fail(f"raised {type(e).__name__}: {e}")
    assert m == CostModel()


@pytest.mark.parametrize("mode", ["dflash", "d3d-seq", "d3d-async"])
def test_cut_verifies_stay_lossless_and_are_recorded(toy, mode):
    cfg = DecodeConfig(mode=mode, max_new_tokens=60, block_size=6, stop_at_eos=False, drafting="always")  # the plan alone
    ar = decode(toy, "the cat sat", cfg.with_(mode="ar"))
    cut = decode(toy, "the cat sat", cfg, costs=STEEP)
    full = decode(toy, "the cat sat", cfg.with_(verify="full"), costs=STEEP)
    assert cut.output_ids == ar.output_ids == full.output_ids
    assert any(r.held_back for r in cut.rounds)  # the plan did cut some verifies
    assert all(not r.held_back and len(r.draft_ids) == 5 for r in full.rounds)
    for r in cut.rounds:
        assert len(r.draft_ids) + len(r.held_back) == 5  # every drafted token is either verified or held back
        assert len(r.target_ids) == len(r.draft_ids) + 1
    assert cut.verify_costs == STEEP.table(6) and cut.cost_source == "test"
    back = Trace.from_json(cut.to_json())
    assert [r.held_back for r in back.rounds] == [r.held_back for r in cut.rounds]


def test_a_cut_trace_without_the_new_fields_still_loads(toy):
    d = decode(toy, "ab", DecodeConfig(mode="d3d-seq", max_new_tokens=8)).to_dict()
    for r in d["rounds"]:
        r.pop("held_back")
    d.pop("verify_costs")
    d.pop("cost_source")
    assert Trace.from_dict(d).rounds[0].held_back == []


def test_unknown_verify_rule_is_refused():
    with pytest.raises(ValueError, match="verify rule must be one of adaptive, full"):
        DecodeConfig(verify="some").validated()


def test_rejection_sampling_over_a_cut_verify_keeps_the_target_distribution(toy):
    """Widths chosen from the drafter's q: the output distribution is still the target's."""
    widths = []
    costs = CostModel(widths=(1, 2, 3), verify=(1.0, 1.1, 1.6), draft=(("d3d", 0.2),), source="test")
    for seed in range(40):
        tr = decode(toy, "ab", DecodeConfig(mode="d3d-seq", temperature=1.0, sampling="rejection", seed=seed, max_new_tokens=6,
                                            block_size=3, stop_at_eos=False), costs=costs)
        widths += [len(r.draft_ids) for r in tr.rounds]
    assert len(set(widths)) >= 2  # the width really varies with q
    _assert_second_token_matches_target(toy, "d3d-seq", "rejection", costs=costs)


# ----------------------------------------------------------------------------- the draft gate

COSTLY = CostModel(widths=(1, 2, 8), verify=(1.0, 1.3, 2.5), draft=(("d3d", 2.0), ("dflash", 2.0)), source="test")


def test_draft_gate_closes_probes_backs_off_and_reopens():
    g = DraftGate()
    assert g.wants_draft() and g.rate is None  # no evidence yet: draft
    g.drafted(1, 2.0)  # one token for two steps of cost
    assert g.rate == 0.5 and not g.is_open()
    for _ in range(g.probe_every):
        assert not g.wants_draft()
        g.skip()
    assert g.wants_draft()  # the probe
    g.drafted(1, 2.0)
    assert g.interval == 2 * g.probe_every and not g.wants_draft()  # a failed probe: probe half as often
    for _ in range(2 * g.probe_every):
        g.skip()
    g.drafted(8, 2.0)  # a stretch where drafting pays again
    assert g.is_open() and g.interval == g.probe_every and g.skipped == 0
    for _ in range(10):
        g.drafted(1, 2.0)
        g.skip()
    assert g.interval <= g.probe_max


def test_draft_gate_is_a_ratio_of_sums_over_its_window_and_one_miss_does_not_close_it():
    g = DraftGate(window=4)
    for t in (3, 3, 3):
        g.drafted(t, 1.5)
    g.drafted(1, 1.5)  # a miss after a good run: 10 tokens for 6 steps
    assert g.rate == pytest.approx(10 / 6) and g.is_open()
    for _ in range(4):
        g.drafted(1, 1.5)  # four misses push the good rounds out of the window
    assert len(g.history) == 4 and g.rate == pytest.approx(1 / 1.5) and not g.is_open()
    h = DraftGate()
    h.drafted(1, 1.25, expected=2.0)  # a miss the drafter thought likely to pass counts half of each
    assert h.rate == pytest.approx(1.5 / 1.25)


def test_under_the_flat_model_the_gate_never_skips(toy):
    for mode in ("dflash", "d3d-seq", "d3d-async"):
        tr = decode(toy, "the cat sat", DecodeConfig(mode=mode, max_new_tokens=40, stop_at_eos=False))
        assert all(r.draft_source != "skipped" for r in tr.rounds) and all(r.gate_rate >= 1 for r in tr.rounds[1:])


@pytest.mark.parametrize("mode", ["dflash", "d3d-seq", "d3d-async"])
def test_gated_rounds_stay_lossless_and_the_drafter_catches_up(toy, mode):
    """Costly drafts close the gate: skipped rounds verify the anchor alone, and the next draft sees every
    token committed meanwhile — its drafts equal those of an always-drafting run at the same anchor."""
    cfg = DecodeConfig(mode=mode, max_new_tokens=60, block_size=5, stop_at_eos=False)
    ar = decode(toy, "the cat sat", cfg.with_(mode="ar"))
    gated = decode(toy, "the cat sat", cfg, costs=COSTLY)
    assert gated.output_ids == ar.output_ids
    skipped = [r for r in gated.rounds if r.draft_source == "skipped"]
    drafted = [r for r in gated.rounds if r.draft_source != "skipped"]
    assert skipped and len(drafted) >= 3  # it skips, and it probes
    assert all(not r.draft_ids and not r.held_back and r.hit is None and r.accepted == 0 for r in skipped)
    assert all(r.gate_rate is not None for r in gated.rounds[1:])
    # a probe after skipped rounds drafts what a fresh drafter would draft from the whole context
    always = decode(toy, "the cat sat", cfg.with_(drafting="always", verify="full"), costs=COSTLY)
    by_pos = {r.anchor_pos: r.draft_ids + r.held_back for r in always.rounds if r.draft_source in ("draft", "sync_draft")}
    probes = [r for i, r in enumerate(gated.rounds) if i and gated.rounds[i - 1].draft_source == "skipped" and r.draft_source != "skipped" and r.anchor_pos in by_pos]
    if mode != "d3d-async":  # async drafts after a miss too; its pairs are checked where they exist
        assert probes
    for r in probes:
        assert r.draft_ids + r.held_back == by_pos[r.anchor_pos]
    assert Trace.from_json(gated.to_json()).rounds == gated.rounds


@pytest.mark.parametrize("mode", ["dflash", "d3d-seq", "d3d-async"])
def test_a_closed_gate_samples_exactly_like_ar(toy, mode, monkeypatch):
    """At temperature > 0 a skipped round is an AR step: with the gate closed from the start, the same seed
    gives the same tokens as ar, token for token."""
    from d3d_core.decoding import engine

    monkeypatch.setattr(engine, "DraftGate", lambda **kw: DraftGate(history=[(0.0, 1.0)], probe_every=10**6))
    for seed in range(5):
        cfg = DecodeConfig(mode=mode, temperature=1.0, sampling="rejection", seed=seed, max_new_tokens=20, stop_at_eos=False, threads=1)
        tr = decode(toy, "ab", cfg)
        assert all(r.draft_source == "skipped" for r in tr.rounds)
        assert tr.output_ids == decode(toy, "ab", cfg.with_(mode="ar")).output_ids


def test_unknown_drafting_rule_is_refused():
    with pytest.raises(ValueError, match="drafting rule must be one of gated, always"):
        DecodeConfig(drafting="sometimes").validated()


def test_async_gate_threshold_is_the_step_speedup_of_every_core(monkeypatch):
    """d3d-async's lanes get one thread each, but a skipped round runs on every core: it earns more than one of
    the one-thread steps the plan counts in, and the gate's threshold says how many."""
    costs = CostModel.from_breakdown(shipped_costs("smollm2-135m"), 1)
    ms = dict(costs.step_ms)
    assert set(ms) >= {1, 2} and costs.step_speedup(1, 2) == pytest.approx(ms[1] / ms[2]) and costs.step_speedup(1, 2) > 1
    assert costs.step_speedup(1, 1) == 1.0 and CostModel().step_speedup(1, 2) == 1.0  # unmeasured: 1
    from d3d_core.decoding import engine

    seen = []
    monkeypatch.setattr(engine, "DraftGate", lambda **kw: seen.append(kw) or DraftGate(**kw))
    from d3d_core.models.bundles import get_bundle

    toy = get_bundle("toy")
    for mode in ("d3d-seq", "d3d-async"):
        decode(toy, "ab", DecodeConfig(mode=mode, max_new_tokens=4, threads=None), costs=costs)
    import torch

    n = torch.get_num_threads()
    assert seen[0]["threshold"] == 1.0  # d3d-seq: its skipped and drafted rounds run on the same cores
    assert seen[1]["threshold"] == pytest.approx(costs.step_speedup(1, n))
