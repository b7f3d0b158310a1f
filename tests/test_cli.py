"""Every command and subcommand of the one `dynpart` entry point has a working --help."""

import argparse

import pytest

from dynpart.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, prefix + (name,))
    return out


COMMANDS = _commands(build_parser())


def test_every_part_is_registered():
    top = {c[0] for c in COMMANDS if c}
    assert {"simulate", "bench", "explain", "planner", "agent", "catalog"} <= top
    assert {("bench", "planner"), ("bench", "packing"), ("planner", "run"), ("agent", "run"), ("agent", "probe")} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "dynpart")
def test_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dynpart") and len(out.splitlines()) > 3


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bench_planner_time_limit_must_be_finite_and_not_negative(value, capsys):
    assert main(["bench", "planner", f"--time-limit={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynpart: error: --time-limit") and "must be" in err and "\n" not in err


def test_bench_planner_reports_wall_and_cpu_time_per_plan(capsys):
    """The wall clock counts other work on a shared machine too; the CPU time is the plan's own:
    both are reported, and a plan's CPU time cannot be far above its wall time (one thread)."""
    import json
    assert main(["bench", "planner", "--nodes", "20", "--pending", "30", "--repeat", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placed"] > 0 and len(out["plan_s_per_seed"]) == 3
    assert 0 < out["plan_cpu_s_median"] <= 1.5 * out["plan_s_median"] + 0.01
    assert main(["bench", "planner", "--nodes", "20", "--pending", "30", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    assert "cpu s" in text and "CPU time median" in text


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch, capsys):
    """`dynpart catalog H100-80GB | head -1`: the pipe closes while the command writes; it ends
    with 141 (as a shell tool killed by SIGPIPE does), no traceback."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone
    with open(write_end, "w", buffering=1) as stdout:  # line-buffered, as on a terminal
        monkeypatch.setattr("sys.stdout", stdout)
        assert main(["catalog", "H100-80GB"]) == 141
    assert "Traceback" not in capsys.readouterr().err


def test_yaml_files_refuse_a_key_given_twice_and_keep_merge_keys():
    """dynpart.yaml_text: a key given twice is an error naming the line; `<<: *anchor` (a merge
    key, which a key of the mapping may override) reads as yaml.safe_load reads it (review 83)."""
    import yaml

    from dynpart import yaml_text
    from dynpart.errors import yaml_problem
    merged = "d: &d {a: 1, b: 2}\nkube: {<<: *d, b: 3}\nboth: {<<: [*d, {c: 4}]}\n"
    assert yaml_text.load(merged) == yaml.safe_load(merged) == {
        "d": {"a": 1, "b": 2}, "kube": {"a": 1, "b": 3}, "both": {"a": 1, "b": 2, "c": 4}}
    with pytest.raises(yaml.YAMLError) as e:
        yaml_text.load("pods: 5\npods: 6\n")
    assert yaml_problem("f.yaml", e.value).startswith("f.yaml:2:1: not valid YAML: key 'pods' given twice")


@pytest.mark.parametrize("argv", [
    ["simulate", "--trace", ""], ["simulate", "--cluster", " "], ["simulate", "--static-geometry", ""],
    ["simulate", "--planner-config", ""], ["simulate", "--seeds", ""],
    ["bench", "packing", "--trace", ""], ["bench", "packing", "--nodes", ""],
    ["explain", "--snapshot", ""], ["explain", "--kubeconfig", ""],
], ids=lambda a: " ".join(a))
def test_an_empty_value_is_refused_not_taken_for_the_default(argv, capsys):
    """`--trace "$TRACE"` with the variable unset replayed the built-in workload, silently
    (helper-148)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {argv[-2]}: expected a value, got an empty one" in capsys.readouterr().err


def test_explain_on_the_live_cluster_names_the_pod_namespace_slash_name(capsys, tmp_path):
    """(A snapshot file may name its pods without a namespace: helper-149.)"""
    assert main(["explain", "--kubeconfig", str(tmp_path / "none"), "train-small"]) == 2
    assert capsys.readouterr().err.strip() == "dynpart: error: pod 'train-small': expected NAMESPACE/NAME"
    snapshot = tmp_path / "s.yaml"
    snapshot.write_text(open("examples/snapshot.yaml").read().replace("ml/train-small", "train-small"))
    assert main(["explain", "--snapshot", str(snapshot), "train-small"]) == 0
    assert capsys.readouterr().out.startswith("train-small: placed on node")


def test_a_stdout_that_cannot_be_written_is_a_one_line_error_and_the_files_are_written(tmp_path):
    """A full disk under stdout: a traceback, and `simulate --out`'s files lost (helper-148)."""
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        with open("/dev/full", "w") as full:
            return subprocess.run([sys.executable, "-m", "dynpart.cli", *args], stdout=full, stderr=subprocess.PIPE,
                                  text=True, timeout=300)

    done = run("catalog")
    assert done.returncode == 2 and done.stderr == "dynpart: error: writing the output: No space left on device\n"
    trace = tmp_path / "t.csv"
    trace.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n"
                     "p1,1000,1024,1,500,0,100\np2,1000,1024,1,250,10,200\n")
    done = run("simulate", "--trace", str(trace), "--cluster", "1x1xH100-80GB", "--policy", "dynpart", "--jobs", "1",
               "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == ("dynpart: error: stdout: cannot write the results (No space left on "
                                            "device); the files of --out, if given, are written")
    assert (tmp_path / "out" / "pods.csv").is_file() and (tmp_path / "out" / "summary.json").is_file()
