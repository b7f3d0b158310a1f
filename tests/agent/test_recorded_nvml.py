"""The real NVML path on a real GPU's answers: `RecordedNvml` replays what an H200 (driver
580.159.04, MIG mode off) answered to every read the agent makes, recorded read-only on the
project's lent GPU machine (tests/fixtures/nvml; scripts/record-nvml.sh made it). The code under
test is the code that runs on a GPU host: nvidia-ml-py's wrappers and `RealNvml`, down to the
ctypes buffers; only libnvidia-ml is replaced by the recording.

The recorder itself is checked on the recording (recording the replay gives the same answers)
and on a stand-in C library (tests/agent/nvml_c_double.py) for MIG mode on."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.agent.capability_reader import read_capability
from dynpart.agent.driver.interface import DeviceInfo, DriverVersions
from dynpart.agent.driver.nvml_recording import (
    ASKED_LATER,
    NvmlRecording,
    NvmlRecordingError,
    NvmlReplayMissing,
    ReadOnlyViolation,
    RecordedNvml,
    ReplayedLibrary,
    record_nvml,
)
from dynpart.agent.nvml_probe import probe, read_paths
from dynpart.capability import node_model
from dynpart.catalog import load_catalog
from dynpart.cli import main
from dynpart.errors import DynpartError
from tests.agent.nvml_c_double import SimulatedNvmlLibrary

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nvml"
# recording -> (GPU name NVML gives, its memory in MiB, the catalog model, MPS capacity in GiB)
RECORDED = {
    "h100-580.159.04-mig-off": ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB", 79),
    "h200-580.159.04-mig-off": ("NVIDIA H200", 143771, "H200-141GB", 139),
}
H200 = FIXTURES / "h200-580.159.04-mig-off.json"
CATALOG = load_catalog([])


def test_every_recording_in_the_fixtures_is_tested():
    assert {p.stem for p in FIXTURES.glob("*.json")} == set(RECORDED)


@pytest.fixture(params=sorted(RECORDED))
def recorded(request):
    driver = RecordedNvml(FIXTURES / f"{request.param}.json")
    yield request.param, driver
    driver.close()


def _smi(stem: str, what: str) -> str:
    return (FIXTURES / f"{stem}.nvidia-smi-{what}.txt").read_text()


def test_the_recorded_gpu_is_what_nvidia_smi_saw_and_a_catalog_model(recorded):
    stem, driver = recorded
    name, memory, model, _ = RECORDED[stem]
    assert driver.versions() == DriverVersions("580.159.04", "13.580.159.04", "13.0")
    [gpu] = driver.devices()
    assert gpu == DeviceInfo(0, name, gpu.uuid, memory, mig_capable=True, mig_current=False, mig_pending=False)
    assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", gpu.uuid)
    smi = _smi(stem, "q")
    for field, value in (("Product Name", name), ("GPU UUID", gpu.uuid), ("Driver Version", "580.159.04"),
                         ("CUDA Version", "13.0")):
        assert re.search(rf"^\s*{field}\s+: {re.escape(value)}$", smi, re.MULTILINE), field
    assert re.search(rf"FB Memory Usage\s+Total\s+: {memory} MiB", smi)
    assert re.search(r"MIG Mode\s+Current\s+: Disabled\s+Pending\s+: Disabled", smi)
    assert CATALOG.resolve(gpu.name).name == model


def test_health_is_what_nvidia_smi_says_of_row_remapping(recorded):
    stem, driver = recorded
    assert re.search(r"Remapped Rows(?:\s+\S.*\n)*?\s+Pending\s+: No\s+Remapping Failure Occurred\s+: No",
                     _smi(stem, "q"))
    assert driver.health(0) is None
    # Hopper remaps rows and retires no page: page retirement is not supported there
    assert any(c["fn"] == "nvmlDeviceGetRetiredPagesPendingStatus" and c["result"] == 3
               for c in NvmlRecording.load(FIXTURES / f"{stem}.json").calls)


def test_profiles_and_placements_read_with_mig_off_are_the_catalogs(recorded):
    stem, driver = recorded
    _, _, model, capacity = RECORDED[stem]
    capability, problems = read_capability(driver, CATALOG)
    assert problems == []
    [kind] = capability.kinds
    assert (kind.memory_slices, kind.compute_slices) == (8, 7)
    catalog = CATALOG.models[model]
    read = {p.name: (p.id, p.compute, p.memory, p.max, p.starts) for p in kind.profiles}
    assert read == {p.name: (p.gi_profile_id, p.compute, p.memory, p.max, p.starts) for p in catalog.mig_profiles}
    assert {p.name: p.nvml for p in kind.profiles} == {
        p.name: p.nvml.removeprefix("NVML_GPU_INSTANCE_PROFILE_") for p in catalog.mig_profiles}
    choice = node_model(capability, CATALOG)
    assert choice.disagreements == ()
    # the catalog's model itself: its profiles, and the memory the driver reports less what it
    # reserves ((MiB - reserved) // 1024 GiB of MPS capacity). These recordings predate the agent's
    # nvmlMemory_v2 read: they replay a driver without it, so the catalog's reserved figure, measured
    # on the same GPU (nvidia-smi -q "Reserved"), is taken
    assert driver.devices()[0].reserved_mib is None
    assert re.search(rf"Reserved\s+: {catalog.reserved_mib} MiB", _smi(stem, "q"))
    assert choice.model is catalog and catalog.mps_capacity_gb == capacity
    assert capability.kinds[0].memory_mib == catalog.memory_mib - catalog.reserved_mib


def test_nvidia_smi_on_the_same_gpu_agrees_with_the_recorded_nvml(recorded):
    stem, driver = recorded
    smi = _smi(stem, "mig")
    placements = {int(pid): ([int(s) for s in starts.split(",")], int(size)) for pid, starts, size in
                  re.findall(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)", smi)}
    listed = {int(pid): (name, int(total)) for name, pid, total in
              re.findall(r"MIG (\S+)\s+(\d+)\s+\d+/(\d+)", smi)}
    assert len(placements) == len(listed) == 7
    for pid, (starts, size) in placements.items():
        assert driver.possible_placements(0, pid) == [(s, size) for s in starts]
    by_id = {p.profile_id: p for p in driver.gpu_instance_profiles(0)}
    assert {pid: (by_id[pid].name.removeprefix("MIG "), by_id[pid].instance_count) for pid in by_id} == listed


def test_the_probe_prints_on_the_recording_what_it_printed_on_the_gpu(recorded):
    stem, driver = recorded
    recording = NvmlRecording.load(FIXTURES / f"{stem}.json")
    report = probe(driver, CATALOG)
    assert report.ok, report.mismatches
    # what the driver said (versions, the GPU, each profile) as printed there; the line naming the
    # model the node is planned with is the planner's conclusion, which may improve after a recording
    said = [line for line in report.lines if not line.startswith("planned as ")]
    assert said == [line for line in recording.meta["probe"] if not line.startswith("planned as ")]
    assert len(said) == 9  # versions, the GPU, 7 profiles
    assert sum("  planned" in line for line in report.lines) == 7
    _, _, model, capacity = RECORDED[stem]
    assert f"planned as {model}, the catalog's: 7 MIG profiles, MPS capacity {capacity} GB" in report.lines
    assert read_paths(driver, CATALOG) == recording.meta["reads"]


@pytest.fixture
def h200():
    driver = RecordedNvml(H200)
    yield driver
    driver.close()


def test_a_call_the_recording_has_no_answer_for_is_refused(h200):
    with pytest.raises(NvmlReplayMissing, match="nvmlDeviceGetGpuInstancePossiblePlacements_v2"):
        h200.possible_placements(0, 3)  # a profile id the H200 does not have: never asked
    with pytest.raises(NvmlReplayMissing, match="nvmlDeviceSetMigMode"):
        h200.set_mig_mode(0, True)
    with pytest.raises(NvmlReplayMissing, match="nvmlDeviceGetHandleByIndex_v2"):
        h200.gpu_instances(1)  # no second GPU was asked for


def test_recording_the_replay_gives_back_the_recorded_answers():
    recording = NvmlRecording.load(H200)
    answers = {json.dumps([c["fn"], c["args"]], sort_keys=True): (c.get("result"), c.get("out"))
               for c in recording.calls}
    with record_nvml(ReplayedLibrary(recording)) as (driver, again):
        probe(driver, CATALOG)
        read_paths(driver, CATALOG)
    assert len(again.calls) > 50
    for call in again.calls:
        if call.get("missing"):  # a read newer than the recording: replayed as a driver without it
            assert call["fn"] in ASKED_LATER
            continue
        key = json.dumps([call["fn"], call["args"]], sort_keys=True)
        assert answers[key] == (call.get("result"), call.get("out")), call["fn"]


def test_a_recording_session_refuses_every_call_that_is_not_a_read():
    lib = SimulatedNvmlLibrary(CATALOG.resolve("H100-80GB"), "NVIDIA H100 80GB HBM3", 81559)
    with record_nvml(lib) as (driver, recording):
        for change in (lambda: driver.set_mig_mode(0, False), lambda: driver.create_gpu_instance(0, 19, 0, 1),
                       lambda: driver.create_compute_instance(0, 1, 1), lambda: driver.destroy_gpu_instance(0, 1),
                       lambda: driver.destroy_compute_instance(0, 1, 1)):
            with pytest.raises(ReadOnlyViolation, match="not a read"):
                change()
    reached = set(lib.calls)
    assert reached and not any(re.search(r"Set|Create|Destroy", name) for name in reached)
    assert not any(re.search(r"Set|Create|Destroy", c["fn"]) for c in recording.calls)


@pytest.mark.parametrize("mig", [True, False])
def test_record_then_replay_gives_the_same_probe(tmp_path, mig):
    lib = SimulatedNvmlLibrary(CATALOG.resolve("H100-80GB"), "NVIDIA H100 80GB HBM3", 81559, mig=mig)
    with record_nvml(lib) as (driver, recording):
        first = probe(driver, CATALOG)
        first_reads = read_paths(driver, CATALOG)
    recording.save(tmp_path / "r.json")
    replayed = RecordedNvml(tmp_path / "r.json")
    again = probe(replayed, CATALOG)
    assert (again.lines, again.mismatches, read_paths(replayed, CATALOG)) == (first.lines, first.mismatches,
                                                                              first_reads)
    assert any("possible_placements id 0 (7g.80gb): [(0, 8)]" in line for line in first_reads) == mig


def test_bad_recordings_are_refused_with_the_file_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(NvmlRecordingError, match="bad.json: not a readable NVML recording"):
        RecordedNvml(bad)
    bad.write_text(json.dumps({"format": "something-else", "calls": []}))
    with pytest.raises(NvmlRecordingError, match="not an NVML recording"):
        NvmlRecording.load(bad)
    bad.write_text(json.dumps({"format": "dynpart.io/nvml-recording/v1", "calls": [{"fn": 3}]}))
    with pytest.raises(NvmlRecordingError, match=r"calls\[0\]"):
        NvmlRecording.load(bad)


def test_probe_command_replays_a_recording(capsys, tmp_path):
    assert main(["agent", "probe", "--replay", str(H200)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"GPU 0: NVIDIA H200 GPU-[0-9a-f-]+ 143771 MiB, MIG off", out)
    assert "catalog matches the driver" in out and "reads:" in out
    assert main(["agent", "probe", "--replay", str(H200), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["versions"]["driver"] == "580.159.04" and len(data["gpus"][0]["profiles"]) == 7
    assert main(["agent", "probe", "--replay", str(tmp_path / "none.json")]) == 2
    assert "none.json: not a readable NVML recording" in capsys.readouterr().err
    assert main(["agent", "probe", "--replay", str(H200), "--fake-gpus", "H100-80GB:1"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["agent", "probe", "--record", str(tmp_path / "no" / "r.json")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize(("reserved", "total", "kind_mib", "capacity"), [
    (480, 81559, 81079, 79),  # what the H100 of tests/fixtures/nvml reserves: the catalog's model
    (2000, 81559, 79559, 77),  # a driver reserving more: what it says wins over the catalog's figure
    (None, 81559, 81079, 79),  # a driver that cannot say: the catalog's figure for the same GPU
    (None, 81000, 81000, 79),  # nor can the catalog (another total): the total
])
def test_the_mps_capacity_leaves_out_what_the_driver_reserves(reserved, total, kind_mib, capacity):
    lib = SimulatedNvmlLibrary(CATALOG.resolve("H100-80GB"), "NVIDIA H100 80GB HBM3", total, mig=False)
    lib.reserved_mib = reserved
    with record_nvml(lib) as (driver, recording):
        assert driver.devices()[0].reserved_mib == reserved
        capability, _ = read_capability(driver, CATALOG)
    assert capability.kinds[0].memory_mib == kind_mib
    choice = node_model(capability, CATALOG)
    assert choice.model.mps_capacity_gb == capacity and choice.model.family_name == "H100-80GB"
    assert (choice.model is CATALOG.models["H100-80GB"]) == (capacity == 79)
    # the version-2 call is made (and recorded) first; version 1 only where it is not supported
    asked = [c["fn"] for c in recording.calls if c["fn"].startswith("nvmlDeviceGetMemoryInfo")]
    assert asked[:2] == (["nvmlDeviceGetMemoryInfo_v2"] * 2 if reserved is not None
                         else ["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo"])


def test_the_reserved_memory_is_rounded_up_to_whole_mib():
    """An H200's driver counts 615.06 MiB in version 1's `used` on an idle GPU, and nvidia-smi shows
    616 MiB "Reserved" (tests/fixtures/nvml): whole MiB up, so that the total less it is never above
    what is free (the catalog's figure for the same GPU gives the same)."""
    lib = SimulatedNvmlLibrary(CATALOG.resolve("H200-141GB"), "NVIDIA H200", 143771, mig=False)
    lib.reserved_bytes = 644_939_776  # 615.0625 MiB
    with record_nvml(lib) as (driver, _):
        assert driver.devices()[0].reserved_mib == 616
        capability, _ = read_capability(driver, CATALOG)
    assert capability.kinds[0].memory_mib == 143771 - 616 == 143155
    assert node_model(capability, CATALOG).model is CATALOG.models["H200-141GB"]


def test_a_recording_without_the_reserved_memory_read_replays_a_driver_without_it(h200):
    # a read newer than the recording, with a fallback: answered as by a driver lacking the function
    nv = h200._nv
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlMemory_v2)
    # any other question the recording never asked is still refused
    with pytest.raises(NvmlReplayMissing, match="nvmlDeviceGetBAR1MemoryInfo"):
        nv.nvmlDeviceGetBAR1MemoryInfo(nv.nvmlDeviceGetHandleByIndex(0))


@pytest.mark.parametrize(("rows", "action", "why"), [
    ((0, 0, 0, 0), None, None),
    ((0, 1, 1, 0), None, "memory rows wait for remapping: the GPU needs a reset"),
    ((0, 9, 0, 1), None, "a memory row could not be remapped"),
    # after an Xid that leaves a GPU unusable, the driver names the action that recovers it
    ((0, 0, 0, 0), 0, None),
    ((0, 0, 0, 0), 1, "recovery action (GPU_RESET)"),
    ((0, 0, 0, 0), 2, "recovery action (NODE_REBOOT)")])
def test_health_reads_row_remapping_and_the_recovery_action(rows, action, why):
    lib = SimulatedNvmlLibrary(CATALOG.resolve("H100-80GB"), "NVIDIA H100 80GB HBM3", 81559)
    lib.remapped_rows = rows
    lib.recovery_action = action
    with record_nvml(lib) as (driver, _):
        health = driver.health(0)
    assert health == why if why is None else why in health


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=12)
                     | st.sampled_from(["", "00", "0000", "zz", "abc", "00000000", "ffffffff"]),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["bytes", "handle", "c", "value", "buffer", "x"]), inner, max_size=3),
                     max_leaves=8)


@settings(max_examples=int(os.environ.get("DYNPART_PROPERTY_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_recording_is_refused_or_replayed_never_crashes(data):
    """Bad input: any one field of any one call changed. The replay either works, or stops with a
    DynpartError naming what it lacks or what is wrong; never a Python or ctypes crash."""
    raw = json.loads(H200.read_text())
    call = raw["calls"][data.draw(st.integers(0, len(raw["calls"]) - 1), label="call")]
    field = data.draw(st.sampled_from(["fn", "args", "result", "out", "missing", "extra"]), label="field")
    if field == "out" and call.get("out") and data.draw(st.booleans(), label="one entry"):
        k = data.draw(st.integers(0, len(call["out"]) - 1), label="entry")
        call["out"][k] = data.draw(_JSON, label="value")
    else:
        call[field] = data.draw(_JSON, label="value")
    try:
        driver = RecordedNvml(NvmlRecording.parse(raw, "damaged"))
        try:
            probe(driver, CATALOG)
            read_paths(driver, CATALOG)
        finally:
            driver.close()
    except DynpartError:
        pass
