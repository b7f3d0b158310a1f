"""The NVIDIA driver's MIG capability minors (pure: no I/O).

A MIG device is opened through its parent GPU's node (`/dev/nvidia<GPU minor>`) and two
capability nodes, `/dev/nvidia-caps/nvidia-cap<minor>`: its GPU instance's access capability and
its compute instance's. The driver lists every capability's minor in
/proc/driver/nvidia-caps/mig-minors, one `<capability> <minor>` line each (`config 1`,
`monitor 2`, `gpu0/gi0/access 3`, `gpu0/gi0/ci0/access 4`, ...), the GPU named by its minor
number (nvmlDeviceGetMinorNumber), not its NVML index. NVIDIA's device plugin and container
toolkit read that file (k8s-device-plugin internal/mig, nvidia-container-toolkit internal/nvcaps).

The numbers are fixed by the driver (open-gpu-kernel-modules kernel-open/nvidia/nv-caps.c): one
counter from 0 over its tables in order: nvlink `fabric-mgmt` (0), MIG `config` (1) and
`monitor` (2), then for each of 32 GPUs and each of its 15 GPU instances the GI's `access`
followed by its 8 compute instances' (`driver_mig_minors`, which `FakeNvml` serves).
"""

from __future__ import annotations

import re

MIG_MINORS_FILE = "/proc/driver/nvidia-caps/mig-minors"
DRIVER_GPUS = 32  # GPUs the driver's table covers (gpu0 .. gpu31)
GIS_PER_GPU = 15  # gi0 .. gi14
CIS_PER_GI = 8  # ci0 .. ci7

_LINE = re.compile(r"^(config|monitor|gpu\d+/gi\d+/access|gpu\d+/gi\d+/ci\d+/access) (\d+)$")


def gi_cap(gpu_minor: int, gi_id: int) -> str:
    """The GPU instance's access capability as mig-minors names it."""
    return f"gpu{gpu_minor}/gi{gi_id}/access"


def ci_cap(gpu_minor: int, gi_id: int, ci_id: int) -> str:
    """The compute instance's access capability as mig-minors names it."""
    return f"gpu{gpu_minor}/gi{gi_id}/ci{ci_id}/access"


def parse_mig_minors(text: str) -> dict[str, int]:
    """Capability -> minor, from mig-minors' text; lines that are none of its forms are skipped
    (as NVIDIA's plugin does)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def driver_mig_minors(gpus: int = DRIVER_GPUS) -> dict[str, int]:
    """mig-minors as the driver writes it (nv-caps.c), for the first `gpus` GPU minors."""
    out = {"config": 1, "monitor": 2}
    minor = 3
    for gpu in range(gpus):
        for gi in range(GIS_PER_GPU):
            out[gi_cap(gpu, gi)] = minor
            minor += 1
            for ci in range(CIS_PER_GI):
                out[ci_cap(gpu, gi, ci)] = minor
                minor += 1
    return out


def mig_cap_minors(table: dict[str, int], gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int] | None:
    """(GI access minor, CI access minor) of a MIG device from the mig-minors table; None if the
    table lacks either (no such file, an unknown capability)."""
    gi = table.get(gi_cap(gpu_minor, gi_id))
    ci = table.get(ci_cap(gpu_minor, gi_id, ci_id))
    return None if gi is None or ci is None else (gi, ci)
