"""MIG geometry rules, exactly as the driver applies them.

A geometry is a set of placements (profile, start). NVML accepts it when every start is legal
for its profile, no two placements share a memory slice, each profile stays within its max
count, at most one `+me` (media extensions) instance exists, and the compute slices add up to
no more than the GPU has (facts file section 1).

`MigRules` precomputes bitmasks per model so that the planner can test placements with a few
integer operations; the functions below are the readable API over it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import NamedTuple

from dynpart.catalog import GpuModel, MigProfile


class Placement(NamedTuple):
    profile: str
    start: int


def slot_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


@dataclass(frozen=True, eq=False)  # hashed by identity: one instance per model
class MigRules:
    """Bitmask view of one model's MIG profiles; profile indices follow the catalog order."""

    model: GpuModel
    names: tuple[str, ...]
    index: dict[str, int]
    memory: tuple[int, ...]
    compute: tuple[int, ...]
    max_count: tuple[int, ...]
    media: tuple[bool, ...]
    # per profile: ((start, mask), ...) in start order
    placements: tuple[tuple[tuple[int, int], ...], ...]
    full_mask: int

    @classmethod
    def of(cls, model: GpuModel) -> MigRules:
        return _rules_for(model)

    def mask(self, p: int, start: int) -> int:
        return slot_mask(start, self.memory[p])

    def violations(self, placements: Iterable[tuple[str, int]]) -> list[str]:
        """Every rule a geometry breaks, as readable sentences (empty when valid). Answers are
        cached per geometry: a cluster's GPUs share a few layouts, and every planning round
        validates each of them."""
        return list(self._violations_as_listed(tuple(placements)))

    @lru_cache(maxsize=8192)  # noqa: B019 - as `_violations`
    def _violations_as_listed(self, placements: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
        """`_violations` of placements in any order (cached as listed: a cluster's GPUs list
        their instances alike, and sorting them cost as much as the rest of a node's checks)."""
        return self._violations(tuple(sorted(placements, key=lambda x: (x[1], x[0]))))

    @lru_cache(maxsize=8192)  # noqa: B019 - MigRules instances live for the process (one per model)
    def _violations(self, placements: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
        problems: list[str] = []
        occupied = 0
        counts: Counter[str] = Counter()
        compute = 0
        media = 0
        for name, start in placements:
            p = self.index.get(name)
            if p is None:
                problems.append(
                    f"profile {name!r} does not exist on {self.model.name} "
                    f"(profiles: {', '.join(self.names)})"
                )
                continue
            legal = [s for s, _ in self.placements[p]]
            if start not in legal:
                problems.append(f"{name} cannot start at memory slice {start} (legal starts: {legal})")
                continue
            m = self.mask(p, start)
            if occupied & m:
                problems.append(f"{name}@{start} overlaps another instance's memory slices")
            occupied |= m
            counts[name] += 1
            compute += self.compute[p]
            media += self.media[p]
        for name, n in counts.items():
            p = self.index[name]
            if n > self.max_count[p]:
                problems.append(f"{n} x {name} exceeds its max count {self.max_count[p]}")
        if media > 1:
            problems.append(f"{media} media-extension (+me, +me.all) instances; at most one per GPU")
        if compute > self.model.compute_slices:
            problems.append(
                f"instances use {compute} compute slices; {self.model.name} has {self.model.compute_slices}"
            )
        return tuple(problems)

    def can_add(self, p: int, start: int, occupied: int, counts: tuple[int, ...] | list[int],
                compute_used: int, media_used: int) -> bool:
        m = self.mask(p, start)
        return (
            not occupied & m
            and counts[p] < self.max_count[p]
            and compute_used + self.compute[p] <= self.model.compute_slices
            and not (self.media[p] and media_used)
        )


@cache
def _rules_for(model: GpuModel) -> MigRules:
    profiles: tuple[MigProfile, ...] = model.mig_profiles
    return MigRules(
        model=model,
        names=tuple(p.name for p in profiles),
        index={p.name: i for i, p in enumerate(profiles)},
        memory=tuple(p.memory for p in profiles),
        compute=tuple(p.compute for p in profiles),
        max_count=tuple(p.max for p in profiles),
        media=tuple(p.media_extensions for p in profiles),
        placements=tuple(tuple((s, slot_mask(s, p.memory)) for s in sorted(p.starts)) for p in profiles),
        full_mask=(1 << model.memory_slices) - 1,
    )


def geometry_violations(model: GpuModel, placements: Iterable[tuple[str, int]]) -> list[str]:
    return MigRules.of(model).violations(placements)


def is_valid_geometry(model: GpuModel, placements: Iterable[tuple[str, int]]) -> bool:
    return not geometry_violations(model, placements)


def feasible_geometries(model: GpuModel, profiles: Iterable[str] | None = None,
                        fixed: Iterable[tuple[str, int]] = ()) -> list[frozenset[Placement]]:
    """Every valid geometry (the empty one included) that contains the `fixed` placements and
    otherwise uses only `profiles` (default: all of the model's profiles). Deterministic order."""
    allowed = tuple(sorted(set(profiles))) if profiles is not None else None
    fixed_key = tuple(sorted(fixed, key=lambda x: (x[1], x[0])))
    return list(_feasible(model, allowed, fixed_key))


@lru_cache(maxsize=4096)
def _feasible(model: GpuModel, allowed: tuple[str, ...] | None,
              fixed: tuple[tuple[str, int], ...]) -> tuple[frozenset[Placement], ...]:
    rules = MigRules.of(model)
    if rules.violations(fixed):
        return ()
    usable = [i for i, n in enumerate(rules.names) if allowed is None or n in allowed]
    # candidate placements ordered by (start, profile) so each set is generated once
    cands = sorted(((s, p, m) for p in usable for s, m in rules.placements[p]))
    counts = [0] * len(rules.names)
    occupied = compute = media = 0
    for name, start in fixed:
        p = rules.index[name]
        counts[p] += 1
        occupied |= rules.mask(p, start)
        compute += rules.compute[p]
        media += rules.media[p]
    base = [Placement(n, s) for n, s in fixed]
    out: list[frozenset[Placement]] = []

    def walk(i: int, chosen: list[Placement], occ: int, comp: int, med: int) -> None:
        out.append(frozenset(chosen))
        for j in range(i, len(cands)):
            s, p, m = cands[j]
            if rules.can_add(p, s, occ, counts, comp, med):
                counts[p] += 1
                chosen.append(Placement(rules.names[p], s))
                walk(j + 1, chosen, occ | m, comp + rules.compute[p], med + rules.media[p])
                chosen.pop()
                counts[p] -= 1

    walk(0, list(base), occupied, compute, media)
    return tuple(out)


def profile_counts(geometry: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """A geometry as a sorted multiset of profiles (what nos and mig-parted call a geometry)."""
    return tuple(sorted(Counter(name for name, _ in geometry).items()))


def maximal_geometries(model: GpuModel, profiles: Iterable[str] | None = None) -> list[tuple[tuple[str, int], ...]]:
    """Profile multisets that have a valid placement and to which no allowed profile can be
    added (in any placement). Deterministic order (largest profiles first)."""
    allowed = tuple(sorted(set(profiles))) if profiles is not None else MigRules.of(model).names
    return list(_maximal(model, allowed))


@lru_cache(maxsize=256)
def _maximal(model: GpuModel, allowed: tuple[str, ...]) -> tuple[tuple[tuple[str, int], ...], ...]:
    """(Cached: nos's model asks for them on every GPU it re-lays, 4 ms each on an H100.)"""
    feasible = {profile_counts(g) for g in feasible_geometries(model, allowed)}
    maximal = []
    for multiset in feasible:
        counts = dict(multiset)
        if not any(
            tuple(sorted({**counts, p: counts.get(p, 0) + 1}.items())) in feasible for p in allowed
        ):
            maximal.append(multiset)
    order = {n: i for i, n in enumerate(MigRules.of(model).names)}
    # largest profiles first, then fewer instances first
    return tuple(sorted(maximal, key=lambda ms: sorted((-_size(model, n), -c, order[n]) for n, c in ms)))


def _size(model: GpuModel, name: str) -> int:
    return model.profiles_by_name[name].memory


def place_counts(model: GpuModel, wanted: dict[str, int],
                 fixed: Iterable[tuple[str, int]] = ()) -> frozenset[Placement] | None:
    """A placement for a profile multiset on top of `fixed` placements, or None when the
    driver would refuse it. Largest profiles are placed first, lowest legal start first."""
    target = Counter({n: c for n, c in wanted.items() if c > 0})
    for g in feasible_geometries(model, list(wanted), fixed):
        got = Counter(n for n, _ in g) - Counter(n for n, _ in fixed)
        if got == target:
            return g
    return None
