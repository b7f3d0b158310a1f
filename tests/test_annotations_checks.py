"""The node-annotation protocol, checks that the round trips of test_annotations.py leave open:
specs written from layouts that hold used slices, the keys that keep a GPU as it is, the limits
of docs/protocol.md exactly at their boundary, and malformed values reported, never raised."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.annotations import (
    SPEC_DRAIN,
    SPEC_MODE,
    SPEC_PLAN,
    SPEC_PODS,
    SPEC_TERM,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_MODE,
    STATUS_PLAN,
    STATUS_UNHEALTHY,
    canonical_layout,
    decode_fencing,
    decode_spec,
    decode_status,
    encode_spec,
    encode_status,
    format_heartbeat,
    is_plan_id,
    is_pod_key,
    keeping_spec,
    mps_token,
)
from dynpart.catalog import GpuModel, default_catalog
from dynpart.kube.conventions import SPEC_REVOKES, STATUS_CAPABILITY
from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice, NodeLayout
from tests.gpus import CAPPED_1G
from tests.test_annotations import MIG_MODELS, mig, mig_layouts

CATALOG = default_catalog()
H100 = CATALOG.resolve("H100-80GB")
T4 = GpuModel(name="T4", memory_gb=16)  # no MIG: the GPUs MPS is mostly for

# The protocol's limits as docs/protocol.md states them, written out here rather than imported:
# a test reading them from the module would move with a changed constant
GPU_INDEX_MAX = 255
PLAN_ID_CHARS = 128
ERROR_CHARS = 4096
TERM_MAX = 999_999
PODS_READ_CHARS = 64 * 1024
PODS_WRITE_CHARS = 32 * 1024


def mps(index: int, *sizes: int, used: tuple[int, ...] = ()) -> GpuLayout:
    """A GPU with MPS slices of these sizes; `used` lists the positions of the used ones."""
    return GpuLayout(index=index, mps=[MpsSlice(size=s, used=i in used) for i, s in enumerate(sizes)])


def pods_joined_to(total: int) -> list[str]:
    """Valid, sorted, distinct pod keys whose comma-joined text is exactly `total` characters."""
    width = 98  # 331 of them join to exactly 32 KiB
    n = -(-(total + 1) // (width + 1))
    last = total - (n - 1) * (width + 1)
    out = []
    for i in range(n):
        head = f"team-a/pod-{i:05d}-"
        out.append(head + "x" * ((width if i < n - 1 else last) - len(head)))
    assert ",".join(out) == ",".join(sorted(out)) and len(",".join(out)) == total
    return out


# --- a spec written from a layout that holds used slices -----------------------------------------


def test_an_mps_spec_counts_used_and_free_slices_of_one_size_under_one_key():
    """The planner's layouts carry used flags; the spec has no state, so a used and a free 10gb
    slice are two slices of one key: "1" would tell the agent to destroy one of them."""
    layout = NodeLayout(node="n1", mode="mps", gpus=[mps(0, 10, 10, 20, used=(0,))])
    spec = encode_spec(layout, "p1")
    assert spec["dynpart.io/spec-gpu-0-10gb"] == "2" and spec["dynpart.io/spec-gpu-0-20gb"] == "1"
    assert [k for k in spec if k.startswith("dynpart.io/spec-gpu-")] == ["dynpart.io/spec-gpu-0-10gb",
                                                                         "dynpart.io/spec-gpu-0-20gb"]
    assert decode_spec(spec, H100, node="n1").layout == canonical_layout(layout)


def test_a_mig_spec_lists_used_and_free_instances_of_one_profile_under_one_key():
    layout = NodeLayout(node="n1", mode="mig", gpus=[mig(0, "1g.10gb@0", "1g.10gb@1", used=("1g.10gb@0",))])
    spec = encode_spec(layout, "p1")
    assert spec["dynpart.io/spec-gpu-0-1g.10gb"] == "2@0,1"
    assert decode_spec(spec, H100, node="n1").layout == canonical_layout(layout)


@st.composite
def mps_layouts_with_repeats(draw, with_used: bool = True):
    """MPS layouts whose slices often share a size, used and free mixed (test_annotations.py's
    strategy draws sizes from 1..capacity, so equal sizes are rare there)."""
    model = draw(st.sampled_from([H100, T4, CATALOG.resolve("A30-24GB")]))
    indices = draw(st.lists(st.sampled_from([0, 1, 7, GPU_INDEX_MAX]), unique=True, max_size=3))
    gpus = []
    for i in indices:
        left, slices = model.mps_capacity_gb, []
        for size in draw(st.lists(st.sampled_from([1, 2, 4, 5, 10]), max_size=8)):
            if size <= left:
                left -= size
                slices.append(MpsSlice(size=size, used=draw(st.booleans()) if with_used else False))
        gpus.append(GpuLayout(index=i, mps=slices))
    return model, NodeLayout(node="n", mode="mps", gpus=gpus)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mps_layouts_with_repeats(), mig_layouts(True)))
def test_a_spec_of_a_layout_with_used_slices_round_trips(model_layout):
    """decode_spec(encode_spec(x)) == canonical_layout(x) whatever x's used flags: the spec asks
    for every slice, used or free (the used ones are kept, never destroyed)."""
    model, layout = model_layout
    decoded = decode_spec(encode_spec(layout, "p"), model, node="n")
    assert decoded.problems == []
    assert decoded.layout == canonical_layout(layout)


# --- keeping a GPU as it is (an unhealthy GPU: cluster_view) --------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mps_layouts_with_repeats(), mig_layouts(True)), st.data())
def test_the_keeping_spec_of_some_gpus_asks_for_exactly_what_their_status_holds(model_layout, data):
    """The planner keeps an unhealthy GPU as it is with these keys: every slice its status
    reports, used or free, on those GPUs only (a short count would destroy a slice)."""
    model, layout = model_layout
    status = decode_status(encode_status(layout, "p"), model, node="n")
    assert status.problems == []
    chosen = data.draw(st.sets(st.sampled_from([0, 1, 2, 7, 15, GPU_INDEX_MAX])))
    kept = keeping_spec(status.layout, chosen)
    assert all(k.startswith("dynpart.io/spec-gpu-") for k in kept)
    decoded = decode_spec({SPEC_MODE: layout.mode, **kept}, model, node="n")
    assert decoded.problems == []
    assert decoded.layout == canonical_layout(layout.model_copy(update={"gpus": [g for g in layout.gpus if g.index in chosen]}))


def test_keeping_spec_examples():
    layout = NodeLayout(node="n1", mode="mps", gpus=[mps(0, 10, 10, used=(1,)), mps(1, 20)])
    status = decode_status(encode_status(layout, "p"), H100).layout
    assert keeping_spec(status, [0]) == {"dynpart.io/spec-gpu-0-10gb": "2"}
    assert keeping_spec(status, [1, 3]) == {"dynpart.io/spec-gpu-1-20gb": "1"}
    assert keeping_spec(status, []) == {}
    assert keeping_spec(None, [0]) == {}  # no status yet: nothing to keep
    layout = NodeLayout(node="n1", mode="mig", gpus=[mig(2, "1g.10gb@0", "1g.10gb@1", "3g.40gb@4", used=("1g.10gb@1",))])
    status = decode_status(encode_status(layout, "p"), H100).layout
    assert keeping_spec(status, [2]) == {"dynpart.io/spec-gpu-2-1g.10gb": "2@0,1", "dynpart.io/spec-gpu-2-3g.40gb": "1@4"}


# --- limits, exactly at the boundary ---------------------------------------------------------------


def test_plan_id_length_limit_is_exactly_128():
    layout = NodeLayout(node="n1", mode="mig", gpus=[])
    longest = "p" * PLAN_ID_CHARS
    assert is_plan_id(longest) and not is_plan_id(longest + "p")
    assert decode_spec(encode_spec(layout, longest), H100).plan_id == longest
    assert decode_status(encode_status(layout, longest), H100).plan_id == longest
    with pytest.raises(ValueError, match="plan id"):
        encode_spec(layout, longest + "p")
    with pytest.raises(ValueError, match="plan id"):
        encode_status(layout, longest + "p")
    d = decode_spec({SPEC_PLAN: longest + "p", SPEC_MODE: "mig"}, H100)
    assert d.plan_id is None and any(SPEC_PLAN in p and "128" in p for p in d.problems)


def test_plan_id_checks_refuse_what_is_not_a_string_with_a_clear_error():
    """The agent reads plan ids from its own state (is_plan_id); a non-string is no plan id, and
    encode raises ValueError naming the plan id, not a TypeError from the regex."""
    for bad in (5, None, b"p1", ["p1"], "a b", "", "é"):
        assert not is_plan_id(bad)
    assert is_plan_id("p-1") and is_plan_id("!~")
    layout = NodeLayout(node="n1", mode="mig", gpus=[])
    with pytest.raises(ValueError, match="plan id 5"):
        encode_spec(layout, 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plan id"):
        encode_status(layout, b"p1")  # type: ignore[arg-type]
    d = decode_status({STATUS_PLAN: 5, STATUS_MODE: "mig"}, H100)  # type: ignore[dict-item]
    assert d.plan_id is None and any(STATUS_PLAN in p for p in d.problems)


def test_pod_keys_are_namespace_slash_name():
    """cluster_view filters the pods it plans with is_pod_key: only what spec-pods can carry."""
    assert is_pod_key("default/web-0") and is_pod_key("a/b.c")
    for bad in (5, None, "default", "default/", "/web", "Default/web", "a/b/c", "a/b,c", "a b/c", "a/-b"):
        assert not is_pod_key(bad), bad


def test_gpu_index_limit_is_exactly_255_in_keys_drain_and_unhealthy():
    top = GPU_INDEX_MAX
    layout = NodeLayout(node="n1", mode="mps", gpus=[mps(top, 10).model_copy(update={"drain": True})])
    spec = encode_spec(layout, "p1")
    assert spec[f"dynpart.io/spec-gpu-{top}-10gb"] == "1" and spec[SPEC_DRAIN] == str(top)
    d = decode_spec(spec, H100, node="n1")
    assert d.problems == [] and d.layout == canonical_layout(layout) and d.drain == (top,)
    status = encode_status(layout, "p1", unhealthy=[top])
    s = decode_status(status, H100, node="n1")
    assert s.problems == [] and s.unhealthy == (top,) and s.layout.gpus[0].index == top
    for index in (-1, top + 1):
        bad = NodeLayout(node="n1", mode="mps", gpus=[mps(index, 10)])
        with pytest.raises(ValueError, match=f"GPU index {index} is outside 0..{top}"):
            encode_spec(bad, "p1")
        with pytest.raises(ValueError, match=f"GPU index {index}"):
            encode_status(bad, "p1")
        with pytest.raises(ValueError, match="unhealthy"):
            encode_status(layout, "p1", unhealthy=[index])
    d = decode_spec({SPEC_MODE: "mps", f"dynpart.io/spec-gpu-{top + 1}-10gb": "1", SPEC_DRAIN: str(top + 1)}, H100)
    assert d.layout.gpus == [] and d.drain == ()
    assert any(f"gpu-{top + 1}-10gb" in p and "0..255" in p for p in d.problems)
    assert any(SPEC_DRAIN in p and "0..255" in p for p in d.problems)


def test_every_gpu_drained_is_a_readable_list_and_an_overlong_one_is_reported():
    every = ",".join(map(str, range(GPU_INDEX_MAX + 1)))
    assert decode_spec({SPEC_DRAIN: every}, H100).drain == tuple(range(GPU_INDEX_MAX + 1))
    d = decode_spec({SPEC_DRAIN: ",".join(["1"] * 5000)}, H100)  # a huge value is not read
    assert d.drain == () and any(SPEC_DRAIN in p for p in d.problems)


def test_no_drain_and_no_unhealthy_read_as_empty_tuples():
    """Callers take set() and `in` of these: absent means (), never None."""
    layout = NodeLayout(node="n1", mode="mig", gpus=[mig(0, "7g.80gb@0")])
    assert decode_spec(encode_spec(layout, "p1"), H100).drain == ()
    assert decode_status(encode_status(layout, "p1"), H100).unhealthy == ()
    assert decode_spec({}, H100).drain == () and decode_status({}, H100).unhealthy == ()


def test_leader_term_limits_are_exactly_0_and_999999():
    layout = NodeLayout(node="n1", mode="mig", gpus=[])
    for term in (0, 1, TERM_MAX):
        spec = encode_spec(layout, "p1", term=term)
        assert spec[SPEC_TERM] == str(term)
        d = decode_spec(spec, H100)
        assert d.term == term and d.problems == []
    assert SPEC_TERM not in encode_spec(layout, "p1")  # no leader election: no term written
    for term in (-1, TERM_MAX + 1):
        with pytest.raises(ValueError, match=f"leader term {term}"):
            encode_spec(layout, "p1", term=term)
    for raw in ("1000000", "-1", "01", "", 7, 1.5):
        d = decode_spec({SPEC_MODE: "mig", SPEC_TERM: raw}, H100)  # type: ignore[dict-item]
        assert d.term is None and any(SPEC_TERM in p for p in d.problems), raw


def test_an_error_of_exactly_4096_characters_is_written_whole():
    layout = NodeLayout(node="n1", mode="mig", gpus=[])
    exact = "e" * ERROR_CHARS
    assert encode_status(layout, None, [exact])[STATUS_ERROR] == exact
    two = ["a" * 2000, "b" * (ERROR_CHARS - 2001)]  # with the newline: 4096
    assert encode_status(layout, None, two)[STATUS_ERROR] == "\n".join(two)
    cut = encode_status(layout, None, [exact + "e"])[STATUS_ERROR]
    assert len(cut) == ERROR_CHARS and cut.endswith(" ...")
    cut = encode_status(layout, None, [*two[:1], two[1] + "b"])[STATUS_ERROR]
    assert cut == two[0] + "\n... (1 more)"


def test_planned_pods_up_to_exactly_32_kib_are_written_whole():
    """The writer's cap (what agents of every version read), at its boundary: names joined to
    exactly 32 KiB are all kept; one name more is left out, and only that one."""
    layout = NodeLayout(node="n1", mode="mps", gpus=[])
    pods = pods_joined_to(PODS_WRITE_CHARS)
    assert len(pods) == 331
    assert encode_spec(layout, "p1", pods=pods)[SPEC_PODS] == ",".join(pods)
    text = encode_spec(layout, "p1", pods=[*pods, "zz/last"])[SPEC_PODS]
    assert text == ",".join(pods)
    text = encode_spec(layout, "p1", pods=[*pods[:-1], pods[-1] + "x"])[SPEC_PODS]
    assert text == ",".join(pods[:-1])
    for n in (300, 400, 1000):
        many = pods_joined_to(n * 99 - 1)
        text = encode_spec(layout, "p1", pods=many)[SPEC_PODS]
        assert len(text) <= PODS_WRITE_CHARS and text == ",".join(many[: min(n, 331)])


def test_planned_pods_are_read_up_to_exactly_64_kib():
    pods = pods_joined_to(PODS_READ_CHARS)
    problems: list[str] = []
    assert decode_fencing({SPEC_PODS: ",".join(pods)}, problems) == (None, tuple(pods)) and problems == []
    longer = pods_joined_to(PODS_READ_CHARS + 1)
    d = decode_spec({SPEC_MODE: "mps", SPEC_PODS: ",".join(longer)}, H100)
    assert d.pods == () and any(SPEC_PODS in p and "65536" in p for p in d.problems)


def test_bad_planned_pods_are_refused_by_the_writer_and_reported_by_the_reader():
    layout = NodeLayout(node="n1", mode="mps", gpus=[])
    with pytest.raises(ValueError, match="pod name 'Default/web'"):
        encode_spec(layout, "p1", pods=["a/b", "Default/web"])
    for raw in ("default/web,Default/web", "a/b,,c/d", "", 7, ["a/b"]):
        d = decode_spec({SPEC_MODE: "mps", SPEC_PODS: raw}, H100)  # type: ignore[dict-item]
        assert d.pods == () and any(SPEC_PODS in p for p in d.problems), raw


def test_mps_slice_sizes_that_cannot_be_written_are_refused():
    assert mps_token(1) == "1gb" and mps_token(80) == "80gb"
    for bad in (0, -10, 10.0, "10", None):
        with pytest.raises(ValueError, match="MPS slice size"):
            mps_token(bad)


def test_a_mig_profile_that_cannot_be_written_in_a_key_is_refused():
    for profile in ("1g.10gb foo", "bogus", "1g.10gb/me", "0g.10gb"):
        layout = NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[MigInstance(profile=profile, start=0)])])
        with pytest.raises(ValueError, match="MIG profile"):
            encode_spec(layout, "p1")


def test_heartbeats_are_written_in_utc():
    """Readers compare heartbeats with their own UTC clock: a +01:00 time written as is would look
    an hour old (or new)."""
    at = datetime(2025, 1, 31, 13, 0, 0, tzinfo=timezone(timedelta(hours=1)))
    assert format_heartbeat(at) == "2025-01-31T12:00:00Z"
    assert encode_status(NodeLayout(node="n", mode="mig", gpus=[]), None, heartbeat=at)[STATUS_HEARTBEAT] == "2025-01-31T12:00:00Z"


def test_a_naive_heartbeat_is_taken_as_utc_whatever_the_local_zone(monkeypatch):
    if not hasattr(time, "tzset"):
        pytest.skip("no time.tzset")
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert format_heartbeat(datetime(2025, 1, 31, 12, 0, 0)) == "2025-01-31T12:00:00Z"
    finally:
        monkeypatch.undo()
        time.tzset()


# --- decoding: what is reported --------------------------------------------------------------------


def test_a_node_with_no_annotations_has_no_spec_no_status_and_no_problems():
    for node in ({}, {"other.io/x": "1"}):
        d = decode_spec(node, H100)
        assert (d.layout, d.problems, d.unknown) == (None, [], [])
        s = decode_status(node, H100)
        assert (s.layout, s.problems, s.layout_incomplete) == (None, [], False)


def test_every_fixed_key_is_known_to_both_readers():
    """A node carries spec and status keys side by side; none of the fixed keys is another
    version's (those are logged as such), for the spec reader or the status reader."""
    layout = NodeLayout(node="n1", mode="mig", gpus=[mig(0, "7g.80gb@0").model_copy(update={"drain": True})])
    node = {
        **encode_spec(layout, "p1", term=3, pods=["a/b"]),
        SPEC_REVOKES: "x",
        **encode_status(layout, "p1", ["an error"], datetime(2025, 1, 1, tzinfo=UTC), unhealthy=[1]),
        STATUS_CAPABILITY: "x",
        "dynpart.io/partitioning": "mig",
    }
    assert {SPEC_PLAN, SPEC_MODE, SPEC_TERM, SPEC_PODS, SPEC_DRAIN, STATUS_PLAN, STATUS_MODE, STATUS_ERROR,
            STATUS_HEARTBEAT, STATUS_UNHEALTHY} <= set(node)
    d = decode_spec(node, H100, node="n1")
    assert d.unknown == [] and d.problems == [] and d.layout == canonical_layout(layout)
    s = decode_status(node, H100, node="n1")
    assert s.unknown == [] and s.problems == [] and s.layout == canonical_layout(layout, keep_used=True)


def test_a_slice_of_the_other_mode_is_reported():
    """A MIG key on an MPS node (or the reverse) is a planner or agent bug: the spec is refused
    (a problem), and a status with one is incomplete (it may hide a used slice)."""
    d = decode_spec({SPEC_MODE: "mps", "dynpart.io/spec-gpu-0-10gb": "2", "dynpart.io/spec-gpu-1-1g.10gb": "1@0"}, H100)
    assert [p for p in d.problems if "spec-gpu-1-1g.10gb" in p and "a MIG slice on a node in mps mode" in p]
    assert len(d.problems) == 1 and d.layout == NodeLayout(node="", mode="mps", gpus=[mps(0, 10, 10)])
    s = decode_status({STATUS_MODE: "mig", "dynpart.io/status-gpu-0-7g.80gb-used": "1@0",
                       "dynpart.io/status-gpu-1-10gb-used": "1"}, H100)
    assert s.layout_incomplete and len(s.problems) == 1 and "an MPS slice on a node in mig mode" in s.problems[0]
    assert [g.index for g in s.layout.gpus] == [0]


def test_mps_on_a_gpu_without_mig_is_not_a_problem():
    layout = NodeLayout(node="n1", mode="mps", gpus=[mps(0, 4, 4, 8)])
    d = decode_spec(encode_spec(layout, "p1"), T4, node="n1")
    assert d.problems == [] and d.layout == canonical_layout(layout)


def test_the_mps_capacity_given_is_the_one_checked():
    """The agent passes the GPU's usable memory (settings); slices past it are refused."""
    spec = encode_spec(NodeLayout(node="n1", mode="mps", gpus=[mps(0, 10, 10, 10)]), "p1")
    assert decode_spec(spec, H100, capacity=30).problems == []
    d = decode_spec(spec, H100, capacity=20)
    assert d.layout.gpus == [] and any("GPU 0 has 20 of 20 GB left" in p for p in d.problems)


def test_a_status_keeps_its_used_mps_slices_before_its_free_ones():
    """Used slices exist (a pod holds them): when the reported slices exceed the capacity, the
    free ones are reported, never the used ones, so the planner never plans over a used slice."""
    status = {STATUS_MODE: "mps", "dynpart.io/status-gpu-0-30gb-used": "2", "dynpart.io/status-gpu-0-40gb-free": "1"}
    s = decode_status(status, H100, capacity=80)
    assert s.layout.gpus[0].mps == [MpsSlice(size=30, used=True), MpsSlice(size=30, used=True)]
    assert len(s.problems) == 1 and "status-gpu-0-40gb-free" in s.problems[0] and s.layout_incomplete


def test_a_gpu_whose_every_key_is_refused_is_absent_from_the_layout():
    d = decode_spec({SPEC_MODE: "mps", "dynpart.io/spec-gpu-0-100gb": "1", "dynpart.io/spec-gpu-1-10gb": "1"}, H100)
    assert d.layout == NodeLayout(node="", mode="mps", gpus=[mps(1, 10)]) and len(d.problems) == 1


def test_conflicting_mig_keys_are_accepted_in_start_then_profile_order():
    """The documented order (`_accept_mig`): the used flag does not reorder (here the used 1g is
    kept and the free 2g at the same start is refused)."""
    s = decode_status({STATUS_MODE: "mig", "dynpart.io/status-gpu-0-1g.10gb-used": "1@0",
                       "dynpart.io/status-gpu-0-2g.20gb-free": "1@0"}, H100)
    assert s.layout.gpus[0].mig == [MigInstance(profile="1g.10gb", start=0, used=True)]
    assert len(s.problems) == 1 and "status-gpu-0-2g.20gb-free" in s.problems[0]


def test_a_refused_instance_is_named_once_in_its_problem():
    overlap = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-7g.80gb": "1@0",
                           "dynpart.io/spec-gpu-0-1g.10gb": "1@3"}, H100).problems
    assert len(overlap) == 1 and overlap[0].count("1g.10gb@3") == 1 and "overlaps" in overlap[0]
    illegal = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-3g.40gb": "1@2"}, H100).problems
    assert len(illegal) == 1 and "'1@2': 3g.40gb cannot start at memory slice 2 (legal starts: [0, 4]); ignored" in illegal[0]
    capped = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.6gb": "3@0,1,2"}, CAPPED_1G).problems
    assert len(capped) == 1 and "'3@0,1,2': 1g.6gb@2: 3 x 1g.6gb exceeds its max count 2; ignored" in capped[0]


def test_problems_say_what_a_key_or_profile_should_have_been():
    spec = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0": "1@0"}, H100).problems
    assert len(spec) == 1 and "expected dynpart.io/spec-gpu-<index>-<profile or size>;" in spec[0]
    status = decode_status({STATUS_MODE: "mig", "dynpart.io/status-gpu-0-1g.10gb": "1@0"}, H100).problems
    assert len(status) == 1 and "expected dynpart.io/status-gpu-<index>-<profile or size>-free|used;" in status[0]
    unknown = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-5g.50gb": "1@0"}, H100).problems
    assert len(unknown) == 1 and "has no MIG profile '5g.50gb' (profiles: 1g.10gb," in unknown[0]
    assert "1g.10gb.me" in unknown[0] and "7g.80gb" in unknown[0]


def test_status_errors_are_read_one_a_line_without_blank_lines():
    s = decode_status({STATUS_MODE: "mig", STATUS_ERROR: "GPU 0: lost\n\n  \nGPU 1: Xid 79\n"}, H100)
    assert s.errors == ["GPU 0: lost", "GPU 1: Xid 79"] and s.problems == []
    layout = NodeLayout(node="n", mode="mig", gpus=[])
    assert decode_status(encode_status(layout, None, ["a", "   ", "b"]), H100).errors == ["a", "b"]
    s = decode_status({STATUS_MODE: "mig", STATUS_ERROR: 5}, H100)  # type: ignore[dict-item]
    assert s.errors == [] and any(STATUS_ERROR in p and "not a string" in p for p in s.problems)


def test_every_mig_model_round_trips_a_used_instance_of_each_profile():
    """One instance of every profile of every MIG model, used, through a status and a spec."""
    for model in MIG_MODELS:
        for p in model.mig_profiles:
            layout = NodeLayout(node="n", mode="mig", gpus=[GpuLayout(index=3, mig=[
                MigInstance(profile=p.name, start=p.starts[-1], used=True)])])
            assert decode_status(encode_status(layout, "p"), model, node="n").layout == canonical_layout(layout, keep_used=True)
            assert decode_spec(encode_spec(layout, "p"), model, node="n").layout == canonical_layout(layout)
