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
