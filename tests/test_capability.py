"""The capability report (dynpart/capability.py): its codec round-trips and is strict; the model a
node is planned with follows the driver, narrowed by the catalog; differences are reported."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.capability import (
    MAX_CAPABILITY_BYTES,
    CapabilityError,
    GpuKind,
    GpuReport,
    NodeCapability,
    ProfileCapability,
    decode_capability,
    encode_capability,
    model_catalog,
    node_model,
)
from dynpart.catalog import MIG_PROFILE_VARIANTS, GpuModel, default_catalog
from tests.gpus import RTX_PRO_6000, RTX_PRO_6000_NVML_NAME

CAT = default_catalog()
H100 = CAT.resolve("H100-80GB")


def kind_of(model: GpuModel, product: str, memory_mib: int | None = None) -> GpuKind:
    return GpuKind(product=product, memory_mib=memory_mib or model.memory_mib or model.memory_gb * 1024, memory_slices=model.memory_slices,
                   compute_slices=model.compute_slices,
                   profiles=tuple(ProfileCapability(name=p.name, id=p.gi_profile_id,
                                                    nvml=p.nvml.removeprefix("NVML_GPU_INSTANCE_PROFILE_"),
                                                    compute=p.compute, memory=p.memory, max=p.max, starts=p.starts)
                                  for p in model.mig_profiles))


def node_of(kind: GpuKind, gpus: int = 8, mig: str = "on") -> NodeCapability:
    return NodeCapability(kinds=(kind,), gpus=tuple(GpuReport(kind=0, mig=mig) for _ in range(gpus)))  # type: ignore[arg-type]  # the test passes valid literals


@st.composite
def kinds(draw: st.DrawFn) -> GpuKind:
    memory_slices = draw(st.integers(1, 8))
    compute_slices = draw(st.integers(1, 8))
    names = draw(st.lists(st.tuples(st.integers(1, compute_slices), st.integers(1, 99),
                                     st.sampled_from(("", *MIG_PROFILE_VARIANTS))), max_size=10,
                          unique_by=lambda t: t))
    profiles = []
    for compute, gb, variant in names:
        memory = draw(st.integers(1, memory_slices))
        starts = draw(st.lists(st.integers(0, memory_slices - memory), min_size=1, unique=True))
        profiles.append(ProfileCapability(name=f"{compute}g.{gb}gb{variant}", id=draw(st.integers(0, 255)),
                                          nvml=draw(st.from_regex(r"[A-Z0-9_]{1,12}", fullmatch=True)),
                                          compute=compute, memory=memory, max=draw(st.integers(1, 8)),
                                          starts=tuple(sorted(starts))))
    return GpuKind(product=draw(st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=40)),
                   memory_mib=draw(st.integers(1, 1 << 20)), memory_slices=memory_slices,
                   compute_slices=compute_slices, profiles=tuple(profiles))


@st.composite
def capabilities(draw: st.DrawFn) -> NodeCapability:
    ks = draw(st.lists(kinds(), min_size=1, max_size=3))
    gpus = draw(st.lists(st.tuples(st.integers(0, len(ks) - 1),
                                   st.sampled_from(("on", "off", "on-pending", "off-pending", "unsupported"))),
                         min_size=1, max_size=16))
    return NodeCapability(kinds=tuple(ks), gpus=tuple(GpuReport(kind=k, mig=m) for k, m in gpus))


@settings(max_examples=300, deadline=None)
@given(capabilities())
def test_report_round_trips(cap: NodeCapability):
    text = encode_capability(cap)
    assert len(text) <= MAX_CAPABILITY_BYTES
    assert decode_capability(text) == cap


@settings(max_examples=500, deadline=None)
@given(capabilities(), st.data())
def test_a_mutated_report_is_refused_cleanly_or_read_as_valid(cap: NodeCapability, data: st.DataObject):
    """Any change of one value: decoding either refuses with CapabilityError or gives a valid report."""
    doc = json.loads(encode_capability(cap))
    path: list[object] = []
    node: object = doc
    while isinstance(node, (dict, list)) and node:
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append(key)
        node = node[key]  # type: ignore[index]  # dict or list, by the loop's test
    parent: object = doc
    for key in path[:-1]:
        parent = parent[key]  # type: ignore[index]  # walks the path drawn above
    if path:
        parent[path[-1]] = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.text(max_size=8),  # type: ignore[index]  # see above
                                               st.lists(st.integers(0, 9), max_size=3), st.floats(allow_nan=False)))
    try:
        decoded = decode_capability(json.dumps(doc))
    except CapabilityError as e:
        assert str(e).startswith("capability report")
    else:
        assert decode_capability(encode_capability(decoded)) == decoded


@pytest.mark.parametrize("text, needle", [
    ("{", "not JSON"),
    ('{"v": 2, "kinds": [], "gpus": []}', "version 2 is not one this dynpart reads"),
    ('{"v": 1, "kinds": [], "gpus": [[0, "on"]]}', "kinds = (): Tuple should have at least 1 item"),
    ('{"v": 1, "kinds": [{"product": "x", "memory_mib": "81559", "slices": [8, 7]}], "gpus": [[0, "on"]]}',
     "kinds[0].memory_mib = '81559': Input should be a valid integer"),
    ('{"v": 1, "kinds": [{"product": "x", "memory_mib": 1, "slices": [8, 7], "extra": 1}], "gpus": [[0, "on"]]}',
     "kinds[0].extra = 1: Extra inputs are not permitted"),
    ('{"v": 1, "kinds": [{"product": "x", "memory_mib": 1, "slices": [8, 7]}], "gpus": [[1, "on"]]}',
     "gpus[0] is of kind 1, but only 1 kind(s) are listed"),
    ('{"v": 1, "kinds": [{"product": "x", "memory_mib": 1, "slices": [8, 7], '
     '"profiles": [["3g.40gb", 9, "3_SLICE", 3, 4, 2, [0, 5]]]}], "gpus": [[0, "on"]]}',
     "profile 3g.40gb: start 5 does not fit in 8 memory slices"),
    ('{"v": 1, "kinds": [{"product": "x", "memory_mib": 1, "slices": [8, 7], '
     '"profiles": [["3g.40gb+xx", 9, "3_SLICE", 3, 4, 2, [0]]]}], "gpus": [[0, "on"]]}',
     "String should match pattern"),
])
def test_strict_decoding_names_the_field(text: str, needle: str):
    with pytest.raises(CapabilityError) as e:
        decode_capability(text)
    assert needle in str(e.value)


def test_a_report_too_large_is_not_parsed():
    with pytest.raises(CapabilityError, match="more than the 16384"):
        decode_capability(" " * (MAX_CAPABILITY_BYTES + 1))


def test_an_unchanged_gpu_plans_with_the_catalog_model_and_nvml_memory_sets_the_mps_capacity():
    # the memory a real H100 80GB HBM3 reports (81,559 MiB = 79.6 GiB) is the catalog's: its model
    same = node_model(node_of(kind_of(H100, "NVIDIA H100 80GB HBM3", memory_mib=81_559)), CAT)
    assert same.model is H100 and same.disagreements == () and H100.mps_capacity_gb == 79
    # one reporting 80 GiB: the catalog's profiles, MPS capacity from its driver
    other = node_model(node_of(kind_of(H100, "NVIDIA H100 80GB HBM3", memory_mib=81_920)), CAT)
    assert other.model.family_name == "H100-80GB" and other.model.mps_capacity_gb == 80
    assert other.model.memory_gb == 80 and other.model.mig_profiles == H100.mig_profiles
    assert other.disagreements == ()
    # a model the catalog has no measured memory for plans with the nominal size until a node reports
    a100 = CAT.resolve("A100-80GB")
    assert a100.memory_mib is None and a100.mps_capacity_gb == 80
    assert node_model(node_of(kind_of(a100, "NVIDIA A100-SXM4-80GB", memory_mib=81_920)), CAT).model is a100


def test_the_driver_wins_and_the_catalog_is_an_allow_list():
    kind = kind_of(H100, "NVIDIA H100 80GB HBM3")
    rows = {p.name: p for p in kind.profiles}
    rows["3g.40gb"] = rows["3g.40gb"].model_copy(update={"starts": (4,)})  # the driver refuses 3g@0
    del rows["1g.10gb+me"]
    extra = ProfileCapability(name="1g.20gb+gfx", id=50, nvml="1_SLICE_REV2_GFX", compute=1, memory=2, max=4,
                              starts=(0, 2, 4, 6))
    choice = node_model(node_of(kind.model_copy(update={"profiles": (*rows.values(), extra)})), CAT)
    m = choice.model
    assert m.name.startswith("H100-80GB~") and m.family_name == "H100-80GB"
    assert m.profile("3g.40gb").starts == (4,)
    assert "1g.10gb+me" not in m.profiles_by_name and "1g.20gb+gfx" not in m.profiles_by_name
    assert choice.disagreements == (
        "1g.10gb+me: in the catalog, not offered by the driver; not planned",
        "3g.40gb: the driver reports starts [4] (catalog [0, 4]); the driver's values are used",
        "1g.20gb+gfx: offered by the driver, not in the catalog's H100-80GB (the allow-list); not planned",
    )
    # an admin narrows the allow-list by overriding the model with fewer profiles
    narrow = CAT.extended(type(CAT)([H100.model_copy(update={"mig_profiles": H100.mig_profiles[-1:]})]))
    assert list(node_model(node_of(kind), narrow).model.profiles_by_name) == ["7g.80gb"]


def test_a_gpu_the_catalog_lacks_is_planned_from_its_report():
    choice = node_model(node_of(kind_of(RTX_PRO_6000, RTX_PRO_6000_NVML_NAME, 97_887), gpus=2), CAT)
    m = choice.model
    assert m.family_name == "RTX-PRO-6000-Blackwell-Server-Edition" and choice.disagreements == ()
    assert {"1g.24gb-me", "1g.24gb+me.all", "1g.24gb+gfx"} <= set(m.profiles_by_name) and m.memory_gb == 95
    extended = model_catalog(CAT, [m])
    # a pod selecting the node's product label (GPU feature discovery's spelling) finds the model
    assert extended.resolve("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition").family_name == m.family_name
    assert model_catalog(CAT, [H100]) is CAT


def test_mig_off_uses_the_catalog_until_the_driver_lists_profiles():
    off = node_of(kind_of(H100, "NVIDIA H100 80GB HBM3").model_copy(update={"profiles": (), "memory_slices": 0,
                                                                           "compute_slices": 0}), mig="off")
    assert node_model(off, CAT).model is H100
    unknown = off.model_copy(update={"kinds": (off.kinds[0].model_copy(update={"product": "NVIDIA Mystery"}),)})
    with pytest.raises(CapabilityError, match="lists no MIG profile while MIG mode is off"):
        node_model(unknown, CAT)


def test_a30_instance_counts_from_nvml_are_not_trusted():
    a30 = CAT.resolve("A30-24GB")
    kind = kind_of(a30, "NVIDIA A30")
    wrong = kind.model_copy(update={"profiles": tuple(p.model_copy(update={"max": 7}) for p in kind.profiles)})
    choice = node_model(node_of(wrong, gpus=1), CAT)
    assert choice.model is a30 and choice.disagreements == ()
