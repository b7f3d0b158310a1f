"""`dynpart agent probe`: a read-only look at the GPUs through the driver, compared with the
catalog. It runs exactly what the agent runs on start (`capability_reader.read_capability`, then
`dynpart.capability.node_model`), so it reports the same differences the agent reports on its
node (Event CatalogDisagreement) and prints the model the node would be planned with. It calls no
NVML function that changes state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from dynpart.agent.capability_reader import mig_state, read_capability
from dynpart.agent.driver.interface import GpuDriver, GpuDriverError
from dynpart.capability import encode_capability, node_model
from dynpart.catalog import Catalog
from dynpart.errors import DynpartError


@dataclass
class ProbeReport:
    lines: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    capability: str | None = None  # the report the agent would write (dynpart.io/status-capability)
    versions: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        return not self.mismatches


def probe(driver: GpuDriver, catalog: Catalog) -> ProbeReport:
    report = ProbeReport()
    out, bad = report.lines, report.mismatches
    try:
        versions = driver.versions()
        report.versions = asdict(versions)
        out.append(f"driver {versions.driver}, NVML {versions.nvml}, CUDA {versions.cuda}")
    except GpuDriverError as e:  # an old driver without one of the calls: say so, go on
        out.append(f"driver version not readable: {e}")
    devices = driver.devices()
    if not devices:
        out.append("no GPU found")
        return report
    for d in devices:
        if d.lost:
            out.append(f"GPU {d.index}: lost (NVML answers GPU_IS_LOST: fallen off the bus); not read")
            bad.append(f"GPU {d.index} is lost (NVML answers GPU_IS_LOST): reset it or reboot the node")
            report.gpus.append({**asdict(d), "mig": None, "model": None, "profiles": [], "instances": []})
            continue
        state = mig_state(d)
        reserved = f" ({d.reserved_mib} reserved)" if d.reserved_mib is not None else ""
        out.append(f"GPU {d.index}: {d.name} {d.uuid} {d.memory_mib} MiB{reserved}, MIG {state}")
        report.gpus.append({**asdict(d), "mig": state, "model": None, "profiles": [], "instances": []})
    try:
        capability, unread = read_capability(driver, catalog)
        choice = node_model(capability, catalog)
    except DynpartError as e:
        bad.append(str(e))
        out.append(f"cannot describe the node: {e}")
        return report
    report.capability = encode_capability(capability)
    model = choice.model
    source = ("the catalog's" if model.family is None else
              f"from the driver ({'catalog model ' + model.family if model.family in catalog.models else 'not in the catalog'})")
    out.append(f"planned as {model.name}, {source}: {len(model.mig_profiles)} MIG profiles, MPS capacity "
               f"{model.mps_capacity_gb} GB")
    kind = capability.kinds[capability.gpus[0].kind]
    if not kind.profiles and model.supports_mig and any(d.mig_capable and not d.mig_current for d in devices):
        out.append("  MIG mode is off and the driver lists no GPU-instance profile: the catalog's are used")
    for p in kind.profiles:
        planned = "planned" if p.name in model.profiles_by_name else "NOT planned"
        out.append(f"  {p.name:<12} id {p.id:>2}  slices {p.compute}  memory {p.memory}  max {p.max}  "
                   f"starts {list(p.starts)}  {planned}")
    for gpu in report.gpus:
        gpu["model"] = model.name
        gpu["profiles"] = [{"name": p.name, "id": p.id, "nvml": p.nvml, "compute": p.compute, "memory": p.memory,
                            "max": p.max, "starts": list(p.starts), "planned": p.name in model.profiles_by_name}
                           for p in kind.profiles]
    bad.extend([*unread, *choice.disagreements])
    by_id = {p.gi_profile_id: p.name for p in model.mig_profiles}
    for d, gpu in zip(devices, report.gpus):
        if not d.mig_current or d.lost:
            continue
        for gi in driver.gpu_instances(d.index):
            gpu["instances"].append(asdict(gi))
            out.append(f"  GPU {d.index} instance GI {gi.gi_id}: {by_id.get(gi.profile_id, f'profile id {gi.profile_id}')}"
                       f"@{gi.start} (size {gi.size}), compute instances {list(gi.compute_instances)}, "
                       f"{gi.uuid or 'no MIG device'}")
    return report


def read_paths(driver: GpuDriver, catalog: Catalog) -> list[str]:
    """Every read the agent may make, on every GPU, and what the driver answered, one line each.
    Reads the probe does not make are made too (health, processes, each of the catalog's profiles
    by its NVML constant and its placements), so that a recording (`probe --record`) holds the
    driver's answers, errors included, to all of them. Changes nothing."""
    lines: list[str] = []

    def ask(what: str, read: Callable[[], object]) -> None:
        try:
            answer = read()
        except GpuDriverError as e:
            lines.append(f"{what}: error {e.code} ({e})")
            return
        lines.append(f"{what}: {answer!r}")

    for d in driver.devices():
        i = d.index
        if d.lost:
            lines.append(f"GPU {i}: lost (GPU_IS_LOST), not read")
            continue
        try:
            profiles = catalog.resolve(d.name).mig_profiles
        except DynpartError:
            profiles = ()
        ask(f"GPU {i} health", partial(driver.health, i))
        ask(f"GPU {i} processes", partial(driver.processes, i))
        ask(f"GPU {i} gpu_instance_profiles", partial(driver.gpu_instance_profiles, i))
        ask(f"GPU {i} gpu_instances", partial(driver.gpu_instances, i))
        for p in profiles:
            ask(f"GPU {i} profile_info {p.nvml}", partial(driver.profile_info, i, p.nvml))
            ask(f"GPU {i} possible_placements id {p.gi_profile_id} ({p.name})",
                partial(driver.possible_placements, i, p.gi_profile_id))
    return lines
