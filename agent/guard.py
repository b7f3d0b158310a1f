"""The last-moment checks before a slice (a MIG instance, an MPS slice, or a whole GPU about to be
carved) stops existing: `SliceGuard`, shared by the MIG and MPS passes.

1. Keep what bound pods need: pods the scheduler bound to this node that the kubelet has not
   admitted yet hold no device in PodResources, but will ask for one; for each resource the
   guard keeps that many free advertised devices (`keep`, from `NodePods`).
2. Withdraw (built-in plugin only): the device leaves ListAndWatch and `release` goes on once
   the kubelet dropped it (PodResources), then waits `settle_s` (an admission that chose the
   device just before the kubelet read the new list still calls Allocate, which the plugin
   serves and records). A device the kubelet still lists when the plugin's wait runs out is
   kept (readmitted): the kubelet may still give it to a pod; the next pass tries again.
3. Re-check: a fresh PodResources list and the plugin's record of Allocate calls; a device found
   in use is advertised again (readmitted) and kept. The bound pods are read again too: until the
   lower allocatable reached the scheduler, it could bind more pods for these devices (1 was read
   before the withdrawal), and a device they need is readmitted. The others are sealed (Allocate
   refuses them) and may be destroyed.

Without the built-in plugin (NVIDIA's), only 1 applies: nothing can be withdrawn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.nodepods import Need, NodePods, to_keep, waiting_for
from dynpart.agent.podresources import PodResources
from dynpart.resources import MpsResource, known_resource

UNCONFIRMED = ("was withdrawn, but the kubelet still listed it when the wait ran out (it could still give it to a "
               "pod); kept, tried again at the next pass")


@dataclass
class Released:
    destroyable: list[str] = field(default_factory=list)  # withdrawn, re-checked unused, sealed
    in_use: dict[str, list[str]] = field(default_factory=dict)  # device id -> who took it (readmitted)
    # device id -> why: pods bound while it was being withdrawn need it (readmitted)
    needed: dict[str, str] = field(default_factory=dict)
    # withdrawn, but the kubelet still listed them when the wait ran out (readmitted; next pass)
    unconfirmed: list[str] = field(default_factory=list)

    @property
    def kept(self) -> set[str]:
        return set(self.in_use) | set(self.needed) | set(self.unconfirmed)


class SliceGuard:
    def __init__(self, pods: PodResources, node_pods: NodePods | None = None, plugins: DevicePluginManager | None = None,
                 *, settle_s: float = 0.5, on_withdrawn: Callable[[], Awaitable[object]] | None = None):
        self.pods = pods
        self.node_pods = node_pods
        self.plugins = plugins
        self.settle_s = settle_s
        self.on_withdrawn = on_withdrawn  # e.g. publish the lower allocatable at once

    async def needs(self) -> dict[str, Need]:
        """What pods bound here and not yet admitted need, per resource (nothing without NodePods)."""
        if self.node_pods is None:
            return {}
        bound = await self.node_pods.bound()
        return waiting_for(bound, await self.pods.list()) if bound else {}

    def advertised(self) -> set[str] | None:
        """Ids the built-in plugin lists healthy now (None: not the built-in plugin; every device
        counts): the kubelet gives a pod no Unhealthy device, so such a device is no free one."""
        if self.plugins is None:
            return None
        return {d.id for ds in self.plugins.advertised().values() for d in ds if d.healthy}

    async def keep(self, candidates: Mapping[str, str], free: Mapping[str, Iterable[str]]) -> dict[str, str]:
        """Device id -> why it stays, among `candidates` (id -> resource, free devices to be
        removed); `free`: resource -> free devices (candidates included). Only advertised devices
        count as free when the built-in plugin serves them."""
        if not candidates:
            return {}
        needs = await self.needs()
        if not needs:
            return {}
        listed = self.advertised()
        if listed is not None:
            free = {r: [i for i in ids if i in listed] for r, ids in free.items()}
            # to_keep keeps the last candidates: an Unhealthy one (not listed) kept for a pod is
            # of no use to it (the kubelet gives it no such device), so those are the first to go
            candidates = {**{i: r for i, r in candidates.items() if i not in listed},
                          **{i: r for i, r in candidates.items() if i in listed}}
        return to_keep(candidates, free, needs)

    async def mps_held(self) -> bool:
        """Whether a pod holds an MPS slice now: listed by PodResources, or running (the API
        server says) with its MPS slices unlisted: a kubelet that restarted lists a pod only once
        its first pod list admitted it again. DynpartError when either cannot be read."""
        assigned = await self.pods.list()
        # (a `<uuid>::<n>` device: one of the agent's slices; a time-sliced replica of NVIDIA's
        # plugin is `nvidia.com/gpu`, and no other device of such a name is a client of the daemon)
        if any(isinstance(known_resource(a.resource), MpsResource) and "::" in a.device_id for a in assigned):
            return True
        bound = await self.node_pods.bound() if self.node_pods is not None else []
        needs = waiting_for(bound, assigned)
        return any(need.unlisted for r, need in needs.items() if isinstance(known_resource(r), MpsResource))

    async def release(self, candidates: Mapping[str, str], free: Mapping[str, Iterable[str]] | None = None) -> Released:
        """Withdraw, wait, re-check: see the module doc. `candidates`: device id -> resource;
        `free`: resource -> free devices (as for `keep`). Without the built-in plugin every id is
        returned destroyable (the caller's own in-use checks still apply)."""
        ids = list(dict.fromkeys(candidates))
        if not ids:
            return Released()
        if self.plugins is None:
            return Released(destroyable=ids)
        since = time.monotonic()
        unconfirmed = await self.plugins.withdraw(*ids)
        if self.on_withdrawn is not None:
            await self.on_withdrawn()
        if self.settle_s > 0:
            await asyncio.sleep(self.settle_s)
        assigned = await self.pods.list()
        holders: dict[str, list[str]] = {}
        for a in assigned:
            holders.setdefault(a.device_id, []).append(f"pod {a.pod}")
        out = Released(unconfirmed=[i for i in ids if i in unconfirmed])
        unused: dict[str, str] = {}
        for i in ids:
            if i in unconfirmed:
                continue
            users = list(dict.fromkeys(holders.get(i, [])))
            last = self.plugins.last_allocated(i)
            if last is not None and last >= since - self.settle_s:
                users.append("a kubelet Allocate call")
            if users:
                out.in_use[i] = users
            else:
                unused[i] = candidates[i]
        if unused and self.node_pods is not None:
            needs = waiting_for(await self.node_pods.bound(), assigned)
            if needs:  # free now: what is still advertised and no pod took
                listed = self.advertised() or set()
                now_free = {r: [i for i in devs if i in listed and i not in holders] for r, devs in (free or {}).items()}
                out.needed = to_keep(unused, now_free, needs)
        # an Allocate that landed while the bound pods were listed (an await) was served: the
        # device is withdrawn, not sealed yet; read the record again right before sealing
        for i in list(unused):
            last = self.plugins.last_allocated(i)
            if i not in out.needed and last is not None and last >= since - self.settle_s:
                out.in_use[i] = ["a kubelet Allocate call"]
                del unused[i]
        out.destroyable = [i for i in unused if i not in out.needed]
        # sealed before anything is readmitted: an Allocate that lands while the kubelet reads the
        # readmitted lists must not get a device about to be destroyed
        if out.destroyable:
            self.plugins.seal(*out.destroyable)
        if out.kept:
            await self.plugins.readmit(*out.kept)
        return out

    async def destroyed(self, ids: Iterable[str]) -> None:
        """These devices were destroyed: forgotten by the plugin at once (`forget`)."""
        ids = list(ids)
        if ids and self.plugins is not None:
            await self.plugins.forget(*ids)

    async def restore(self, ids: Iterable[str]) -> None:
        """Advertise again what could not be destroyed after all (e.g. the driver said IN_USE)."""
        ids = list(ids)
        if ids and self.plugins is not None:
            await self.plugins.readmit(*ids)
