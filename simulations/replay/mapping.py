"""How a trace pod's GPU request (`num_gpu`, `gpu_milli`) becomes a slice resource in replay.

MIG, rule `compute` (default): the smallest profile whose compute share (compute slices / the
GPU's compute slices) is at least gpu_milli / 1000; among profiles with the same compute, the
one with the least memory; `+me` profiles are never chosen. Rule `memory`: the same with the
memory share (memory slices / the GPU's memory slices). A pod asking for whole GPUs
(gpu_milli 1000) gets `num_gpu` instances of the full-GPU profile (7g) on one node.

MPS (capacity in GB, the model's memory): a sharing pod gets the smallest slice in whole GB
with at least its share of the memory, `nvidia.com/gpu-<N>gb`; whole-GPU pods get
`nvidia.com/gpu` x num_gpu. (The packing benchmark uses its own unit, GPU milli.)

A pod that names its slice (`TracePod.slice_name`, the built-in workload's pods) gets that
slice: a MIG profile of the model in MIG mode, `<N>gb` in MPS mode; `gpu_milli` is then only
informative.
"""

from __future__ import annotations

import math

from dynpart.catalog import GpuModel
from dynpart.planner.baselines.static import balanced_counts
from dynpart.resources import WHOLE_GPU, mig_resource_name, mps_resource_name
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.traces import MILLI, TracePod

RULES = ("compute", "memory")


def mig_profile_for(model: GpuModel, gpu_milli: int, rule: str = "compute") -> str:
    if rule not in RULES:
        raise SimulationError(f"--mapping {rule!r}: expected one of {', '.join(RULES)}")
    if not model.supports_mig:
        raise SimulationError(f"GPU model {model.name} does not support MIG")
    share = gpu_milli / MILLI
    best = None
    for p in model.mig_profiles:
        if p.media_extensions:
            continue
        have = p.compute / model.compute_slices if rule == "compute" else p.memory / model.memory_slices
        if have + 1e-9 < share:
            continue
        key = (p.compute, p.memory) if rule == "compute" else (p.memory, p.compute)
        if best is None or key < best[0]:
            best = (key, p.name)
    if best is None:  # cannot happen: the full profile covers any share
        raise SimulationError(f"no MIG profile of {model.name} covers {gpu_milli} milli")
    return best[1]


def full_profile(model: GpuModel) -> str:
    return max((p for p in model.mig_profiles if not p.media_extensions), key=lambda p: (p.compute, p.memory)).name


def request_for(pod: TracePod, model: GpuModel, mode: str, rule: str = "compute") -> tuple[str, int]:
    """(resource, count) of a GPU pod on this model in this mode."""
    if pod.num_gpu == 0:
        raise ValueError("CPU-only pods have no GPU request")
    if pod.slice_name:
        return _named(pod, model, mode), pod.num_gpu
    if mode == "mig":
        profile = full_profile(model) if not pod.is_share else mig_profile_for(model, pod.gpu_milli, rule)
        return mig_resource_name(profile), pod.num_gpu
    if not pod.is_share:
        return WHOLE_GPU, pod.num_gpu
    # the whole GB within its share, at least 1: k pods of 1/k share fit a GPU, as they did on the
    # traced cluster (rounded up, two half-GPU pods would not fit the 79 GiB of an H100)
    return mps_resource_name(max(1, math.floor(pod.gpu_milli * model.mps_capacity_gb / MILLI + 1e-9))), 1


def _named(pod: TracePod, model: GpuModel, mode: str) -> str:
    name = pod.slice_name
    size = name[:-2] if name.endswith("gb") and name[:-2].isdigit() else None
    if mode == "mig":
        if name not in model.profiles_by_name:
            raise SimulationError(f"pod {pod.name} asks for {name!r}, not a MIG profile of {model.name} "
                                  f"({', '.join(p.name for p in model.mig_profiles)})")
        return mig_resource_name(name)
    if size is None or not 1 <= int(size) <= model.mps_capacity_gb:
        raise SimulationError(f"pod {pod.name} asks for {name!r}: an MPS cluster of {model.name} serves "
                              f"<N>gb slices, N in 1..{model.mps_capacity_gb}")
    return mps_resource_name(int(size))


def held_share(model: GpuModel, mode: str, what: str, capacity: int) -> float:
    """Fraction of one GPU a slice holds (MIG: its memory slices; MPS: its size / capacity)."""
    if what == "whole":
        return 1.0
    if mode == "mig":
        profile = what.split("@")[0]
        return model.profiles_by_name[profile].memory / model.memory_slices
    return int(what) / capacity


MPS_STATIC = (1, 2, 4, 8)  # mps-N layouts tried for the best static layout


def static_contenders(model: GpuModel, mode: str, sizes: tuple[int, ...] = ()) -> list[str]:
    """The standard static layouts the static policy can apply to this model, as
    `--static-geometry` names: mig-parted's all-balanced and all-<profile> for every profile
    (not `+me`: mig-parted's all-1g.10gb.me holds one such instance only), or in MPS mode
    every GPU in N equal slices, and for each slice size the pods ask for (`sizes`, GB) every GPU
    in as many slices of that size as fit (`mps-<S>gb`: what an admin names in a static config,
    e.g. 7 x 10gb on an H100's 79 GiB, where 8 equal slices of 9 GB serve no 10gb pod)."""
    if mode == "mps":
        cap = model.mps_capacity_gb
        return ([f"mps-{n}" for n in MPS_STATIC if cap // n >= 1]
                + [f"mps-{s}gb" for s in sorted(set(sizes)) if 1 <= s <= cap])
    balanced = ["all-balanced"] if balanced_counts(model) is not None else []  # a narrowed model may lack it
    return balanced + [f"all-{p.name}" for p in model.mig_profiles if not p.media_extensions]


def static_fits(name: str, mode: str) -> bool:
    """Whether a --static-geometry name is a layout of that mode (all-balanced: both)."""
    if name == "all-balanced":
        return True
    return name.startswith("mps-") == (mode == "mps")


def static_layout(name: str, model: GpuModel, mode: str) -> dict[str, str]:
    """`PlanOptions.static_layout` for a named static geometry:
    - `all-balanced`: mig-parted's all-balanced (the planner's default for static);
    - `all-<profile>` or `all-<N>g`: as many instances of that profile as fit
      (e.g. all-1g.10gb: 7 x 1g.10gb, all-7g: one 7g instance per GPU);
    - `<profile>:<count>,...`: an explicit geometry;
    - MPS: `mps-<N>` splits every GPU into N equal slices (all-balanced: 4); `mps-<S>gb` carves
      every GPU into as many S GB slices as fit."""
    from dynpart.mig import place_counts  # the MIG rules, not planning logic

    if mode == "mps":
        if name == "all-balanced":
            return {}
        most = min(model.mps_capacity_gb, model.mps_max_clients or model.mps_capacity_gb)
        if name.startswith("mps-") and name[4:].isdigit() and 1 <= int(name[4:]) <= most:
            return {"mps": name[4:]}
        size = name[4:-2] if name.startswith("mps-") and name.endswith("gb") else ""
        if size.isdigit() and 1 <= int(size) <= model.mps_capacity_gb:
            return {"mps_size": size}
        raise SimulationError(f"--static-geometry {name!r}: in mps mode use all-balanced, mps-N (N equal slices, "
                              f"N in 1..{most}) or mps-<S>gb (slices of S GB, S in 1..{model.mps_capacity_gb})")
    if name == "all-balanced":
        if balanced_counts(model) is None:
            raise SimulationError(f"--static-geometry all-balanced: {model.name} has no all-balanced layout (its "
                                  "catalog entry lacks a 1g, 2g or 3g profile); profiles: "
                                  + ", ".join(p.name for p in model.mig_profiles if not p.media_extensions))
        return {}
    if name.startswith("all-"):
        want = name[4:]
        names = [p for p in model.mig_profiles if not p.media_extensions]
        match = [p for p in names if p.name == want] or sorted(
            (p for p in names if p.name.split(".")[0] == want), key=lambda p: p.memory)[:1]
        media = model.profiles_by_name.get(want)
        if not match and media is not None:  # (+me: at most one a GPU, no layout of its own; it was "no profile")
            raise SimulationError(f"--static-geometry {name!r}: {want} is at most {media.max} a GPU, so no all-<profile> "
                                  f"layout; write a geometry with it, e.g. {want}:1,{names[0].name}:1")
        if not match:
            raise SimulationError(f"--static-geometry {name!r}: {model.name} has no profile {want!r} "
                                  f"(profiles: {', '.join(p.name for p in names)})")
        prof = match[0]
        count = max(k for k in range(1, prof.max + 1) if place_counts(model, {prof.name: k}) is not None)
        return {model.name: f"{prof.name}:{count}"}
    if name.startswith("mps-"):  # an MPS layout on a MIG cluster (cf. all-7g in mps mode, above)
        raise SimulationError(f"--static-geometry {name!r}: an MPS layout, and the cluster replayed is in mig mode "
                              "(--mode mps replays it in mps mode); in mig mode use all-balanced, all-<profile> or "
                              f"profile:count,... with profiles of {model.name}")
    for part in name.split(","):
        profile, _, n = part.strip().partition(":")
        if profile not in model.profiles_by_name or (n and not n.isdigit()):
            raise SimulationError(f"--static-geometry {name!r}: expected all-balanced, all-<profile> or "
                                  f"profile:count,... with profiles of {model.name}")
        if n and int(n) == 0:
            raise SimulationError(f"--static-geometry {name!r}: {profile}:0 carves nothing (leave it out)")
    if place_counts(model, {p.split(":")[0].strip(): int(p.split(":")[1] or 1) if ":" in p else 1
                            for p in name.split(",")}) is None:
        raise SimulationError(f"--static-geometry {name!r}: no valid MIG placement on {model.name}")
    return {model.name: name}
