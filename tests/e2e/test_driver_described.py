"""GPUs described by their driver, on the real API server and scheduler: the agents report what
their fake NVML offers (`dynpart.io/status-capability`), the real planner plans those nodes from
the reports, pods run.

- an RTX PRO 6000 Blackwell, which the catalog does not know, with its -me, +me.all and +gfx
  profiles (tests/gpus.py says which of its figures are assumed);
- a GB200 whose driver's placements differ from the catalog's (the catalog's GB200 starts are
  inferred): planned with the driver's, and the difference is an Event on the node."""

from __future__ import annotations

import pytest

from dynpart.agent.driver.fake import FakeNvml
from dynpart.catalog import default_catalog
from dynpart.kube.conventions import STATUS_CAPABILITY
from tests.e2e.harness import Harness, PlannerProcess, SimNode, module_planner, wait_until
from tests.gpus import RTX_PRO_6000, RTX_PRO_6000_MEMORY_MIB, RTX_PRO_6000_NVML_NAME

pytestmark = pytest.mark.e2e

GB200 = default_catalog().resolve("GB200-186GB")
# the driver on this node offers 1g.47gb at 0, 2 and 4 only (the catalog says 0, 2, 4, 6)
GB200_DRIVER = GB200.model_copy(update={"mig_profiles": tuple(
    p.model_copy(update={"starts": (0, 2, 4)}) if p.name == "1g.47gb" else p for p in GB200.mig_profiles)})


def driver_of(model, name: str, memory_mib: int | None = None):
    """A `prepare` hook: the node's fake NVML describes `model` under the product `name`."""
    def prepare(node: SimNode) -> None:
        node.model = model
        node.by_profile_id = {p.gi_profile_id: p for p in model.mig_profiles}
        node.driver = FakeNvml(model, node.count, name=name, memory_mib=memory_mib)
        node.driver.before_op = node._before_op
        node.product = "NVIDIA-" + name.removeprefix("NVIDIA ").replace(" ", "-")
    return prepare


@pytest.fixture(scope="module")
def planner(e2e_cluster, tmp_path_factory):
    yield from module_planner(e2e_cluster, tmp_path_factory, "planner-driver")


async def test_nodes_are_planned_from_their_agents_reports(e2e_cluster, planner: PlannerProcess):
    await planner.wait_log(r"acquired leadership", timeout=60)
    h = Harness(e2e_cluster.kubeconfig, planners=[planner])
    await h.start()
    try:
        rtx = await h.add_node("rtx", "H100-80GB", "mig", 2,
                               prepare=driver_of(RTX_PRO_6000, RTX_PRO_6000_NVML_NAME, RTX_PRO_6000_MEMORY_MIB))
        # two GPUs: whether the three gb pods fit on one depends on how the scheduler's marking splits
        # them into batches (a lone 1g.47gb placed first at 4 leaves no 3g.93gb beside two of them)
        gb = await h.add_node("gb200", "H100-80GB", "mig", 2, prepare=driver_of(GB200_DRIVER, "NVIDIA GB200"))
        for node in (rtx, gb):
            await h.start_agent(node)
        specs = [("rtx-nome", "nvidia.com/mig-1g.24gb-me"), ("rtx-meall", "nvidia.com/mig-1g.24gb.me.all"),
                 ("rtx-gfx-0", "nvidia.com/mig-1g.24gb.gfx"), ("rtx-gfx-1", "nvidia.com/mig-1g.24gb.gfx"),
                 ("rtx-4g", "nvidia.com/mig-4g.96gb"),
                 ("gb-3g", "nvidia.com/mig-3g.93gb"), ("gb-1g-0", "nvidia.com/mig-1g.47gb"),
                 ("gb-1g-1", "nvidia.com/mig-1g.47gb")]
        recs = await h.create_pods(specs)
        await h.wait_running(recs, timeout=120)
        assert {r.key.split("/")[-1].split("-")[0]: r.node for r in recs} == {"rtx": rtx.name, "gb": gb.name}
        carved = sorted(p for i in range(rtx.count) for p, _ in rtx.driver.layout(i))
        assert carved == sorted(["1g.24gb-me", "1g.24gb+me.all", "1g.24gb+gfx", "1g.24gb+gfx", "4g.96gb"])
        # the 1g.47gb sit where the driver allows them (never at 6, which the catalog would allow)
        gb_layout = [gb.driver.layout(i) for i in range(gb.count)]
        assert all(s != 6 for layout in gb_layout for p, s in layout if p == "1g.47gb"), gb_layout
        node = await h.core.read_node(gb.name)
        assert STATUS_CAPABILITY in node.metadata.annotations

        async def disagreement():
            events = await h.core.list_event_for_all_namespaces(field_selector=f"involvedObject.name={gb.name}")
            return [e for e in events.items if e.reason == "CatalogDisagreement"
                    and e.source.component == "dynpart-planner"]
        events = await wait_until(disagreement, 30, "a CatalogDisagreement Event from the planner on the GB200 node",
                                  interval=0.5)
        assert "1g.47gb: the driver reports starts [0, 2, 4] (catalog [0, 2, 4, 6])" in events[0].message
        assert h.destroy_violations() == [] and h.handshake_violations() == []
    finally:
        await h.close()
