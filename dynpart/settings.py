"""Configuration: one pydantic settings model per component, from a YAML file, environment
variables and command-line flags (flags win over the environment, which wins over the file),
merged by pydantic-settings' own sources. Validated at start-up; an invalid value is one clear
line naming the setting and the value."""

from __future__ import annotations

import difflib
import logging
import os
import re
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from importlib.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from dynpart import yaml_text
from dynpart.errors import DynpartError, read_problem, yaml_problem
from dynpart.kube.conventions import DEFAULT_SCHEDULER, LEASE_NAME, SYSTEM_NAMESPACE
from dynpart.kube.selectors import dns_label_problem, dns_subdomain_problem, selector_problem
from dynpart.snapshot import RequestShare

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
log = logging.getLogger("dynpart.settings")
NonEmptyStr = Annotated[str, Field(min_length=1)]
NESTED = "__"  # env_nested_delimiter: DYNPART_PLANNER_KUBE__BACKOFF_MAX_S sets kube.backoff_max_s


class KubeSettings(BaseModel):
    """How a component talks to the API server: the one place for the knobs of dynpart.kube
    (back-off of watches and retried calls, Event de-duplication)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    backoff_initial_s: float = Field(default=0.2, gt=0, description="first wait before trying again after a call "
                                     "or a watch fails (each wait is drawn between half and all of it, at random; a "
                                     "watch starts from this one again after 2 minutes without a failure)")
    backoff_max_s: float = Field(default=10.0, gt=0, description="longest wait between two attempts (a longer "
                                 "Retry-After of the API server, up to 60 s, is waited for)")
    backoff_multiplier: float = Field(default=2.0, ge=1, description="each failed attempt multiplies the wait by this")
    watch_timeout_s: int = Field(default=300, gt=0, description="the API server ends a watch after between this and "
                                 "twice this (at random); it is started again from the last resourceVersion seen, "
                                 "and the objects are listed again only when that is too old or the watch failed")
    request_timeout_s: float = Field(default=30.0, gt=0, description="every API call but a watch gives up after "
                                     "this long (the client's default is to wait for ever)")
    watch_idle_timeout_s: float = Field(default=120.0, gt=0, description="a watch that receives nothing for this long "
                                        "(the API server sends a bookmark about every minute while the kind changes) is "
                                        "dropped and started again")
    event_repeat_s: float = Field(default=3600.0, gt=0, description="the same Event (object, reason, message) is "
                                  "posted again at most this often")
    event_memory: int = Field(default=4096, ge=1, description="(object, reason) pairs the Event de-duplication "
                              "remembers, each for event_repeat_s; while that many are, warnings about further pods "
                              "(a backlog of waiting pods) are dropped, counted in dynpart_events_dropped_total; what "
                              "a plan did and node Events are always posted")


    @model_validator(mode="after")
    def _backoff_in_order(self) -> KubeSettings:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(f"backoff_initial_s ({self.backoff_initial_s:g}) is above backoff_max_s "
                             f"({self.backoff_max_s:g})")
        return self


class AgentKubeSettings(KubeSettings):
    """The agent's: client-go's back-off (0.8 s to 30 s, as the kubelet's own watches), so that the
    agents of a thousand nodes coming back after an API server restart do not ask ten times a
    second each."""

    backoff_initial_s: float = Field(default=0.8, gt=0, description=KubeSettings.model_fields["backoff_initial_s"]
                                     .description)
    backoff_max_s: float = Field(default=30.0, gt=0, description=KubeSettings.model_fields["backoff_max_s"].description)


class CommonSettings(BaseSettings):
    kubeconfig: str | None = Field(default=None, description="kubeconfig file; default: $KUBECONFIG or in-cluster")
    log_level: LogLevel = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_json: bool = Field(default=False, description="one JSON object per log line")
    metrics_host: str = Field(default="0.0.0.0", description="address of the /metrics server")
    metrics_port: int = Field(default=9090, ge=0, le=65535, description="Prometheus /metrics port; 0 = off")
    catalog_files: list[str] = Field(default=[], description="extra GPU catalog files")
    kube: KubeSettings = Field(default_factory=KubeSettings, description="Kubernetes API client")

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (init arguments) over the environment over the `--config` file over defaults."""
        return init_settings, env_settings, ConfigFileSource(settings_cls, _config_file.get())


class PlannerSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="DYNPART_PLANNER_", env_nested_delimiter=NESTED, extra="forbid",
                                      allow_inf_nan=False)

    batch_idle_s: float = Field(default=0.5, gt=0, description="close a batch after this long without a new pod "
                                "(at most batch_timeout_s)")
    batch_timeout_s: float = Field(default=3.0, gt=0, description="close a batch at the latest this long after its first pod")
    ack_timeout_s: float = Field(default=60.0, gt=0, description="give up waiting for an agent's acknowledgement")
    reservation_s: float = Field(default=15.0, ge=0, description="after a node acknowledges a plan, how long the "
                                 "slices made for its pods stay theirs while the scheduler binds them (longer "
                                 "than the scheduler's 10 s maximum back-off)")
    resync_s: float = Field(default=15.0, gt=0, description="re-plan still pending pods at least this often")
    allocatable_lag_s: float = Field(default=60.0, ge=0, description="free slices a node's agent reports beyond "
                                     "its allocatable count of their resource are not planned for pods; they are "
                                     "reported (log, SlicesNotAllocatable Event) once this lasts this long (the "
                                     "kubelet writes new device counts at its next node status write, every 10 s "
                                     "by default, after each reconfiguration with publish_allocatable off)")
    plan_time_limit_s: float = Field(default=0.5, ge=0, description="exact-search budget per plan (deterministic s)")
    demand_half_life_s: float = Field(default=3600.0, gt=0, description="the request distribution the objective keeps "
                                      "free capacity usable for is learnt from the pending pods seen, each counting "
                                      "half as much after this long (metric dynpart_workload_weight)")
    workload: list[RequestShare] = Field(default=[], description="plan for this request distribution instead of the "
                                         "learnt one: a list of {resource, count, cpu_milli, memory_mib, weight} and the "
                                         "nodes its pods may use: gpu_models, node_selector, tolerations, "
                                         "node_affinity")
    drain_after_s: float = Field(default=0.0, ge=0, description="a pod asking for whole GPUs that no plan could place "
                                 "for this long has GPUs drained for it (the least used ones): their agent destroys "
                                 "each slice as it frees until they are empty; 0: never drain (drained capacity "
                                 "idles, which on a busy cluster costs more waiting than it saves: docs/planner.md)")
    drain_max_gpus: int = Field(default=1, ge=1, description="at most this many GPUs drained at once over the "
                                "cluster, oldest waiting pod first (a pod asking for more GPUs than this is drained "
                                "for when no other drain holds any): drains that pile up while whole-GPU pods queue "
                                "idle ever more capacity (like the cluster autoscaler's --max-drain-parallelism)")
    scheduler_names: list[NonEmptyStr] = Field(default=[DEFAULT_SCHEDULER], min_length=1, description="plan only for "
                                       "pods these schedulers place (spec.schedulerName): dynpart predicts the "
                                       "default scheduler's filters, and a pod another scheduler places (Volcano, "
                                       "a gang scheduler...) is left to it; a kube-scheduler profile of another "
                                       "name with the default filters may be added")
    mps_clients_host_ipc: bool = Field(default=False, description="MPS pods must run with hostIPC: true, and one "
                                       "without is warned (an MpsUnreachable Event): the MPS control daemon "
                                       "shares the host's /dev/shm (the chart's agent.mpsShm.mode hostIPC, or an "
                                       "agent that runs the daemon itself). False (the chart's default, tmpfs): "
                                       "the agent's device plugin mounts the daemon's own /dev/shm into its clients")
    leader_election: bool = Field(default=True, description="only the holder of the lease plans")
    lease_name: str = Field(default=LEASE_NAME, description="coordination.k8s.io Lease name")
    lease_namespace: str = Field(default=SYSTEM_NAMESPACE, description="namespace of the Lease")
    lease_duration_s: int = Field(default=15, ge=2, description="a standby takes over after this long without renewal")
    lease_renew_s: float = Field(default=4.0, gt=0, description="how often the leader renews (at most half of "
                                 "lease_duration_s)")
    lease_retry_s: float = Field(default=1.0, gt=0, description="how often a standby tries (less than "
                                 "lease_duration_s)")
    identity: str = Field(default_factory=socket.gethostname, min_length=1,
                          description="this replica's name in the Lease")

    @field_validator("lease_name", "lease_namespace")
    @classmethod
    def _lease(cls, value: str, info: ValidationInfo) -> str:
        # only where used (as nvidia_plugin_namespace): a planner without leader election reads no Lease
        return _lease_field(value, info) if info.data.get("leader_election", True) else value

    @model_validator(mode="after")
    def _consistent(self) -> PlannerSettings:
        # the leader writes only while its last renewal is younger than 2/3 of the lease
        # (dynpart.kube.leases): renewing less often than half the lease leaves it unable to write
        if self.lease_renew_s * 2 > self.lease_duration_s:
            raise ValueError(f"lease_renew_s = {self.lease_renew_s:g} must be at most half of lease_duration_s = "
                             f"{self.lease_duration_s} (the leader stops writing 2/3 of the lease after a renewal)")
        if self.lease_retry_s >= self.lease_duration_s:
            raise ValueError(f"lease_retry_s = {self.lease_retry_s:g} must be shorter than lease_duration_s = "
                             f"{self.lease_duration_s}")
        if self.batch_idle_s > self.batch_timeout_s:
            raise ValueError(f"batch_idle_s = {self.batch_idle_s:g} must be at most batch_timeout_s = "
                             f"{self.batch_timeout_s:g} (a batch closes at the latest after batch_timeout_s)")
        return self


def _lease_field(value: str, info: ValidationInfo) -> str:
    """A Lease's name or namespace, checked here, not by the API server after the process started
    (a Lease read under a name that cannot exist fails on every try, for ever)."""
    namespace = (info.field_name or "").endswith("namespace")
    problem = dns_label_problem(value) if namespace else dns_subdomain_problem(value, "Lease name")
    if problem:
        raise ValueError(problem)
    return value


def default_planner_settings() -> PlannerSettings:
    """The planner's defaults and the `DYNPART_PLANNER_*` environment, without a file: what a
    simulation plans with unless told otherwise (`dynpart simulate --planner-config`). A bad
    variable is a DynpartError naming it."""
    return load_settings(PlannerSettings)


class AgentSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="DYNPART_AGENT_", env_nested_delimiter=NESTED, extra="forbid",
                                      allow_inf_nan=False)

    kube: AgentKubeSettings = Field(default_factory=AgentKubeSettings, description="Kubernetes API client")
    node_name: str = Field(default="", description="the node this agent manages (downward API: spec.nodeName)")
    report_interval_s: float = Field(default=10.0, gt=0, description="period of the agent's passes (the driver read, "
                                     "the status written when it changed); a spec change starts one at once")
    heartbeat_interval_s: float = Field(default=300.0, gt=0, description="a status write that would only move "
                                        "`status-heartbeat` is made at most this often (at least every "
                                        "report_interval_s): each Node write reaches etcd and every Node watcher")
    fake_gpus: str | None = Field(default=None, description="MODEL:N — a fake NVML driver (tests, demos)")
    mps_capacity_gb: int | None = Field(default=None, gt=0, description="MPS capacity of one GPU in GB "
                                        "(default: the memory NVML reports, in GiB; only lowers it; the "
                                        "capability report offers this much memory, so the planner plans with it)")
    pod_resources_socket: str = Field(default="/var/lib/kubelet/pod-resources/kubelet.sock", description="kubelet PodResources API socket")
    node_lock_file: str = Field(default="/var/lib/dynpart/agent.lock", description="a file on the node's "
                                "filesystem: one agent at a time acts on the node's GPUs (empty: no lock)")
    planner_lease_name: str = Field(default=LEASE_NAME, description="the planner's leader-election Lease: a spec "
                                    "written under an older term than the Lease's is ignored (fencing)")
    planner_lease_namespace: str = Field(default=SYSTEM_NAMESPACE, description="its namespace")
    device_plugin: Literal["builtin", "nvidia"] = Field(
        default="builtin", description="who advertises the slices to the kubelet: `builtin`, the agent's own device "
        "plugin (MIG, MPS and whole GPUs; NVIDIA's plugin must be off on the node), or `nvidia`, NVIDIA's device "
        "plugin on MIG nodes (restarted after each change). MPS nodes are always served by the agent's own plugin, "
        "in both modes (NVIDIA's plugin must be off there): NVIDIA's can only split a GPU into equal replicas")
    device_plugin_dir: str = Field(default="/var/lib/kubelet/device-plugins", description="the agent's own device "
                                   "plugin: the kubelet's device-plugin directory (kubelet.sock and the plugins' "
                                   "sockets)")
    device_list_strategy: Literal["envvar", "volume-mounts", "cdi-cri", "cdi-annotations"] = Field(
        default="envvar", description="the agent's own device plugin: how Allocate names a container's GPUs or MIG "
        "devices to the NVIDIA container runtime, as NVIDIA's plugin's DEVICE_LIST_STRATEGY: `envvar` "
        "(NVIDIA_VISIBLE_DEVICES lists them; a pod can set that variable itself) or `volume-mounts` (one /dev/null "
        "mount per device under /var/run/nvidia-container-devices; needs the runtime's "
        "accept-nvidia-visible-devices-as-volume-mounts=true, as GPU Operator sets it, and is what a runtime that "
        "refuses the variable from unprivileged pods needs), or by CDI name, for a runtime that injects GPUs by CDI "
        "(GPU Operator v25.10 or later, whose `nvidia` runtime runs in CDI mode): `cdi-cri` (the Allocate response's "
        "CDI devices, kubelet 1.29 or later, 1.28 with the DevicePluginCDIDevices gate) or `cdi-annotations` "
        "(a cdi.k8s.io/ annotation), each device "
        "`<cdi_kind>=<GPU or MIG UUID>`, from a spec the agent writes in `cdi_spec_dir`; NVIDIA_VISIBLE_DEVICES is "
        "then `void`")
    cdi_spec_dir: str = Field(default="/var/run/cdi", description="the agent's own device plugin, a CDI "
                              "`device_list_strategy`: the directory (a CDI spec directory of the node's runtime) "
                              "where the agent writes its spec `<cdi_kind, / written ->.json` and where it reads the "
                              "NVIDIA Container Toolkit's management spec")
    cdi_kind: str = Field(default="dynpart.io/gpu", pattern=r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?/"
                          r"[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?$",
                          description="the agent's own device plugin, a CDI `device_list_strategy`: the kind "
                          "(vendor/class) of its CDI devices")
    cdi_management_spec: list[str] = Field(
        default_factory=list, description="the agent's own device plugin, a CDI `device_list_strategy`: the "
        "management CDI spec(s) whose common edits (the driver's libraries, binaries and hooks) the agent's spec "
        "copies, the first that exists (empty: management.nvidia.com-gpu.yaml, then .json, in `cdi_spec_dir`, as "
        "the NVIDIA Container Toolkit writes it)")
    device_specs: bool = Field(
        default=True, description="the agent's own device plugin: Allocate also lists the container's device nodes "
        "as DeviceSpecs, as NVIDIA's plugin does with PASS_DEVICE_SPECS=true (GPU Operator's setting): "
        "/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools, /dev/nvidia-modeset, the GPU's /dev/nvidia<minor> "
        "and, for a MIG device, its GPU and compute instances' /dev/nvidia-caps/nvidia-cap<N>, each only where it "
        "exists. They are then in the container's OCI spec and device cgroup, which a CPU manager's "
        "UpdateContainerResources or a systemd daemon-reload otherwise rewrites without the GPU the runtime gave "
        "it (\"Failed to initialize NVML: Unknown Error\" in a running pod)")
    nvidia_dev_root: str = Field(default="/", description="the agent's own device plugin, `device_specs`: the host "
                                 "directory whose dev/ holds the driver's device nodes, as NVIDIA's plugin's "
                                 "NVIDIA_DEV_ROOT (`/` for a driver installed on the host)")
    nvidia_dev_dir: str = Field(default="/dev", description="the agent's own device plugin, `device_specs`: where "
                                "the agent sees the host's `<nvidia_dev_root>/dev`, to list only the nodes that exist "
                                "(one that does not fails the container's creation). The chart mounts it at "
                                "/host/nvidia-dev; the agent's own /dev holds what its runtime gave it at its start "
                                "(a privileged container: the host's nodes then, not those made later)")
    mps_pipe_dir: str = Field(default="/var/lib/dynpart/mps", description="MPS: host directory of the MPS control "
                              "daemon's pipes, mounted into MPS pods (the same path inside the agent)")
    mps_log_dir: str = Field(default="/var/lib/dynpart/mps-log", description="MPS: the MPS control daemon's logs")
    mps_control_dir: str | None = Field(default=None, description="MPS: a host directory shared with a pod that "
                                        "runs `dynpart agent mps-control --dir` on it (the Helm chart's `mps-control` "
                                        "DaemonSet): the MPS control daemon runs there, and a restart or replacement "
                                        "of the agent leaves it and its clients running. Unset: the agent runs the "
                                        "daemon in its own container, and its restart or exit ends every MPS client "
                                        "on the node")
    mps_exclusive_process: bool = Field(default=True, description="MPS: put each GPU with MPS slices in "
                                        "EXCLUSIVE_PROCESS compute mode, as NVIDIA's MPS daemon does (the MPS server "
                                        "is then its only process: a client that misses the daemon gets no context "
                                        "instead of running beside it without its slice's limits); a GPU it put so is "
                                        "set back to DEFAULT once it has no slice, before it is listed whole (reported "
                                        "unhealthy while it cannot be), whatever this setting says later. Needs "
                                        "CAP_SYS_ADMIN on the GPUs (the chart sets this false for an agent without "
                                        "it). False: no GPU is put in EXCLUSIVE_PROCESS")
    compute_modes_file: str = Field(default="/var/lib/dynpart/compute-modes.json", description="MPS: a file on the "
                                    "node's filesystem where the agent remembers which GPUs it put in "
                                    "EXCLUSIVE_PROCESS (mps_exclusive_process), so that a restarted agent still sets "
                                    "them back to DEFAULT once they have no slice, and leaves other GPUs' modes as "
                                    "they are (empty: remembered in memory only)")
    publish_allocatable: bool = Field(default=True, description="the agent's own device plugin: write the node's "
                                      "status.allocatable of the slice resources as soon as the kubelet holds the "
                                      "devices (never more than it holds), instead of waiting for the kubelet's next "
                                      "node-status write, and again at once when the node shows other counts (a "
                                      "kubelet restart)")
    withdraw_settle_s: float = Field(default=0.5, ge=0, description="the agent's own device plugin: after a slice is "
                                     "withdrawn and the kubelet dropped it, wait this long for an admission already "
                                     "under way before checking it is still free and destroying it")
    nvidia_plugin_namespace: str = Field(default="gpu-operator", description="nvidia: namespace of NVIDIA's "
                                         "device-plugin pods (restarted on this node after a MIG change)")
    nvidia_plugin_selector: str = Field(default="app=nvidia-device-plugin-daemonset",
                                        description="nvidia: label selector of those pods")

    @field_validator("planner_lease_name", "planner_lease_namespace")
    @classmethod
    def _lease(cls, value: str, info: ValidationInfo) -> str:
        return _lease_field(value, info)  # (read on every pass: the fencing of plans)

    @field_validator("nvidia_plugin_namespace", "nvidia_plugin_selector")
    @classmethod
    def _as_the_api_server_takes_them(cls, value: str, info: ValidationInfo) -> str:
        # checked here, not by the API server at the first MIG change; and never an empty
        # selector: the agent deletes the pods it selects on its node. Only where they are used
        # (a builtin agent never reads them)
        if info.data.get("device_plugin") != "nvidia":
            return value
        check = dns_label_problem if info.field_name == "nvidia_plugin_namespace" else selector_problem
        problem = check(value)
        if problem:
            raise ValueError(problem)
        return value


# --- sources ----------------------------------------------------------------------------------

# The `--config` file of the settings being loaded: settings_customise_sources is a classmethod,
# so load_settings hands it the file this way (None: no file).
_config_file: ContextVar[str | Path | None] = ContextVar("dynpart_config_file", default=None)


class ConfigFileSource(YamlConfigSettingsSource):
    """The `--config` YAML file. Unlike pydantic-settings' own source, a file that cannot be read,
    is not YAML or is not a mapping is an error naming the file, not silently no settings."""

    def __init__(self, settings_cls: type[BaseSettings], file: str | Path | None):
        self.shown = file
        self.model = settings_cls  # the base class sets its own only after reading the file
        if file is not None:
            try:
                with open(file, "rb"):
                    pass
            except OSError as e:
                raise DynpartError(f"config file {file}: {e.strerror}") from None
        super().__init__(settings_cls, yaml_file=file)

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        try:
            with file_path.open(encoding="utf-8") as f:
                values: object = yaml_text.load(f.read()) or {}
        except yaml.YAMLError as e:
            raise DynpartError(f"config file {yaml_problem(self.shown, e)}") from None
        except UnicodeDecodeError as e:
            raise DynpartError(f"config file {self.shown}: {read_problem(e)}") from None
        if not isinstance(values, dict):
            raise DynpartError(f"config file {self.shown}: must be a mapping of setting: value")
        return _known_settings(self.model, values, f"config file {self.shown}")


def _known_settings(model: type[BaseModel], values: dict[Any, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """The file's settings that this version has; the others are ignored with a warning, also in
    nested settings (`kube`). A file is written for one version and read by others: the chart's
    ConfigMap is mounted afresh at each container start, so an agent not yet replaced by an
    upgrade (the DaemonSet's OnDelete) reads the new version's file when it restarts, and must not
    crash-loop on a setting it does not know. (The chart's values schema refuses unknown keys
    where they are written.)"""
    out: dict[str, Any] = {}
    for key, value in values.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            near = difflib.get_close_matches(str(key), list(model.model_fields), n=1)
            log.warning("%s: %s is not a setting of this dynpart version (a newer version's, or a misspelling%s): "
                        "ignored", where, f"{prefix}{key}", f": {prefix}{near[0]}?" if near else "")
            continue
        nested = field.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel) and isinstance(value, dict):
            value = _known_settings(nested, value, where, f"{prefix}{key}.")
        out[key] = value
    return out


@contextmanager
def _reading(file: str | Path | None) -> Iterator[None]:
    token = _config_file.set(file)
    try:
        yield
    finally:
        _config_file.reset(token)


S = TypeVar("S", bound=CommonSettings)


_said_unknown: set[str] = set()  # said once a process (a simulation loads the settings per run)
# <SERVICE>_SERVICE_HOST, _SERVICE_PORT[_<NAME>], _PORT, _PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR]
_SERVICE_LINK = re.compile(r"_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)$")


def _warn_unknown_variables(cls: type[BaseSettings]) -> None:
    """Environment variables of the settings' prefix that name no setting (a misspelling, or a
    newer version's) are ignored by pydantic-settings: said, as the config file's unknown keys are."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    if not prefix:
        return
    fields = list(cls.model_fields)
    for var in sorted(os.environ):
        if not var.upper().startswith(prefix):
            continue
        if _SERVICE_LINK.search(var):
            continue  # the kubelet's service links of a Service named like dynpart-planner-...
        name = var[len(prefix):].lower().split(NESTED, 1)[0]
        if name in fields:
            continue
        if var in _said_unknown:
            continue
        _said_unknown.add(var)
        near = difflib.get_close_matches(name, fields, n=1)
        log.warning("environment variable %s names no setting of this dynpart version (a newer version's, or a "
                    "misspelling%s): ignored", var, f": {prefix}{near[0].upper()}?" if near else "")


def load_settings(cls: type[S], file: str | Path | None = None, flags: Mapping[str, Any] | None = None) -> S:
    """Settings from `file` (YAML mapping), then the environment, then `flags` (None values ignored)."""
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    _warn_unknown_variables(cls)
    try:
        with _reading(file):
            return cls(**given)
    except SettingsError as e:  # a variable the sources cannot parse (e.g. a list that is not JSON)
        named = re.search(r'for field "([^"]+)"', str(e))
        if named is not None and "EnvSettingsSource" in str(e):
            var = f"{cls.model_config.get('env_prefix', '')}{named.group(1).upper()}"
            raise DynpartError(f"settings: environment variable {var}: not JSON; a list or mapping setting is "
                               "JSON there (e.g. '[...]' or '{...}'; docs/configuration.md shows each setting's "
                               "shape)") from None
        raise DynpartError(f"settings: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        field = ".".join(loc)
        var = f"{cls.model_config.get('env_prefix', '')}{NESTED.join(loc).upper()}"
        top = f"{cls.model_config.get('env_prefix', '')}{loc[0].upper()}" if loc else ""
        # where the value came from, in the sources' order of precedence
        environ = {k.upper() for k in os.environ}
        if loc and loc[0] in given:
            env = " (command-line flag)"
        elif var in environ or top in environ:
            env = f" (environment variable {var if var in environ else top})"
        elif len(loc) == 1 and (nested := sorted(k for k in environ if k.startswith(top + NESTED))):
            # a check across a nested model's settings (kube's back-offs): its variables
            env = f" (environment variable{'s' if len(nested) > 1 else ''} {', '.join(nested)})"
        elif file is not None:
            env = f" (config file {file})"
        else:
            env = ""
        given = err.get("input")
        if (field and isinstance(given, str) and given.startswith(("tcp://", "udp://", "sctp://"))
                and any(k.upper() == var and v == given for k, v in os.environ.items())):
            # the kubelet's service links: <SERVICE>_PORT=tcp://<ip>:<port> for every Service
            env += (" (this looks like a Kubernetes service link: a Service whose name makes this variable "
                    "exists in the pod's namespace; set enableServiceLinks: false on the pod)")
        if not field:  # a check across settings: its message names them
            raise DynpartError(f"settings: {err['msg'].removeprefix('Value error, ')}") from None
        raise DynpartError(f"setting {field} = {given!r}: {err['msg'].removeprefix('Value error, ')}{env}") from None
