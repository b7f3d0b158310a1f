"""One MPS pass on a node: the device plugin (nebuly-ai fork) is told the node's slices through a
named config in its ConfigMap, selected by the node label `nvidia.com/device-plugin.config`.

Order matters (nos issue #57): the config is written to the ConfigMap first, the label is
switched only once the config is visible to the plugin; until then the plan is not
acknowledged and the next pass checks again. The config name is a hash of its content, so a
name always means one content and identical nodes share a config.

Slices pods hold (kubelet PodResources) are kept whatever the spec says; a GPU a pod holds
whole (`nvidia.com/gpu`) is not shared until it is free; GPUs in MIG mode get no MPS slices
(MPS is not supported on MIG devices).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import yaml

from dynpart.agent import metrics
from dynpart.agent.driver.interface import GpuDriver
from dynpart.agent.kube import ConfigStore, NodeApi, NodeView
from dynpart.agent.mig_agent import PassResult
from dynpart.agent.podresources import PodResources, base_device_id
from dynpart.agent.reconcile import reconcile_mps
from dynpart.kube.conventions import DEVICE_PLUGIN_CONFIG_LABEL, MPS_CONFIG_PREFIX
from dynpart.resources import WHOLE_GPU, MpsResource, is_slice_resource, mps_resource_name, parse_resource
from dynpart.snapshot import GpuLayout, MpsSlice


def render_config(slices: dict[int, list[int]]) -> str:
    """The device-plugin config (nebuly-ai fork schema) for these slice sizes per GPU index:
    one `sharing.mps.resources` entry per GPU and size. No slices: no sharing section (every
    GPU is a whole `nvidia.com/gpu`)."""
    resources = []
    for index in sorted(slices):
        for size, n in sorted(Counter(slices[index]).items(), key=lambda x: -x[0]):
            resources.append({"name": WHOLE_GPU, "rename": mps_resource_name(size), "memoryGB": size,
                              "replicas": n, "devices": [str(index)]})
    config: dict[str, Any] = {"version": "v1", "flags": {"migStrategy": "none"}}
    if resources:
        config["sharing"] = {"mps": {"failRequestsGreaterThanOne": True, "resources": resources}}
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def config_name(content: str) -> str:
    """A valid label value and ConfigMap key naming exactly this content."""
    return MPS_CONFIG_PREFIX + hashlib.sha256(content.encode()).hexdigest()[:16]


def parse_config(content: str | None) -> dict[int, list[int]] | None:
    """Slice sizes per GPU of a config `render_config` wrote; None if it cannot be read."""
    if content is None:
        return None
    try:
        doc = yaml.safe_load(content)
        if not isinstance(doc, dict) or doc.get("version") != "v1":
            return None
        out: dict[int, list[int]] = {}
        for r in ((doc.get("sharing") or {}).get("mps") or {}).get("resources") or []:
            for dev in r["devices"]:
                out.setdefault(int(dev), []).extend([int(r["memoryGB"])] * int(r["replicas"]))
        return {k: sorted(v, reverse=True) for k, v in out.items()}
    except (yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError):
        return None


class MpsAgent:
    def __init__(self, driver: GpuDriver, pods: PodResources, node_api: NodeApi, configs: ConfigStore,
                 capacity_gb: int):
        self.driver = driver
        self.pods = pods
        self.node_api = node_api
        self.configs = configs
        self.capacity_gb = capacity_gb

    async def apply(self, desired: dict[int, list[int]] | None, node: NodeView) -> PassResult:
        devices = self.driver.devices()
        index_of = {d.uuid: d.index for d in devices} | {str(d.index): d.index for d in devices}
        errors: list[str] = []
        used: dict[int, Counter[int]] = {d.index: Counter() for d in devices}
        whole: dict[int, list[str]] = {}
        for a in await self.pods.list():
            if not is_slice_resource(a.resource):
                continue
            gpu = index_of.get(base_device_id(a.device_id))
            if gpu is None:
                continue  # a MIG device or another node's id format: not an MPS slice of ours
            res = parse_resource(a.resource)
            if isinstance(res, MpsResource):
                used[gpu][res.size] += 1
            elif a.resource == WHOLE_GPU:
                whole.setdefault(gpu, []).append(a.pod)
        current = node.labels.get(DEVICE_PLUGIN_CONFIG_LABEL)
        live = parse_config(await self.configs.read(current)) if current else None
        applied = False
        if desired is not None:
            shareable = [d.index for d in devices if not d.mig_current and d.index not in whole]
            for d in devices:
                if d.mig_current and desired.get(d.index):
                    errors.append(f"GPU {d.index} is in MIG mode: MPS slices cannot be configured on it")
                if d.index in whole and desired.get(d.index):
                    errors.append(f"GPU {d.index} is held whole by {', '.join(whole[d.index])}; "
                                  "its slices are configured once it is free")
            wanted = {i: s for i, s in desired.items() if i in shareable or i not in index_of.values()}
            final, problems = reconcile_mps(wanted, used, shareable, self.capacity_gb)
            errors += problems
            content = render_config({i: s for i, s in final.items() if s})
            name = config_name(content)
            if current == name:
                applied = True
            else:
                if await self.configs.read(name) != content:
                    await self.configs.write(name, content)
                if await self.configs.visible(name, content):
                    await self.node_api.patch(labels={DEVICE_PLUGIN_CONFIG_LABEL: name})
                    metrics.MPS_CONFIGS.inc()
                    applied = True
                else:
                    errors.append(f"device-plugin config {name} written; {DEVICE_PLUGIN_CONFIG_LABEL} is switched "
                                  "to it once the device plugin can read it")
            if applied:
                live = final
        gpus = []
        for d in devices:
            sizes = (live or {}).get(d.index, [])
            held = Counter(used[d.index])
            slices = []
            for size in sorted(sizes, reverse=True):
                slices.append(MpsSlice(size=size, used=held[size] > 0))
                held[size] -= 1
            gpus.append(GpuLayout(index=d.index, mps=slices))
        return PassResult(gpus, errors, applied)
