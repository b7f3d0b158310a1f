"""The built-in workload of `dynpart simulate`: seeded and deterministic, its parameters
validated with errors naming the field, named slices in replay, and the best static layout."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import pytest

from dynpart.cli import main
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.workloads import (
    DEFAULT_MIG_MIX,
    WorkloadSpec,
    generate,
    parse_inline,
    read_workload,
    workload_source,
    workload_spec,
)
from dynpart.simulations.replay.engine import ReplayOptions, run_replay
from dynpart.simulations.replay.mapping import mig_profile_for, request_for, static_contenders, static_fits, static_layout
from dynpart.simulations.replay.summary import best_static, change_pct, gpu_waits, summary

from .conftest import pod

SMALL = "pods=120,mps_pods=60"


def test_same_seed_same_pods_other_seed_other_pods(catalog):
    a = generate(WorkloadSpec(seed=7, pods=300, mps_pods=100), catalog)
    b = generate(WorkloadSpec(seed=7, pods=300, mps_pods=100), catalog)
    c = generate(WorkloadSpec(seed=8, pods=300, mps_pods=100), catalog)
    assert [p.trace.pods for p in a] == [p.trace.pods for p in b]
    assert a[0].trace.pods != c[0].trace.pods and a[1].trace.pods != c[1].trace.pods
    # the parts draw from their own streams: the MPS part's parameters do not change the MIG pods
    d = generate(WorkloadSpec(seed=7, pods=300, mps_pods=50, mps_rate=9), catalog)
    assert d[0].trace.pods == a[0].trace.pods


def test_default_workload_shape(catalog):
    spec = WorkloadSpec()
    mig, mps = generate(spec, catalog)
    assert (mig.name, mps.name) == ("mig", "mps")
    assert mig.cluster.gpu_count == 32 and {n.mode for n in mig.cluster.nodes} == {"mig"}
    assert mps.cluster.gpu_count == 16 and {n.mode for n in mps.cluster.nodes} == {"mps"}
    assert {n.model for n in mig.cluster.nodes + mps.cluster.nodes} == {"H100-80GB"}
    counts = Counter(p.slice_name for p in mig.trace.pods)
    assert set(counts) == set(DEFAULT_MIG_MIX)
    # many 1g/2g, some 3g/4g, a few 7g
    assert counts["1g.10gb"] > counts["3g.40gb"] > counts["7g.80gb"] and counts["2g.20gb"] > counts["4g.40gb"]
    assert {p.slice_name for p in mps.trace.pods} == {"10gb", "20gb", "40gb"}
    assert 0.7 < mig.offered_load < 0.95 and 0.7 < mps.offered_load < 0.95
    # Poisson arrivals at `rate` per minute, log-normal durations of median duration_median_s
    times = [p.creation_time for p in mig.trace.pods]
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(60 / spec.rate, rel=0.1)
    durations = sorted(p.duration for p in mig.trace.pods)
    assert durations[len(durations) // 2] == pytest.approx(spec.duration_median_s, rel=0.15)
    assert all(p.num_gpu == 1 and p.creation_time is not None for p in mig.trace.pods + mps.trace.pods)
    # gpu_milli agrees with the named slice (the compute rule maps it back; MPS: the same GB)
    h100 = catalog.resolve("H100-80GB")
    assert all(mig_profile_for(h100, p.gpu_milli) == p.slice_name for p in mig.trace.pods[:200])
    assert all(request_for(replace(p, slice_name=""), h100, "mps")[0] == f"nvidia.com/gpu-{p.slice_name}"
               for p in mps.trace.pods[:200])


def test_inline_and_yaml_parameters(tmp_path):
    assert parse_inline("seed=7,mix=1g.10gb:40,2g.20gb:30,pods=10") == {
        "seed": "7", "mix": "1g.10gb:40,2g.20gb:30", "pods": "10"}
    spec = read_workload("seed=7, mix=1g.10gb:40,7g.80gb:1 ,rate=2.5")
    assert (spec.seed, spec.rate, spec.mix) == (7, 2.5, {"1g.10gb": 40.0, "7g.80gb": 1.0})
    f = tmp_path / "w.yaml"
    f.write_text("seed: 3\nmix: {1g.10gb: 1, 3g.40gb: 2}\nmps_pods: 0\n")
    spec = read_workload(str(f))
    assert (spec.seed, spec.mix, spec.mps_pods) == (3, {"1g.10gb": 1.0, "3g.40gb": 2.0}, 0)
    assert read_workload(None) == WorkloadSpec()
    assert read_workload(WorkloadSpec(seed=5).inline()) == WorkloadSpec(seed=5)


@pytest.mark.parametrize(("value", "field"), [
    ("rate=-1", "rate:"),
    ("rate=0", "rate:"),
    ("seed=x", "seed:"),
    ("pods=-5", "pods:"),
    ("duration_sigma=9", "duration_sigma:"),
    ("nodes=0", "nodes:"),
    ("mps_nodes=0", "mps_nodes:"),
    ("colour=red", "colour: unknown key"),
    ("mix=1g.5gb:3", "mix: '1g.5gb' is not a MIG profile of H100-80GB"),
    ("mix=1g.10gb:-1", "mix: weights must be"),
    ("mix=1g.10gb:0", "mix: at least one weight"),
    ("mix=1g.10gb:1e308,2g.20gb:1e308", "mix: weights too large"),
    ("duration_median_s=inf", "duration_median_s: Input should be a finite number"),
    ("duration_sigma=nan", "duration_sigma:"),
    ("rate=nan", "rate:"),
    ("rate=1e-300", "rates and duration_median_s give times over"),
    ("duration_median_s=1e300", "rates and duration_median_s give times over"),
    ("mix=1g.10gb", "mix: '1g.10gb': expected NAME:WEIGHT"),
    ("mps_mix=100gb:1", "mps_mix: '100gb'"),
    ("mps_mix=big:1", "mps_mix: 'big'"),
    ("gpu_model=nope", "gpu_model:"),
    ("gpu_model=A30-24GB,mix=1g.10gb:1", "mix: '1g.10gb' is not a MIG profile of A30-24GB ("),
    # the mix was not given: the error says it is the default one, and what to give (review 172)
    ("gpu_model=A100-40GB", "mix: '2g.20gb' is not a MIG profile of A100-40GB (1g.5gb, 1g.5gb+me, 1g.10gb, 2g.10gb, "
                            "3g.20gb, 4g.20gb, 7g.40gb); the default mix names H100-80GB's profiles: set mix to "
                            "A100-40GB's, e.g. 1g.5gb:60,7g.40gb:40"),
    ("pods=0,gpu_model=A30-24GB", "mps_mix: '40gb': expected a size <N>gb with N in 1..24 (A30-24GB holds 24 GiB of MPS "
                                  "slices); the default mps_mix is H100-80GB's: set mps_mix to sizes A30-24GB holds, "
                                  "e.g. 6gb:60,12gb:40"),
    ("mps_mix=\u0661\u0660gb:1", "mps_mix: '\u0661\u0660gb': expected a size <N>gb"),
    ("rate=1e300", "rate: Input should be less than or equal to 1000000"),
    ("mps_rate=1e7", "mps_rate: Input should be less than or equal to 1000000"),
    ("pods=0,mps_pods=0", "pods: pods and mps_pods are both 0"),
    ("seed=1,seed=2", "seed: given twice"),
    ("=3", "expected key=value"),
])
def test_bad_parameters_name_the_field(value, field, catalog):
    with pytest.raises(SimulationError) as e:
        generate(read_workload(value), catalog)
    msg = str(e.value)
    assert msg.startswith("--workload") and field in msg and "\n" not in msg


def test_bad_workload_files(tmp_path, catalog):
    with pytest.raises(SimulationError, match="no-such.yaml"):
        read_workload(str(tmp_path / "no-such.yaml"))
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(SimulationError, match="expected a mapping"):
        read_workload(str(f))
    f.write_text("rate: fast\n")
    with pytest.raises(SimulationError, match=f"--workload {f}: rate:"):
        read_workload(str(f))
    # a mistake found against the catalog names the file too (review 172)
    f.write_text("pods: 30\nmix: {1g.10gb: 5, 9g.1gb: 1}\n")
    with pytest.raises(SimulationError, match=f"^--workload {f}: mix: '9g.1gb' is not a MIG profile of H100-80GB"):
        generate(read_workload(str(f)), catalog, workload_source(str(f)))
    with pytest.raises(SimulationError, match="seed:"):
        workload_spec({"seed": -1})


def test_named_slices_in_replay(catalog):
    h100 = catalog.resolve("H100-80GB")
    mig = pod("m", milli=142)
    assert request_for(mig, h100, "mig") == ("nvidia.com/mig-1g.10gb", 1)
    named = replace(mig, slice_name="1g.20gb")  # the name wins over gpu_milli
    assert request_for(named, h100, "mig") == ("nvidia.com/mig-1g.20gb", 1)
    assert request_for(replace(mig, slice_name="40gb"), h100, "mps") == ("nvidia.com/gpu-40gb", 1)
    with pytest.raises(SimulationError, match="not a MIG profile"):
        request_for(replace(mig, slice_name="40gb"), h100, "mig")
    with pytest.raises(SimulationError, match="MPS cluster"):
        request_for(replace(mig, slice_name="1g.20gb"), h100, "mps")


def test_generated_pods_get_their_profile_in_replay(catalog):
    mig, _ = generate(WorkloadSpec(pods=80, mps_pods=10), catalog)
    r = run_replay(mig.trace.pods, mig.cluster, catalog, ReplayOptions(policy="dynpart"))
    assert all(x.resource == f"nvidia.com/mig-{x.pod.slice_name}" for x in r.runs)
    assert summary(r)["never_placed"] == 0 and r.used_slices_disrupted == 0


def test_static_contenders(catalog):
    h100 = catalog.resolve("H100-80GB")
    mig = static_contenders(h100, "mig")
    assert mig == ["all-balanced", "all-1g.10gb", "all-1g.20gb", "all-2g.20gb", "all-3g.40gb", "all-4g.40gb",
                   "all-7g.80gb"]
    assert static_contenders(h100, "mps") == ["mps-1", "mps-2", "mps-4", "mps-8"]
    # slices of the sizes pods ask for, as many as fit an H100's 79 GiB (not the ones bigger than it)
    assert static_contenders(h100, "mps", (10, 40, 90)) == ["mps-1", "mps-2", "mps-4", "mps-8", "mps-10gb", "mps-40gb"]
    assert static_layout("mps-10gb", h100, "mps") == {"mps_size": "10"}
    with pytest.raises(SimulationError, match="mps-<S>gb"):
        static_layout("mps-80gb", h100, "mps")
    for name in mig:
        static_layout(name, h100, "mig")
    assert static_fits("all-balanced", "mps") and static_fits("all-7g", "mig") and not static_fits("all-7g", "mps")
    assert static_fits("mps-4", "mps") and not static_fits("mps-4", "mig")


def test_a_narrowed_model_without_balanced_profiles_has_no_all_balanced(tmp_path):
    # a catalog file may give a model only some of its profiles: all-balanced (1g, 2g and 3g)
    # is then not a contender, and forcing it is a one-line error; the other layouts still run
    from dynpart.catalog import load_catalog
    f = tmp_path / "narrow.yaml"
    f.write_text(NARROW_H100)
    h100 = load_catalog([f]).resolve("H100-80GB")
    assert static_contenders(h100, "mig") == ["all-1g.10gb", "all-7g.80gb"]
    with pytest.raises(SimulationError, match="H100-80GB has no all-balanced layout"):
        static_layout("all-balanced", h100, "mig")
    assert static_layout("all-balanced", h100, "mps") == {}


NARROW_H100 = """models:
  - name: H100-80GB
    memory_gb: 80
    memory_mib: 81559
    memory_slices: 8
    compute_slices: 7
    mig_profiles:
      - {name: 1g.10gb, id: 19, nvml: NVML_GPU_INSTANCE_PROFILE_1_SLICE, compute: 1, memory: 1, max: 7,
         starts: [0, 1, 2, 3, 4, 5, 6]}
      - {name: 7g.80gb, id: 0, nvml: NVML_GPU_INSTANCE_PROFILE_7_SLICE, compute: 7, memory: 8, max: 1, starts: [0]}
"""


def _s(mean, p95, never=0):
    return {"pending_s": {"mean": mean, "p95": p95}, "never_placed": never}


def test_best_static_is_the_minimum():
    cands = [("a", _s(50.0, 90.0)), ("b", _s(40.0, 200.0)), ("c", _s(40.0, 100.0)), ("d", _s(None, None, 3))]
    assert best_static(cands) == 2  # lowest mean, then lowest p95
    assert best_static([("x", _s(10.0, 10.0, 1)), ("y", _s(10.0, 10.0, 0))]) == 1
    assert best_static([("x", _s(10.0, 10.0)), ("y", _s(10.0, 10.0))]) == 0  # the first of equals
    with pytest.raises(ValueError):
        best_static([])
    assert change_pct(90.0, 100.0) == -10.0 and change_pct(1.0, 0.0) is None and change_pct(None, 1.0) is None


def test_never_placed_pods_wait_until_the_common_horizon(catalog):
    h100 = catalog.resolve("H100-80GB")
    r = run_replay([pod("a", milli=1000, t0=0, t1=100), pod("b", milli=100, t0=0, t1=50)],
                   _one_node("mig"), catalog,
                   ReplayOptions(policy="static", static_layout=tuple(static_layout("all-7g", h100, "mig").items())))
    waits, never = gpu_waits(r)
    assert never == 1
    later, _ = gpu_waits(r, horizon=r.end_time + 1000)
    assert max(later) == pytest.approx(max(waits) + 1000)
    assert summary(r, r.end_time + 1000)["pending_s"]["max"] == pytest.approx(max(waits) + 1000, abs=0.1)


def _one_node(mode):
    from .conftest import cluster
    return cluster(("n0", 64_000, 1, "H100-80GB"), mode=mode)


def test_simulate_default_workload_end_to_end(capsys, tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "--workload", SMALL, "--jobs", "1", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["pods"] == 120 and doc["trace"] is None
    assert [p["part"] for p in doc["parts"]] == ["mig", "mps"]
    for part in doc["parts"]:
        policies = part["policies"]
        assert [p["policy"] for p in policies] == ["dynpart", "nos", "static"]
        assert all(p["used_slices_disrupted"] == 0 for p in policies)
        cands = part["static_contenders"]
        # MPS: 4 equal splits and one layout per slice size the pods ask for (10, 20, 40 GB)
        assert len(cands) == (7 if part["part"] == "mig" else 7)
        # the reported static layout is the candidate with the lowest mean pending time
        best = min(cands, key=lambda c: (c["mean_pending_s"], c["p95_pending_s"], c["never_placed"]))
        assert part["best_static"] == best["geometry"] == policies[2]["static_geometry"]
        assert policies[2]["pending_s"]["mean"] == best["mean_pending_s"]
        assert policies[2]["static_choice"].startswith("best of")
        assert set(part["dynpart_vs"]) == {"nos", f"static ({best['geometry']})"}
        # every policy's never-placed pods wait until the same horizon
        assert {p["never_placed_wait_until_s"] for p in policies} == {part["never_placed_wait_until_s"]}
    assert {p.name for p in out.iterdir()} == {"summary.json", "steps.csv", "pods.csv", "timeline.png",
                                               "pending_cdf.png", "pending_bars.png"}
    assert (out / "pods.csv").read_text().startswith("part,policy,pod,")


def test_simulate_table_and_forced_static(capsys):
    assert main(["simulate", "--workload", SMALL, "--jobs", "2", "--policy", "dynpart,static",
                 "--static-geometry", "all-7g"]) == 0
    captured = capsys.readouterr()
    table = captured.out
    assert "static (all-7g)" in table and "dynpart against" in table
    assert "best static layout (MPS part): mps-" in table  # the forced MIG layout leaves MPS to the search
    assert "MIG part: 120 pods" in captured.err


def test_simulate_one_part(capsys):
    assert main(["simulate", "--workload", SMALL, "--mode", "mps", "--jobs", "1", "--json", "--policy", "dynpart"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["part"] for p in doc["parts"]] == ["mps"]
    assert [p["policy"] for p in doc["parts"][0]["policies"]] == ["dynpart"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--cluster", "2x8xH100-80GB"], "--cluster goes with --trace"),
    (["--trace", "x.csv", "--workload", "seed=1"], "either --trace or --workload"),
    (["--workload", "seed=-1"], "--workload: seed:"),
    (["--workload", "pods=10,mps_pods=0", "--mode", "mps"], "no MPS part"),
    (["--workload", "pods=10,mps_pods=0", "--static-geometry", "mps-4"], "--static-geometry mps-4"),
    (["--workload", "pods=10,mps_pods=0", "--static-geometry", "all-9g"], "all-9g"),
])
def test_simulate_mistakes_are_one_line_errors(argv, message, capsys):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynpart: error:") and message in err and "\n" not in err


def test_offered_load_follows_rate(catalog):
    lo = generate(WorkloadSpec(pods=10, mps_pods=0, rate=1.0), catalog)[0].offered_load
    hi = generate(WorkloadSpec(pods=10, mps_pods=0, rate=2.0), catalog)[0].offered_load
    assert hi == pytest.approx(2 * lo)
    spec = WorkloadSpec()
    assert spec.mean_duration_s() == pytest.approx(spec.duration_median_s * math.exp(spec.duration_sigma ** 2 / 2))
