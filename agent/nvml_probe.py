"""`dynpart agent probe`: a read-only look at the GPUs through the driver, compared with the
catalog: model, MIG mode, each profile's GI profile id, compute slices, max count and possible
placements, and the GPU instances that exist. Run it on a GPU host before trusting the catalog
rows marked inferred (H200, GH200, B200 starts). It calls no NVML function that changes state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dynpart.agent.driver.interface import GpuDriver, GpuDriverError
from dynpart.catalog import Catalog
from dynpart.errors import DynpartError


@dataclass
class ProbeReport:
    lines: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def probe(driver: GpuDriver, catalog: Catalog) -> ProbeReport:
    report = ProbeReport()
    out, bad = report.lines, report.mismatches
    for d in driver.devices():
        gpu: dict[str, Any] = {**asdict(d), "model": None, "profiles": [], "instances": []}
        report.gpus.append(gpu)
        mode = ("on" if d.mig_current else "off") + ("" if d.mig_current == d.mig_pending else
                                                    f" (pending {'on' if d.mig_pending else 'off'} after reset)")
        out.append(f"GPU {d.index}: {d.name} {d.uuid} {d.memory_mib} MiB, MIG "
                   f"{mode if d.mig_capable else 'not supported'}")
        try:
            model = catalog.resolve(d.name, where=f"GPU {d.index} product name")
        except DynpartError as e:
            bad.append(str(e))
            out.append(f"  not in the catalog: {e}")
            continue
        gpu["model"] = model.name
        out.append(f"  catalog model {model.name}: {len(model.mig_profiles)} MIG profiles")
        if not (d.mig_capable and model.supports_mig):
            if d.mig_capable != model.supports_mig:
                bad.append(f"GPU {d.index}: MIG support is {d.mig_capable} on the driver, "
                           f"{model.supports_mig} in the catalog")
            continue
        for p in model.mig_profiles:
            row: dict[str, Any] = {"name": p.name, "nvml": p.nvml, "catalog_id": p.gi_profile_id}
            gpu["profiles"].append(row)
            try:
                info = driver.profile_info(d.index, p.nvml)
            except GpuDriverError as e:
                out.append(f"  {p.name:<12} {p.nvml}: error {e}")
                row["error"] = str(e)
                continue
            if info is None:
                out.append(f"  {p.name:<12} {p.nvml}: not offered by the driver"
                           + ("" if d.mig_current else " (MIG mode is off: enable it to probe profiles)"))
                row["offered"] = False
                if d.mig_current:
                    bad.append(f"GPU {d.index}: {p.name} ({p.nvml}) not offered by the driver")
                continue
            row.update(driver_id=info.profile_id, slices=info.slices, max=info.instance_count,
                       memory_mib=info.memory_mib, driver_name=info.name)
            problems = []
            if info.profile_id != p.gi_profile_id:
                problems.append(f"id {info.profile_id} (catalog {p.gi_profile_id})")
            if info.slices != p.compute:
                problems.append(f"compute slices {info.slices} (catalog {p.compute})")
            if info.instance_count != p.max:
                problems.append(f"max count {info.instance_count} (catalog {p.max})")
            if info.name and p.name not in info.name:
                problems.append(f"driver name {info.name!r} (catalog {p.name!r})")
            try:
                placements = driver.possible_placements(d.index, info.profile_id)
                row["placements"] = placements
                starts = sorted(s for s, _ in placements)
                if starts != sorted(p.starts):
                    problems.append(f"starts {starts} (catalog {sorted(p.starts)})")
                if any(size != p.memory for _, size in placements):
                    problems.append(f"placement sizes {sorted({z for _, z in placements})} (catalog {p.memory})")
            except GpuDriverError as e:
                problems.append(f"possible placements: {e}")
            row["mismatches"] = problems
            verdict = "ok" if not problems else "MISMATCH: " + "; ".join(problems)
            out.append(f"  {p.name:<12} id {info.profile_id:>2}  slices {info.slices}  max {info.instance_count}  "
                       f"{info.memory_mib} MiB  starts {sorted(p.starts)}  {verdict}")
            bad.extend(f"GPU {d.index} {p.name}: {x}" for x in problems)
        if d.mig_current:
            by_id = {p.gi_profile_id: p.name for p in model.mig_profiles}
            for gi in driver.gpu_instances(d.index):
                gpu["instances"].append(asdict(gi))
                out.append(f"  instance GI {gi.gi_id}: {by_id.get(gi.profile_id, f'profile id {gi.profile_id}')}"
                           f"@{gi.start} (size {gi.size}), compute instances {list(gi.compute_instances)}, "
                           f"{gi.uuid or 'no MIG device'}")
    if not report.gpus:
        out.append("no GPU found")
    return report
