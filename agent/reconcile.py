"""What to do to bring a node's GPUs to the spec: pure decisions, no I/O.

MIG (`reconcile_mig`): keep the instances the spec has (completing a GPU instance left without
its compute instance), destroy the free ones it lacks, create the missing ones at their explicit
placements. An instance in use (a process on it, or a pod holding its device) is never
destroyed: when the spec wants it gone it is kept and reported, and a wanted instance that
would overlap it is not created (reported too). MIG mode is enabled only on a GPU the spec
wants partitioned, and only when nothing runs on it. A GPU whose MIG mode enable is pending is
asked again (once per pass) while it is idle, unless the driver said only a GPU reset applies
it. An instance of a GI profile the model does not know is left alone; a wanted instance it
keeps from being created is reported by `unknown_blocks` (the plan cannot be acknowledged).

MPS (`reconcile_mps`): the slices of each GPU are the spec's, plus any slice pods still hold;
what then does not fit in the GPU's capacity is left out and reported.

A GPU the spec drains (`drained_mig`, `drained_mps`) keeps only the spec's slices in use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dynpart.agent.driver.interface import IN_USE
from dynpart.catalog import GpuModel
from dynpart.mig import MigRules, slot_mask


@dataclass(frozen=True)
class Instance:
    """A GPU instance found on a GPU."""

    gi_id: int
    profile: str | None  # catalog profile name; None when the catalog does not know its profile id
    profile_id: int
    start: int
    size: int
    complete: bool = True  # has its compute instance
    users: tuple[str, ...] = ()  # why it is in use: "pid 4242", "pod ns/name"

    @property
    def used(self) -> bool:
        return bool(self.users)

    @property
    def label(self) -> str:
        return f"{self.profile or f'profile id {self.profile_id}'}@{self.start}"

    @property
    def described(self) -> str:
        """The instance as the driver knows it (for one whose profile the catalog does not know)."""
        return f"GPU instance {self.gi_id} (GI profile id {self.profile_id}, placement start {self.start} size {self.size})"


@dataclass(frozen=True)
class MigGpuState:
    index: int
    mig_enabled: bool
    mig_pending: bool = False  # MIG mode enabled, pending (not active yet)
    instances: tuple[Instance, ...] = ()
    users: tuple[str, ...] = ()  # processes/pods on the GPU as a whole
    # why the pending mode is not active, as the driver said when last asked (NVML activation
    # status: IN_USE, RESET_REQUIRED, ...); None: not asked since the agent started
    activation: str | None = None
    # a pending enable (IN_USE) asked again lately: not asked this pass (each ask takes the idle
    # GPU from the kubelet's list a moment, and a client that holds it open usually stays)
    asked_lately: bool = False

    @property
    def retry_enable(self) -> bool:
        """A pending enable that asking again may activate (not one that waits for a GPU reset),
        and not asked lately."""
        return self.mig_pending and self.activation in (None, IN_USE) and not self.asked_lately


@dataclass(frozen=True)
class EnableMig:
    gpu: int


@dataclass(frozen=True)
class Destroy:
    gpu: int
    gi_id: int
    label: str
    start: int
    size: int


@dataclass(frozen=True)
class Create:
    gpu: int
    profile: str
    start: int


@dataclass(frozen=True)
class Complete:
    """Create the missing compute instance of a wanted GPU instance."""

    gpu: int
    gi_id: int
    profile: str
    start: int


@dataclass
class MigActions:
    enable: list[EnableMig] = field(default_factory=list)
    destroy: list[Destroy] = field(default_factory=list)
    complete: list[Complete] = field(default_factory=list)
    create: list[Create] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _users(inst: Instance) -> str:
    return ", ".join(inst.users)


def reconcile_mig(desired: Mapping[int, Iterable[tuple[str, int]]], gpus: Iterable[MigGpuState],
                  model: GpuModel) -> MigActions:
    """Actions for every GPU of the node. `desired` maps a GPU index to its (profile, start)
    placements; a GPU it lacks is wanted empty. `desired` is assumed valid per GPU (decoded)."""
    out = MigActions()
    rules = MigRules.of(model) if model.supports_mig else None
    states = {g.index: g for g in gpus}
    for index in sorted(set(desired) - set(states)):
        out.errors.append(f"the spec has GPU {index} but this node has GPUs "
                          f"{', '.join(map(str, sorted(states))) or 'none'}; ignored")
    for index in sorted(states):
        gpu = states[index]
        want = set(desired.get(index, ()))
        if rules is None:
            if want:
                out.errors.append(f"GPU {index}: {model.name} does not support MIG; the spec's instances are ignored")
            continue
        if not gpu.mig_enabled:
            _reconcile_mig_off(gpu, want, out)
            continue
        _reconcile_gpu(gpu, want, rules, out)
    out.destroy.sort(key=lambda d: (d.gpu, d.start))
    out.create.sort(key=lambda c: (c.gpu, c.start))
    return out


def _reconcile_mig_off(gpu: MigGpuState, want: set[tuple[str, int]], out: MigActions) -> None:
    """A GPU out of MIG mode. MIG mode is enabled when the spec wants the GPU carved and nothing
    uses it. A pending enable is asked again while the GPU is idle (after a growing wait:
`MigGpuState.asked_lately`), also when the
    spec no longer wants the GPU carved: the planner leaves a GPU whose MIG mode is pending out
    of its plans until it is active, so no later spec would ask. Not when the driver said that
    only a GPU reset applies it: that is reported, not asked again."""
    index = gpu.index
    if gpu.mig_pending and not gpu.retry_enable:
        if want and not gpu.asked_lately:  # (why, and what to do: the caller's status line, `mig_pending_reason`)
            out.errors.append(f"GPU {index}: MIG mode enable is pending until the GPU is reset; the spec's instances "
                              "there are created once it is active")
        return
    if not want and not gpu.mig_pending:
        return
    if gpu.users:
        if want:
            state = "MIG mode enable is pending" if gpu.mig_pending else "MIG mode is disabled"
            out.errors.append(f"GPU {index}: {state} and the GPU is in use ({', '.join(gpu.users)}); "
                              "MIG mode will be enabled when it is idle")
        return
    out.enable.append(EnableMig(index))
    out.create.extend(Create(index, p, s) for p, s in sorted(want, key=lambda x: (x[1], x[0])))


def _reconcile_gpu(gpu: MigGpuState, want: set[tuple[str, int]], rules: MigRules, out: MigActions) -> None:
    index = gpu.index
    kept: list[tuple[str, int]] = []  # instances staying, in catalog terms
    unknown: list[Instance] = []  # staying instances the catalog cannot name
    staying: list[Instance] = []
    have: set[tuple[str, int]] = set()
    for inst in sorted(gpu.instances, key=lambda i: (i.start, i.gi_id)):
        key = (inst.profile, inst.start) if inst.profile is not None else None
        if key is None:
            out.errors.append(f"GPU {index}: {inst.described} has a GI profile the catalog does not know for "
                              f"{rules.model.name} (made outside dynpart, or a profile left out of the node's list); "
                              "left alone, and not reported to the planner: destroy it or add its profile")
            unknown.append(inst)
            staying.append(inst)
            continue
        if key in want and key not in have:
            have.add(key)
            kept.append(key)
            staying.append(inst)
            if not inst.complete:
                out.complete.append(Complete(index, inst.gi_id, key[0], key[1]))
        elif inst.used:
            out.errors.append(f"GPU {index}: {inst.label} is in use ({_users(inst)}) but the spec does not have it; "
                              "kept until it is free")
            kept.append(key)
            staying.append(inst)
        else:
            out.destroy.append(Destroy(index, inst.gi_id, inst.label, inst.start, inst.size))
    for profile, start in sorted(want - have, key=lambda x: (x[1], x[0])):
        broken = rules.violations([*kept, (profile, start)])
        p = rules.index.get(profile)
        if not broken and p is not None:
            hit = [i for i in unknown if slot_mask(i.start, i.size) & rules.mask(p, start)]
            if hit:
                out.errors.append(f"GPU {index}: cannot create {profile}@{start}: it overlaps {hit[0].described}, "
                                  "of a GI profile the catalog does not know; the plan is not acknowledged while "
                                  "that instance is there")
                continue
        if broken:
            mask = slot_mask(start, rules.memory[p]) if p is not None else 0
            in_the_way = [i for i in staying if i.used and slot_mask(i.start, i.size) & mask]
            why = (f"{', '.join(f'{i.label} ({_users(i)})' for i in in_the_way)} in use there"
                   if in_the_way else broken[0])
            out.errors.append(f"GPU {index}: cannot create {profile}@{start}: {why}; it will be created once that is free")
            continue
        kept.append((profile, start))
        out.create.append(Create(index, profile, start))


def unknown_blocks(desired: Mapping[int, Iterable[tuple[str, int]]], gpus: Iterable[MigGpuState],
                   model: GpuModel) -> list[str]:
    """Why the plan cannot be acknowledged because of instances of a GI profile the model does
    not know (left alone, and invisible to the planner, which sees their slices as free): one
    line per wanted instance that is missing from a GPU in MIG mode (`gpus`: after the pass) where
    such instances are, unless an instance the model knows is in its way (reported as any such
    conflict). Names the unknown instances it overlaps, else all those of the GPU (another rule
    of the driver's, such as one `+me` instance per GPU or the compute-slice total, refused it)."""
    if not model.supports_mig:
        return []
    rules = MigRules.of(model)
    out = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        unknown = [i for i in gpu.instances if i.profile is None]
        if not gpu.mig_enabled or not unknown:
            continue
        known = [(i.profile, i.start) for i in gpu.instances if i.profile is not None]
        for profile, start in sorted(set(desired.get(gpu.index, ())) - set(known), key=lambda x: (x[1], x[0])):
            p = rules.index.get(profile)
            if p is None or rules.violations([*known, (profile, start)]):
                continue
            hit = [i for i in unknown if slot_mask(i.start, i.size) & rules.mask(p, start)] or unknown
            out.append(f"GPU {gpu.index}: {profile}@{start} could not be created next to "
                       f"{', '.join(i.described for i in hit)}, of a GI profile the catalog does not know")
    return out


def drained_mig(desired: Mapping[int, Iterable[tuple[str, int]]], gpus: Iterable[MigGpuState],
                drain: Iterable[int]) -> dict[int, list[tuple[str, int]]]:
    """`desired` with each drained GPU cut down to the spec's instances in use now: the idle
    ones are then destroyed (guarded as any destroy), so nothing new is bound there and the GPU
    empties as its pods end."""
    out = {i: list(v) for i, v in desired.items()}
    states = {g.index: g for g in gpus}
    for index in drain:
        state = states.get(index)
        used = {(i.profile, i.start) for i in state.instances if i.used} if state is not None else set()
        out[index] = [k for k in out.get(index, []) if k in used]
    return out


def drained_mps(desired: Mapping[int, Iterable[int]], used: Mapping[int, Counter[int]],
                drain: Iterable[int]) -> dict[int, list[int]]:
    """`desired` with each drained GPU cut down to the spec's slices pods hold now (as
    `drained_mig`)."""
    out = {i: list(v) for i, v in desired.items()}
    for index in drain:
        kept = Counter(out.get(index, [])) & used.get(index, Counter())
        out[index] = sorted(kept.elements(), reverse=True)
    return out


def reconcile_mps(desired: Mapping[int, Iterable[int]], used: Mapping[int, Counter[int]], gpus: Iterable[int],
                  capacity: int, max_slices: int | None = None) -> tuple[dict[int, list[int]], list[str]]:
    """Slice sizes per GPU to configure, and the errors. Slices pods hold are always kept;
    the spec's other slices are added largest first while they fit in `capacity` and the GPU has
    fewer than `max_slices` (the MPS server's clients per GPU; None: no bound)."""
    errors: list[str] = []
    gpu_set = set(gpus)
    for index in sorted(set(desired) - gpu_set):
        errors.append(f"the spec has GPU {index} but this node has GPUs "
                      f"{', '.join(map(str, sorted(gpu_set))) or 'none'}; ignored")
    final: dict[int, list[int]] = {}
    for index in sorted(gpu_set):
        want = Counter(desired.get(index, ()))
        held = used.get(index, Counter())
        sizes: list[int] = []
        for size, n in sorted(held.items(), key=lambda x: -x[0]):
            sizes.extend([size] * n)
            if n > want[size]:
                errors.append(f"GPU {index}: {n} x {size}gb slice(s) are in use by pods but the spec has {want[size]}; "
                              "kept until they are free")
        total = sum(sizes)
        for size in sorted(want, reverse=True):
            for _ in range(want[size] - held[size]):
                if total + size > capacity:
                    errors.append(f"GPU {index}: a {size}gb slice does not fit next to the slices in use "
                                  f"({total} of {capacity} GB taken); it will be added once they are free")
                    continue
                if max_slices is not None and len(sizes) >= max_slices:
                    errors.append(f"GPU {index}: a {size}gb slice would be the MPS server's client "
                                  f"{len(sizes) + 1} (at most {max_slices} a GPU); it will be added once slices in "
                                  "use are free")
                    continue
                sizes.append(size)
                total += size
        final[index] = sorted(sizes, reverse=True)
    return final, errors
