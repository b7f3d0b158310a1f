"""The node-annotation protocol: exact formats, round trips, and total, strict decoding."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.annotations import (
    SPEC_MODE,
    SPEC_PLAN,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_PLAN,
    STATUS_PREFIX,
    annotation_patch,
    canonical_layout,
    decode_spec,
    decode_status,
    encode_spec,
    encode_status,
)
from dynpart.catalog import GpuModel, default_catalog
from dynpart.mig import MigRules, feasible_geometries
from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice, NodeLayout
from tests.gpus import RTX_PRO_6000

CATALOG = default_catalog()
H100 = CATALOG.resolve("H100-80GB")
A30 = CATALOG.resolve("A30-24GB")



# Not catalog data: a model carrying every RTX PRO Blackwell name variant (`-me`, `+me.all`,
# `+gfx`) so that the codec is tested on them (tests/gpus.py says which figures are assumed).
RTX_LIKE = RTX_PRO_6000
MIG_MODELS = [m for m in CATALOG.models.values() if m.supports_mig] + [RTX_LIKE]


def mig(index: int, *placements: str, used: tuple[str, ...] = ()) -> GpuLayout:
    out = []
    for p in placements:
        profile, start = p.split("@")
        out.append(MigInstance(profile=profile, start=int(start), used=p in used))
    return GpuLayout(index=index, mig=out)


# --- exact format -------------------------------------------------------------------------------


def test_spec_format_mig():
    layout = NodeLayout(node="n1", mode="mig", gpus=[
        mig(0, "3g.40gb@4", "1g.10gb@1", "1g.10gb@0"),
        mig(1, "1g.10gb+me@6", "4g.40gb@0"),
        GpuLayout(index=2),
    ])
    assert encode_spec(layout, "plan-7") == {
        "dynpart.io/spec-plan": "plan-7",
        "dynpart.io/spec-mode": "mig",
        "dynpart.io/spec-gpu-0-1g.10gb": "2@0,1",
        "dynpart.io/spec-gpu-0-3g.40gb": "1@4",
        "dynpart.io/spec-gpu-1-1g.10gb.me": "1@6",
        "dynpart.io/spec-gpu-1-4g.40gb": "1@0",
    }


def test_spec_format_mps():
    layout = NodeLayout(node="n1", mode="mps", gpus=[
        GpuLayout(index=0, mps=[MpsSlice(size=10), MpsSlice(size=10), MpsSlice(size=20)]),
    ])
    assert encode_spec(layout, "p") == {
        SPEC_PLAN: "p", SPEC_MODE: "mps",
        "dynpart.io/spec-gpu-0-10gb": "2", "dynpart.io/spec-gpu-0-20gb": "1",
    }


def test_status_format():
    layout = NodeLayout(node="n1", mode="mig", gpus=[
        mig(0, "1g.10gb@0", "1g.10gb@1", "1g.10gb@2", used=("1g.10gb@1",)),
    ])
    beat = datetime(2025, 1, 31, 12, 0, 5, tzinfo=UTC)
    assert encode_status(layout, "p3", ["GPU 0: first", "second\nline"], beat) == {
        "dynpart.io/status-mode": "mig",
        "dynpart.io/status-plan": "p3",
        "dynpart.io/status-gpu-0-1g.10gb-free": "2@0,2",
        "dynpart.io/status-gpu-0-1g.10gb-used": "1@1",
        "dynpart.io/status-error": "GPU 0: first\nsecond line",
        "dynpart.io/status-heartbeat": "2025-01-31T12:00:05Z",
    }
    status = decode_status(encode_status(layout, "p3", ["e1", "e2"], beat), H100, node="n1")
    assert status.plan_id == "p3" and status.errors == ["e1", "e2"] and status.heartbeat == beat
    assert status.layout == canonical_layout(layout, keep_used=True)
    assert not status.problems


def test_variant_profiles_format():
    """`-me`, `+me.all` and `+gfx` profiles are written as the device plugin names them; the `-`
    of `-me` stays inside the profile when a key is read back."""
    layout = NodeLayout(node="n1", mode="mig", gpus=[
        mig(0, "1g.24gb-me@0", "1g.24gb+me.all@1", "1g.24gb+gfx@2", "1g.24gb-me@3", used=("1g.24gb-me@3",)),
        mig(1, "2g.48gb-me@0", "2g.48gb+gfx@2"),
    ])
    spec = encode_spec(layout, "p")
    assert spec == {
        SPEC_PLAN: "p", SPEC_MODE: "mig",
        "dynpart.io/spec-gpu-0-1g.24gb-me": "2@0,3",
        "dynpart.io/spec-gpu-0-1g.24gb.me.all": "1@1",
        "dynpart.io/spec-gpu-0-1g.24gb.gfx": "1@2",
        "dynpart.io/spec-gpu-1-2g.48gb-me": "1@0",
        "dynpart.io/spec-gpu-1-2g.48gb.gfx": "1@2",
    }
    status = encode_status(layout, "p")
    assert status["dynpart.io/status-gpu-0-1g.24gb-me-free"] == "1@0"
    assert status["dynpart.io/status-gpu-0-1g.24gb-me-used"] == "1@3"
    assert status["dynpart.io/status-gpu-0-1g.24gb.me.all-free"] == "1@1"
    decoded = decode_spec(spec, RTX_LIKE, node="n1")
    assert not decoded.problems and decoded.layout == canonical_layout(layout)
    decoded_status = decode_status(status, RTX_LIKE, node="n1")
    assert not decoded_status.problems and decoded_status.layout == canonical_layout(layout, keep_used=True)


@pytest.mark.parametrize("key,value,message", [
    ("dynpart.io/spec-gpu-0-1g.24gb-me-free", "1@0", "unknown key"),  # a state in a spec key
    ("dynpart.io/spec-gpu-0-1g.24gb-me-me", "1@0", "unknown key"),
    ("dynpart.io/spec-gpu-0-1g.24gb-gfx", "1@0", "unknown key"),
    ("dynpart.io/spec-gpu-0-1g.24gb.gfx-me", "1@0", "neither a MIG profile"),
    ("dynpart.io/spec-gpu-0-1g.24gb.me.all.gfx", "1@0", "neither a MIG profile"),
    ("dynpart.io/spec-gpu-0-1g.24gb+gfx", "1@0", "neither a MIG profile"),
    ("dynpart.io/spec-gpu-0-10gb-me", "1", "neither a MIG profile"),
    ("dynpart.io/spec-gpu-0-me", "1@0", "neither a MIG profile"),
    ("dynpart.io/spec-gpu-0-1g.24gb-me", "1@4", "cannot start at memory slice 4"),
    ("dynpart.io/spec-gpu-0-1g.24gb.me.all", "2@0,1", "exceeds its max count 1"),
    ("dynpart.io/status-gpu-0-1g.24gb-me", "1@0", "state 'me' is neither"),  # a status key without state
    ("dynpart.io/status-gpu-0-1g.24gb-me-busy", "1@0", "state 'busy' is neither"),
    ("dynpart.io/status-gpu-0-1g.24gb-me-free-used", "1@0", "unknown key"),
    ("dynpart.io/status-gpu-x-1g.24gb-me-free", "1@0", "GPU index 'x'"),
])
def test_malformed_variant_keys_are_reported(key, value, message):
    decode = decode_status if key.startswith(STATUS_PREFIX) else decode_spec
    decoded = decode({key: value}, RTX_LIKE)
    text = " | ".join(decoded.problems)
    assert message in text and repr(key) in text, decoded.problems
    assert decoded.layout is None or all(not g.mig for g in decoded.layout.gpus) or "max count" in message


def test_variant_profile_unknown_to_the_model():
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.10gb-me": "1@0"}, H100)
    assert any("has no MIG profile '1g.10gb-me'" in p for p in d.problems)
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.24gb.gfx": "1@0"}, H100)
    assert any("has no MIG profile '1g.24gb+gfx'" in p for p in d.problems)


def test_me_all_counts_as_media_extensions():
    """`+me.all` takes every media engine: never next to a `+me` instance on one GPU."""
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.24gb.me": "1@0",
                     "dynpart.io/spec-gpu-0-1g.24gb.me.all": "1@1"}, RTX_LIKE)
    assert len(d.problems) == 1 and "media-extension" in d.problems[0]


def test_keys_are_valid_annotation_keys():
    layout = NodeLayout(node="n", mode="mig", gpus=[mig(15, "1g.10gb+me@0"),
                                                    mig(255, "1g.24gb+me.all@0", "1g.24gb-me@1", "1g.24gb+gfx@2")])
    import re
    name = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
    used = NodeLayout(node="n", mode="mig", gpus=[
        mig(15, "1g.10gb+me@0", used=("1g.10gb+me@0",)),
        mig(255, "1g.24gb+me.all@0", "1g.24gb-me@1", used=("1g.24gb-me@1", "1g.24gb+me.all@0"))])
    for key in [*encode_spec(layout, "p"), *encode_status(used, "p")]:
        prefix, _, rest = key.partition("/")
        assert prefix == "dynpart.io" and len(rest) <= 63 and name.fullmatch(rest), key


def test_encode_refuses_what_it_cannot_write():
    layout = NodeLayout(node="n", mode="mig", gpus=[mig(0, "1g.10gb@0")])
    with pytest.raises(ValueError, match="plan id"):
        encode_spec(layout, "has space")
    with pytest.raises(ValueError, match="plan id"):
        encode_spec(layout, "")


def test_unpacks_as_triple():
    layout, plan, problems = decode_spec({SPEC_PLAN: "p", SPEC_MODE: "mig"}, H100)
    assert layout == NodeLayout(node="", mode="mig", gpus=[]) and plan == "p" and problems == []


def test_no_spec_means_no_layout():
    assert decode_spec({}, H100).layout is None
    assert decode_spec({"foo": "bar", "other.io/spec-gpu-0-1g.10gb": "1@0"}, H100).layout is None
    assert decode_spec(None, H100).layout is None  # type: ignore[arg-type]


def test_mode_inferred_when_missing():
    d = decode_spec({"dynpart.io/spec-gpu-1-10gb": "3"}, H100)
    assert d.layout is not None and d.layout.mode == "mps" and not d.problems
    assert [s.size for s in d.layout.gpus[0].mps] == [10, 10, 10]


# --- malformed input is reported, never raised -----------------------------------------------------

BAD = [
    ("dynpart.io/spec-gpu-x-1g.10gb", "1@0", "GPU index 'x'"),
    ("dynpart.io/spec-gpu-01-1g.10gb", "1@0", "GPU index '01'"),
    ("dynpart.io/spec-gpu-256-1g.10gb", "1@0", "GPU index '256'"),
    ("dynpart.io/spec-gpu-0-9g.10gb", "1@0", "has no MIG profile '9g.10gb'"),
    ("dynpart.io/spec-gpu-0-1g.10gb+me", "1@0", "neither a MIG profile"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "2", "<count>@<start>"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "0@", "count '0'"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "2@0", "does not match"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "1@x", "start 'x'"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "1@-1", "start '-1'"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "2@3,3", "listed twice"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "1@\u0663", "start"),  # an Arabic-Indic digit: int() would take it
    ("dynpart.io/spec-gpu-0-1g.10gb", "1@" + "9" * 5000, "start"),  # int() refuses 4300+ digits
    ("dynpart.io/spec-gpu-0-3g.40gb", "1@2", "cannot start at memory slice 2"),
    ("dynpart.io/spec-gpu-0-7g.80gb", "1@1", "cannot start at memory slice 1"),
    ("dynpart.io/spec-gpu-0-1g.10gb", "1@7", "cannot start at memory slice 7"),
    ("dynpart.io/spec-gpu-0-1g.10gb.me", "2@0,1", "exceeds its max count 1"),
    ("dynpart.io/spec-gpu-0-10gb", "1@0", "positive integer"),
    ("dynpart.io/spec-gpu-0-0gb", "1", "neither a MIG profile"),
    ("dynpart.io/spec-gpu-0-100gb", "1", "does not fit"),
    ("dynpart.io/spec-gpu-0", "1", "unknown key"),
    ("dynpart.io/spec-gpu-0-1g.10gb-free", "1@0", "unknown key"),
    ("dynpart.io/spec-plan", "has space", "plan id"),
    ("dynpart.io/spec-mode", "both", "'mig' or 'mps'"),
]


@pytest.mark.parametrize("key,value,message", BAD)
def test_malformed_spec_is_reported(key, value, message):
    if "mps" in key or key.endswith("gb") and "g." not in key:
        base = {}
    else:
        base = {SPEC_MODE: "mig"} if key != SPEC_MODE else {}
    decoded = decode_spec({**base, key: value}, H100)
    assert len(decoded.problems) >= 1, decoded
    text = " | ".join(decoded.problems)
    assert message in text
    assert repr(key)[:60] in text or key == "dynpart.io/spec-gpu-0-1g.10gb" and value.startswith("1@99")
    if decoded.layout is not None and "max count" not in message:  # there the first instance stays
        assert all(not g.mig and not g.mps for g in decoded.layout.gpus)


def test_overlap_reported_and_the_rest_kept():
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-3g.40gb": "1@4",
                     "dynpart.io/spec-gpu-0-1g.20gb": "2@0,4"}, H100)
    assert d.layout is not None
    # instances are taken in (start, profile) order: 1g.20gb@4 comes before 3g.40gb@4
    assert [(m.profile, m.start) for m in d.layout.gpus[0].mig] == [("1g.20gb", 0), ("1g.20gb", 4)]
    assert len(d.problems) == 1 and "3g.40gb@4 overlaps" in d.problems[0]
    assert "'dynpart.io/spec-gpu-0-3g.40gb' = '1@4'" in d.problems[0]


def test_max_count_checked():
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.20gb": "4@0,2,4,6",
                     "dynpart.io/spec-gpu-1-4g.40gb": "1@0", "dynpart.io/spec-gpu-1-3g.40gb": "1@4"}, H100)
    assert d.problems == []
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-3g.40gb": "2@0,4",
                     "dynpart.io/spec-gpu-0-4g.40gb": "1@0"}, H100)
    assert len(d.problems) == 1 and "4g.40gb@0 overlaps" in d.problems[0]


def test_a30_profiles_and_model_without_mig():
    d = decode_spec({"dynpart.io/spec-gpu-0-2g.12gb.me": "1@2", "dynpart.io/spec-gpu-0-2g.12gb": "1@0"}, A30)
    assert not d.problems and [m.profile for m in d.layout.gpus[0].mig] == ["2g.12gb", "2g.12gb+me"]
    from dynpart.catalog import GpuModel
    t4 = GpuModel(name="T4", memory_gb=16)
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0"}, t4)
    assert any("does not support MIG" in p for p in d.problems)
    assert d.layout is not None and d.layout.gpus == []


def test_mixed_shapes_without_mode():
    d = decode_spec({"dynpart.io/spec-gpu-0-10gb": "1", "dynpart.io/spec-gpu-1-1g.10gb": "1@0"}, H100)
    assert d.layout is None and any("mix MIG and MPS" in p for p in d.problems)


def test_status_problems():
    d = decode_status({"dynpart.io/status-gpu-0-1g.10gb-busy": "1@0", STATUS_HEARTBEAT: "yesterday",
                       STATUS_PLAN: "p", "dynpart.io/status-gpu-0-1g.10gb-free": "1@0",
                       "dynpart.io/status-gpu-0-1g.10gb-used": "1@0"}, H100)
    text = " | ".join(d.problems)
    assert "'busy' is neither" in text and "heartbeat" in text and "overlaps" in text
    assert d.layout.gpus[0].mig == [MigInstance(profile="1g.10gb", start=0, used=False)]
    assert d.plan_id == "p" and d.heartbeat is None


# --- versions: what another version writes ------------------------------------------------------


def test_a_key_of_another_version_is_listed_apart_and_refuses_nothing():
    """A newer planner's extra spec key must not make an older agent refuse the spec, and a newer
    agent's extra status key must not make an older planner leave the node out: both are listed in
    `unknown`, never in `problems`. A key of the slice form stays strict (it may hide a slice)."""
    layout = NodeLayout(node="n1", mode="mig", gpus=[mig(0, "1g.10gb@0", used=("1g.10gb@0",))])
    spec = {**encode_spec(layout, "p1", term=3, pods=["ml/a"]), "dynpart.io/spec-priority": "high"}
    d = decode_spec(spec, H100, node="n1")
    assert d.problems == [] and d.layout == canonical_layout(layout) and d.pods == ("ml/a",)
    assert len(d.unknown) == 1 and "'dynpart.io/spec-priority'" in d.unknown[0]
    status = {**encode_status(layout, "p1"), "dynpart.io/status-driver": "580.65"}
    st = decode_status(status, H100, node="n1")
    assert st.problems == [] and not st.layout_incomplete and st.layout == canonical_layout(layout, keep_used=True)
    assert len(st.unknown) == 1 and "'dynpart.io/status-driver'" in st.unknown[0]
    # known keys stay strict: a malformed value, or a slice-shaped key that cannot be read
    assert decode_spec({**spec, "dynpart.io/spec-term": "x"}, H100).problems
    assert decode_status({**status, "dynpart.io/status-gpu-0-1g.10gb-busy": "1@0"}, H100).layout_incomplete
    assert decode_status({**status, "dynpart.io/status-gpu-1-1g.10gb-used": "2@0"}, H100).layout_incomplete


def test_a_status_gpu_with_a_profile_the_model_lacks_is_kept_apart_as_it_is():
    """An agent planning with another model (its capability report unreadable here) reports a
    profile under a name this model lacks: that GPU is set apart, with the spec keys that keep it as
    it is; the node's other GPUs read as usual. In a spec such a key stays a problem."""
    status = {**encode_status(NodeLayout(node="n1", mode="mig", gpus=[mig(0, "3g.40gb@4", used=("3g.40gb@4",))]),
                              "p1"),
              "dynpart.io/status-gpu-1-7g.79gb-used": "1@0",
              "dynpart.io/status-gpu-2-1g.10gb-free": "1@0", "dynpart.io/status-gpu-2-1g.12gb-used": "2@1,2"}
    d = decode_status(status, H100)
    assert d.problems == [] and not d.layout_incomplete
    assert [g.index for g in d.layout.gpus] == [0]
    assert d.foreign == {1: ("7g.79gb",), 2: ("1g.12gb",)}
    assert d.kept_spec == {"dynpart.io/spec-gpu-1-7g.79gb": "1@0", "dynpart.io/spec-gpu-2-1g.10gb": "1@0",
                           "dynpart.io/spec-gpu-2-1g.12gb": "2@1,2"}
    # malformed, it is still unreadable
    bad = decode_status({**status, "dynpart.io/status-gpu-1-7g.79gb-used": "1@x"}, H100)
    assert bad.layout_incomplete and any("start 'x'" in p for p in bad.problems)
    assert any("no MIG profile '7g.79gb'" in p
               for p in decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-1-7g.79gb": "1@0"}, H100).problems)


def test_annotation_patch():
    old = {SPEC_PLAN: "p1", SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0",
           "dynpart.io/spec-gpu-1-1g.10gb": "1@0", "dynpart.io/status-plan": "p1", "other": "x"}
    new = {SPEC_PLAN: "p2", SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0"}
    assert annotation_patch(old, new) == {SPEC_PLAN: "p2", "dynpart.io/spec-gpu-1-1g.10gb": None}
    assert annotation_patch(new, new) == {}
    assert annotation_patch(old, {"dynpart.io/status-plan": "p2"}, prefix=STATUS_PREFIX) == {
        "dynpart.io/status-plan": "p2"}
    assert annotation_patch({"dynpart.io/status-error": "e"}, {}, prefix=STATUS_PREFIX) == {STATUS_ERROR: None}


def test_long_error_list_truncated():
    out = encode_status(NodeLayout(node="n", mode="mig", gpus=[]), None, [f"error {i} " + "x" * 100 for i in range(100)])
    assert len(out[STATUS_ERROR]) < 4200 and out[STATUS_ERROR].endswith("more)")


# --- properties ----------------------------------------------------------------------------------


@st.composite
def mig_layouts(draw, with_used: bool, only: GpuModel | None = None):
    model = only if only is not None else draw(st.sampled_from(MIG_MODELS))
    indices = draw(st.lists(st.integers(0, 15), unique=True, max_size=4))
    geometries = feasible_geometries(model)
    gpus = []
    for i in indices:
        g = sorted(draw(st.sampled_from(geometries)), key=lambda p: p.start)
        used = draw(st.lists(st.booleans(), min_size=len(g), max_size=len(g))) if with_used else [False] * len(g)
        gpus.append(GpuLayout(index=i, mig=[MigInstance(profile=p.profile, start=p.start, used=u)
                                             for p, u in zip(g, used)]))
    return model, NodeLayout(node="n", mode="mig", gpus=gpus)


@st.composite
def mps_layouts(draw, with_used: bool):
    model = draw(st.sampled_from([*CATALOG.models.values(), RTX_LIKE]))
    indices = draw(st.lists(st.integers(0, 15), unique=True, max_size=4))
    gpus = []
    for i in indices:
        left, slices = model.mps_capacity_gb, []
        for _ in range(draw(st.integers(0, 6))):
            if left < 1:
                break
            size = draw(st.integers(1, left))
            left -= size
            slices.append(MpsSlice(size=size, used=draw(st.booleans()) if with_used else False))
        gpus.append(GpuLayout(index=i, mps=slices))
    return model, NodeLayout(node="n", mode="mps", gpus=gpus)


plan_ids = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=128)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mig_layouts(False, RTX_LIKE), plan_ids)
def test_spec_round_trip_variant_profiles(model_layout, plan_id):
    model, layout = model_layout
    decoded = decode_spec(encode_spec(layout, plan_id), model, node="n")
    assert decoded.problems == [] and decoded.plan_id == plan_id
    assert decoded.layout == canonical_layout(layout)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mig_layouts(True, RTX_LIKE))
def test_status_round_trip_variant_profiles(model_layout):
    model, layout = model_layout
    decoded = decode_status(encode_status(layout, "p"), model, node="n")
    assert decoded.problems == []
    assert decoded.layout == canonical_layout(layout, keep_used=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mig_layouts(False), mps_layouts(False)), plan_ids)
def test_spec_round_trip(model_layout, plan_id):
    model, layout = model_layout
    decoded = decode_spec(encode_spec(layout, plan_id), model, node="n")
    assert decoded.problems == []
    assert decoded.plan_id == plan_id
    assert decoded.layout == canonical_layout(layout)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mig_layouts(True), mps_layouts(True)), st.none() | plan_ids,
       st.lists(st.text(min_size=1, max_size=30).filter(str.strip), max_size=3))
def test_status_round_trip(model_layout, plan_id, errors):
    model, layout = model_layout
    beat = datetime(2025, 6, 1, 8, 30, tzinfo=UTC)
    decoded = decode_status(encode_status(layout, plan_id, errors, beat), model, node="n")
    assert decoded.problems == []
    assert (decoded.plan_id, decoded.heartbeat) == (plan_id, beat)
    assert decoded.errors == [" ".join(e.split()) for e in errors]
    assert decoded.layout == canonical_layout(layout, keep_used=True)


_PARTS = st.sampled_from(["gpu", "0", "1", "7", "01", "-1", "1g.10gb", "1g.10gb.me", "3g.40gb", "7g.80gb",
                          "10gb", "0gb", "free", "used", "x", "", "+", "1g.5gb", "2g.12gb.me", "me", "1g.24gb",
                          "1g.24gb.me.all", "1g.24gb.gfx", "1g.24gb-me", "all", "gfx"])
_KEYS = st.one_of(
    st.text(max_size=40),
    st.builds(lambda p, parts: p + "-".join(parts),
              st.sampled_from(["dynpart.io/spec-", "dynpart.io/status-", "dynpart.io/", "nos.nebuly.com/spec-"]),
              st.lists(_PARTS, max_size=6)),
    st.sampled_from([SPEC_PLAN, SPEC_MODE, STATUS_PLAN, STATUS_ERROR, STATUS_HEARTBEAT, "dynpart.io/status-mode"]),
    # near-valid slice keys, so that many examples decode to non-empty layouts
    st.builds(lambda i, t: f"dynpart.io/spec-gpu-{i}-{t}", st.sampled_from(["0", "1", "3"]),
              st.sampled_from(["1g.10gb", "1g.10gb.me", "1g.20gb", "3g.40gb", "2g.12gb", "1g.5gb", "10gb", "40gb"])),
    st.builds(lambda i, t, u: f"dynpart.io/status-gpu-{i}-{t}-{u}", st.sampled_from(["0", "2"]),
              st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb", "4g.20gb", "20gb", "1g.24gb-me", "1g.24gb.gfx",
                               "1g.24gb.me.all", "2g.48gb-me"]), st.sampled_from(["free", "used"])),
    st.builds(lambda i, t: f"dynpart.io/spec-gpu-{i}-{t}", st.sampled_from(["0", "1"]),
              st.sampled_from(["1g.24gb", "1g.24gb-me", "1g.24gb.me", "1g.24gb.me.all", "1g.24gb.gfx", "2g.48gb-me",
                               "2g.48gb.gfx", "4g.96gb", "1g.24gb-me-free", "1g.24gb-me-me"])),
)
_VALUES = st.one_of(
    st.text(max_size=30),
    st.builds(lambda c, s: f"{c}@{','.join(s)}", st.sampled_from(["0", "1", "2", "3", "x", ""]),
              st.lists(st.sampled_from(["0", "1", "2", "4", "6", "7", "8", "00", "x", ""]), max_size=4)),
    st.sampled_from(["mig", "mps", "1", "2", "0", "2025-01-31T12:00:00Z"]),
    st.builds(lambda starts: f"{len(starts)}@{','.join(starts)}",
              st.lists(st.sampled_from(["0", "1", "2", "4", "6", "7"]), min_size=1, max_size=3)),
    st.integers(), st.none(), st.lists(st.integers(), max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=12), st.sampled_from(MIG_MODELS + [CATALOG.resolve("A30-24GB"), RTX_LIKE]))
def test_garbage_never_raises(annotations, model):
    for decode in (decode_spec, decode_status):
        decoded = decode(annotations, model)
        assert all(isinstance(p, str) and p for p in decoded.problems)
        layout = decoded.layout
        if layout is None:
            continue
        for gpu in layout.gpus:  # whatever is accepted is a layout the driver would take
            assert not MigRules.of(model).violations([(m.profile, m.start) for m in gpu.mig])
            assert sum(s.size for s in gpu.mps) <= model.mps_capacity_gb
        # and it can be written back and read again unchanged
        again = decode_spec(encode_spec(layout, "p"), model)
        assert again.layout == canonical_layout(layout) and not again.problems


def test_garbage_container_types():
    assert decode_spec("not a dict", H100).layout is None  # type: ignore[arg-type]
    assert decode_status([1, 2], H100).layout is None  # type: ignore[arg-type]
    d = decode_spec({SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-1g.10gb": 3, 5: "x"}, H100)  # type: ignore[dict-item]
    assert any("not a string" in p for p in d.problems)


_MIG_KEYS = st.builds(lambda i, t: f"dynpart.io/spec-gpu-{i}-{t}", st.sampled_from(["0", "1", "01", "x"]),
                      st.sampled_from(["1g.10gb", "1g.10gb.me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb",
                                       "7g.80gb", "1g.5gb", "9g.9gb"]))
_MIG_VALUES = st.one_of(
    st.builds(lambda starts: f"{len(starts)}@{','.join(starts)}",
              st.lists(st.sampled_from(["0", "1", "2", "3", "4", "5", "6", "7", "8"]), min_size=1, max_size=4)),
    st.sampled_from(["1@", "@0", "2@0", "1@0,,1", "x@1"]),
)


def _check_near_valid(annotations, model):
    """Keys and values close to valid ones: what is accepted is a valid geometry, every rejected
    key is named in a problem, and the accepted part survives a round trip."""
    decoded = decode_spec({SPEC_MODE: "mig", **annotations}, model)
    assert decoded.layout is not None
    for gpu in decoded.layout.gpus:
        assert not MigRules.of(model).violations([(m.profile, m.start) for m in gpu.mig])
    got = {(g.index, m.profile, m.start) for g in decoded.layout.gpus for m in g.mig}
    for key, value in annotations.items():
        if any(repr(key) in p for p in decoded.problems):
            continue
        # a key nobody complained about was taken whole
        alone = decode_spec({SPEC_MODE: "mig", key: value}, model)
        assert not alone.problems
        assert {(g.index, m.profile, m.start) for g in alone.layout.gpus for m in g.mig} <= got
    accepted = encode_spec(decoded.layout, "p")
    assert decode_spec(accepted, model).layout == decoded.layout


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_MIG_KEYS, _MIG_VALUES, max_size=8))
def test_near_valid_mig_specs(annotations):
    _check_near_valid(annotations, H100)


_VARIANT_KEYS = st.builds(lambda i, t: f"dynpart.io/spec-gpu-{i}-{t}", st.sampled_from(["0", "1", "01", "x"]),
                          st.sampled_from(["1g.24gb", "1g.24gb.me", "1g.24gb.me.all", "1g.24gb.gfx", "1g.24gb-me",
                                           "2g.48gb-me", "2g.48gb.gfx", "4g.96gb", "1g.24gb-me-free", "1g.24gb-gfx",
                                           "1g.24gb.gfx-me", "1g.24gb+gfx", "1g.10gb-me"]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_VARIANT_KEYS, _MIG_VALUES, max_size=8))
def test_near_valid_variant_specs(annotations):
    _check_near_valid(annotations, RTX_LIKE)


# --- drained GPUs ---------------------------------------------------------------------------------


def test_drained_gpus_round_trip():
    layout = NodeLayout(node="n1", mode="mig", gpus=[
        mig(0, "3g.40gb@4", used=("3g.40gb@4",)).model_copy(update={"drain": True}),
        mig(1, "7g.80gb@0"),
        GpuLayout(index=3, drain=True),  # nothing left on it: drained still (nothing new is made there)
    ])
    spec = encode_spec(layout, "p1")
    assert spec["dynpart.io/spec-drain"] == "0,3"
    decoded = decode_spec(spec, H100, node="n1")
    assert decoded.problems == [] and decoded.drain == (0, 3)
    assert decoded.layout == canonical_layout(layout)  # the flag is not a slice: the layout is unchanged
    assert "dynpart.io/spec-drain" not in encode_spec(canonical_layout(layout), "p1")


@pytest.mark.parametrize("value", ["", "a", "1,,2", "-1", "256", "01", " 1", 7])
def test_malformed_drain_is_reported(value):
    spec = {**encode_spec(NodeLayout(node="n1", mode="mig", gpus=[mig(0, "7g.80gb@0")]), "p1"),
            "dynpart.io/spec-drain": value}
    decoded = decode_spec(spec, H100)
    assert decoded.drain == () and any("dynpart.io/spec-drain" in p for p in decoded.problems)


def test_a_status_error_too_long_for_the_annotation_is_cut_not_dropped():
    from dynpart.annotations import MAX_ERROR_CHARS, STATUS_ERROR

    layout = NodeLayout(node="n1", mode="mig", gpus=[])
    first = "GPU 0: " + "x" * (MAX_ERROR_CHARS + 100)
    text = encode_status(layout, None, [first, "GPU 1: short"])[STATUS_ERROR]
    assert len(text) <= MAX_ERROR_CHARS and text.startswith("GPU 0: xxx") and text.endswith("(1 more)")
    assert encode_status(layout, None, ["GPU 1: short", first])[STATUS_ERROR] == "GPU 1: short\n... (1 more)"


def test_the_planned_pods_of_a_node_never_make_a_spec_its_agent_refuses():
    from dynpart.annotations import SPEC_PODS, WRITE_PODS_CHARS, decode_fencing

    layout = NodeLayout(node="n1", mode="mps", gpus=[])
    pods = [f"team-{i % 7}/inference-server-{i:05d}-" + "x" * 40 for i in range(1000)]
    spec = encode_spec(layout, "p1", pods=pods)
    assert len(spec[SPEC_PODS]) <= WRITE_PODS_CHARS  # what an agent of any version reads
    problems: list[str] = []
    _, planned = decode_fencing(spec, problems)
    assert problems == [] and 300 < len(planned) < 1000 and set(planned) <= set(pods)
    assert decode_fencing(encode_spec(layout, "p1", pods=pods[:100]), problems)[1] == tuple(sorted(pods[:100]))
