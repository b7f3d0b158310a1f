"""One MPS pass with the agent's own device plugin: the slices the agent applies are what it
advertises (`nvidia.com/gpu-<N>gb`, device id `<GPU UUID>::<n>`); no ConfigMap, no node label.

- A slice keeps its number n for as long as it exists (the kubelet and PodResources know it by
  its id); a removed slice's number is not reused in the same pass (`assign_slices`).
- Slices pods hold (PodResources) are kept whatever the spec says; slices pods bound to the node
  and not yet admitted need are kept too; the others the spec drops are withdrawn, re-checked and
  only then dropped (`SliceGuard`). After an agent restart the slices pods hold are found again
  from PodResources; the spec (still on the node) gives the rest, and the slices the last agent
  reported that it drops are guarded as above (`previous`).
- A GPU a pod holds whole is not shared until it is free; GPUs in MIG mode get no MPS slices.
  A GPU without slices is advertised whole (`nvidia.com/gpu`): slicing it ends that device, so it
  is guarded as a removed slice is (a pod bound for a whole GPU keeps it whole, one that took it
  meanwhile too).
- The MPS control daemon (`MpsDaemon`) runs for the node's non-MIG GPUs while any GPU has
  slices; when it cannot run, the slices are listed Unhealthy (the kubelet gives them to no
  pod) and the error says why.
- The compute modes of the GPUs with slices: agent/compute_modes.py, from the agent's pass.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from dynpart.agent.deviceplugin.devices import mps_device_id
from dynpart.agent.driver.interface import DeviceInfo, GpuDriver
from dynpart.agent.driver.threaded import AsyncDriver, as_async
from dynpart.agent.guard import UNCONFIRMED, Released, SliceGuard
from dynpart.agent.mig_agent import PassResult
from dynpart.agent.mps_daemon import MpsDaemon, MpsDaemonBusy, MpsDaemonError
from dynpart.agent.podresources import PodResources
from dynpart.agent.reconcile import drained_mps, reconcile_mps
from dynpart.errors import DynpartError
from dynpart.resources import WHOLE_GPU, MpsResource, known_resource, mps_resource_name
from dynpart.snapshot import GpuLayout, MpsSlice

log = logging.getLogger("dynpart.agent.mps")

Slices = dict[int, int]  # slice number -> size (GB)


def assign_slices(sizes: list[int], fixed: Mapping[int, int], previous: Mapping[int, int]) -> Slices:
    """Numbers for one GPU's slices: `fixed` ones (held or kept) keep theirs; the other `sizes`
    (which include the fixed ones' sizes) reuse a previous number of the same size where they
    can, else take the lowest number not used now nor in `previous` (a number just freed is not
    given to a slice of another size in the same pass: the kubelet may still list it)."""
    out = dict(fixed)
    remaining = Counter(sizes) - Counter(fixed.values())
    for n, size in sorted(previous.items()):
        if n not in out and remaining[size] > 0:
            out[n] = size
            remaining[size] -= 1
    taken = set(out) | set(previous)
    n = 0
    for size in sorted(remaining.elements(), reverse=True):
        while n in taken:
            n += 1
        out[n] = size
        taken.add(n)
    return dict(sorted(out.items()))


class MpsPluginAgent:
    def __init__(self, driver: GpuDriver | AsyncDriver, pods: PodResources, capacity_gb: int, *,
                 guard: SliceGuard | None = None, daemon: MpsDaemon | None = None, pipe_dir: str = "/tmp/nvidia-mps",
                 log_dir: str = "/var/log/nvidia-mps", max_slices: int | None = None,
                 previous: Mapping[int, list[int]] | None = None):
        self.driver = as_async(driver)  # awaited: made on the driver's own thread (driver/threaded.py)
        self.pods = pods
        self.capacity_gb = capacity_gb
        self.max_slices = max_slices  # the MPS server's clients per GPU (catalog mps_max_clients; None: no bound)
        self.guard = guard
        self.daemon = daemon
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self.live: dict[int, Slices] = {}  # GPU index -> its slices, as advertised
        # a restarted agent: GPU index -> the sizes of the slices the last agent reported (its
        # status), taken as live at its first pass (observe-only too: a bound pod may need one),
        # so that those a spec drops go through the guard (a pod bound and not yet admitted may need one)
        self.previous = {g: list(s) for g, s in (previous or {}).items() if s}
        self.daemon_error: str | None = None
        self._daemon_gpus: list[str] | None = None  # the GPUs the daemon was last made to run for
        # its (pipe, log) directories, where it outlives this agent and they may differ from ours
        self._daemon_dirs: tuple[str, str] | None = None
        self.uncovered: set[str] = set()  # UUIDs of GPUs with MPS slices the daemon does not run for

    def view(self, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(sizes, numbers) of GPU `index`'s slices, for its GpuView."""
        slices = self.live.get(index, {})
        return tuple(slices.values()), tuple(slices)

    @property
    def healthy(self) -> bool:
        return self.daemon_error is None

    def serves(self, gpu_uuid: str) -> bool:
        """Whether a pod given a slice of this GPU finds the MPS daemon running for it."""
        return self.daemon_error is None and gpu_uuid not in self.uncovered

    async def apply(self, desired: dict[int, list[int]] | None, drain: tuple[int, ...] = ()) -> PassResult:
        """One pass. `desired` None: no spec, observe only. `drain`: GPUs whose idle slices go
        (`reconcile.drained_mps`)."""
        every = await self.driver.devices()
        # a lost GPU (fallen off the bus) is left alone: its slices stay as they are, listed (the
        # agent lists them Unhealthy), reported used; the MPS daemon is not restarted for it
        lost = {d.index: d for d in every if d.lost}
        devices = [d for d in every if not d.lost]
        index_of = {d.uuid: d.index for d in every if d.uuid}
        assigned = await self.pods.list()
        used: dict[int, Slices] = {}
        whole: dict[int, list[str]] = {}
        held_ids: set[str] = set()
        for a in assigned:
            res = known_resource(a.resource)
            if res is None:
                continue
            base, _, n = a.device_id.partition("::")
            gpu = index_of.get(base)
            if gpu is None:
                continue  # a MIG device: not an MPS slice
            if isinstance(res, MpsResource) and n.isdigit():
                used.setdefault(gpu, {})[int(n)] = res.size
                held_ids.add(a.device_id)
            elif a.resource == WHOLE_GPU:
                whole.setdefault(gpu, []).append(a.pod)
        for gpu, slices in used.items():  # held slices are live, whatever the agent remembers
            self.live[gpu] = {**{n: s for n, s in self.live.get(gpu, {}).items() if n not in slices}, **slices}
        errors: list[str] = []
        applied = desired is not None
        if self.previous:  # (an observe-only pass too: it lists what the last agent served, as that one did)
            for d in every:
                sizes = self.previous.get(d.index)
                if sizes and not d.mig_current and d.index not in whole:  # (held slices keep their numbers)
                    self.live[d.index] = assign_slices(sizes, self.live.get(d.index, {}), {})
            self.previous = {}
        if desired is not None:
            desired = drained_mps(desired, {g: Counter(s.values()) for g, s in used.items()}, drain)
            kept = {i: self.live[i] for i in lost if i in self.live}
            errors += await self._apply({i: s for i, s in desired.items() if i not in lost}, devices,
                                        {g: s for g, s in used.items() if g not in lost}, whole, held_ids)
            self.live.update(kept)
        for d in devices:
            if d.mig_current and d.index not in used:
                self.live.pop(d.index, None)
        # (a lost GPU it ran for stays in its list: a restart would end its clients on the other GPUs)
        errors += await self._daemon({d.uuid: d.index for d in every if not d.mig_current and d.uuid
                                      and (not d.lost or d.uuid in (self._daemon_gpus or ()))}, in_use=bool(used))
        gpus = []
        for d in devices:
            held = used.get(d.index, {})
            listed = sorted(self.live.get(d.index, {}).items(), key=lambda x: (-x[1], x[0]))
            gpus.append(GpuLayout(index=d.index, mps=[MpsSlice(size=s, used=n in held) for n, s in listed]))
        return PassResult(gpus, errors, applied, every)

    async def _apply(self, desired: dict[int, list[int]], devices: list[DeviceInfo], used: dict[int, Slices],
                     whole: dict[int, list[str]], held_ids: set[str]) -> list[str]:
        errors: list[str] = []
        uuid = {d.index: d.uuid for d in devices}
        shareable = [d.index for d in devices if not d.mig_current and d.index not in whole]
        for d in devices:
            if d.mig_current and desired.get(d.index):
                errors.append(f"GPU {d.index} is in MIG mode: MPS slices cannot be configured on it")
            if d.index in whole and desired.get(d.index):
                errors.append(f"GPU {d.index} is held whole by {', '.join(whole[d.index])}; "
                              "its slices are configured once it is free")
        wanted = {i: s for i, s in desired.items() if i in shareable or i not in uuid}
        # GPUs left whole this pass: a pod bound for `nvidia.com/gpu` needs one, or took it meanwhile
        whole_kept: set[int] = set()

        def plan(fixed: dict[int, Slices]) -> tuple[dict[int, Slices], list[str]]:
            sizes, problems = reconcile_mps({i: s for i, s in wanted.items() if i not in whole_kept},
                                            {g: Counter(f.values()) for g, f in fixed.items()}, shareable,
                                            self.capacity_gb, self.max_slices)
            new = {g: assign_slices(sizes.get(g, []), fixed.get(g, {}), self.live.get(g, {})) for g in shareable}
            for g, f in fixed.items():  # held slices on a GPU not shareable now stay listed
                if g not in new:
                    new[g] = dict(f)
            return new, problems

        def removed(new: dict[int, Slices]) -> dict[str, str]:
            """Devices the new slices end: free slices dropped, and whole GPUs (advertised as
            `nvidia.com/gpu` while they have no slice) that get slices: guarded alike."""
            out = {mps_device_id(uuid[g], n): mps_resource_name(s) for g, slices in self.live.items() if g in uuid
                   for n, s in slices.items() if new.get(g, {}).get(n) != s}
            out.update({uuid[g]: WHOLE_GPU for g in shareable if not self.live.get(g) and new.get(g)})
            return out

        gpu_of = {u: g for g, u in uuid.items()}

        def label(device: str) -> str:
            return f"GPU {gpu_of[device]} (whole)" if device in gpu_of else f"MPS slice {device}"

        free: dict[str, list[str]] = {WHOLE_GPU: [uuid[g] for g in shareable if not self.live.get(g)]}
        for g, slices in self.live.items():
            for n, s in slices.items():
                if g in uuid and mps_device_id(uuid[g], n) not in held_ids:
                    free.setdefault(mps_resource_name(s), []).append(mps_device_id(uuid[g], n))
        fixed = {g: dict(s) for g, s in used.items()}
        kept: dict[str, str] = {}
        while True:  # keeping a slice can push another out: until nothing new is kept (each round keeps more)
            new, problems = plan(fixed)
            gone = removed(new)
            more = {i: why for i, why in (await self.guard.keep(gone, free)).items() if i not in kept} if self.guard else {}
            if not more:
                break
            kept |= more
            for i in more:
                if i in gpu_of:
                    whole_kept.add(gpu_of[i])
                    continue
                base, _, number = i.rpartition("::")
                g, n = gpu_of[base], int(number)
                fixed.setdefault(g, {})[n] = self.live[g][n]
        errors += problems
        errors += [f"{label(i)} {why}; the plan's change of that GPU waits until they are admitted"
                   for i, why in kept.items()]
        released = await self.guard.release(gone, free) if self.guard else Released(destroyable=list(gone))
        if released.kept:
            for i, users in released.in_use.items():
                errors.append(f"{label(i)} was taken ({', '.join(users)}) just before it was to be removed; kept")
            for i, why in released.needed.items():
                errors.append(f"{label(i)} {why}; the plan's change of that GPU waits until they are admitted")
            errors += [f"{label(i)} {UNCONFIRMED}" for i in released.unconfirmed]
            # everything not released stays: recompute around it
            dropped = set(released.destroyable)
            whole_kept.update(gpu_of[i] for i in released.kept if i in gpu_of)
            fixed = {g: {n: s for n, s in slices.items() if mps_device_id(uuid[g], n) not in dropped}
                     for g, slices in self.live.items() if g in uuid}
            for g, slices in used.items():
                fixed.setdefault(g, {}).update(slices)
            new, _ = plan(fixed)
        for i in released.destroyable:
            log.info("%s removed", label(i))
        self.live = {g: s for g, s in new.items() if s}
        return errors

    async def _slices_held(self) -> bool:
        """Whether a pod holds an MPS slice now (`SliceGuard.mps_held`; what cannot be read counts
        as yes: the daemon is then not restarted this pass)."""
        guard = self.guard or SliceGuard(self.pods)
        try:
            return await guard.mps_held()
        except DynpartError as e:
            log.warning("the MPS daemon is not restarted for other GPUs this pass: which pods hold MPS slices "
                        "cannot be read (%s)", e)
            return True

    def daemon_running(self) -> bool:
        """Whether this agent made the daemon run (and has not stopped it since)."""
        return self.daemon is not None and self._daemon_gpus is not None

    async def stop_daemon(self) -> None:
        """The node left MPS mode and no slice is left: nothing needs the daemon."""
        if self.daemon is not None and self.daemon_running():
            await self.daemon.stop()
            self._daemon_gpus = None

    async def _daemon(self, gpus: dict[str, int], in_use: bool) -> list[str]:
        """Keep the daemon running for the non-MIG GPUs (`gpus`: UUID -> index) while slices exist."""
        self.uncovered = set()
        if self.daemon is None or not any(self.live.values()):
            self.daemon_error = None
            return []
        errors: list[str] = []
        if self._daemon_gpus is None:
            # a restarted agent, the daemon still running in the mps-control pod: what it
            # runs for is what this agent made it run for (not changed under pods using it)
            self._daemon_gpus = self.daemon.running_for()
            self._daemon_dirs = self.daemon.running_dirs() if self._daemon_gpus else None
        dirs = (self.pipe_dir, self.log_dir)
        # other directories (an agent of another version or settings): a restart as for other GPUs
        moved = self._daemon_dirs is not None and self._daemon_dirs != dirs
        changed = self._daemon_gpus is not None and (set(gpus) != set(self._daemon_gpus) or moved)
        if changed and not in_use:
            # `in_use` is the pass's first PodResources list: the guard's waits since (withdraw,
            # settle) leave the kubelet time to give a slice to a pod, whose CUDA context the
            # restart would end. Read again right before it (ensure's alive() is all that follows)
            in_use = await self._slices_held()
        if in_use and changed:
            assert self._daemon_gpus is not None
            # GPUs entered or left MIG mode: restarting the daemon for the new set would end the CUDA
            # contexts of the pods using slices, so it changes once they are gone; until then the
            # slices of a GPU it does not run for are listed Unhealthy (no pod gets one). Whether it
            # answers does not matter: one that is slow to answer must not be told to quit
            # (ensure restarts it for the same GPUs only if it is gone)
            self.uncovered = set(gpus) - set(self._daemon_gpus)
            if moved:
                assert self._daemon_dirs is not None
                if self._daemon_dirs[0] != self.pipe_dir:  # a new pod given our pipe directory would miss it
                    self.uncovered = set(gpus)
                dirs = self._daemon_dirs
            if any(self.live.get(gpus[u]) for u in self.uncovered):
                errors.append(f"the MPS daemon runs for {', '.join(self._daemon_gpus)} and is not restarted while "
                              f"pods use MPS slices: the slices of {', '.join(sorted(self.uncovered))} are listed "
                              "Unhealthy until it can be")
            running = self._daemon_gpus
        else:
            running = sorted(gpus, key=lambda u: gpus[u])  # NVML index order: the clients' device numbers
        try:
            await self.daemon.ensure(running, *dirs)
            self._daemon_gpus = running
            self._daemon_dirs = dirs
        except MpsDaemonError as e:
            # what it runs for now (a busy one is kept as it was), else what it was asked to run
            # for: a later pass with slices in use must not take a difference for a change of GPUs
            # (and stop it), nor miss one
            self._daemon_gpus = list(e.gpus) if isinstance(e, MpsDaemonBusy) and e.gpus else running
            self.daemon_error = str(e)
            return [f"MPS control daemon: {e}; the MPS slices are listed Unhealthy (not allocatable) until it runs"]
        self.daemon_error = None
        return errors
