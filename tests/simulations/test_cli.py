"""`dynpart simulate` and `dynpart bench packing` end to end, on the built-in synthetic data."""

from __future__ import annotations

import json
import pickle

import pytest

from dynpart.cli import main
from dynpart.errors import SnapshotError, UnknownGpuModel
from dynpart.simulations.errors import SimulationError, TraceError
from dynpart.simulations.packing import experiment
from dynpart.simulations.replay import cli as replay_cli

from .test_workloads import NARROW_H100

HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
          "scheduled_time\n")


def _trace(tmp_path, rows: str, name: str = "pods.csv"):
    f = tmp_path / name
    f.write_text(HEADER + rows)
    return str(f)


def test_bench_packing_json_and_files(capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "packing", "--seeds", "42-43", "--jobs", "1", "--policy", "dynpart,best-fit",
                 "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    runs = doc["runs"]
    assert [r["policy"] for r in runs] == ["dynpart", "best-fit"]
    for r in runs:
        assert {"policy", "batch", "seeds", "alloc_at_100", "alloc_at_130", "per_seed", "wall_s"} <= set(r)
        assert r["seeds"] == [42, 43] and len(r["per_seed"]) == 2
        assert 0 < r["alloc_at_100"] <= r["alloc_at_130"] <= 100
    assert runs[0]["per_seed"][0]["used_slices_disrupted"] == 0
    # dynpart against the other policy, seed by seed
    vs = doc["dynpart_vs"]["best-fit"]["alloc_at_130"]
    diffs = [a["alloc_at_130"] - b["alloc_at_130"] for a, b in zip(runs[0]["per_seed"], runs[1]["per_seed"])]
    assert vs["seeds"] == 2 and vs["difference_points"] == pytest.approx(sum(diffs) / 2, abs=1e-3)
    assert vs["seeds_higher"] == sum(d > 0 for d in diffs) and vs["seeds_lower"] == sum(d < 0 for d in diffs)
    lo, hi = vs["interval_points"]
    assert lo <= vs["difference_points"] <= hi
    assert {p.name for p in out.iterdir()} == {"summary.json", "steps.csv", "allocation.png"}
    assert (out / "steps.csv").read_text().startswith("policy,batch,seed,arrived_pct,allocation_pct")


def test_bench_packing_single_policy_table(capsys):
    assert main(["bench", "packing", "--seeds", "1", "--policy", "random", "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    assert "alloc@130%" in captured.out and "random" in captured.out
    assert "synthetic trace" in captured.err


def test_bench_packing_says_when_the_trace_is_tuned_down(capsys, tmp_path):
    """A trace asking for more than 1.3 x the cluster loses pods at random (tuneDownPods): here a
    16-GPU pod takes the two others with it and nothing arrives. The input line says '3 pods used'
    and the table 0 failed: a line says the list is cut down."""
    trace = tmp_path / "pods.csv"
    trace.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\nbig,4000,8192,16,1000\n"
                     "a,1000,1024,1,500\nb,1000,1024,1,500\n")
    assert main(["bench", "packing", "--trace", str(trace), "--cluster", "1x12xT4:mps", "--seeds", "1",
                 "--policy", "random", "--jobs", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["per_seed"][0]["pods"] < 3
    assert (f"trace {trace}: its pods ask for 142% of the cluster's GPU capacity, above --tune 1.3: each seed removes "
            "pods at random") in captured.err
    assert main(["bench", "packing", "--trace", str(trace), "--cluster", "1x12xT4:mps", "--seeds", "1",
                 "--policy", "random", "--jobs", "1", "--tune", "1.5", "--out", f"{tmp_path / 'res'}/"]) == 0
    captured = capsys.readouterr()
    assert "removes pods" not in captured.err
    assert f"wrote {tmp_path / 'res' / 'summary.json'}, " in captured.out  # not res//summary.json


def test_bench_packing_tuned_below_a_level_does_not_report_it(capsys):
    """--tune 0.5 stops arrivals at 50% of the capacity: its end's allocation was printed as
    alloc@100% and alloc@130%. Now those levels are '-' (null), with the end's allocation said."""
    assert main(["bench", "packing", "--seeds", "1", "--policy", "random", "--jobs", "1", "--tune", "0.5",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["alloc_at_100"] is doc["alloc_at_130"] is doc["alloc_at_130_stdev"] is None
    (seed,) = doc["per_seed"]
    assert seed["alloc_at_100"] is None and seed["final_arrived_pct"] <= 50
    assert 0 < doc["alloc_at_end"] == seed["alloc_at_end"] <= 50
    assert main(["bench", "packing", "--seeds", "1", "--policy", "random", "--jobs", "1", "--tune", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("random"))
    assert row[3].endswith("%") and row[4] == "-"  # 100% arrived (within one pod), 130% not
    assert "--tune 1: the pod list ends at 100% of the GPU capacity, before 130% arrived; allocation at the end: random" in out


def test_simulate_json_and_files(capsys, tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "--workload", "pods=100,mps_pods=0", "--policy", "dynpart,static",
                 "--static-geometry", "all-7g", "--jobs", "1", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    (part,) = doc["parts"]
    assert [p["policy"] for p in part["policies"]] == ["dynpart", "static"]
    for p in part["policies"]:
        assert p["used_slices_disrupted"] == 0
        assert {"mean", "p50", "p95", "p99"} <= set(p["pending_s"])
    assert part["policies"][1]["reconfigurations"] == 0
    assert part["policies"][1]["static_geometry"] == "all-7g" and part["policies"][1]["static_choice"] == "forced"
    assert {p.name for p in out.iterdir()} == {"summary.json", "steps.csv", "pods.csv", "timeline.png",
                                               "pending_cdf.png", "pending_bars.png"}


def test_simulate_seeds_averages_the_runs_of_each_seed(capsys, tmp_path):
    workload = "pods=60,mps_pods=40,nodes=1,mps_nodes=1,gpus_per_node=2,rate=2,mps_rate=2"
    out = tmp_path / "seeds"
    assert main(["simulate", "--workload", workload, "--seeds", "3,1", "--policy", "dynpart,nos,static",
                 "--jobs", "1", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["seeds"] == [3, 1] and "seed" not in doc["workload"]
    assert [d["part"] for d in doc["parts"]] == ["mig", "mps"]
    for part in doc["parts"]:
        names = [p["policy"] for p in part["policies"]]
        assert names[:2] == ["dynpart", "nos"] and names[2] == f"static ({part['best_static']})"
        best = min(part["static_contenders"], key=lambda c: (c["mean_of_means_s"], c["mean_of_p95s_s"]))
        assert best["geometry"] == part["best_static"]  # one layout for every seed
        for p in part["policies"]:
            assert [r["seed"] for r in p["per_seed"]] == [3, 1] and p["used_slices_disrupted"] == 0
            assert p["mean_of_means_s"] == pytest.approx(sum(r["mean_s"] for r in p["per_seed"]) / 2, abs=0.051)
        assert set(part["dynpart_vs"]) == set(names[1:])
    # each seed's figures are those of the same workload replayed alone with that seed
    for seed in (3, 1):
        assert main(["simulate", "--workload", f"{workload},seed={seed}", "--policy", "dynpart,nos",
                     "--jobs", "1", "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        for part, single in zip(doc["parts"], alone["parts"]):
            for p, s in zip(part["policies"], single["policies"]):
                row = next(r for r in p["per_seed"] if r["seed"] == seed)
                assert (row["mean_s"], row["p95_s"], row["reconfigurations"]) == (
                    s["pending_s"]["mean"], s["pending_s"]["p95"], s["reconfigurations"])
    assert {f.name for f in out.iterdir()} == {"summary.json", "seeds.csv", "pending_bars.png"}
    assert len((out / "seeds.csv").read_text().splitlines()) == 1 + 2 * 3 * 2  # parts x policies x seeds
    assert main(["simulate", "--workload", workload, "--seeds", "1-2", "--mode", "mig", "--policy", "dynpart,nos",
                 "--jobs", "2"]) == 0
    text = capsys.readouterr().out
    assert "seeds 1-2: each figure" in text and "[95% interval]" in text and " of 2" in text


def test_simulate_seeds_replays_every_static_layout_on_every_seed(capsys):
    """Seeds 3 and 5 draw no 10gb pod; mps-10gb was replayed on the other four only and ranked
    on them (helper-174): every layout asked for by some seed is replayed on all."""
    workload = "pods=0,mps_pods=2,mps_nodes=1,gpus_per_node=1,mps_mix=10gb:50,40gb:50,rate=0.1"
    assert main(["simulate", "--seeds", "0-5", "--workload", workload, "--jobs", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (part,) = doc["parts"]
    ours, _, static = part["policies"]
    assert static["seeds"] == 6 and static["gpu_pods"] == ours["gpu_pods"] == 12
    assert "mps-10gb" in {c["geometry"] for c in part["static_contenders"]}
    assert part["dynpart_vs"][static["policy"]]["mean"]["change_pct"] is not None
    # the workload as recorded can be given again with the same seeds
    assert "seed=" not in doc["workload_inline"]
    assert main(["simulate", "--seeds", "0-5", "--workload", doc["workload_inline"], "--jobs", "1",
                 "--policy", "nos"]) == 0
    assert "\n\n" not in capsys.readouterr().out.strip()  # no comparison: no empty lines for it


def test_simulate_trace_picks_the_best_static_layout(capsys, tmp_path):
    trace = tmp_path / "pods.csv"
    trace.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
                     "deletion_time,scheduled_time\n"
                     + "".join(f"p{i},1000,1024,1,{1000 if i % 3 == 0 else 100},,LS,Running,{10 * i},{10 * i + 300},\n"
                               for i in range(30)))
    assert main(["simulate", "--trace", str(trace), "--cluster", "1x2xH100-80GB", "--policy", "static",
                 "--jobs", "1", "--json"]) == 0
    (part,) = json.loads(capsys.readouterr().out)["parts"]
    assert part["part"] == "trace" and len(part["static_contenders"]) == 7
    best = min(part["static_contenders"], key=lambda c: (c["mean_pending_s"], c["p95_pending_s"]))
    assert part["best_static"] == best["geometry"]


def test_simulate_says_when_dynpart_waits_longer_than_a_layout_that_never_waits(capsys, tmp_path):
    """A workload of one profile that the static layout offers from the start: static never waits,
    dynpart waits for its first instances. The comparison showed '-' (no percentage of 0 s),
    hiding that dynpart's waits are longer: it gives the change in seconds."""
    trace = _trace(tmp_path, "".join(f"p{i},1000,1024,1,100,,LS,Running,{100 * i},{100 * i + 50},\n"
                                     for i in range(4)))
    assert main(["simulate", "--trace", trace, "--cluster", "1x1xH100-80GB", "--policy", "dynpart,static",
                 "--static-geometry", "all-1g.10gb", "--jobs", "1"]) == 0
    comparison = capsys.readouterr().out.split("dynpart against")[1]
    row = next(line for line in comparison.splitlines() if line.startswith("static (all-1g.10gb)"))
    assert row.split()[-4:] == ["+1.2", "s", "+5.0", "s"], row  # the first pod waits 5 s, the others none
    assert main(["simulate", "--trace", trace, "--cluster", "1x1xH100-80GB", "--policy", "dynpart,static",
                 "--static-geometry", "all-1g.10gb", "--jobs", "1", "--json"]) == 0
    (part,) = json.loads(capsys.readouterr().out)["parts"]
    assert part["dynpart_vs"]["static (all-1g.10gb)"] == {"mean_pending_change_pct": None, "p95_pending_change_pct": None,
                                                          "mean_pending_change_s": 1.2, "p95_pending_change_s": 5.0}


def test_user_mistakes_are_one_line_errors(capsys, tmp_path):
    bad = tmp_path / "pods.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,1,100\nb,1,1,one,100\n")
    assert main(["bench", "packing", "--trace", str(bad), "--cluster", "2x2xT4:mps", "--seeds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dynpart: error: {bad}:3: num_gpu = 'one': not an integer"
    assert main(["bench", "packing", "--seeds", "x"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main(["bench", "packing", "--policy", "best-fit", "--batch", "4"]) == 2
    assert "batch 1" in capsys.readouterr().err
    good = tmp_path / "five.csv"
    good.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,1,100\n")
    assert main(["simulate", "--trace", str(good)]) == 2
    assert "creation_time" in capsys.readouterr().err
    assert main(["bench", "packing", "--trace", str(good)]) == 2
    assert "needs a cluster" in capsys.readouterr().err


WORKER_ERRORS = {  # built when a test runs
    "snapshot": lambda: SnapshotError(["pending[0] (openb-pod-0008).gpu_models: unknown GPU model 'T4'"]),
    "snapshot-2": lambda: SnapshotError(["a: bad", "b: worse"]),
    "unknown-model": lambda: UnknownGpuModel("T4", ["H100-80GB", "A30-24GB"], where="pending[0].gpu_models"),
    "trace": lambda: TraceError("pods.csv", 3, "num_gpu = 'one': not an integer"),
    "trace-no-line": lambda: TraceError("pods.csv", None, "no pods"),
    "trace-column": lambda: TraceError("cluster.yaml", 2, "not valid YAML: x", 5),
}


@pytest.mark.parametrize("name", WORKER_ERRORS)
def test_user_errors_pickle_faithfully(name):
    # they come back from the worker processes of --jobs N pickled
    error = WORKER_ERRORS[name]()
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)


@pytest.mark.parametrize("name", ["snapshot", "unknown-model", "trace"])
def test_a_user_error_in_a_worker_process_is_one_clear_line(name, capsys, tmp_path, monkeypatch):
    error = WORKER_ERRORS[name]()

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(replay_cli, "run_replay", failing)  # the workers are forked: they run it too
    trace = _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\n")
    assert main(["simulate", "--trace", trace, "--policy", "dynpart,nos", "--jobs", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"dynpart: error: {error}"


def test_replay_ignores_the_traces_gpu_models_with_several_processes(capsys, tmp_path):
    trace = _trace(tmp_path, "p1,1000,1024,1,500,T4,LS,Running,0,100,0\np2,1000,1024,1,1000,T4|A10,LS,Running,5,100,5\n")
    assert main(["simulate", "--trace", trace, "--policy", "dynpart,nos", "--jobs", "2", "--json"]) == 0
    (part,) = json.loads(capsys.readouterr().out)["parts"]
    for s in part["policies"]:
        assert s["placed"] == 2 and s["notes"] == {"gpu_spec_not_applied": 2}


def test_a_narrowed_catalog_model_replays_the_static_layouts_it_has(capsys, tmp_path):
    cat = tmp_path / "narrow.yaml"
    cat.write_text(NARROW_H100)
    trace = _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\np2,1000,1024,1,100,,LS,Running,0,100,0\n")
    assert main(["--catalog", str(cat), "simulate", "--trace", trace, "--cluster", "1x2xH100-80GB", "--jobs", "1",
                 "--json"]) == 0
    (part,) = json.loads(capsys.readouterr().out)["parts"]
    assert [c["geometry"] for c in part["static_contenders"]] == ["all-1g.10gb", "all-7g.80gb"]
    assert [s["policy"] for s in part["policies"]] == ["dynpart", "nos", "static"]


@pytest.mark.parametrize("command", [["simulate", "--trace", "TRACE", "--jobs", "1"],
                                     ["bench", "packing", "--seeds", "1", "--jobs", "1"]])
@pytest.mark.parametrize("out", ["file", "/proc/no-such-dir"])
def test_a_bad_out_is_found_before_the_run(command, out, capsys, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("ran before --out was checked")

    monkeypatch.setattr(replay_cli, "_run_jobs", never)
    monkeypatch.setattr(experiment, "run_jobs", never)
    if out == "file":
        out = str(tmp_path / "a-file")
        (tmp_path / "a-file").write_text("")
    trace = _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\n")
    assert main([trace if a == "TRACE" else a for a in command] + ["--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"dynpart: error: --out {out}: ")


def test_results_are_printed_before_files_are_written(capsys, tmp_path, monkeypatch):
    from dynpart.simulations.reporting import report

    def full(path, *args, **kwargs):
        raise SimulationError(f"{path}: cannot write: No space left on device")

    monkeypatch.setattr(report, "write_json", full)
    trace = _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\n")
    assert main(["simulate", "--trace", trace, "--policy", "dynpart", "--jobs", "1", "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    assert "mean s" in captured.out and "No space left on device" in captured.err
    assert main(["bench", "packing", "--seeds", "1", "--jobs", "1", "--out", str(tmp_path / "p")]) == 2
    captured = capsys.readouterr()
    assert "alloc@130%" in captured.out and "No space left on device" in captured.err


def test_pods_that_can_never_be_placed_are_shown(capsys, tmp_path):
    # 8-GPU pods on 4-GPU nodes: no policy places anything, and the table says why
    trace = _trace(tmp_path, "g1,1000,1024,8,1000,,LS,Running,0,100,0\ng2,1000,1024,8,1000,,LS,Running,5,100,5\n")
    assert main(["simulate", "--trace", trace, "--cluster", "2x4xH100-80GB", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert "failed" in header
    assert "failed: 2 GPU pod(s) can never run on this cluster" in out and "8 GPUs" in out
    assert "static layouts: none of the 7 tried placed a GPU pod" in out
    cpu_only = _trace(tmp_path, "c1,1000,1024,0,0,,LS,Running,0,100,0\n", "cpu.csv")
    assert main(["simulate", "--trace", cpu_only, "--jobs", "1"]) == 0
    # it runs (nothing is wrong with such a trace), and the empty table is said to be empty
    assert "note: no GPU pod in the trace (1 CPU-only pod(s)): nothing to compare" in capsys.readouterr().out


def test_mps_mode_is_the_cluster_described(capsys, tmp_path):
    trace = _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\n")
    assert main(["simulate", "--trace", trace, "--mode", "mps", "--policy", "dynpart", "--jobs", "1", "--json"]) == 0
    (part,) = json.loads(capsys.readouterr().out)["parts"]
    assert part["cluster_description"] == "8 nodes, 64 GPUs: 8 x 8 H100-80GB (mps)"
    assert main(["simulate", "--trace", trace, "--mode", "mps", "--policy", "dynpart", "--jobs", "1"]) == 0
    assert "8 x 8 H100-80GB (mps)" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--trace", "TRACE", "--time-limit=-1"], "--time-limit -1.0: must be"),
    (["simulate", "--trace", "TRACE", "--time-limit", "nan"], "--time-limit nan: must be"),
    (["bench", "packing", "--seeds", "1", "--time-limit=-1"], "--time-limit -1.0: must be"),
    (["bench", "packing", "--seeds", "1", "--time-limit", "inf"], "--time-limit inf: must be"),
    (["simulate", "--trace", "TRACE", "--compress", "nan"], "--compress nan: must be"),
    (["simulate", "--trace", "TRACE", "--compress", "inf"], "--compress inf: must be"),
    (["simulate", "--trace", "TRACE", "--mig-delay", "nan"], "--mig-delay nan: must be"),
    (["simulate", "--trace", "TRACE", "--mps-delay=-inf"], "--mps-delay -inf: must be"),
    (["simulate", "--workload", "duration_median_s=inf"], "--workload: duration_median_s:"),
    (["simulate", "--workload", "mix=1g.10gb:1e308,2g.20gb:1e308"], "--workload: mix: weights too large"),
    (["simulate", "--trace", "TRACE", "--cluster", "BADYAML"], "bad.yaml:2:1: not valid YAML: expected the node"),
    (["--catalog", "BADYAML", "simulate", "--trace", "TRACE"], "bad.yaml:2:1: not valid YAML: expected the node"),
    (["explain", "--snapshot", "BADYAML"], "snapshot file BADYAML:2:1: not valid YAML"),
    (["explain", "--snapshot", "BLANK"], "snapshot file BLANK: the file is empty"),
    # (session 24, helper-80's black-box run: each was a traceback or a hang)
    (["simulate", "--trace", "TRACE", "--cluster", "LATIN1"], "LATIN1: not a UTF-8 text file (byte 0"),
    (["simulate", "--workload", "LATIN1"], "--workload LATIN1: not a UTF-8 text file (byte 0"),
    (["explain", "--snapshot", "LATIN1"], "snapshot file LATIN1: not a UTF-8 text file (byte 0"),
    (["--catalog", "LATIN1", "simulate", "--trace", "TRACE"], "catalog file LATIN1: not a UTF-8 text file"),
    (["simulate", "--trace", "TRACE", "--planner-config", "LATIN1"], "config file LATIN1: not a UTF-8 text file"),
    (["simulate", "--trace", "UNCLOSED"], "UNCLOSED:2: a quoted field runs from line 2 to line 3, leaving 1 fields"),
    (["simulate", "--trace", "HUGEFIELD"], "HUGEFIELD:2: not readable as CSV from this line on (field larger"),
    (["simulate", "--trace", "TRACE", "--cluster", "INFCPU"], "nodes[0]: cpu inf: expected cores, at most"),
    (["simulate", "--trace", "TRACE", "--cluster", "100000000x8xH100-80GB"],
     "count 100000000: the cluster would have 100000000 nodes, at most 100000"),
    (["simulate", "--trace", "LATE"], "creation_time = 100000000000000000000: out of range (0..1000000000000)"),
    (["bench", "packing", "--seeds", "42,,43"], "--seeds '42,,43': an empty item in the list"),
    (["bench", "packing", "--seeds", "1", "--policy", "dynpart,dynpart"], "--policy 'dynpart,dynpart': dynpart listed"),
    (["simulate", "--trace", "TRACE", "--policy", "nos,nos"], "--policy 'nos,nos': nos listed twice"),
    (["simulate", "--trace", "TRACE", "--out", ""], "--out '': expected a directory"),
    (["simulate", "--workload", "DUPKEY"], "DUPKEY:2:1: not valid YAML: key 'pods' given twice"),
    (["simulate", "--trace", "TRACE", "--seeds", "0-3"], "--seeds 0-3: goes with the built-in workload (a trace"),
    (["simulate", "--workload", "seed=2,pods=10", "--seeds", "0-3"],
     "--seeds 0-3 and --workload seed=2: give the seeds once"),
    (["simulate", "--seeds", "3-1"], "--seeds '3-1': bad range 3-1"),
    (["simulate", "--workload", "BLANK"], "--workload BLANK: the file is empty"),
    (["simulate", "--workload", "BOOLPODS"], "--workload BOOLPODS: pods: a number, not true/false"),
    (["simulate", "--trace", "TRACE", "--cluster", "1x8xH100-80GB", "--policy", "static", "--static-geometry",
      "1g.10gb:0"], "--static-geometry '1g.10gb:0': 1g.10gb:0 carves nothing"),
    (["simulate", "--policy", "dynpart", "--static-geometry", "all-1g.10gb"],
     "--static-geometry all-1g.10gb: goes with the static policy, which --policy dynpart leaves out"),
    (["simulate", "--trace", "TRACE", "--planner-config", "DUPKEY"], "DUPKEY:2:1: not valid YAML: key 'pods' given"),
    (["simulate", "--trace", "TRACE", "--cluster", "DUPNODE"], "DUPNODE:2:25: not valid YAML: key 'gpus' given twice"),
])
def test_bad_numbers_and_files_are_one_line_errors(argv, message, capsys, tmp_path):
    files = {"TRACE": _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\n"),
             "BADYAML": str(tmp_path / "bad.yaml"), "BLANK": str(tmp_path / "blank.yaml"),
             "LATIN1": str(tmp_path / "latin1.yaml"), "INFCPU": str(tmp_path / "inf.yaml"),
             "DUPKEY": str(tmp_path / "dup.yaml"), "DUPNODE": str(tmp_path / "dupnode.yaml"),
             "BOOLPODS": str(tmp_path / "boolpods.yaml"),
             "LATE": _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,100000000000000000000,"
                                      "100000000000000001000,0\n", "late.csv"),
             "UNCLOSED": _trace(tmp_path, '"p1,1000,1024,1,1000,,LS,Running,0,100,0\np2,1000,1024,1,1000,,LS,Running,0,100,0\n',
                             "quote.csv"),
             "HUGEFIELD": _trace(tmp_path, '"p0,1000,1024,1,1000,,LS,Running,0,100,0\n'
                                + "".join(f"p{i},1000,1024,1,1000,,LS,Running,0,100,0\n" for i in range(1, 4000)),
                                "bigquote.csv")}
    (tmp_path / "bad.yaml").write_text("nodes: [\n")
    (tmp_path / "blank.yaml").write_text("\n  \n")
    (tmp_path / "latin1.yaml").write_bytes(b"\xff\xfenodes: []\n")
    (tmp_path / "dup.yaml").write_text("pods: 5\npods: 6\n")
    (tmp_path / "boolpods.yaml").write_text("pods: true\n")
    (tmp_path / "dupnode.yaml").write_text("nodes:\n  - {count: 1, gpus: 8, gpus: 4, gpu_model: H100-80GB}\n")
    (tmp_path / "inf.yaml").write_text("nodes:\n  - {count: 1, gpu_model: H100-80GB, gpus: 8, cpu: .inf}\n")
    assert main([files.get(a, a) for a in argv] + (["--jobs", "1"] if argv[0] != "explain" else [])) == 2
    err = capsys.readouterr().err.strip()
    for name, path in files.items():
        message = message.replace(name, path)
    assert err.startswith("dynpart: error: ") and message in err and "\n" not in err


def test_a_trace_saved_with_a_bom_reads(capsys, tmp_path):
    trace = tmp_path / "excel.csv"
    trace.write_text(HEADER + "p1,1000,1024,1,1000,,LS,Running,0,100,0\n", encoding="utf-8-sig")
    assert main(["simulate", "--trace", str(trace), "--policy", "dynpart", "--jobs", "1", "--json"]) == 0
    (part,) = json.loads(capsys.readouterr().out)["parts"]
    assert part["policies"][0]["placed"] == 1


def test_simulate_checks_the_planners_workload_setting_before_any_replay(tmp_path, capsys):
    """As `dynpart planner run` does; and a MIG profile no catalog model offers is refused, since a
    simulated node offers only its catalog model's profiles (the share would count nowhere)."""
    from dynpart.cli import main

    f = tmp_path / "planner.yaml"
    f.write_text("workload:\n- {resource: nvidia.com/mig-5g.20gb, weight: 5}\n")
    assert main(["simulate", "--planner-config", str(f), "--mode", "mig"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: setting workload[0].resource = 'nvidia.com/mig-5g.20gb': MIG profile '5g.20gb' is offered by no" in err
    f.write_text("workload:\n- {resource: nvidia.com/foo}\n")
    assert main(["simulate", "--planner-config", str(f), "--mode", "mig"]) == 2
    assert f"{f}: setting workload: workload[0].resource: resource 'nvidia.com/foo' is not" in capsys.readouterr().err
    # a profile of another model than the replayed one (A100-40GB's 1g.5gb on the built-in H100s)
    f.write_text("workload:\n- {resource: nvidia.com/mig-1g.10gb}\n- {resource: nvidia.com/mig-1g.5gb}\n")
    assert main(["simulate", "--planner-config", str(f), "--mode", "mig"]) == 2
    assert ("workload[1].resource = 'nvidia.com/mig-1g.5gb': MIG profile '1g.5gb' is not offered by the replayed "
            "MIG GPUs (H100-80GB)") in capsys.readouterr().err


def test_a_reader_that_goes_away_loses_none_of_the_files(tmp_path, monkeypatch):
    """`dynpart bench packing --out d | head`: the table's reader goes away; the files are written
    all the same, and the command ends with 141 (a shell tool killed by SIGPIPE)."""
    import os

    from dynpart.cli import main

    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", buffering=1) as stdout:
        monkeypatch.setattr("sys.stdout", stdout)
        assert main(["bench", "packing", "--policy", "best-fit", "--seeds", "1", "--jobs", "1",
                     "--out", str(tmp_path / "out")]) == 141
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["allocation.png", "steps.csv", "summary.json"]


def test_files_of_a_run_that_cannot_write_them_all_leave_the_folder_as_it_was(capsys, tmp_path, monkeypatch):
    """A full disk half-way through a run's files: the folder keeps the earlier run's files, whole,
    and gets none of this run's (they are moved in only once all are written)."""
    from dynpart.simulations.reporting import plots

    trace = _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\n")
    out = tmp_path / "o"
    argv = ["simulate", "--trace", trace, "--policy", "dynpart", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert {"summary.json", "pods.csv", "timeline.png"} <= set(before)

    def full(*args, **kwargs):
        raise SimulationError(f"{args[1]}: cannot write: No space left on device")
    monkeypatch.setattr(plots, "pending_cdf", full)
    assert main([*argv, "--compress", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{out}/pending_cdf.png: cannot write" in err and ".dynpart-writing" not in err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


def test_results_of_another_run_in_out_are_said_and_left(capsys, tmp_path):
    """A packing benchmark written where a replay wrote: its summary.json and steps.csv replace
    the replay's, and the replay's other files, which would read as this run's, are named."""
    trace = _trace(tmp_path, "p1,1000,1024,1,500,,LS,Running,0,100,0\np2,1000,1024,1,500,,LS,Running,5,100,5\n")
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,8000,65536,2,T4\n")
    out = tmp_path / "o"
    assert main(["simulate", "--trace", trace, "--policy", "dynpart", "--jobs", "1", "--out", str(out)]) == 0
    assert "also holds" not in capsys.readouterr().err
    (out / "mine.md").write_text("notes")  # not a result file: not named
    assert main(["bench", "packing", "--trace", trace, "--nodes", str(nodes), "--seeds", "1", "--jobs", "1",
                 "--policy", "best-fit", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert (f"note: --out {out} also holds pending_bars.png, pending_cdf.png, pods.csv, timeline.png, not written "
            "by this run (left as they were)") in err
    assert (out / "pods.csv").exists() and json.loads((out / "summary.json").read_text()).get("parts") is None


@pytest.mark.parametrize(("argv", "message"), [
    # (helper h1's black-box run: each was a traceback, or nonsense accepted without a word)
    (["bench", "packing", "--seeds", "1", "--policy", ""], "--policy '': expected one of dynpart"),
    (["bench", "packing", "--seeds", "1", "--policy", "best-fit", "--trace", "OPENQUOTE", "--cluster", "1x8xT4"],
     "OPENQUOTE:2: a quoted field runs from line 2 to the end of the file: an unclosed quote?"),
    (["bench", "packing", "--seeds", "1", "--policy", "best-fit", "--trace", "TRACE", "--nodes", "NODEQUOTE"],
     "NODEQUOTE:2: a quoted field runs from line 2 to the end of the file: an unclosed quote?"),
    (["bench", "packing", "--seeds", "1", "--policy", "dynpart", "--trace", "HUGECPU", "--cluster", "1x8xT4"],
     "HUGECPU:2: cpu_milli = 99999999999999999999999: out of range (0..100000000)"),
    (["bench", "packing", "--seeds", "1", "--policy", "best-fit", "--trace", "TRACE", "--nodes", "HUGENODE"],
     "HUGENODE:2: cpu_milli = 99999999999999999999999: out of range (1..100000000)"),
    (["simulate", "--workload", "pods=5,mps_pods=0,mix=1g.10gb:1,1g.10gb:2"], "--workload: mix: '1g.10gb' given twice"),
    (["simulate", "--workload", ""], "--workload '': empty (give key=value,... or a YAML file"),
    (["simulate", "--trace", "TRACE", "--cluster", "1x8xH100-80GB", "--mode", "mps", "--policy", "static",
      "--static-geometry", "mps-1000"], "--static-geometry 'mps-1000': in mps mode use all-balanced, mps-N (N equal "
                                       "slices, N in 1..48)"),
    # (review 172: the MPS layout on a MIG cluster was "expected all-balanced, all-<profile> or ...")
    (["simulate", "--trace", "TRACE", "--cluster", "1x8xH100-80GB", "--policy", "static", "--static-geometry", "mps-4"],
     "--static-geometry 'mps-4': an MPS layout, and the cluster replayed is in mig mode (--mode mps replays it"),
    # (review 172: flags that changed nothing were taken without a word)
    (["simulate", "--workload", "pods=5,mps_pods=0", "--mapping", "memory"], "--mapping memory: goes with --trace"),
    (["simulate", "--trace", "TRACE", "--cluster", "1x8xH100-80GB:mps", "--mapping", "memory"],
     "--mapping memory: maps gpu_milli to MIG profiles, and the cluster is replayed in mps mode"),
    (["bench", "packing", "--seeds", "1", "--policy", "best-fit", "--trace", "TRACE", "--cluster", "1x8xT4",
      "--time-limit", "3"], "--time-limit 3: the planner's budget, used by the dynpart and fgd policies, which --policy "
                            "best-fit leaves out"),
    (["simulate", "--trace", "LONG", "--compress", "1e-6"], "--compress 1e-06: the last pod would arrive at 1e+13 s"),
    (["simulate", "--trace", "TRACE", "--cluster", "1x8xH100-80GB:"], "nodes[0]: mode '': expected mig or mps"),
    (["explain", "--snapshot", "HUGESNAP"], "pending[0].cpu_milli = 99999999999999999999: Input should be less than"),
    (["simulate", "--trace", "TRACE", "--planner-config", "HUGESHARE"],
     "setting workload.0.cpu_milli = 99999999999999999999: Input should be less than"),
])
def test_more_bad_inputs_are_one_line_errors(argv, message, capsys, tmp_path):
    nodes = "sn,cpu_milli,memory_mib,gpu,model\n"
    files = {"TRACE": _trace(tmp_path, "p1,1000,1024,1,1000,,LS,Running,0,100,0\n"),
             # a quote opened in the last column and never closed took every later row into it
             "OPENQUOTE": _trace(tmp_path, 'p1,1000,1024,1,500,,LS,Running,0,100,"0\np2,1000,1024,1,500,,LS,Running,0,'
                                           '100,0\n', "open.csv"),
             "NODEQUOTE": str(tmp_path / "nodes.csv"),
             "HUGECPU": _trace(tmp_path, "p1,99999999999999999999999,1024,1,500,,LS,Running,0,100,0\n", "huge.csv"),
             "HUGENODE": str(tmp_path / "hugenodes.csv"),
             "LONG": _trace(tmp_path, "p1,1000,1024,1,500,,LS,Running,0,100,0\np2,1000,1024,1,500,,LS,Running,"
                                      "10000000,10000100,0\n", "long.csv"),
             "HUGESNAP": str(tmp_path / "snap.yaml"), "HUGESHARE": str(tmp_path / "planner.yaml")}
    (tmp_path / "nodes.csv").write_text(nodes + 'n1,32000,65536,8,"G2\nn2,32000,65536,8,G2\nn3,32000,65536,8,G2\n')
    (tmp_path / "hugenodes.csv").write_text(nodes + "n1,99999999999999999999999,65536,8,G2\nn2,32000,65536,8,G2\n")
    (tmp_path / "snap.yaml").write_text("nodes: [{name: n1, mode: mps, gpu_model: H100-80GB, gpus: [{index: 0}]}]\n"
                                        "pending: [{name: ns/a, resource: nvidia.com/gpu-10gb, "
                                        "cpu_milli: 99999999999999999999}]\n")
    (tmp_path / "planner.yaml").write_text("workload: [{resource: nvidia.com/mig-1g.10gb, "
                                           "cpu_milli: 99999999999999999999}]\n")
    assert main([files.get(a, a) for a in argv] + (["--jobs", "1"] if argv[0] != "explain" else [])) == 2
    err = capsys.readouterr().err.strip()
    for name, path in files.items():
        message = message.replace(name, path)
    assert err.startswith("dynpart: error: ") and message in err and "\n" not in err
