"""Seeded small instances mixing GPU models, MIG and MPS nodes, used and free slices."""

from __future__ import annotations

import random

from dynpart.catalog import default_catalog
from dynpart.mig import feasible_geometries
from dynpart.resources import mig_resource_name, mps_resource_name
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Node, PendingPod, Snapshot

MIG_MODELS = ["A100-40GB", "A100-80GB", "H100-80GB", "A30-24GB"]


def small_instance(seed: int, max_nodes: int = 4, max_gpus: int = 8, max_pods: int = 40,
                   mps_share: float = 0.25) -> Snapshot:
    rng = random.Random(seed)
    catalog = default_catalog()
    nodes = []
    for n in range(rng.randint(1, max_nodes)):
        mode = "mps" if rng.random() < mps_share else "mig"
        model = catalog.models[rng.choice(MIG_MODELS)]
        gpus = []
        for i in range(rng.randint(1, max_gpus)):
            if mode == "mig":
                geom = rng.choice(feasible_geometries(model)) if rng.random() < 0.7 else frozenset()
                gpus.append(Gpu(index=i, mig=[MigInstance(profile=pl.profile, start=pl.start, used=rng.random() < 0.5)
                                              for pl in sorted(geom, key=lambda pl: pl.start)]))
            else:
                slices, left = [], model.mps_capacity_gb
                while left > 4 and rng.random() < 0.6:
                    size = rng.randint(1, left // 2)
                    slices.append(MpsSlice(size=size, used=rng.random() < 0.5))
                    left -= size
                gpus.append(Gpu(index=i, mps=slices))
        nodes.append(Node(name=f"n{n}", mode=mode, gpu_model=model.name, gpus=gpus,
                          cpu_milli_free=rng.choice([4000, 16000, 64000]), memory_mib_free=rng.choice([16384, 262144]),
                          labels={"pool": rng.choice(["a", "b"])}))
    models_here = sorted({nd.gpu_model for nd in nodes if nd.mode == "mig"})
    mps_caps = [catalog.models[nd.gpu_model].mps_capacity_gb for nd in nodes if nd.mode == "mps"]
    pods = []
    for p in range(rng.randint(1, max_pods)):
        if models_here and (not mps_caps or rng.random() < 0.7):
            model = catalog.models[rng.choice(models_here)]
            prof = rng.choice(model.mig_profiles)
            resource = mig_resource_name(prof.name)
        elif mps_caps:
            resource = "nvidia.com/gpu" if rng.random() < 0.1 else mps_resource_name(rng.randint(1, max(mps_caps) // 2))
        else:
            continue
        pods.append(PendingPod(
            name=f"ns/p{p}", resource=resource, count=rng.choice([1, 1, 1, 2]),
            cpu_milli=rng.choice([500, 1000, 4000]), memory_mib=rng.choice([1024, 8192]),
            priority=rng.choice([0, 0, 0, 10]),
            node_selector={"pool": "a"} if rng.random() < 0.1 else {},
        ))
    return Snapshot(nodes=nodes, pending=pods)
