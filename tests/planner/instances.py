"""Seeded small instances mixing GPU models, MIG and MPS nodes, used and free slices; and MPS
instances crowded with small pods, built from drawn parameters (so that hypothesis can shrink
them), where the MPS server's bound on clients (`mps_max_clients`) is what limits a GPU."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.mig import feasible_geometries
from dynpart.resources import mig_resource_name, mps_resource_name
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Node, PendingPod, Snapshot, gpu_capacity

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


# MPS models that hold more 1 GB slices than an MPS server serves (48): 79, 80 and 140 GiB
CROWDABLE_MODELS = ["H100-80GB", "A100-80GB", "H200-141GB"]


def crowded_mps_instance(model: str, gpus: Sequence[Sequence[tuple[int, bool]]], pods: Sequence[tuple[int, int]],
                         gpus_per_node: int = 2) -> Snapshot:
    """MPS nodes of one model with `gpus_per_node` GPUs each; GPU i starts with the slices
    `gpus[i]` as (size GB, used), cut where they would pass the GPU's capacity (not its MPS
    server's bound: a GPU may start past it); pending pods as (size GB, count), each
    `nvidia.com/gpu-<size>gb`. CPU and memory are plentiful: only the GPUs limit the plan."""
    m = default_catalog().models[model]
    laid_out: list[Gpu] = []
    for i, wanted in enumerate(gpus):
        slices, left = [], gpu_capacity(Gpu(index=i), m)
        for size, used in wanted:
            if size <= left:
                slices.append(MpsSlice(size=size, used=used))
                left -= size
        laid_out.append(Gpu(index=i, mps=slices))
    nodes = [Node(name=f"n{k}", mode="mps", gpu_model=model,
                  gpus=[g.model_copy(update={"index": j}) for j, g in enumerate(laid_out[k:k + gpus_per_node])],
                  cpu_milli_free=10**6, memory_mib_free=10**7)
             for k in range(0, len(laid_out), gpus_per_node)]
    return Snapshot(nodes=nodes, pending=[
        PendingPod(name=f"ns/p{i:03}", resource=mps_resource_name(size), count=count, cpu_milli=10, memory_mib=10)
        for i, (size, count) in enumerate(pods)])


@st.composite
def crowded_mps_instances(draw: st.DrawFn, max_gpus: int = 3) -> Snapshot:
    """Few MPS GPUs, many 1-2 GB pods (a few larger ones, a few asking two slices), GPUs empty,
    partly laid out, or laid out past the MPS server's bound. Every parameter is drawn (counts,
    not a seed), so a failure shrinks to few GPUs, slices and pods."""
    model = draw(st.sampled_from(CROWDABLE_MODELS), label="model")
    gpus = []
    for _ in range(draw(st.integers(1, max_gpus), label="GPUs")):
        used_1, used_2, free_1, free_2, free_5 = draw(st.just((0, 0, 0, 0, 0)) | st.tuples(  # empty: half the GPUs
            st.integers(0, 60), st.integers(0, 30), st.integers(0, 64), st.integers(0, 30), st.integers(0, 4)),
            label="slices: used 1gb, used 2gb, free 1gb, free 2gb, free 5gb")
        gpus.append([(1, True)] * used_1 + [(2, True)] * used_2 + [(1, False)] * free_1 + [(2, False)] * free_2
                    + [(5, False)] * free_5)
    ones, twos, tens, pairs = draw(st.tuples(st.integers(0, 130), st.integers(0, 60), st.integers(0, 4),
                                             st.integers(0, 10)),
                                   label="pods: 1gb, 2gb, 10gb, 1gb x 2")
    pods = [(1, 1)] * ones + [(2, 1)] * twos + [(10, 1)] * tens + [(1, 2)] * pairs
    return crowded_mps_instance(model, gpus, pods or [(1, 1)], draw(st.integers(1, 2), label="GPUs a node"))
