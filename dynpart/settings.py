"""Configuration: one pydantic settings model per component, from a YAML file, environment
variables and command-line flags (flags win over the environment, which wins over the file).
Validated at start-up; an invalid value is one clear line naming the setting and the value."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from dynpart.errors import DynpartError

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


class CommonSettings(BaseSettings):
    kubeconfig: str | None = Field(default=None, description="kubeconfig file; default: $KUBECONFIG or in-cluster")
    log_level: LogLevel = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_json: bool = Field(default=False, description="one JSON object per log line")
    metrics_host: str = Field(default="0.0.0.0", description="address of the /metrics server")
    metrics_port: int = Field(default=9090, ge=0, le=65535, description="Prometheus /metrics port; 0 = off")
    catalog_files: list[str] = Field(default=[], description="extra GPU catalog files")


class PlannerSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="DYNPART_PLANNER_", extra="forbid")

    batch_idle_s: float = Field(default=0.5, gt=0, description="close a batch after this long without a new pod")
    batch_timeout_s: float = Field(default=3.0, gt=0, description="close a batch at the latest this long after its first pod")
    ack_timeout_s: float = Field(default=60.0, gt=0, description="give up waiting for an agent's acknowledgement")
    resync_s: float = Field(default=15.0, gt=0, description="re-plan still pending pods at least this often")
    plan_time_limit_s: float = Field(default=0.5, ge=0, description="exact-search budget per plan (deterministic s)")
    leader_election: bool = Field(default=True, description="only the holder of the lease plans")
    lease_name: str = Field(default="dynpart-planner", description="coordination.k8s.io Lease name")
    lease_namespace: str = Field(default="dynpart-system", description="namespace of the Lease")
    lease_duration_s: int = Field(default=15, ge=2, description="a standby takes over after this long without renewal")
    lease_renew_s: float = Field(default=4.0, gt=0, description="how often the leader renews")
    lease_retry_s: float = Field(default=1.0, gt=0, description="how often a standby tries")
    identity: str = Field(default_factory=socket.gethostname, description="this replica's name in the Lease")


class AgentSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="DYNPART_AGENT_", extra="forbid")

    node_name: str = Field(default="", description="the node this agent manages (downward API: spec.nodeName)")
    report_interval_s: float = Field(default=10.0, gt=0, description="status heartbeat period")
    device_plugin_configmap: str = Field(default="dynpart-device-plugin-configs", description="ConfigMap of MPS device-plugin configs")
    device_plugin_namespace: str = Field(default="dynpart-system", description="its namespace")
    fake_gpus: str | None = Field(default=None, description="MODEL:N — a fake NVML driver (tests, demos)")
    device_plugin_config_mount: str | None = Field(
        default=None, description="where the device-plugin ConfigMap is mounted: the node label is switched once "
        "a new config file appears there")
    config_settle_s: float = Field(default=60.0, ge=0, description="without a mount: seconds between writing a "
                                   "config and switching the label to it")
    mps_capacity_gb: int | None = Field(default=None, gt=0, description="MPS capacity of one GPU in GB "
                                        "(default: the model's memory)")
    pod_resources_socket: str = Field(default="/var/lib/kubelet/pod-resources/kubelet.sock", description="kubelet PodResources API socket")


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], file: str | Path | None = None, flags: dict[str, Any] | None = None) -> S:
    """Settings from `file` (YAML mapping), then the environment, then `flags` (None values ignored)."""
    file_values: dict[str, Any] = {}
    if file is not None:
        try:
            file_values = yaml.safe_load(Path(file).read_text()) or {}
        except OSError as e:
            raise DynpartError(f"config file {file}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise DynpartError(f"config file {file}: not valid YAML: {e}") from None
        if not isinstance(file_values, dict):
            raise DynpartError(f"config file {file}: must be a mapping of setting: value")
    try:
        env_only = cls()  # environment and defaults
        explicit_env = env_only.model_dump(exclude_unset=True)
        merged = {**file_values, **explicit_env, **{k: v for k, v in (flags or {}).items() if v is not None}}
        return cls.model_validate(merged)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        env = f" (environment variable {cls.model_config.get('env_prefix', '')}{field.upper()})"
        raise DynpartError(f"setting {field} = {err.get('input')!r}: {err['msg']}{env if field else ''}") from None
