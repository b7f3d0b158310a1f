"""Label selectors and namespace names are refused where the API server would refuse them."""

from __future__ import annotations

import re

import pytest

from dynpart.errors import DynpartError
from dynpart.kube.selectors import dns_label_problem, selector_problem
from dynpart.settings import AgentSettings, load_settings


@pytest.mark.parametrize("text", [
    "app=nvidia-device-plugin-daemonset", "app", "!app", "app!=x", "app==x", "app=", "app in (a, b)",
    "app notin (a)", "a=b,c in (d,e),!f", "x>3", "x<9223372036854775807",
    "app in ()", "app notin ()", "app in ( )", "app in (),b=c",  # `()`: the set of the empty value
    "nvidia.com/gpu.deploy.device-plugin=true", " app = x ",
])
def test_selectors_the_api_server_takes_are_taken(text):
    assert selector_problem(text) is None


@pytest.mark.parametrize("text, said", [
    ("", "an empty label selector selects every pod"),
    ("  ", "an empty label selector selects every pod"),
    ("app=x,", "'' is not a label requirement"),
    ("app=nvidia device", "'app=nvidia device' is not a label requirement"),
    ("x>-1", "needs a non-negative 64-bit integer"),
    ("x>9223372036854775808", "needs a non-negative 64-bit integer"),
    ("x>" + "1" * 64, "needs a non-negative 64-bit integer"),
    ("x>\u0663", "needs a non-negative 64-bit integer"),
    # the API server's lexer takes only ' ', \t, \r, \n for whitespace: a no-break space copied
    # from a web page is part of a token
    ("app=nvidia-device-plugin-daemonset\u00a0", "is not valid (at most 63"),
    ("\u00a0app=x", "is not a qualified name"),
    ("app\u2003in (a)", "is not a label requirement"),
    ("app=x\f", "is not valid (at most 63"),
    ("app=x\v", "is not valid (at most 63"),
    ("app in (a,b", "is not a label requirement"),
    ("Nvidia.com/app=x", "label key 'Nvidia.com/app' is not a qualified name"),
    ("a" * 64 + "=x", "is not a qualified name"),
    ("app=" + "v" * 64, "is not valid (at most 63"),
    ("app in (ok, -bad)", "label value '-bad' is not valid"),
    ("x>three", "> needs a non-negative 64-bit integer"),
])
def test_selectors_the_api_server_refuses_are_named(text, said):
    problem = selector_problem(text)
    assert problem is not None and said in problem


def test_namespace_names():
    assert dns_label_problem("gpu-operator") is None
    for bad in ("GPU", "", "-x", "x" * 64, "a.b"):
        assert "is not a valid namespace name" in (dns_label_problem(bad) or "")


def test_the_agent_refuses_a_plugin_selector_or_namespace_the_api_server_would(monkeypatch):
    """Found when the agent starts, not at the first MIG change; never an empty selector, which
    would have the agent delete every pod of the namespace on its node. Only where NVIDIA's plugin
    is used: a builtin agent never reads them."""
    monkeypatch.setenv("DYNPART_AGENT_NVIDIA_PLUGIN_SELECTOR", "")
    assert load_settings(AgentSettings).device_plugin == "builtin"
    monkeypatch.setenv("DYNPART_AGENT_DEVICE_PLUGIN", "nvidia")
    monkeypatch.setenv("DYNPART_AGENT_NVIDIA_PLUGIN_SELECTOR", "")
    with pytest.raises(DynpartError, match=r"nvidia_plugin_selector = '': an empty label selector selects every "
                                           r"pod \(environment variable DYNPART_AGENT_NVIDIA_PLUGIN_SELECTOR\)"):
        load_settings(AgentSettings)
    monkeypatch.setenv("DYNPART_AGENT_NVIDIA_PLUGIN_SELECTOR", "app=x,")
    with pytest.raises(DynpartError, match="is not a label requirement"):
        load_settings(AgentSettings)
    monkeypatch.setenv("DYNPART_AGENT_NVIDIA_PLUGIN_SELECTOR", "app in (nvidia-device-plugin-daemonset)")
    monkeypatch.setenv("DYNPART_AGENT_NVIDIA_PLUGIN_NAMESPACE", "GPU-Operator")
    with pytest.raises(DynpartError, match="'GPU-Operator' is not a valid namespace name"):
        load_settings(AgentSettings)
    monkeypatch.setenv("DYNPART_AGENT_NVIDIA_PLUGIN_NAMESPACE", "nvidia")
    settings = load_settings(AgentSettings)
    assert (settings.nvidia_plugin_namespace, settings.nvidia_plugin_selector) == \
        ("nvidia", "app in (nvidia-device-plugin-daemonset)")


def test_the_lease_is_checked_when_the_process_starts(monkeypatch):
    """A Lease namespace or name the API server cannot have (`Bad_NS`) made the planner retry its
    read for ever, and the agent's fencing read fail on every pass (reviews 172, 173). A planner
    without leader election reads no Lease: its settings are not checked."""
    from dynpart.settings import PlannerSettings

    for kind, prefix, field in ((PlannerSettings, "DYNPART_PLANNER_", "lease_namespace"),
                                (PlannerSettings, "DYNPART_PLANNER_", "lease_name"),
                                (AgentSettings, "DYNPART_AGENT_", "planner_lease_namespace"),
                                (AgentSettings, "DYNPART_AGENT_", "planner_lease_name")):
        variable = prefix + field.upper()
        what = "namespace name" if field.endswith("namespace") else "Lease name"
        for bad in ("Bad_NS", "kube system", "", "a..b"):
            monkeypatch.setenv(variable, bad)
            with pytest.raises(DynpartError, match=rf"^setting {field} = '{re.escape(bad)}': '{re.escape(bad)}' is not a "
                                                   rf"valid {what} .*\(environment variable {variable}\)$"):
                load_settings(kind)
        monkeypatch.setenv(variable, "gpu-system.x" if what == "Lease name" else "gpu-system")
        assert getattr(load_settings(kind), field) in ("gpu-system", "gpu-system.x")
    monkeypatch.setenv("DYNPART_PLANNER_LEASE_NAMESPACE", "Bad_NS")
    monkeypatch.setenv("DYNPART_PLANNER_LEADER_ELECTION", "false")
    assert load_settings(PlannerSettings).lease_namespace == "Bad_NS"
