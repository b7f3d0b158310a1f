"""The node's GPUs as the driver describes them: product, memory, MIG mode and, per GPU-instance
profile, its id, compute and memory slices, max count and possible placements. Read-only NVML
calls; the result is the capability report (`dynpart.capability`) the agent writes on its node
and plans its own node with, and what `dynpart agent probe` prints. The agent makes them on its
driver's thread as one call (`AsyncDriver.read`), never on its event loop."""

from __future__ import annotations

import re
from dataclasses import replace

from pydantic import ValidationError

from dynpart.agent.driver.interface import GPU_IS_LOST, DeviceInfo, GpuDriver, GpuDriverError
from dynpart.capability import GpuKind, GpuReport, MigState, NodeCapability, ProfileCapability
from dynpart.catalog import MIG_PROFILE_PATTERN, Catalog
from dynpart.errors import DynpartError, first_problem

_DRIVER_NAME = re.compile(rf"(?:MIG )?({MIG_PROFILE_PATTERN})")


def mig_state(d: DeviceInfo) -> MigState:
    if not d.mig_capable:
        return "unsupported"
    if d.mig_current == d.mig_pending:
        return "on" if d.mig_current else "off"
    return "off-pending" if d.mig_current else "on-pending"


def mps_memory_mib(d: DeviceInfo, catalog: Catalog) -> int:
    """What MPS slices may take of GPU `d`, in MiB: NVML's total less what the driver reserves (not
    free even on an idle GPU: 480 MiB on an H100, 616 on an H200, tests/fixtures/nvml). A driver
    that cannot say what it reserves is taken to reserve what the catalog measured on the same GPU
    (same product, same total), else nothing."""
    reserved = d.reserved_mib
    if reserved is None:
        try:
            model = catalog.resolve(d.name)
        except DynpartError:
            model = None
        if model is not None and model.memory_mib == d.memory_mib:
            reserved = model.reserved_mib
    return max(1, d.memory_mib - (reserved or 0))


def read_profiles(driver: GpuDriver, index: int, catalog: Catalog, product: str,
                  problems: list[str]) -> list[ProfileCapability]:
    """The profiles the driver offers on GPU `index` (in MIG mode), with their placements. A
    profile without a usable name (drivers before the V2 profile info give none) takes the
    catalog's name for its id; one that cannot be named or placed is left out with a problem."""
    try:
        known = {p.gi_profile_id: p.name for p in catalog.resolve(product).mig_profiles}
    except DynpartError:
        known = {}
    out: list[ProfileCapability] = []
    for info in driver.gpu_instance_profiles(index):
        m = _DRIVER_NAME.fullmatch(info.name.strip())
        name = m.group(1) if m else known.get(info.profile_id)
        if name is None:
            problems.append(f"GPU {index}: GI profile id {info.profile_id} ({info.name or 'no name'}): the driver gives "
                            "no profile name dynpart reads, and the catalog has none for this id; not planned")
            continue
        try:
            placements = driver.possible_placements(index, info.profile_id)
        except GpuDriverError as e:
            problems.append(f"GPU {index}: {name}: possible placements: {e}; not planned")
            continue
        sizes = {size for _, size in placements}
        if len(sizes) != 1:
            problems.append(f"GPU {index}: {name}: placements of sizes {sorted(sizes)}; not planned")
            continue
        try:
            out.append(ProfileCapability(name=name, id=info.profile_id, nvml=info.nvml or "UNKNOWN",
                                         compute=info.slices, memory=sizes.pop(), max=info.instance_count,
                                         starts=tuple(sorted({s for s, _ in placements}))))
        except ValidationError as e:
            problems.append(f"GPU {index}: {name}: the driver's values are not usable ({first_problem(e)}); not planned")
    return sorted(out, key=lambda p: (p.memory, p.compute, p.name))


def read_capability(driver: GpuDriver, catalog: Catalog) -> tuple[NodeCapability, list[str]]:
    """The node's capability report, and what could not be read (sentences). The profiles of a
    kind of GPU (product and memory) are read once, from a GPU in MIG mode if there is one: the
    driver lists them whatever the MIG mode (an H100 and an H200 on driver 580 do, tests/fixtures/nvml),
    but a driver that lists none while MIG mode is off is asked again on the kind's next GPU."""
    problems: list[str] = []
    devices = driver.devices()
    if not devices:
        raise DynpartError("the driver reports no GPU")
    # a lost GPU (fallen off the bus) is not read: it is described as last read, or, never read
    # (lost before the agent started), as the node's first GPU that answers (a node's GPUs are of
    # one kind; its agent reports it unhealthy, and the planner leaves it out)
    readable = [d for d in devices if not d.lost]
    if not readable and any(not d.name for d in devices):
        raise GpuDriverError(GPU_IS_LOST, "every GPU of the node is lost (NVML answers GPU_IS_LOST): "
                                          "nothing describes them")
    stand_in = min(readable, key=lambda d: d.index) if readable else None
    devices = [d if not d.lost or d.name or stand_in is None
               else replace(stand_in, index=d.index, uuid=d.uuid, lost=True) for d in devices]
    read: dict[tuple[str, int], tuple[ProfileCapability, ...]] = {}
    settled: set[tuple[str, int]] = set()  # kinds read, or whose read said what went wrong
    for d in sorted(readable, key=lambda d: (not d.mig_current, d.index)):
        key = (d.name, d.memory_mib)
        if d.mig_capable and key not in settled:
            before = len(problems)
            read[key] = tuple(read_profiles(driver, d.index, catalog, d.name, problems))
            if read[key] or len(problems) > before:
                settled.add(key)
    # what MPS slices may take, per kind (product, total): the least of its GPUs. What the driver
    # reserves is read per GPU and may differ between GPUs of one product (MIG mode, firmware):
    # one kind a product and total, as before, or the node would be of several kinds, not planned
    mps_mib: dict[tuple[str, int], int] = {}
    for d in devices:
        key = (d.name, d.memory_mib)
        mps_mib[key] = min(mps_mib.get(key, d.memory_mib), mps_memory_mib(d, catalog))
    kinds: dict[GpuKind, int] = {}
    gpus: list[GpuReport] = []
    for d in sorted(devices, key=lambda d: d.index):
        profiles = read.get((d.name, d.memory_mib), ())
        try:
            kind = GpuKind(product=d.name[:96], memory_mib=mps_mib[(d.name, d.memory_mib)],
                           memory_slices=max((s + p.memory for p in profiles for s in p.starts), default=0),
                           compute_slices=max((p.compute for p in profiles), default=0), profiles=profiles)
        except ValidationError as e:  # e.g. no product name: nothing to plan this node with
            raise DynpartError(f"GPU {d.index} ({d.name!r}, {d.memory_mib} MiB): the driver's description is not "
                               f"usable ({first_problem(e)})") from None
        gpus.append(GpuReport(kind=kinds.setdefault(kind, len(kinds)), mig=mig_state(d)))
    try:
        return NodeCapability(kinds=tuple(kinds), gpus=tuple(gpus)), problems
    except ValidationError as e:
        raise DynpartError(f"the node's GPUs cannot be described ({first_problem(e)})") from None

