"""The MPS agent: device-plugin config rendering, config-before-label ordering, used slices kept."""

from __future__ import annotations

import yaml

from dynpart.agent.kube import FakeNodeApi
from dynpart.agent.mps_agent import DEVICE_PLUGIN_CONFIG_LABEL, config_name, parse_config, render_config
from dynpart.annotations import SPEC_MODE, SPEC_PLAN, STATUS_ERROR, STATUS_PLAN, decode_status

from .conftest import H100, Rig, make_rig, mps_spec


def mps_rig(**kw) -> Rig:
    return make_rig(H100, 2, mig_enabled=False, **kw)


def test_render_config_schema():
    content = render_config({0: [10, 10, 20], 1: [40]})
    assert yaml.safe_load(content) == {
        "version": "v1",
        "flags": {"migStrategy": "none"},
        "sharing": {"mps": {"failRequestsGreaterThanOne": True, "resources": [
            {"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu-20gb", "memoryGB": 20, "replicas": 1, "devices": ["0"]},
            {"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu-10gb", "memoryGB": 10, "replicas": 2, "devices": ["0"]},
            {"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu-40gb", "memoryGB": 40, "replicas": 1, "devices": ["1"]},
        ]}},
    }
    assert parse_config(content) == {0: [20, 10, 10], 1: [40]}
    assert yaml.safe_load(render_config({})) == {"version": "v1", "flags": {"migStrategy": "none"}}
    assert parse_config("::: not yaml") is None and parse_config("[1, 2]") is None


def test_config_name_is_a_content_hash():
    a, b = render_config({0: [10]}), render_config({0: [20]})
    assert config_name(a) == config_name(render_config({0: [10]})) != config_name(b)
    name = config_name(a)
    assert len(name) <= 63 and name.replace("-", "").isalnum()


class CheckingNodeApi(FakeNodeApi):
    """Fails the test if the label ever names a config the ConfigMap does not have (yet)."""

    def __init__(self, rig: Rig):
        super().__init__("node-1", events=rig.events)
        self.rig = rig

    async def patch(self, *, annotations=None, labels=None):
        if labels and labels.get(DEVICE_PLUGIN_CONFIG_LABEL):
            assert labels[DEVICE_PLUGIN_CONFIG_LABEL] in self.rig.configs.data, "label before config"
        return await super().patch(annotations=annotations, labels=labels)


async def test_config_is_written_and_visible_before_the_label():
    rig = mps_rig()
    rig.node_api = CheckingNodeApi(rig)
    rig.configs.visible_after = 2  # the kubelet needs two checks to sync the plugin's volume
    rig.node_api.set_annotations(mps_spec({0: [10, 10, 20], 1: [40, 40]}, plan="m1"))
    agent = rig.agent()

    for _ in range(2):  # written, not visible yet: no label, no acknowledgement
        report = await agent.reconcile_once()
        assert DEVICE_PLUGIN_CONFIG_LABEL not in rig.node_api.labels
        assert STATUS_PLAN not in rig.node_api.annotations
        assert "is switched to it once the device plugin can read it" in rig.node_api.annotations[STATUS_ERROR]
    report = await agent.reconcile_once()
    name = rig.node_api.labels[DEVICE_PLUGIN_CONFIG_LABEL]
    assert report.plan_id == "m1" and report.errors == []
    kinds = [(kind, value if kind != "annotations" else value.get(STATUS_PLAN)) for kind, value in rig.events]
    config_at = kinds.index(("config", name))
    label_at = kinds.index(("labels", {DEVICE_PLUGIN_CONFIG_LABEL: name}))
    ack_at = kinds.index(("annotations", "m1"))
    assert config_at < label_at < ack_at
    assert [k for k in kinds if k[0] == "config"] == [("config", name)]  # written once
    assert parse_config(rig.configs.data[name]) == {0: [20, 10, 10], 1: [40, 40]}
    status = decode_status(rig.node_api.annotations, H100)
    assert [(s.size, s.used) for s in status.layout.gpus[0].mps] == [(20, False), (10, False), (10, False)]


async def test_used_slices_are_kept():
    rig = mps_rig()
    rig.node_api.set_annotations(mps_spec({0: [10, 10, 20, 40]}, plan="m1"))
    await rig.agent().reconcile_once()
    rig.pods.assign("ns/a", "nvidia.com/gpu-10gb", "GPU-fake-0000::0")
    rig.pods.assign("ns/b", "nvidia.com/gpu-10gb", "GPU-fake-0000::1")
    # the planner re-carves GPU 0 into 40+20+20 while two 10gb slices are in use
    rig.node_api.set_annotations({**mps_spec({0: [40, 20, 20]}, plan="m2"), "dynpart.io/spec-gpu-0-10gb": None})
    report = await rig.agent().reconcile_once()
    live = parse_config(rig.configs.data[rig.node_api.labels[DEVICE_PLUGIN_CONFIG_LABEL]])
    assert live == {0: [40, 20, 10, 10]}
    assert report.plan_id == "m2"
    assert any("2 x 10gb slice(s) are in use by pods but the spec has 0" in e for e in report.errors)
    assert any("a 20gb slice does not fit" in e for e in report.errors)
    status = decode_status(rig.node_api.annotations, H100)
    assert [(s.size, s.used) for s in status.layout.gpus[0].mps] == [(40, False), (20, False), (10, True), (10, True)]


async def test_whole_gpu_and_mig_gpus_are_not_shared():
    rig = make_rig(H100, 3, mig_enabled=False)
    rig.driver.set_mig_mode(2, True)
    rig.pods.assign("ns/whole", "nvidia.com/gpu", "GPU-fake-0001")
    rig.node_api.set_annotations(mps_spec({0: [40, 40], 1: [40, 40], 2: [80]}))
    report = await rig.agent().reconcile_once()
    live = parse_config(rig.configs.data[rig.node_api.labels[DEVICE_PLUGIN_CONFIG_LABEL]])
    assert live == {0: [40, 40]}
    assert any("GPU 1 is held whole by ns/whole" in e for e in report.errors)
    assert any("GPU 2 is in MIG mode" in e for e in report.errors)


async def test_no_spec_reports_the_live_config():
    rig = mps_rig()
    content = render_config({1: [20, 20]})
    await rig.configs.write(config_name(content), content)
    rig.node_api.labels[DEVICE_PLUGIN_CONFIG_LABEL] = config_name(content)
    rig.node_api.labels["dynpart.io/gpu-partitioning"] = "mps"
    rig.events.clear()
    report = await rig.agent().reconcile_once()
    assert report.mode == "mps" and report.plan_id is None
    assert [e[0] for e in rig.events] == ["annotations"]  # only the status
    assert rig.node_api.annotations["dynpart.io/status-gpu-1-20gb-free"] == "2"


async def test_empty_spec_unshares_everything():
    rig = mps_rig()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="a"))
    await rig.agent().reconcile_once()
    rig.node_api.set_annotations({SPEC_PLAN: "b", SPEC_MODE: "mps", "dynpart.io/spec-gpu-0-40gb": None})
    report = await rig.agent().reconcile_once()
    assert report.plan_id == "b"
    assert parse_config(rig.configs.data[rig.node_api.labels[DEVICE_PLUGIN_CONFIG_LABEL]]) == {}
