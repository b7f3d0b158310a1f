"""Checks of the learned request distribution (`planner/demand.py`) that mutation testing found
unasserted: the decay's clock, the memory of the pods counted, the floor below which a kind is
forgotten, and the bound on the kinds kept."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.planner.demand import DemandTracker, check_workload
from dynpart.snapshot import PendingPod, RequestShare

MIG = "nvidia.com/mig-1g.10gb"


def weights(t: DemandTracker) -> dict[int, float]:
    return {s.cpu_milli: s.weight for s in t.workload()}


def test_a_round_observed_late_does_not_turn_the_clock_back():
    """Rounds may report out of order (a slow round's `now` behind the last): what was seen
    decays once over the elapsed time, never twice over the same stretch."""
    t = DemandTracker(half_life_s=100)
    t.observe([PendingPod(name="a", resource=MIG)], now=100)
    t.observe([PendingPod(name="b", resource=MIG, cpu_milli=1)], now=50)  # late: no decay, counted
    t.observe([], now=200)
    assert weights(t) == {0: 0.5, 1: 0.5}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e4), min_size=1, max_size=6))
def test_a_kind_seen_once_weighs_half_per_half_life_since_the_latest_time_observed(times):
    t = DemandTracker(half_life_s=100, floor=0.0)
    t.observe([PendingPod(name="a", resource=MIG)], now=0)
    for now in times:
        t.observe([], now=now)
    [share] = t.workload()
    assert abs(share.weight - 0.5 ** (max(times) / 100)) <= 1e-9 * max(1.0, share.weight)


def test_a_pod_still_pending_stays_remembered_while_others_come_and_go():
    """The memory of the pods counted drops the least recently seen: a pod pending through many
    rounds is not counted again when new pods fill the memory, one not seen lately may be."""
    t = DemandTracker(half_life_s=1e9, remember=2)
    old = PendingPod(name="old", resource=MIG)
    t.observe([old], now=0)
    t.observe([PendingPod(name="x", resource=MIG, cpu_milli=1)], now=0)
    t.observe([old], now=0)  # still pending: seen last now
    t.observe([PendingPod(name="y", resource=MIG, cpu_milli=2)], now=0)  # x is forgotten, not old
    t.observe([old], now=0)
    assert weights(t) == {0: 1.0, 1: 1.0, 2: 1.0}
    t.observe([PendingPod(name="x", resource=MIG, cpu_milli=1)], now=0)  # forgotten: counted again
    assert weights(t)[1] == 2.0


def test_the_memory_of_pods_counted_holds_exactly_remember_pods():
    t = DemandTracker(half_life_s=1e9, remember=3)
    pods = [PendingPod(name=f"p{i}", resource=MIG) for i in range(3)]
    t.observe(pods, now=0)
    t.observe(pods, now=0)
    assert weights(t) == {0: 3.0}, "three pods, all remembered: none counted twice"


def test_a_kind_is_forgotten_once_its_weight_decays_below_the_floor():
    """The default floor, 0.01: a kind not seen for 7 half-lives is gone (the workload, and the
    objective's work, keep only what was asked for lately)."""
    t = DemandTracker(half_life_s=100)
    t.observe([PendingPod(name="a", resource=MIG)], now=0)
    t.observe([], now=600)  # 1/64 > 0.01
    assert weights(t) == {0: 1 / 64}
    t.observe([], now=700)  # 1/128 < 0.01
    assert t.workload() == [] and not t._weights
    at = DemandTracker(half_life_s=100, floor=0.25)
    at.observe([PendingPod(name="a", resource=MIG)], now=0)
    at.observe([], now=200)
    assert weights(at) == {0: 0.25}, "at the floor, not below it: kept"


def test_only_mig_profiles_no_model_offers_are_doubtful_in_the_workload_setting():
    """A profile the catalog knows, an MPS slice and a whole GPU are said nothing of; a MIG
    profile no model offers (perhaps a driver's own name) is, by its index."""
    shares = [RequestShare(resource=r) for r in ("nvidia.com/mig-1g.10gb", "nvidia.com/gpu-10gb", "nvidia.com/gpu",
                                                 "nvidia.com/mig-7g.79gb")]
    said = check_workload(shares, default_catalog())
    assert len(said) == 1 and said[0].startswith("setting workload[3].resource = 'nvidia.com/mig-7g.79gb'")


@settings(max_examples=30, deadline=None)
@given(st.permutations(range(4)), st.integers(1, 4))
def test_the_workload_does_not_depend_on_the_order_the_pods_were_seen(order, max_kinds):
    """Kinds of equal weight, seen in any order: the same kinds kept and in the same order (the
    plan stays a function of the snapshot)."""
    def learned(seq):
        t = DemandTracker(half_life_s=100, max_kinds=max_kinds)
        t.observe([PendingPod(name=f"p{i}", resource=MIG, cpu_milli=i) for i in seq], now=0)
        return t.workload()

    assert learned(order) == learned(range(4))


def test_a_kind_outside_the_heaviest_is_still_counted_and_may_overtake():
    """The workload shows the `max_kinds` heaviest, but lighter kinds are kept counting (until the
    memory bound, 4 x max_kinds kinds): one asked for more and more becomes the workload."""
    t = DemandTracker(half_life_s=1e9, max_kinds=1)
    t.observe([PendingPod(name=f"a{i}", resource=MIG) for i in range(3)]
              + [PendingPod(name="b", resource=MIG, cpu_milli=1), PendingPod(name="c", resource=MIG, cpu_milli=2)],
              now=0)
    assert weights(t) == {0: 3.0}
    t.observe([PendingPod(name=f"c{i}", resource=MIG, cpu_milli=2) for i in range(3)], now=0)
    assert weights(t) == {2: 4.0}


def test_shares_whose_models_the_catalog_all_knows_come_back_as_the_same_list():
    from dynpart.planner.demand import known_to

    shares = [RequestShare(resource="nvidia.com/gpu", gpu_models=["H100-80GB", "A100-80GB"])]
    assert known_to(shares, default_catalog()) is shares
