"""Property test: on MPS GPUs crowded with small pods, no plan of any policy gives a GPU more
slices, or more pods, than its MPS server serves (`mps_max_clients`, tests/planner/check.py),
a GPU laid out past the bound keeping what it has; the instances reach the bound."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.planner import PlanOptions, plan
from dynpart.snapshot import Plan, Snapshot
from tests.planner.check import check_plan
from tests.planner.instances import crowded_mps_instance, crowded_mps_instances

CAT = default_catalog()
OPTIONS = [PlanOptions(time_limit_s=0), PlanOptions(time_limit_s=0.2), PlanOptions(policy="nos"),
           PlanOptions(policy="static", static_layout={"mps_size": "1"})]


def most_held(result: Plan) -> int:
    """The most slices pods hold on one GPU of the plan."""
    return max((sum(1 for s in g.mps if s.used or s.pod) for lay in result.layouts for g in lay.gpus), default=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=crowded_mps_instances(), options=st.sampled_from(OPTIONS))
def test_no_plan_gives_a_gpu_more_than_its_mps_server_serves(snap: Snapshot, options: PlanOptions):
    result = plan(snap, CAT, options)
    check_plan(snap, result)
    most = most_held(result)
    target(float(most), label="most slices held on one GPU")
    event("a GPU at the bound" if most == 48 else "no GPU at the bound")


def test_a_crowded_instance_reaches_the_bound():
    """What the property test is for: the bound, not memory, decides. 120 pods of 1 GB and 10 of
    2 GB on one empty H100 (79 GiB) and one laid out with 60 free 1 GB slices: each GPU ends with
    48 pods."""
    snap = crowded_mps_instance("H100-80GB", [[], [(1, False)] * 60], [(1, 1)] * 120 + [(2, 1)] * 10)
    for options in OPTIONS[:3]:
        result = plan(snap, CAT, options)
        check_plan(snap, result)
        held = [sum(1 for s in g.mps if s.used or s.pod) for lay in result.layouts for g in lay.gpus]
        assert held == [48, 48] and len(result.placements) == 96, (options, held)
        assert most_held(result) == CAT.resolve("H100-80GB").mps_max_clients
