"""MIG geometry rules, checks that tests/test_mig.py leaves open: the search on top of fixed
placements (the used instances a plan must keep), each geometry found once, placing a profile
multiset on top of fixed placements, and the validator's answers independent of input order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.mig import MigRules, feasible_geometries, geometry_violations, is_valid_geometry, place_counts
from tests.test_mig import CAT, MODELS, _all_placement_sets, _brute_force_valid

H100 = CAT.models["H100-80GB"]
SMALL = ["A30-24GB", "Test-capped-1g", "Test-short-compute", "RTX-PRO-6000-Blackwell"]


@pytest.mark.parametrize("name", SMALL + ["H100-80GB"])
def test_each_geometry_is_found_once(name):
    """The planner scores every geometry the search returns: one found twice is work done twice
    (and the docstring promises each valid geometry once)."""
    model = MODELS[name]
    every = feasible_geometries(model)
    assert len(every) == len(set(every))
    for fixed in [sorted(g) for g in every[:: max(1, len(every) // 40)]]:
        found = feasible_geometries(model, fixed=fixed)
        assert len(found) == len(set(found)), fixed


@pytest.mark.parametrize("name", SMALL)
def test_geometries_on_top_of_fixed_placements_are_exactly_the_valid_supersets(name):
    """The planner keeps the used instances (`fixed`) and searches the rest: what it gets must be
    every valid geometry holding them, and nothing that the driver would refuse (a fixed instance
    counts toward its profile's max count, the compute total and the one media extension)."""
    model = MODELS[name]
    every = feasible_geometries(model)
    assert all(_brute_force_valid(model, g) for g in every)
    for fixed in every:
        want = {g for g in every if fixed <= g}
        got = feasible_geometries(model, fixed=sorted(fixed))
        assert set(got) == want, sorted(fixed)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(SMALL + ["H100-80GB", "A100-40GB"]), data=st.data())
def test_geometries_on_top_of_fixed_placements_use_only_the_allowed_profiles(name, data):
    model = MODELS[name]
    every = feasible_geometries(model)
    fixed = data.draw(st.sampled_from(every))
    allowed = data.draw(st.sets(st.sampled_from([p.name for p in model.mig_profiles])))
    want = {g for g in every if fixed <= g and {p.profile for p in g - fixed} <= allowed}
    got = feasible_geometries(model, sorted(allowed), fixed=sorted(fixed, reverse=True))
    assert set(got) == want and len(got) == len(want)


@pytest.mark.parametrize("name", ["A30-24GB", "Test-capped-1g"])
def test_fixed_placements_the_driver_refuses_give_no_geometry(name):
    model = MODELS[name]
    for fixed in _all_placement_sets(model):
        if not _brute_force_valid(model, fixed):
            assert feasible_geometries(model, fixed=fixed) == [], fixed


def test_fixed_placements_the_driver_refuses_give_no_geometry_and_no_placement():
    for fixed in ([("7g.80gb", 0), ("1g.10gb", 0)],  # overlap
                  [("3g.40gb", 2)],  # illegal start
                  [("1g.10gb+me", 0), ("1g.10gb+me", 1)],  # two media extensions
                  [("5g.50gb", 0)]):  # no such profile
        assert feasible_geometries(H100, fixed=fixed) == []
        assert place_counts(H100, {"1g.10gb": 1}, fixed=fixed) is None


def test_a_profile_multiset_is_placed_on_top_of_fixed_placements():
    """`wanted` is what is added to `fixed` (nos' baseline places its plan around used ones)."""
    fixed = [("3g.40gb", 4)]
    g = place_counts(H100, {"1g.10gb": 2}, fixed=fixed)
    assert g is not None and ("3g.40gb", 4) in g
    assert sorted(p.profile for p in g) == ["1g.10gb", "1g.10gb", "3g.40gb"] and is_valid_geometry(H100, g)
    g = place_counts(H100, {"3g.40gb": 1, "1g.10gb": 0}, fixed=fixed)
    assert g is not None and sorted(g) == [("3g.40gb", 0), ("3g.40gb", 4)]
    assert place_counts(H100, {"4g.40gb": 1}, fixed=fixed) is not None
    assert place_counts(H100, {"4g.40gb": 1}, fixed=[("3g.40gb", 0)]) is None  # 4g.40gb starts at 0 only
    assert place_counts(H100, {}, fixed=fixed) == frozenset(fixed)


def test_is_valid_geometry_answers_true_or_false():
    assert is_valid_geometry(H100, [("3g.40gb", 0), ("3g.40gb", 4)]) is True
    assert is_valid_geometry(H100, []) is True
    assert is_valid_geometry(H100, [("3g.40gb", 0), ("4g.40gb", 0)]) is False
    assert is_valid_geometry(H100, [("3g.40gb", 2)]) is False


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), data=st.data())
def test_violations_do_not_depend_on_the_order_placements_are_given_in(name, data):
    """The same geometry gives the same sentences however it is listed (a set's iteration order
    changes from one process to the next; an agent's status-error must not flap)."""
    model = MODELS[name]
    universe = [(p.name, s) for p in model.mig_profiles for s in range(model.memory_slices)]
    placements = data.draw(st.lists(st.sampled_from(universe), max_size=6, unique=True))
    shuffled = data.draw(st.permutations(placements))
    assert geometry_violations(model, shuffled) == geometry_violations(model, placements)


def test_violations_order_examples():
    """Same start, two profiles; same profile, two starts: listed by (start, profile)."""
    for order in itertools.permutations([("3g.40gb", 2), ("3g.40gb", 1), ("1g.10gb", 1), ("2g.20gb", 1)]):
        assert geometry_violations(H100, order) == [
            "2g.20gb cannot start at memory slice 1 (legal starts: [0, 2, 4])",
            "3g.40gb cannot start at memory slice 1 (legal starts: [0, 4])",
            "3g.40gb cannot start at memory slice 2 (legal starts: [0, 4])",
        ]


def test_a_placement_at_an_illegal_start_is_reported_alone():
    """It occupies nothing: the legal instances beside it are not blamed for overlapping it."""
    assert geometry_violations(H100, [("3g.40gb", 2), ("1g.10gb", 3), ("1g.10gb", 4)]) == [
        "3g.40gb cannot start at memory slice 2 (legal starts: [0, 4])"]
    assert geometry_violations(MODELS["Test-short-compute"], [("4g.40gb", 1), ("4g.40gb", 0), ("2g.20gb", 4)]) == [
        "4g.40gb cannot start at memory slice 1 (legal starts: [0, 4])"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_mask_covers_exactly_the_gpus_memory_slices(name):
    """The planner counts free memory slices from `full_mask` (planner/mig_state.py)."""
    model = MODELS[name]
    rules = MigRules.of(model)
    assert rules.full_mask == (1 << model.memory_slices) - 1
    union = 0
    for p in range(len(rules.names)):
        for _, mask in rules.placements[p]:
            union |= mask
    assert union == rules.full_mask
