import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynpart.errors import ResourceNameError
from dynpart.resources import (
    MigResource,
    MpsResource,
    WholeGpuResource,
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


@pytest.mark.parametrize("bad", ["nvidia.com/mig-", "nvidia.com/gpu-0gb", "nvidia.com/gpu-10", "cpu", "amd.com/gpu",
                                 "nvidia.com/mig-1g.10gb+me"])
def test_bad_names_say_what_is_expected(bad):
    with pytest.raises(ResourceNameError, match="nvidia.com/mig-<profile>|at least 1"):
        parse_resource(bad)


@given(st.integers(min_value=1, max_value=10**6))
def test_mps_roundtrip(n):
    assert parse_resource(mps_resource_name(n)) == MpsResource(size=n)


@given(st.text(max_size=40))
def test_parse_is_total(text):
    try:
        parse_resource(text)
    except ResourceNameError:
        pass
