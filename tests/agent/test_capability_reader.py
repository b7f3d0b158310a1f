"""`read_capability`: a kind of GPU's profiles are read once, from a GPU in MIG mode first, and
asked again on the kind's next GPU only while a driver lists none (MIG mode off on a driver that
lists profiles only in MIG mode; real H100s and H200s on driver 580 list them in either mode)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dynpart.agent.capability_reader import read_capability
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import GpuDriverError
from dynpart.agent.nvml_probe import probe
from dynpart.catalog import load_catalog
from dynpart.errors import DynpartError

CATALOG = load_catalog([])
H100 = CATALOG.resolve("H100-80GB")


class _Counting(FakeNvml):
    asked: list[int]

    def gpu_instance_profiles(self, index):
        self.asked = [*getattr(self, "asked", []), index]
        return super().gpu_instance_profiles(index)


def test_profiles_are_read_once_per_kind_from_a_gpu_in_mig_mode_first():
    driver = _Counting(H100, 3, mig_enabled=True, profiles_need_mig=True)
    driver.set_mig_mode(0, False)
    capability, problems = read_capability(driver, CATALOG)
    assert problems == [] and driver.asked == [1]
    assert len(capability.kinds) == 1 and len(capability.kinds[0].profiles) == len(H100.mig_profiles)
    assert [g.mig for g in capability.gpus] == ["off", "on", "on"]


def test_a_driver_listing_none_with_mig_off_is_asked_on_every_gpu_of_the_kind():
    driver = _Counting(H100, 2, mig_enabled=False, profiles_need_mig=True)
    capability, _ = read_capability(driver, CATALOG)
    assert driver.asked == [0, 1] and capability.kinds[0].profiles == ()


def test_a_driver_listing_profiles_with_mig_off_is_asked_once():
    driver = _Counting(H100, 2, mig_enabled=False)
    capability, _ = read_capability(driver, CATALOG)
    assert driver.asked == [0] and len(capability.kinds[0].profiles) == len(H100.mig_profiles)


def test_a_gpu_without_a_product_name_is_a_clear_error_not_a_crash():
    driver = FakeNvml(H100, 1)
    driver.name = ""  # NVML gave an empty name buffer
    with pytest.raises(DynpartError, match=r"GPU 0 \(''.*the driver's description is not usable \(product: "):
        read_capability(driver, CATALOG)
    report = probe(driver, CATALOG)  # the probe says so and goes on
    assert not report.ok and "not usable" in report.mismatches[0]


@pytest.mark.parametrize("model, renames", [
    ("A100-80GB", {"7g.80gb": "7g.79gb"}),  # an older driver's name (the facts file, section 1)
    ("GB200-186GB", {"1g.23gb": "1g.24gb", "1g.23gb+me": "1g.24gb+me", "3g.93gb": "3g.95gb"}),
])
def test_a_profile_the_driver_names_otherwise_is_planned_under_the_drivers_name(model, renames):
    """What the driver reports wins: the same NVML profile and shape under another name is the
    catalog's profile, planned (by the agent and the planner, from one report) as the driver
    names it, which is what its pods ask for."""
    from dynpart.capability import node_model

    catalog = load_catalog()
    base = catalog.models[model]
    driver = base.model_copy(update={"mig_profiles": tuple(
        p.model_copy(update={"name": renames.get(p.name, p.name)}) for p in base.mig_profiles)})
    cap, _ = read_capability(FakeNvml(driver, 1, name=base.products[0].replace("\\", "")), catalog)
    choice = node_model(cap, catalog)
    names = [p.name for p in choice.model.mig_profiles]
    assert len(names) == len(base.mig_profiles) and set(renames.values()) <= set(names)
    assert not set(renames) & set(names)
    assert any(f"{old}: the driver names it {new}" in d for old, new in renames.items() for d in choice.disagreements)


def test_a_lost_gpu_is_described_as_last_read_and_not_read():
    """A GPU fallen off the bus (`DeviceInfo.lost`) is not read: described as last read, or, never
    read, as the node's first GPU that answers; every GPU lost and never read is an NVML error."""
    driver = _Counting(H100, 3, mig_enabled=True)
    driver.lose(0)
    capability, problems = read_capability(driver, CATALOG)
    assert problems == [] and driver.asked == [1] and driver.lost_calls == 0
    assert [g.mig for g in capability.gpus] == ["on", "on", "on"] and len(capability.kinds) == 1

    class _NeverRead(FakeNvml):  # as RealNvml lists a GPU lost before it was ever read
        def devices(self):
            return [replace(d, name="", uuid="", memory_mib=0, mig_capable=False, mig_current=False,
                            mig_pending=False, reserved_mib=None) if d.lost else d for d in super().devices()]
    never = _NeverRead(H100, 2, mig_enabled=True)
    never.lose(1)
    capability, _ = read_capability(never, CATALOG)
    assert [g.mig for g in capability.gpus] == ["on", "on"] and len(capability.kinds) == 1
    never.lose(0)
    with pytest.raises(GpuDriverError, match="every GPU of the node is lost") as e:
        read_capability(never, CATALOG)
    assert e.value.code == "GPU_IS_LOST"
    report = probe(driver, CATALOG)  # the probe says which is lost and goes on with the others
    assert not report.ok and any("GPU 0 is lost" in m for m in report.mismatches)
    assert any(line.startswith("GPU 0: lost") for line in report.lines) and driver.lost_calls == 0
