"""GPU models that the shipped catalog lacks, for fake drivers in tests: what NVML would describe.

RTX PRO 6000 Blackwell (96 GB, 4 memory and 4 compute slices): the 1g.24gb ids and the variant
names are the facts file's (section 1, "Other GPUs users run": 1g.24gb 14, +me 21, +gfx 47,
+me.all 65, -me 67); the 2g/4g ids, counts and starts are assumed by analogy with A30's
4-slice layout (the facts file does not give them). Tests use it only as "a GPU the catalog does
not know", planned from what the fake driver reports."""

from __future__ import annotations

from dynpart.catalog import GpuModel, MigProfile


def _p(name: str, gi_id: int, nvml: str, compute: int, memory: int, max_count: int, starts: list[int]) -> MigProfile:
    return MigProfile(name=name, gi_profile_id=gi_id, nvml=f"NVML_GPU_INSTANCE_PROFILE_{nvml}", compute=compute, memory=memory,
                      max=max_count, starts=tuple(starts))


RTX_PRO_6000 = GpuModel(
    name="RTX-PRO-6000-Blackwell", memory_gb=96, memory_slices=4, compute_slices=4,
    mig_profiles=(
        _p("1g.24gb", 14, "1_SLICE", 1, 1, 4, [0, 1, 2, 3]),
        _p("1g.24gb+me", 21, "1_SLICE_REV1", 1, 1, 1, [0, 1, 2, 3]),
        _p("1g.24gb+gfx", 47, "1_SLICE_GFX", 1, 1, 4, [0, 1, 2, 3]),
        _p("1g.24gb+me.all", 65, "1_SLICE_ALL_ME", 1, 1, 1, [0, 1, 2, 3]),
        _p("1g.24gb-me", 67, "1_SLICE_NO_ME", 1, 1, 4, [0, 1, 2, 3]),
        _p("2g.48gb", 5, "2_SLICE", 2, 2, 2, [0, 2]),
        _p("2g.48gb-me", 68, "2_SLICE_NO_ME", 2, 2, 2, [0, 2]),
        _p("2g.48gb+gfx", 48, "2_SLICE_GFX", 2, 2, 2, [0, 2]),
        _p("4g.96gb", 0, "4_SLICE", 4, 4, 1, [0]),
    ),
)
RTX_PRO_6000_NVML_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
RTX_PRO_6000_MEMORY_MIB = 97_887  # below the nominal 96 GiB, as real GPUs report (an assumption)


# Two made-up MIG GPUs on which the rules that no real model makes bind do bind. On every catalog
# model (and on RTX_PRO_6000) a profile's max count is the number of its starts that fit side by
# side (or 1 for the `+me` ones, which the one-media-instance rule already caps) and the compute
# slices of any non-overlapping set add up to no more than the GPU has: a driver double, or
# MigRules, without those two rules would pass every test built on them alone.

# The per-profile max count binds: four 1g.6gb fit side by side, two are allowed.
CAPPED_1G = GpuModel(
    name="Test-capped-1g", memory_gb=24, memory_slices=4, compute_slices=4,
    mig_profiles=(
        _p("1g.6gb", 14, "1_SLICE", 1, 1, 2, [0, 1, 2, 3]),
        _p("2g.12gb", 5, "2_SLICE", 2, 2, 2, [0, 2]),
        _p("4g.24gb", 0, "4_SLICE", 4, 4, 1, [0]),
    ),
)

# The compute-slice total binds: 8 memory slices but 6 compute slices, every max count equal to
# the number of starts that fit side by side, so only the compute total refuses 7 x 1g, 4 x 2g,
# 2 x 4g, 4g + 2 x 2g.
SHORT_COMPUTE = GpuModel(
    name="Test-short-compute", memory_gb=80, memory_slices=8, compute_slices=6,
    mig_profiles=(
        _p("1g.10gb", 19, "1_SLICE", 1, 1, 8, [0, 1, 2, 3, 4, 5, 6, 7]),
        _p("2g.20gb", 14, "2_SLICE", 2, 2, 4, [0, 2, 4, 6]),
        _p("4g.40gb", 5, "4_SLICE", 4, 4, 2, [0, 4]),
        _p("6g.80gb", 0, "6_SLICE", 6, 8, 1, [0]),
    ),
)
