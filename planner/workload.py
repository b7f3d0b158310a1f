"""Seeded random clusters and pending pods, for the planner benchmark and the tests.

A generated cluster is loaded the way a busy one is: GPUs carry valid MIG geometries (or MPS
slices) whose instances are partly in use, until about `utilization` of the GPU memory is in
use; the pending pods ask for a mix of slice sizes (small ones most often).
"""

from __future__ import annotations

import random

from dynpart.catalog import Catalog, GpuModel, default_catalog
from dynpart.mig import feasible_geometries
from dynpart.resources import mig_resource_name, mps_resource_name
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Node, PendingPod, Snapshot

# relative frequency of profiles by compute slices (+me and double-memory 1g are rarer)
_MIG_MIX = {"1g": 40, "1g-2x": 8, "1g+me": 3, "2g": 20, "3g": 15, "4g": 7, "7g": 7}
_MPS_MIX = {1 / 8: 35, 1 / 4: 30, 1 / 2: 20, 1.0: 15}


def _profile_classes(model: GpuModel) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in model.mig_profiles:
        c = p.name.split(".")[0]
        if p.media_extensions:
            out.setdefault(c + "+me", p.name)
        elif c in out:
            out.setdefault(c + "-2x", p.name)
        else:
            out[c] = p.name
    return out


def random_snapshot(seed: int, nodes: int, gpus_per_node: int, gpu: str, pending: int, mode: str,
                    utilization: float = 0.9, catalog: Catalog | None = None) -> Snapshot:
    rng = random.Random(seed)
    model = (catalog or default_catalog()).resolve(gpu)
    geoms = [g for g in feasible_geometries(model) if g] if mode == "mig" else []
    out_nodes = []
    for n in range(nodes):
        gpus = []
        for i in range(gpus_per_node):
            if rng.random() >= utilization:
                gpus.append(Gpu(index=i))
                continue
            if mode == "mig":
                geom = sorted(rng.choice(geoms), key=lambda pl: pl.start)
                gpus.append(Gpu(index=i, mig=[
                    MigInstance(profile=pl.profile, start=pl.start, used=rng.random() < 0.8) for pl in geom]))
            else:
                cap, slices = model.mps_capacity_gb, []
                left = cap
                while left > 0:
                    size = min(left, max(1, int(cap * rng.choice(list(_MPS_MIX)))))
                    slices.append(MpsSlice(size=size, used=rng.random() < 0.8))
                    left -= size
                    if rng.random() < 0.25:
                        break
                gpus.append(Gpu(index=i, mps=slices))
        out_nodes.append(Node(
            name=f"node-{n:04d}", mode=mode, gpu_model=model.name,
            cpu_milli_free=rng.randrange(16_000, 96_001, 1000), memory_mib_free=rng.randrange(64, 513) * 1024,
            labels={"topology.kubernetes.io/zone": f"zone-{n % 3}"}, gpus=gpus,
        ))
    classes = _profile_classes(model) if mode == "mig" else {}
    pods = []
    for p in range(pending):
        if mode == "mig":
            keys = [k for k in _MIG_MIX if k in classes]
            resource = mig_resource_name(classes[rng.choices(keys, [_MIG_MIX[k] for k in keys])[0]])
        else:
            frac = rng.choices(list(_MPS_MIX), list(_MPS_MIX.values()))[0]
            resource = mps_resource_name(max(1, int(model.mps_capacity_gb * frac)))
        pods.append(PendingPod(
            name=f"team-{p % 7}/pod-{p:05d}", resource=resource,
            count=2 if rng.random() < 0.08 else 1,
            cpu_milli=rng.choice([500, 1000, 2000, 4000, 8000]), memory_mib=rng.choice([2048, 8192, 16384, 32768]),
            priority=100 if rng.random() < 0.1 else 0,
            node_selector={"topology.kubernetes.io/zone": f"zone-{p % 3}"} if rng.random() < 0.05 else {},
        ))
    return Snapshot(nodes=out_nodes, pending=pods)
