"""Where the replay must behave as the systems it models: the node agent (agent/) and nos
(nebuly-ai/nos). Each test names the code it is checked against."""

from __future__ import annotations

from dataclasses import replace

from dynpart.simulations.replay.engine import ReplayOptions, run_replay

from .conftest import cluster, pod


def _named(p, slice_name):
    return replace(p, slice_name=slice_name)


def test_nos_mps_keeps_free_slices_that_spare_memory_allows(catalog):
    # nos's slicing GPU.UpdateGeometryFor (pkg/gpu/slicing/gpu.go): a missing slice is made from
    # the spare memory first; the free slices are deleted only when that is not enough, and
    # restored afterwards where they still fit. Here: 40 GB held, a free 20 GB slice, 19 GB
    # spare; a 10 GB pod comes: nos adds a 10 GB slice and keeps the free 20 GB one, so a 20 GB
    # pod arriving later binds at once (no plan, no wait).
    pods = [_named(pod("big", milli=507, t0=0, t1=100_000), "40gb"),
            _named(pod("twenty", milli=254, t0=0, t1=200), "20gb"),
            _named(pod("ten", milli=127, t0=1000, t1=100_000), "10gb"),
            _named(pod("late", milli=254, t0=2000, t1=3000), "20gb")]
    spec = cluster(("n0", 64_000, 1, "H100-80GB"), mode="mps")
    r = run_replay(pods, spec, catalog, ReplayOptions(policy="nos"))
    runs = {x.pod.name: x for x in r.runs}
    assert runs["ten"].planned and runs["ten"].start is not None
    assert not runs["late"].planned and runs["late"].wait == 0, (
        f"the free 20 GB slice was destroyed for the 10 GB one: the late 20 GB pod waited {runs['late'].wait} s")


def test_pods_of_one_node_plan_start_when_the_node_acknowledges(catalog):
    # agent/loop.py + agent/mig_agent.py: one pass applies a node's whole spec (every destroy,
    # then every create, GPU after GPU) and the built-in device plugin advertises the new devices
    # at the end of the pass; the plan is acknowledged once the kubelet holds them. A pod planned
    # on the node can be bound no earlier than that, whichever GPU its slice is on.
    pods = [pod("whole", milli=1000, t0=0, t1=10_000), pod("small", milli=100, t0=0, t1=10_000)]
    spec = cluster(("n0", 64_000, 2, "H100-80GB"), mode="mig")
    r = run_replay(pods, spec, catalog, ReplayOptions(policy="dynpart", mig_op_delay_s=5))
    runs = {x.pod.name: x for x in r.runs}
    assert len(r.writes) == 1 and set(r.writes[0].pods) == {"whole", "small"}
    # both pods' slices come from the same pass: the node's ack is at the end of all its operations
    node_done = r.writes[0].time + 5 * r.mig_ops
    assert runs["whole"].start == runs["small"].start == node_done, (
        f"pods of one node plan start at {runs['whole'].start} and {runs['small'].start}; the agent's pass "
        f"({r.mig_ops} MIG operations) ends at {node_done}")
