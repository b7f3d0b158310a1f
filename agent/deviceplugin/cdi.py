"""CDI (Container Device Interface) for the agent's own device plugin: the `cdi-cri` and
`cdi-annotations` device-list strategies.

With them Allocate names a container's devices by CDI name (`dynpart.io/gpu=<GPU or MIG UUID>`)
instead of NVIDIA_VISIBLE_DEVICES, as NVIDIA's plugin does with DEVICE_LIST_STRATEGY=cdi-cri or
cdi-annotations (`internal/plugin/server.go` updateResponseForCDI), and the runtime (containerd's or
CRI-O's own CDI, or the NVIDIA runtime in CDI mode) resolves each name from a spec in its CDI
directories. The agent writes that spec (`CdiSpecWriter`): one device per GPU UUID and per MIG UUID
it advertises (an MPS slice is its GPU's device), each with its own device nodes (`device_nodes`:
the GPU's /dev/nvidia<minor>, for a MIG device its parent's and its GPU and compute instances'
capability nodes, as the toolkit's `dgpu` discoverers give them); the spec's common edits are the
driver's: the top-level containerEdits (libraries, binaries, hooks, NVIDIA_VISIBLE_DEVICES=void) of
the management spec that the NVIDIA Container Toolkit writes (`management.nvidia.com-gpu.yaml`,
`nvidia-ctk-installer`, GPU Operator's toolkit DaemonSet), the hooks of its `all` device (the
folder-permission chmod), never its device nodes (those are every GPU's), plus the driver's control
nodes where they exist. Without a management spec the common edits are the control nodes alone: a
container then gets its device nodes but not the driver's libraries (see `CdiSpecWriter.problem`).

Pure helpers (`build_spec`, `common_edits`, `annotations`) and the writer (atomic: a temporary
file in the same directory, then a rename; the CDI caches ignore names not ending .json/.yaml).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from dynpart.agent.deviceplugin.devices import CONTROL_NODES, PluginDevice, host_device_path

log = logging.getLogger("dynpart.agent.deviceplugin.cdi")

CDI_STRATEGIES = ("cdi-cri", "cdi-annotations")
DEFAULT_SPEC_DIR = "/var/run/cdi"
DEFAULT_KIND = "dynpart.io/gpu"
# the oldest version whose fields the spec uses (deviceNodes.hostPath came in 0.5.0); a management
# spec of a later version raises it
CDI_VERSION = "0.5.0"
# what nvidia-ctk-installer names its management spec (cdi.GenerateNameForSpec, default .yaml)
MANAGEMENT_SPECS = ("management.nvidia.com-gpu.yaml", "management.nvidia.com-gpu.json")
ANNOTATION_PREFIX = "cdi.k8s.io/"
ANNOTATION_PLUGIN = "dynpart-device-plugin"

_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")  # a CDI device name (parser.ValidateDeviceName)
_REFUSED: set[str] = set()  # device names refused once (logged)
# (vendor and class start with a letter: parser.validateVendorOrClassName)
_KIND = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?$")


def is_cdi(strategy: str) -> bool:
    return strategy in CDI_STRATEGIES


def valid_kind(kind: str) -> bool:
    """`vendor/class` as CDI's parser accepts it (each starting with a letter; vendor: alphanumerics,
    `_`, `-`, `.`; class: no `.`)."""
    return bool(_KIND.match(kind))


def valid_name(name: str) -> bool:
    """A CDI device name (alphanumerics, `_`, `-`, `.`, `:`; starting and ending alphanumeric)."""
    return bool(_NAME.match(name))


def device_name(d: PluginDevice) -> str:
    """The CDI device name of a plugin device: the MIG UUID, else its GPU's UUID (an MPS slice is
    its whole GPU to the runtime; the MPS daemon limits it)."""
    return d.id if d.kind == "mig" else d.gpu_uuid


def qualified_names(kind: str, devices: Iterable[PluginDevice]) -> list[str]:
    """`<kind>=<name>` for each device, once each, in order."""
    return list(dict.fromkeys(f"{kind}={device_name(d)}" for d in devices))


def cdi_annotations(response_id: str, names: list[str], plugin: str = ANNOTATION_PLUGIN) -> dict[str, str]:
    """The container annotation naming `names` (cdi.UpdateAnnotations / AnnotationKey: key
    `cdi.k8s.io/<plugin>_<id, / written _>`, at most 63 characters after the prefix, starting and
    ending alphanumeric; value: the names comma-separated)."""
    name = plugin + "_" + response_id.replace("/", "_")
    if len(name) > 63 or not re.match(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$", name):
        raise ValueError(f"invalid CDI annotation key {name!r}")
    return {ANNOTATION_PREFIX + name: ",".join(names)}


# --- the spec ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommonEdits:
    """The driver's edits for every container, from a management spec (`source`); `error`: why
    there are none (no spec found, or one that cannot be read)."""

    edits: Mapping[str, Any] = field(default_factory=dict)
    version: str | None = None
    source: str | None = None
    error: str | None = None


def common_edits(paths: Iterable[str]) -> CommonEdits:
    """The common edits of the first management spec of `paths` that exists: its top-level
    containerEdits less any device node, plus the hooks of its `all` device."""
    tried = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f)  # (JSON is YAML)
        except FileNotFoundError:
            tried.append(path)
            continue
        except (OSError, ValueError, yaml.YAMLError) as e:  # (ValueError: not UTF-8)
            return CommonEdits(source=path, error=f"the management CDI spec {path} cannot be read: {e}")
        try:
            return _management_edits(path, raw)
        except (TypeError, ValueError, AttributeError) as e:
            return CommonEdits(source=path, error=f"the management CDI spec {path} is not a CDI spec: {e}")
    return CommonEdits(error=f"no management CDI spec ({', '.join(tried) or 'none configured'})")


def _management_edits(path: str, raw: Any) -> CommonEdits:
    if not isinstance(raw, dict):
        raise ValueError("not a mapping")
    top = raw.get("containerEdits") or {}
    if not isinstance(top, dict):
        raise ValueError("containerEdits is not a mapping")
    edits = {k: v for k, v in top.items() if k != "deviceNodes" and v}
    for d in raw.get("devices") or ():
        if d.get("name") == "all":
            hooks = (d.get("containerEdits") or {}).get("hooks") or []
            edits["hooks"] = [*edits.get("hooks", []), *hooks]
    version = raw.get("cdiVersion")
    return CommonEdits(edits=edits, version=str(version) if version else None, source=path)


def _version_key(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in v.split("."))
    except ValueError:
        return (0,)


def build_spec(devices: Iterable[PluginDevice], kind: str = DEFAULT_KIND, common: CommonEdits | None = None,
               dev_root: str = "/", node_exists: Callable[[str], bool] = lambda path: True) -> dict[str, Any]:
    """The CDI spec of `devices`: one device per CDI name (`device_name`), its containerEdits the
    device's own nodes (`PluginDevice.nodes`, given whether or not they exist yet: a node missing
    when a container is created fails that creation, which the kubelet retries, rather than
    starting it without its GPU); the top-level containerEdits the control nodes that exist and
    the management spec's `common` edits. Device nodes: `path` inside the container, `hostPath`
    under `dev_root` on the host. Devices whose name CDI refuses are left out (logged)."""
    common = common or CommonEdits()
    out: dict[str, list[str]] = {}
    for d in devices:
        name = device_name(d)
        if not valid_name(name):
            if name not in _REFUSED:  # (said once: the spec is built at every pass)
                _REFUSED.add(name)
                log.warning("CDI: device %s is left out of the spec, and not advertised: %r is no valid CDI device "
                            "name", d.id, name)
            continue
        nodes = out.setdefault(name, [])
        nodes += [n for n in d.nodes if n not in nodes]
    # a device whose nodes are unknown (its minor number unread: a lost GPU, a driver that does
    # not answer) is left out, so not advertised: CDI refuses a device with empty edits, and with
    # it the whole spec, which would fail every container of the node
    out = {name: nodes for name, nodes in out.items() if nodes}

    def node(path: str) -> dict[str, str]:
        host = host_device_path(dev_root, path)
        return {"path": path} if host == path else {"path": path, "hostPath": host}

    top = dict(common.edits)
    control = [node(p) for p in CONTROL_NODES if node_exists(p)]
    if control:
        top["deviceNodes"] = control
    version = max(CDI_VERSION, common.version or CDI_VERSION, key=_version_key)
    spec: dict[str, Any] = {
        "cdiVersion": version,
        "kind": kind,
        "devices": [{"name": n, "containerEdits": {"deviceNodes": [node(p) for p in nodes]}}
                    for n, nodes in out.items()],
    }
    if top:
        spec["containerEdits"] = top
    return spec


def spec_file_name(kind: str) -> str:
    """`dynpart.io/gpu` -> `dynpart.io-gpu.json` (as cdi.GenerateNameForSpec names a spec)."""
    return kind.replace("/", "-") + ".json"


class CdiSpecWriter:
    """Keeps `<spec_dir>/<kind as a file name>.json` in step with the devices the plugin serves
    (`write`, after every change of them and before a new one is advertised; `remove`). The
    management spec is read again at each write (`management_specs`: paths; default: the
    toolkit's names in `spec_dir`), so one written after the agent started is taken up."""

    def __init__(self, spec_dir: str = DEFAULT_SPEC_DIR, kind: str = DEFAULT_KIND,
                 management_specs: Iterable[str] | None = None, dev_root: str = "/",
                 node_exists: Callable[[str], bool] = lambda path: True):
        if not valid_kind(kind):
            raise ValueError(f"invalid CDI kind {kind!r} (vendor/class)")
        self.spec_dir = spec_dir
        self.kind = kind
        self.path = os.path.join(spec_dir, spec_file_name(kind))
        self.management_specs = (list(management_specs) if management_specs is not None
                                 else [os.path.join(spec_dir, n) for n in MANAGEMENT_SPECS])
        self.dev_root = dev_root
        self.node_exists = node_exists
        self.names: frozenset[str] = frozenset()  # the device names of the spec on disk (as last written)
        self.problem: str | None = None  # what is wrong now (no management spec, a failed write), or None
        self._content: str | None = None  # as last written (None: unknown, or removed)
        self._said: str | None = None
        self._common_cache: tuple[list[tuple[str, int, int, int]], CommonEdits] | None = None

    def write(self, devices: Iterable[PluginDevice]) -> bool:
        """Write the spec of `devices` if it changed (none: remove it; CDI refuses a spec without
        devices). True if the file on disk now names them; False if the write failed (`problem`
        says why; `names` is still what the file names)."""
        common = self._common()
        spec = build_spec(devices, self.kind, common, self.dev_root, self.node_exists)
        names = frozenset(d["name"] for d in spec["devices"])
        problems = []
        failed = False
        if common.error and names:  # (no device: no spec to complete)
            problems.append(f"{common.error}: containers get their device nodes but not the driver's libraries "
                            "and binaries")
        try:
            if not names:
                self.remove()
            else:
                try:
                    content = json.dumps(spec, indent=2) + "\n"
                except (TypeError, ValueError) as e:  # (a YAML value JSON has not, e.g. a date)
                    raise OSError(f"the spec cannot be written as JSON ({e}): see the management CDI spec "
                                  f"{common.source}") from None
                if content != self._content:
                    self._write(content)
                    self._content = content
                    log.info("CDI: wrote %s (%d device(s))", self.path, len(names))
                self.names = names
        except OSError as e:
            problems.append(f"writing {self.path}: {e}")
            failed = True
        self._say("; ".join(problems) or None)
        return not failed

    def _common(self) -> CommonEdits:
        """`common_edits`, parsed again only when a management spec's file changed (the writer runs
        at every pass, and every poll while a device waits)."""
        stamps = []
        for p in self.management_specs:
            try:
                st = os.stat(p)
                stamps.append((p, st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((p, 0, 0, -1))
        if self._common_cache is None or self._common_cache[0] != stamps:
            self._common_cache = (stamps, common_edits(self.management_specs))
        return self._common_cache[1]

    def _write(self, content: str) -> None:
        os.makedirs(self.spec_dir, exist_ok=True)
        tmp = os.path.join(self.spec_dir, f".{os.path.basename(self.path)}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def remove(self) -> None:
        """Remove the spec (no device to name; the node left dynpart)."""
        try:
            os.unlink(self.path)
            log.info("CDI: removed %s", self.path)
        except FileNotFoundError:
            pass
        self.names = frozenset()
        self._content = None

    def _say(self, problem: str | None) -> None:
        self.problem = problem
        if problem == self._said:
            return
        if problem:
            log.warning("CDI: %s", problem)
        elif self._said:
            log.info("CDI: %s is complete again (common edits from %s)", self.path,
                     ", ".join(self.management_specs))
        self._said = problem
