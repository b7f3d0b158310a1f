"""Which devices each resource advertises, from the agent's view of the GPUs (pure: no I/O).

A GPU is advertised one way only:
- MIG mode on: each MIG device (one with a compute instance, so a `MIG-...` UUID) under
  `nvidia.com/mig-<profile>` (`+` written `.`), device id = the MIG UUID;
- MPS slices planned on it: each slice under `nvidia.com/gpu-<N>gb`, device id
  `<GPU UUID>::<n>` (n = the slice's number: its position on the GPU, as the device-plugin fork
  numbers replicas, unless the view gives the numbers);
- otherwise: the whole GPU under `nvidia.com/gpu`, device id = the GPU UUID.

Withdrawn device ids (a slice the agent is about to destroy) are left out. `check_exclusive`
is the invariant the plugin manager enforces on every update: no GPU is advertised both whole
and sliced.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from dynpart.agent.podresources import AssignedDevice
from dynpart.errors import DynpartError
from dynpart.kube.conventions import DEV_SHM
from dynpart.resources import WHOLE_GPU, mig_resource_name, mps_resource_name, parse_resource

Kind = Literal["gpu", "mig", "mps"]


class DeviceListError(DynpartError):
    """A device list the plugin must not advertise (e.g. a GPU both whole and sliced)."""


@dataclass(frozen=True)
class PluginDevice:
    """One device as a plugin advertises it and as Allocate needs it."""

    id: str  # GPU UUID, MIG UUID, or `<GPU UUID>::<n>` for an MPS slice
    kind: Kind
    gpu_uuid: str
    gpu_index: int
    size_gb: int = 0  # MPS: the slice's memory; MIG/whole: informational
    gpu_memory_gb: int = 0
    healthy: bool = True
    numa_node: int | None = None
    # the device nodes a container needs for it besides the control nodes (`device_nodes`):
    # /dev/nvidia<GPU minor>, and for a MIG device its two capability nodes
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class MigDeviceView:
    profile: str  # driver name, e.g. "1g.10gb" or "1g.10gb+me"
    uuid: str | None  # None while the GI has no compute instance: not advertised
    # minors of its GPU instance's and compute instance's access capabilities
    # (/dev/nvidia-caps/nvidia-cap<minor>, `driver.nvcaps`); None: not known
    caps: tuple[int, int] | None = None


@dataclass(frozen=True)
class GpuView:
    """The agent's view of one GPU after a pass."""

    index: int
    uuid: str
    memory_gb: int
    mig_enabled: bool = False
    mig: tuple[MigDeviceView, ...] = ()
    mps: tuple[int, ...] = ()  # MPS slice sizes in GB, in the order the plan lists them
    # the slices' numbers (device id `<GPU UUID>::<n>`), one per size; empty: 0, 1, 2, ... The
    # agent keeps a slice's number for as long as the slice exists (the kubelet knows it by it)
    mps_ids: tuple[int, ...] = ()
    healthy: bool = True
    numa_node: int | None = None
    minor: int | None = None  # the GPU's device minor number (/dev/nvidia<minor>); None: not known


@dataclass
class Advertised:
    """Devices by resource name, in a stable order."""

    by_resource: dict[str, list[PluginDevice]] = field(default_factory=dict)

    def add(self, resource: str, device: PluginDevice) -> None:
        self.by_resource.setdefault(resource, []).append(device)


def mps_device_id(gpu_uuid: str, n: int) -> str:
    return f"{gpu_uuid}::{n}"


def advertise(gpus: Iterable[GpuView], withdrawn: Iterable[str] = ()) -> dict[str, list[PluginDevice]]:
    """Resource name -> the devices to advertise for it. Resources with no device are absent."""
    gone = set(withdrawn)
    out = Advertised()
    for g in sorted(gpus, key=lambda g: g.index):

        def device(device_id: str, kind: Kind, size_gb: int, g: GpuView = g,
                   caps: tuple[int, int] | None = None) -> PluginDevice:
            return PluginDevice(id=device_id, kind=kind, gpu_uuid=g.uuid, gpu_index=g.index, size_gb=size_gb,
                                gpu_memory_gb=g.memory_gb, healthy=g.healthy, numa_node=g.numa_node,
                                nodes=device_nodes(g.minor, caps))

        if g.mig_enabled:
            for m in g.mig:
                if m.uuid and m.uuid not in gone:
                    out.add(mig_resource_name(m.profile), device(m.uuid, "mig", 0, caps=m.caps))
        elif g.mps:
            if g.mps_ids and len(g.mps_ids) != len(g.mps):
                raise DeviceListError(f"GPU {g.uuid}: {len(g.mps)} MPS slice sizes but {len(g.mps_ids)} slice numbers")
            for n, size in zip(g.mps_ids or range(len(g.mps)), g.mps, strict=True):
                device_id = mps_device_id(g.uuid, n)
                if device_id not in gone:
                    out.add(mps_resource_name(size), device(device_id, "mps", size))
        elif g.uuid not in gone:
            out.add(WHOLE_GPU, device(g.uuid, "gpu", g.memory_gb))
    return out.by_resource


def held_elsewhere(lists: Mapping[str, Iterable[PluginDevice]], assigned: Iterable[AssignedDevice]
                   ) -> dict[str, list[str]]:
    """Device id -> the holders ("pod <ns/name> as <resource> <id>") of each listed device that a
    pod holds under another resource name or device id: what another plugin gave out as the same
    hardware (a MIG UUID as nvidia.com/gpu, a time-sliced `<uuid>::<n>`). `assigned`: the
    PodResources assignments."""
    listed = {(r, d.id) for r, ds in lists.items() for d in ds}
    ids = {i for _, i in listed}
    out: dict[str, list[str]] = {}
    for a in assigned:
        base = a.device_id.split("::", 1)[0]
        if base in ids and (a.resource, a.device_id) not in listed:
            holder = f"pod {a.pod} as {a.resource} {a.device_id}"
            if holder not in out.setdefault(base, []):
                out[base].append(holder)
    return out


def check_exclusive(devices_by_resource: Mapping[str, Iterable[PluginDevice]]) -> None:
    """Raise DeviceListError if a GPU is advertised both whole and sliced, if a device id appears
    twice, or if a device sits under a resource of another kind."""
    whole: dict[str, str] = {}
    sliced: dict[str, str] = {}
    seen: dict[str, str] = {}
    for resource, devices in devices_by_resource.items():
        for d in devices:
            if d.id in seen:
                raise DeviceListError(f"device {d.id} is advertised twice ({seen[d.id]} and {resource})")
            seen[d.id] = resource
            expected = resource_kind(resource)
            if d.kind != expected:
                raise DeviceListError(f"device {d.id} is a {d.kind} device but sits under {resource} ({expected})")
            (whole if d.kind == "gpu" else sliced)[d.gpu_uuid] = resource
    both = sorted(set(whole) & set(sliced))
    if both:
        raise DeviceListError("GPU(s) advertised both whole and sliced: " +
                              ", ".join(f"{u} ({whole[u]} and {sliced[u]})" for u in both))


def resource_kind(resource: str) -> Kind:
    return parse_resource(resource).kind


# --- the device nodes a container is given -------------------------------------------------------

# the driver's control nodes, as NVIDIA's plugin lists them for every container (each only where
# it exists: nvidia-modeset and nvidia-uvm-tools are not on every host)
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


def gpu_node(minor: int) -> str:
    return f"/dev/nvidia{minor}"


def cap_node(minor: int) -> str:
    return f"/dev/nvidia-caps/nvidia-cap{minor}"


def device_nodes(gpu_minor: int | None, caps: tuple[int, int] | None = None) -> tuple[str, ...]:
    """A device's own nodes, as NVIDIA's plugin computes them (internal/rm/nvml_devices.go
    GetPaths): the GPU's /dev/nvidia<minor> (whole GPU, MPS slice, a MIG device's parent) and, for
    a MIG device, its GPU instance's and compute instance's access capability nodes (`caps`: their
    minors). What is not known is left out."""
    gpu = (gpu_node(gpu_minor),) if gpu_minor is not None else ()
    return gpu + (tuple(cap_node(c) for c in caps) if caps else ())


@dataclass(frozen=True)
class DeviceSpec:
    """A device node the kubelet has the runtime put in the container (its OCI spec's devices and
    device cgroup rules): `host_path` on the node, `container_path` inside."""

    container_path: str
    host_path: str
    permissions: str = "rw"


def device_specs(devices: Iterable[PluginDevice], dev_root: str = "/",
                 exists: Callable[[str], bool] = lambda path: True) -> tuple[DeviceSpec, ...]:
    """The DeviceSpecs of a container given `devices`: the control nodes then each device's nodes
    (once each), at the same path inside as under `dev_root` on the host (NVIDIA's NVIDIA_DEV_ROOT:
    `<dev_root>/dev/nvidia0` -> /dev/nvidia0), only those `exists` says are there (given the path
    inside, /dev/...): a DeviceSpec whose host path is missing fails the container's creation.
    NVIDIA's plugin with PASS_DEVICE_SPECS=true (as GPU Operator deploys it) answers the same; the
    device cgroup then keeps them across a CPU manager's UpdateContainerResources or a systemd
    daemon-reload, which otherwise cut the container off the GPU the runtime hook gave it
    ("Failed to initialize NVML: Unknown Error", NVIDIA/nvidia-docker#1730)."""
    paths = dict.fromkeys([*CONTROL_NODES, *(n for d in devices for n in d.nodes)])
    return tuple(DeviceSpec(p, host_device_path(dev_root, p)) for p in paths if exists(p))


def host_device_path(dev_root: str, path: str) -> str:
    """`path` (/dev/...) under `dev_root` on the host."""
    return posixpath.join(dev_root, path.lstrip("/"))


# --- what Allocate hands a container ------------------------------------------------------------

MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class MountSpec:
    host_path: str
    container_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerAllocation:
    envs: dict[str, str]
    mounts: tuple[MountSpec, ...] = ()


# NVIDIA's device-list strategies (its plugin's DEVICE_LIST_STRATEGY): the device ids in
# NVIDIA_VISIBLE_DEVICES, or one /dev/null mount per id under this directory, with the variable
# naming the directory (the runtime then takes the devices only from mounts, which a pod cannot
# forge, where it is set with accept-nvidia-visible-devices-as-volume-mounts=true); or by CDI name
# (`cdi-cri`: the response's CDIDevices, `cdi-annotations`: a cdi.k8s.io/ annotation; deviceplugin/
# cdi.py), NVIDIA_VISIBLE_DEVICES then `void` as NVIDIA's plugin sets it (a CUDA image's own `all`
# would otherwise give the container every GPU under the NVIDIA runtime)
DeviceList = Literal["envvar", "volume-mounts", "cdi-cri", "cdi-annotations"]
DEVICE_LIST_MOUNTS = "/var/run/nvidia-container-devices"


def container_allocation(devices: list[PluginDevice], mps_pipe_host: str = MPS_PIPE_DIRECTORY,
                         mps_pipe_container: str = MPS_PIPE_DIRECTORY,
                         device_list: DeviceList = "envvar", mps_shm_host: str | None = None) -> ContainerAllocation:
    """The env vars and mounts for a container given `devices` (all of one resource, as the kubelet
    asks per resource): NVIDIA_VISIBLE_DEVICES names the MIG or GPU UUIDs (the NVIDIA container
    runtime does the rest). MPS slices also get their memory limit per GPU
    (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<N>G`, slices on one GPU summed), a thread share
    proportional to the memory share (the largest over the GPUs), and the MPS pipe directory.
    The limit names the GPUs by the CUDA ordinal the container sees, not by UUID (NVIDIA's plugin
    moved its limits to device indices in v0.15.0 because limits set by UUID were not applied;
    its daemon sets them by host index, a client's variable counts the client's GPUs): ordinal i is
    the i-th UUID of `CUDA_VISIBLE_DEVICES`, set to the slices' GPUs in NVML index order (and
    `CUDA_DEVICE_ORDER=PCI_BUS_ID`, the same order, for a pod that overrides it with indices). `mps_shm_host`: the host directory that
    is the MPS control daemon's /dev/shm, mounted at the client's (as NVIDIA's plugin does); None:
    the daemon shares the host's, which the client reaches only with hostIPC: true."""
    if not devices:
        return ContainerAllocation(envs={})
    if any(d.kind == "mig" for d in devices):
        return _visible([d.id for d in devices], device_list)
    gpus = [u for _, u in sorted({(d.gpu_index, d.gpu_uuid) for d in devices})]
    visible = _visible(gpus, device_list)
    if all(d.kind == "gpu" for d in devices):
        return visible
    envs = dict(visible.envs)
    per_gpu: dict[str, int] = {}
    share = 0
    for d in devices:
        per_gpu[d.gpu_uuid] = per_gpu.get(d.gpu_uuid, 0) + d.size_gb
    for d in devices:
        total = per_gpu[d.gpu_uuid]
        share = max(share, min(100, max(1, round(100 * total / d.gpu_memory_gb))) if d.gpu_memory_gb else 100)
    envs["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # the ordinals the limit names, pinned: CUDA sees exactly these GPUs, in this order (UUIDs, as
    # NVIDIA's MPS guide recommends for clients). Without it a GPU the container gets from another
    # resource (the kubelet merges the responses: first env value wins, mounts add up) would be a
    # CUDA device no limit names, usable whole
    envs["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{n}={per_gpu[u]}G" for n, u in enumerate(gpus))
    envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share)
    envs["CUDA_MPS_PIPE_DIRECTORY"] = mps_pipe_container
    shm = (MountSpec(mps_shm_host, DEV_SHM),) if mps_shm_host else ()
    return ContainerAllocation(envs=envs, mounts=(*visible.mounts, MountSpec(mps_pipe_host, mps_pipe_container), *shm))


def _visible(ids: list[str], device_list: DeviceList) -> ContainerAllocation:
    """How the NVIDIA container runtime is told which GPUs or MIG devices the container gets."""
    if device_list in ("cdi-cri", "cdi-annotations"):
        return ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": "void"})
    if device_list == "volume-mounts":
        return ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": DEVICE_LIST_MOUNTS},
                                   mounts=tuple(MountSpec("/dev/null", f"{DEVICE_LIST_MOUNTS}/{i}") for i in ids))
    return ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)})


def packed_first(available: Iterable[str], devices: Iterable[PluginDevice], used_per_gpu: Mapping[int, int]) -> list[str]:
    """The `available` ids in the order GetPreferredAllocation prefers them: those on the GPUs
    with the most slices in use first, then by GPU index, then as advertised. The kubelet's request
    names no pod, so the plugin cannot tell which pod a slice was made for; on one node the slices
    of one resource are alike, and what is left to prefer is packing: a pod goes where others run,
    which keeps the other GPUs' free slices together for the planner's next re-carving."""
    where = {d.id: d.gpu_index for d in devices}
    order = {d: i for i, d in enumerate(where)}
    ids = [i for i in available if i in where]
    return sorted(ids, key=lambda i: (-used_per_gpu.get(where[i], 0), where[i], order[i]))
