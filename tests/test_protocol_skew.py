"""The annotation protocol against hand edits and version skew (helper-113): every decoder is
fuzzed with arbitrary strings and with mutations of valid encodings; a bad annotation on one
node is that node's problem, never the planner's or the agent's crash."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.capability import CapabilityError, decode_capability
from dynpart.catalog import default_catalog
from dynpart.kube.conventions import STATUS_CAPABILITY, STATUS_MODE
from dynpart.planner.cluster_view import build_snapshot
from tests.controller.test_cluster_view import node

CAT = default_catalog()


@pytest.mark.parametrize("text", [
    "[" * 2000,
    '{"v": 1, "kinds": ' + "[" * 3000 + "]" * 3000 + ', "gpus": [[0, "on"]]}',
    '{"v": 1, "kinds": [{"product": ' + '{"a":' * 1500 + "1" + "}" * 1500 + "}]}",
])
def test_a_deeply_nested_capability_report_is_a_capability_error(text: str):
    """A hand-edited (or truncated-and-repaired) report nested deeper than json's recursion limit,
    well under the 16 KiB read: refused as any unreadable report, not a RecursionError."""
    with pytest.raises(CapabilityError, match="capability report"):
        decode_capability(text)


def test_a_deeply_nested_capability_report_leaves_the_other_nodes_planned():
    """One node's report nested too deep: that node is planned from the catalog (a problem
    naming it), and the snapshot of the cluster is still built."""
    bad = node("bad", annotations={STATUS_MODE: "mig", STATUS_CAPABILITY: "[" * 2000})
    good = node("good", annotations={STATUS_MODE: "mig"})
    view = build_snapshot([bad, good], [], CAT)
    assert sorted(n.name for n in view.snapshot.nodes) == ["bad", "good"]
    assert any("bad" in p and STATUS_CAPABILITY in p for _, p in view.problems)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30).map(lambda doc: __import__("json").dumps(doc))))
def test_any_text_is_read_or_refused_with_a_capability_error(text: str):
    try:
        decode_capability(text)
    except CapabilityError as e:
        assert str(e).startswith("capability report")


from dynpart.annotations import decode_fencing, decode_spec, decode_status  # noqa: E402
from dynpart.kube.conventions import (  # noqa: E402
    SPEC_DRAIN,
    SPEC_MODE,
    SPEC_PLAN,
    SPEC_PODS,
    SPEC_REVOKES,
    SPEC_TERM,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_PLAN,
    STATUS_UNHEALTHY,
)

_FIXED = [SPEC_PLAN, SPEC_MODE, SPEC_TERM, SPEC_PODS, SPEC_REVOKES, SPEC_DRAIN, STATUS_PLAN, STATUS_MODE,
          STATUS_ERROR, STATUS_HEARTBEAT, STATUS_CAPABILITY, STATUS_UNHEALTHY]
_ANY_KEY = st.one_of(st.sampled_from(_FIXED), st.text(max_size=30).map(lambda t: "dynpart.io/" + t),
                     st.builds(lambda p, i, t, s: f"dynpart.io/{p}gpu-{i}-{t}{s}", st.sampled_from(["spec-", "status-"]),
                               st.text(max_size=4), st.text(max_size=10), st.sampled_from(["", "-free", "-used", "-"])))
_ANY_VALUE = st.one_of(st.text(max_size=60), st.text(alphabet="0123456789,@-:TZ.gbme ", max_size=40),
                       st.sampled_from(["2025-02-29T12:00:00Z", "2025-01-31T12:00:61Z", "9999-12-31T23:59:59Z",
                                        "0001-01-01T00:00:00Z", "\u0662025-01-31T12:00:00Z"]))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_ANY_KEY, _ANY_VALUE, max_size=10),
       st.sampled_from([CAT.resolve("H100-80GB"), CAT.resolve("A30-24GB"), CAT.resolve("A100-40GB")]))
def test_any_strings_in_any_key_never_make_a_decoder_raise(annotations, model):
    for decode in (decode_spec, decode_status):
        decoded = decode(annotations, model)
        assert all(isinstance(p, str) and p for p in decoded.problems)
    decode_fencing(annotations, [])


import json  # noqa: E402

from dynpart.annotations import slice_token  # noqa: E402


def _report_with_profile(name: str) -> str:
    return json.dumps({"v": 1, "kinds": [{"product": "Foo GPU", "memory_mib": 20000, "slices": [2, 2],
                                          "profiles": [[name, 19, "1_SLICE", 1, 1, 2, [0, 1]]]}],
                       "gpus": [[0, "on"]]})


@pytest.mark.parametrize("name", ["1g.10000gb", "01g.10gb", "1g.010gb", "100g.10gb", "1g.\u0661\u0660gb"])
def test_a_reported_profile_that_no_annotation_key_can_name_is_refused(name: str):
    """The planner plans a reported profile and writes it in spec keys (`slice_token`): a report
    naming one that no key can carry is refused when read (the node planned from the catalog),
    never planned and then found unwritable in the middle of a round (a ValueError that stopped
    every node's planning while a pod asked for it)."""
    with pytest.raises(CapabilityError, match=r"kinds\[0\]\.profiles\[0\]\[0\]"):
        decode_capability(_report_with_profile(name))


@settings(max_examples=300, deadline=None)
@given(st.from_regex(r"\A[0-9]{1,5}g\.[0-9]{1,6}gb(\+me|\+me\.all|-me|\+gfx)?\Z"))
def test_every_profile_a_report_may_name_can_be_written_in_a_key(name: str):
    try:
        cap = decode_capability(_report_with_profile(name))
    except CapabilityError:
        return
    for kind in cap.kinds:
        for p in kind.profiles:
            slice_token(p.name)


def test_a_pod_asking_for_a_profile_no_key_can_name_stops_no_round():
    from dynpart.planner.cluster_view import planned_patches
    from dynpart.planner.core import plan
    from tests.controller.test_cluster_view import pod
    n = node("n1", product="Foo GPU", count=1,
             annotations={STATUS_MODE: "mig", STATUS_CAPABILITY: _report_with_profile("1g.10000gb")})
    view = build_snapshot([n], [pod("a", {"nvidia.com/mig-1g.10000gb": "1"})], CAT)
    planned_patches(view.snapshot, plan(view.snapshot, view.catalog), {"n1": n}, "p1")  # raised ValueError
    assert any(STATUS_CAPABILITY in p for _, p in view.problems)
