"""helper-121: the nos baseline's MPS planning against nos's GPU.UpdateGeometryFor
(nebuly-ai/nos pkg/gpu/slicing/gpu.go)."""

from __future__ import annotations

from dynpart.planner.baselines.nos import _nos_mps_sizes
from dynpart.planner.mps_state import MpsPiece, MpsState


def _gpu(cap: int, used: list[int], free: list[int]) -> MpsState:
    st = MpsState.__new__(MpsState)
    st.info, st.cap, st.max_slices, st.whole_pod = None, cap, None, None
    st.changed, st.destroyed, st.created = False, 0, 0
    st.slices = [MpsPiece(s, True, None, True) for s in used] + [MpsPiece(s, False, None, True) for s in free]
    return st


def test_a_lacking_size_the_gpu_already_has_free_loses_the_slices_made_from_spare_memory():
    """gpu.go: step 1 makes the 2 missing 10gb slices from the spare memory (FreeProfiles[10gb] =
    3); step 2 then runs whatever is still missing (none) and first `delete(g.FreeProfiles, k)`
    for every size k the GPU had free, 10gb included: the 3 go; the restore gives back the
    original count (1). nos ends with one free 10gb slice, not three."""
    st = _gpu(80, used=[40], free=[10])
    lacking = [10, 10, 10]
    _nos_mps_sizes(st, lacking)
    free = sorted(s.size for s in st.slices if not s.hard)
    assert free == [10], f"nos's UpdateGeometryFor leaves one free 10gb slice; the port made {free}"
    assert lacking == [10, 10]  # Node.UpdateGeometryFor: the GPU's free slices count against it
