import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.mig import feasible_geometries, geometry_violations, maximal_geometries, place_counts
from tests.gpus import CAPPED_1G, RTX_PRO_6000, SHORT_COMPUTE

CAT = default_catalog()
# every model the rules are checked on: the catalog's, a GPU it lacks, and two made-up GPUs on
# which the max-count and compute-total rules bind (no real model makes them bind: tests/gpus.py)
MODELS = {**{n: m for n, m in CAT.models.items() if m.supports_mig},
          **{m.name: m for m in (RTX_PRO_6000, CAPPED_1G, SHORT_COMPUTE)}}


def test_a100_40gb_has_the_twelve_maximal_geometries_of_the_user_guide():
    a100 = CAT.models["A100-40GB"]
    got = maximal_geometries(a100, [p for p in a100.profiles_by_name if p not in ("1g.10gb", "1g.5gb+me")])
    expected = [
        {"7g.40gb": 1}, {"4g.20gb": 1, "3g.20gb": 1}, {"4g.20gb": 1, "2g.10gb": 1, "1g.5gb": 1},
        {"4g.20gb": 1, "1g.5gb": 3}, {"3g.20gb": 1, "2g.10gb": 2}, {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2},
        {"3g.20gb": 1, "1g.5gb": 4}, {"3g.20gb": 2}, {"2g.10gb": 3, "1g.5gb": 1},
        {"2g.10gb": 2, "1g.5gb": 3}, {"2g.10gb": 1, "1g.5gb": 5}, {"1g.5gb": 7},
    ]
    assert len(got) == 12
    assert sorted(map(sorted, (dict(g).items() for g in got))) == sorted(map(sorted, (e.items() for e in expected)))
    # (cached, so nos's model does not build them again for every GPU it re-lays): the same
    # answer for the profiles in any order, and a caller's changes to it do not reach the cache
    again = maximal_geometries(a100, sorted(p for p in a100.profiles_by_name if p not in ("1g.10gb", "1g.5gb+me"))[::-1])
    assert again == got and again is not got
    got.clear()
    assert len(maximal_geometries(a100, [p for p in a100.profiles_by_name if p not in ("1g.10gb", "1g.5gb+me")])) == 12


def test_3g_with_four_1g_must_sit_at_4():
    a100 = CAT.models["A100-40GB"]
    g = place_counts(a100, {"3g.20gb": 1, "1g.5gb": 4})
    assert g is not None and ("3g.20gb", 4) in g
    assert geometry_violations(a100, [("3g.20gb", 0), ("1g.5gb", 4), ("1g.5gb", 5), ("1g.5gb", 6), ("1g.5gb", 7)])


def test_each_rule_is_reported():
    h100 = CAT.models["H100-80GB"]
    assert "legal starts" in geometry_violations(h100, [("3g.40gb", 2)])[0]
    assert "overlaps" in geometry_violations(h100, [("4g.40gb", 0), ("2g.20gb", 2)])[0]
    assert "+me" in geometry_violations(h100, [("1g.10gb+me", 0), ("1g.10gb+me", 1)])[0]
    assert "does not exist" in geometry_violations(h100, [("5g.50gb", 0)])[0]
    a30 = CAT.models["A30-24GB"]
    assert "+me" in " ".join(geometry_violations(a30, [("1g.6gb+me", 0), ("2g.12gb+me", 2)]))
    assert not geometry_violations(a30, [("2g.12gb+me", 0), ("2g.12gb", 2)])
    # the two rules no real model makes bind (tests/gpus.py)
    assert not geometry_violations(CAPPED_1G, [("1g.6gb", 0), ("1g.6gb", 1), ("2g.12gb", 2)])
    assert geometry_violations(CAPPED_1G, [("1g.6gb", 0), ("1g.6gb", 1), ("1g.6gb", 2)]) == [
        "3 x 1g.6gb exceeds its max count 2"]
    assert not geometry_violations(SHORT_COMPUTE, [("4g.40gb", 0), ("2g.20gb", 4)])  # 6 compute slices: all
    assert geometry_violations(SHORT_COMPUTE, [("4g.40gb", 0), ("2g.20gb", 4), ("2g.20gb", 6)]) == [
        "instances use 8 compute slices; Test-short-compute has 6"]


def _brute_force_valid(model, placements) -> bool:
    """The driver's rules, written out independently of MigRules."""
    profiles = model.profiles_by_name
    slots: set[int] = set()
    for name, start in placements:
        p = profiles.get(name)
        if p is None or start not in p.starts:
            return False
        cover = set(range(start, start + p.memory))
        if cover & slots:
            return False
        slots |= cover
    for name in {n for n, _ in placements}:
        if sum(1 for n, _ in placements if n == name) > profiles[name].max:
            return False
    if sum(1 for n, _ in placements if "+me" in n) > 1:  # +me and +me.all, not -me
        return False
    return sum(profiles[n].compute for n, _ in placements) <= model.compute_slices


@settings(max_examples=400, deadline=None)
@given(model=st.sampled_from(sorted(MODELS)), data=st.data())
def test_rules_match_a_brute_force_reading(model, data):
    m = MODELS[model]
    universe = [(p.name, s) for p in m.mig_profiles for s in range(m.memory_slices)]
    placements = data.draw(st.lists(st.sampled_from(universe), max_size=8, unique=True))
    assert (not geometry_violations(m, placements)) == _brute_force_valid(m, placements)


def _all_placement_sets(model):
    universe = [(p.name, s) for p in model.mig_profiles for s in p.starts]
    return [c for k in range(len(universe) + 1) for c in itertools.combinations(universe, k)]


@pytest.mark.parametrize("model", [CAT.models["A30-24GB"], CAPPED_1G, SHORT_COMPUTE], ids=lambda m: m.name)
def test_feasible_geometries_are_exactly_the_valid_sets(model):
    """Every set of legal placements, checked against the brute-force reading: by the search
    (`MigRules.can_add`) and by the validator (`MigRules.violations`). On the two made-up GPUs
    the max-count (CAPPED_1G) and compute-total (SHORT_COMPUTE) rules decide some of the sets."""
    sets = _all_placement_sets(model)
    valid = {frozenset(c) for c in sets if _brute_force_valid(model, c)}
    assert {frozenset(g) for g in feasible_geometries(model)} == valid
    assert [c for c in sets if not geometry_violations(model, c)] == [c for c in sets if frozenset(c) in valid]


def test_the_made_up_gpus_make_the_max_count_and_compute_rules_decide():
    """What the two models are for: sets that only the max count (CAPPED_1G) or only the compute
    total (SHORT_COMPUTE) refuses, so the checks above cannot pass without those rules."""
    def refused_only_by(model, rule):
        return [c for c in _all_placement_sets(model) if not _brute_force_valid(model, c)
                and _brute_force_valid(model.model_copy(update=rule), c)]

    unlimited = tuple(p.model_copy(update={"max": len(p.starts)}) for p in CAPPED_1G.mig_profiles)
    assert len(refused_only_by(CAPPED_1G, {"mig_profiles": unlimited})) == 5  # 3 or 4 of the 1g.6gb
    assert len(refused_only_by(SHORT_COMPUTE, {"compute_slices": 8})) > 100


def test_feasible_geometries_keep_fixed_placements():
    h100 = CAT.models["H100-80GB"]
    for g in feasible_geometries(h100, fixed=[("3g.40gb", 4)]):
        assert ("3g.40gb", 4) in g
