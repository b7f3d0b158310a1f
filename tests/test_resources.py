import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynpart.errors import ResourceNameError
from dynpart.resources import (
    MigResource,
    MpsResource,
    WholeGpuResource,
    is_slice_resource,
    mig_resource_name,
    mps_resource_name,
    parse_resource,
)


def test_names():
    assert parse_resource("nvidia.com/mig-1g.10gb") == MigResource(profile="1g.10gb")
    assert parse_resource("nvidia.com/mig-1g.10gb.me") == MigResource(profile="1g.10gb+me")
    assert parse_resource("nvidia.com/gpu-10gb") == MpsResource(size=10)
    assert parse_resource("nvidia.com/gpu") == WholeGpuResource()
    assert mig_resource_name("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"


@pytest.mark.parametrize("name,profile", [
    # RTX PRO 5000/6000 Blackwell variants, named as NVIDIA's device plugin v0.20 serves them
    ("nvidia.com/mig-1g.24gb-me", "1g.24gb-me"),
    ("nvidia.com/mig-1g.24gb.me.all", "1g.24gb+me.all"),
    ("nvidia.com/mig-1g.24gb.gfx", "1g.24gb+gfx"),
    ("nvidia.com/mig-1g.24gb.me", "1g.24gb+me"),
    ("nvidia.com/mig-4g.96gb.gfx", "4g.96gb+gfx"),
])
def test_variant_names(name, profile):
    assert parse_resource(name) == MigResource(profile=profile)
    assert mig_resource_name(profile) == name
    assert is_slice_resource(name)


@pytest.mark.parametrize("bad", ["nvidia.com/mig-", "nvidia.com/gpu-0gb", "nvidia.com/gpu-10", "cpu", "amd.com/gpu",
                                 "nvidia.com/mig-1g.10gb+me", "nvidia.com/mig-1g.24gb+gfx", "nvidia.com/mig-1g.24gb+me.all",
                                 "nvidia.com/mig-1g.24gb.me.me", "nvidia.com/mig-1g.24gb-gfx", "nvidia.com/mig-1g.24gb-me.all",
                                 "nvidia.com/mig-1g.24gb.gfx.me", "nvidia.com/mig-1g.24gb.all"])
def test_bad_names_say_what_is_expected(bad):
    with pytest.raises(ResourceNameError, match="nvidia.com/mig-<profile>|at least 1"):
        parse_resource(bad)


@pytest.mark.parametrize("bad,meant", [
    # a profile as `dynpart catalog` and the docs write it, whose `+` no resource name may hold
    ("nvidia.com/mig-1g.10gb+me", "nvidia.com/mig-1g.10gb.me"),
    ("nvidia.com/mig-1g.24gb+me.all", "nvidia.com/mig-1g.24gb.me.all"),
    ("nvidia.com/mig-1g.10GB", "nvidia.com/mig-1g.10gb"),
    ("nvidia.com/gpu-10Gi", "nvidia.com/gpu-10gb"),  # Kubernetes' memory units
    ("nvidia.com/gpu-10GB", "nvidia.com/gpu-10gb"),
    ("nvidia.com/gpu-20gib", "nvidia.com/gpu-20gb"),
])
def test_near_misses_name_the_resource_meant(bad, meant):
    with pytest.raises(ResourceNameError, match=f"did you mean {re.escape(meant)}\\? expected"):
        parse_resource(bad)


@pytest.mark.parametrize("bad", ["nvidia.com/mig-huge", "nvidia.com/mig-1g.24gb-gfx", "amd.com/gpu"])
def test_no_near_miss_is_made_up(bad):
    with pytest.raises(ResourceNameError) as e:
        parse_resource(bad)
    assert "did you mean" not in str(e.value)


def test_every_catalog_profile_round_trips():
    from dynpart.catalog import default_catalog
    for model in default_catalog().models.values():
        for p in model.mig_profiles:
            assert parse_resource(p.resource_name) == MigResource(profile=p.name)


@given(st.integers(1, 99), st.integers(1, 9999), st.sampled_from(["", "+me", "+me.all", "-me", "+gfx"]))
def test_mig_roundtrip(compute, memory, variant):
    profile = f"{compute}g.{memory}gb{variant}"
    name = mig_resource_name(profile)
    assert parse_resource(name) == MigResource(profile=profile)
    assert "+" not in name


@given(st.integers(min_value=1, max_value=10**6))
def test_mps_roundtrip(n):
    assert parse_resource(mps_resource_name(n)) == MpsResource(size=n)


@given(st.text(max_size=40))
def test_parse_is_total(text):
    try:
        parse_resource(text)
    except ResourceNameError:
        pass


def test_an_mps_size_with_leading_zeros_is_refused_with_the_name_to_use():
    """nvidia.com/gpu-0010gb would be planned as 10 GB but never bind: the agent advertises gpu-10gb."""
    with pytest.raises(ResourceNameError, match=r"'nvidia.com/gpu-0010gb'.*nvidia.com/gpu-10gb"):
        parse_resource("nvidia.com/gpu-0010gb")


def test_known_resource_is_none_for_what_nothing_of_dynpart_advertises():
    from dynpart.resources import known_resource

    assert known_resource("nvidia.com/gpu-10gb") == MpsResource(size=10)
    assert known_resource("nvidia.com/gpu-010gb") is None  # a slice name, but one no agent advertises
    assert known_resource("cpu") is None and known_resource("nvidia.com/mig-1g.10gb") == MigResource(profile="1g.10gb")


def test_an_allocatable_key_nothing_advertises_does_not_stop_the_agent_publishing():
    from dynpart.agent.loop import _publishable

    assert _publishable({}, {}, {"nvidia.com/gpu-010gb": "3", "nvidia.com/gpu-10gb": "2", "cpu": "8"}) == {
        "nvidia.com/gpu-10gb": 0}
