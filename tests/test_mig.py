import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.mig import feasible_geometries, geometry_violations, maximal_geometries, place_counts

CAT = default_catalog()


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
    if sum(1 for n, _ in placements if n.endswith("+me")) > 1:
        return False
    return sum(profiles[n].compute for n, _ in placements) <= model.compute_slices


@settings(max_examples=400, deadline=None)
@given(model=st.sampled_from(sorted(CAT.models)), data=st.data())
def test_rules_match_a_brute_force_reading(model, data):
    m = CAT.models[model]
    universe = [(p.name, s) for p in m.mig_profiles for s in range(m.memory_slices)]
    placements = data.draw(st.lists(st.sampled_from(universe), max_size=8, unique=True))
    assert (not geometry_violations(m, placements)) == _brute_force_valid(m, placements)


def test_feasible_geometries_are_exactly_the_valid_sets_on_a30():
    a30 = CAT.models["A30-24GB"]
    universe = [(p.name, s) for p in a30.mig_profiles for s in p.starts]
    valid = {frozenset(c) for k in range(len(universe) + 1) for c in itertools.combinations(universe, k)
             if _brute_force_valid(a30, c)}
    assert {frozenset(g) for g in feasible_geometries(a30)} == valid


def test_feasible_geometries_keep_fixed_placements():
    h100 = CAT.models["H100-80GB"]
    for g in feasible_geometries(h100, fixed=[("3g.40gb", 4)]):
        assert ("3g.40gb", 4) in g
