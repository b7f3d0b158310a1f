"""Kubernetes resource names of GPU slices, parsed and written in one place.

- MIG (device plugin, mixed strategy): `nvidia.com/mig-<profile>`, `+` written `.`, as NVIDIA's
  device plugin (v0.20) names them: `nvidia.com/mig-1g.10gb`, `nvidia.com/mig-1g.10gb.me`,
  and for the RTX PRO Blackwell variants `nvidia.com/mig-1g.24gb.me.all` (`+me.all`),
  `nvidia.com/mig-1g.24gb.gfx` (`+gfx`), `nvidia.com/mig-1g.24gb-me` (`-me`, unchanged).
- MPS slices (the agent's own device plugin; the names nos used): `nvidia.com/gpu-<N>gb`; N is in the
  GPU's capacity unit (GB on a real cluster, any unit a simulation picks).
- A whole GPU: `nvidia.com/gpu`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dynpart.errors import ResourceNameError
from dynpart.kube.conventions import MIG_RESOURCE_PREFIX, MPS_RESOURCE_PREFIX, WHOLE_GPU_RESOURCE

WHOLE_GPU = WHOLE_GPU_RESOURCE
_MIG = re.compile(r"^nvidia\.com/mig-(\d+g\.\d+gb)(\.me|\.me\.all|\.gfx|-me)?$")
_MPS = re.compile(r"^nvidia\.com/gpu-(\d+)gb$")


class MigResource(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: Literal["mig"] = "mig"
    profile: str


class MpsResource(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: Literal["mps"] = "mps"
    size: int


class WholeGpuResource(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: Literal["gpu"] = "gpu"


SliceResource = MigResource | MpsResource | WholeGpuResource


def is_slice_resource(name: str) -> bool:
    return name == WHOLE_GPU or bool(_MIG.match(name) or _MPS.match(name))


def parse_resource(name: str) -> SliceResource:
    if name == WHOLE_GPU:
        return WholeGpuResource()
    m = _MIG.match(name)
    if m:
        return MigResource(profile=m.group(1) + mig_profile_suffix(m.group(2) or ""))
    m = _MPS.match(name)
    if m:
        size = int(m.group(1))
        if size <= 0:
            raise ResourceNameError(f"resource {name!r}: an MPS slice must be at least 1 unit")
        if m.group(1) != str(size):  # the agent advertises the canonical name only: it would never bind
            raise ResourceNameError(f"resource {name!r}: write the size without leading zeros, "
                                    f"{mps_resource_name(size)} (the name the agent advertises)")
        return MpsResource(size=size)
    near = _near_miss(name)
    raise ResourceNameError(
        f"resource {name!r} is not a GPU slice resource; "
        + (f"did you mean {near}? " if near else "")
        + "expected nvidia.com/mig-<profile> (e.g. nvidia.com/mig-1g.10gb, `+` written `.`: "
        "nvidia.com/mig-1g.10gb.me), nvidia.com/gpu-<N>gb (e.g. nvidia.com/gpu-10gb) or nvidia.com/gpu"
    )


def _near_miss(name: str) -> str | None:
    """The slice resource a misspelt name likely meant: a profile as the catalog writes it
    (`1g.10gb+me`, whose `+` no resource name may hold), upper case, or GiB units (`10Gi`, `10GB`)."""
    near = name.lower().replace("+", ".")
    near = re.sub(r"^(nvidia\.com/(?:gpu-|mig-\d+g\.)\d+)(?:gib|gi|g)(?=$|[.-])", r"\1gb", near)
    return near if near != name and is_slice_resource(near) else None


def known_resource(name: str) -> SliceResource | None:
    """The slice resource `name` is, or None: not one, or one written so that `parse_resource`
    refuses it (e.g. nvidia.com/gpu-010gb), which nothing dynpart advertises."""
    try:
        return parse_resource(name) if is_slice_resource(name) else None
    except ResourceNameError:
        return None


def mig_profile_suffix(written: str) -> str:
    """A profile suffix as written in a resource name or annotation key, back as the driver
    names it: `.me` -> `+me`, `.me.all` -> `+me.all`, `.gfx` -> `+gfx`, `-me` -> `-me`."""
    return "+" + written[1:] if written.startswith(".") else written


def mig_resource_name(profile: str) -> str:
    return MIG_RESOURCE_PREFIX + profile.replace("+", ".")


def mps_resource_name(size: int) -> str:
    return f"{MPS_RESOURCE_PREFIX}{size}gb"


def pod_requests(spec: Mapping[str, Any], of: Callable[[Mapping[str, Any]], Mapping[str, float]],
                 running: Callable[[Mapping[str, Any]], Mapping[str, float]] | None = None) -> dict[str, float]:
    """A pod's effective requests as the scheduler and the kubelet count them (Kubernetes'
    PodRequests, without the overhead): the containers and the sidecars (restartable init
    containers) summed, at least what each plain init container needs beside the sidecars
    started before it. `of`: one container's requests; `running`, if given, those of a container
    or sidecar (the ones an in-place resize changes: AggregateContainerRequests reads their
    statuses, never a plain init container's)."""
    def add(into: dict[str, float], more: Mapping[str, float]) -> None:
        for name, q in more.items():
            into[name] = into.get(name, 0) + q

    counted = running or of
    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        add(total, counted(c))
    sidecars: dict[str, float] = {}
    init_peak: dict[str, float] = {}
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            add(sidecars, counted(c))
            continue
        beside = dict(sidecars)
        add(beside, of(c))
        for name, q in beside.items():
            init_peak[name] = max(init_peak.get(name, 0), q)
    add(total, sidecars)
    for name, q in init_peak.items():
        total[name] = max(total.get(name, 0), q)
    return total
