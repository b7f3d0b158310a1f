"""`dynpart simulate` and `dynpart bench packing` end to end, on the built-in synthetic data."""

from __future__ import annotations

import json

from dynpart.cli import main


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
    assert {p.name for p in out.iterdir()} == {"summary.json", "steps.csv", "allocation.png"}
    assert (out / "steps.csv").read_text().startswith("policy,batch,seed,arrived_pct,allocation_pct")


def test_bench_packing_single_policy_table(capsys):
    assert main(["bench", "packing", "--seeds", "1", "--policy", "random", "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    assert "alloc@130%" in captured.out and "random" in captured.out
    assert "synthetic trace" in captured.err


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
