"""Trace and cluster inputs: the openb CSV formats, the cluster YAML, and errors that name the
file and the line."""

from __future__ import annotations

import re

import pytest

from dynpart.simulations.errors import SimulationError, TraceError
from dynpart.simulations.inputs.cluster_spec import parse_cluster, parse_cpu_milli, parse_memory_mib, read_cluster
from dynpart.simulations.inputs.command_line import parse_seeds
from dynpart.simulations.inputs.traces import parse_nodes, parse_pods, read_nodes, read_pods

HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def test_full_pod_list_is_parsed():
    trace = parse_pods(HEADER
                       + "p0,12000,16384,1,1000,,LS,Running,0,100,0\n"
                       + "p1,6000,12288,1,460,T4|G2,LS,Running,5,50,5\n"
                       + "p2,88000,327680,8,1000,,BE,Failed,7,9,\n"
                       + "p3,8000,30517,0,0,,BE,Running,1,2,1\n", "pods.csv")
    assert trace.has_times and trace.rows == 4 and len(trace.pods) == 4
    p0, p1, p2, p3 = trace.pods
    assert (p0.gpu_demand, p0.is_share) == (1000, False)
    assert (p1.gpu_demand, p1.is_share, p1.gpu_spec) == (460, True, ("T4", "G2"))
    assert p2.gpu_demand == 8000 and p2.duration == 2
    assert p3.num_gpu == 0 and p3.gpu_demand == 0 and p3.line == 5


def test_five_column_multigpu_format_has_no_times():
    trace = parse_pods("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,10,2,1000\nb,1000,10,1,300\n")
    assert not trace.has_times
    assert [p.gpu_demand for p in trace.pods] == [2000, 300]
    assert trace.pods[0].creation_time is None


def test_an_integer_past_pythons_digit_limit_is_not_an_integer():
    """int() refuses more than 4,300 digits with a ValueError of its own: a traceback (review 173)."""
    with pytest.raises(TraceError, match=r"pods.csv:3: cpu_milli = '9{40}'\.\.\.: not an integer$"):
        parse_pods(HEADER + "ok,1,1,1,100,,LS,R,0,1,0\n" + f"x,{'9' * 5000},1,1,100,,LS,R,0,1,0\n", "pods.csv")


@pytest.mark.parametrize("row, message", [
    ("x,abc,1,1,1000,,LS,R,0,1,0", "cpu_milli = 'abc': not an integer"),
    # Python's int() reads these; a trace writer never meant them (review 172)
    ("x,6_000,1,1,1000,,LS,R,0,1,0", "cpu_milli = '6_000': not an integer"),
    ("x,+6000,1,1,1000,,LS,R,0,1,0", "cpu_milli = '+6000': not an integer"),
    ("x,\u0666\u0660\u0660\u0660,1,1,1000,,LS,R,0,1,0", "cpu_milli = '\u0666\u0660\u0660\u0660': not an integer"),
    ("x,1,1,1,1000,,LS,R,0,1", "10 fields, the header has 11"),
    ("x,1,1,2,500,,LS,R,0,1,0", "only single-GPU pods may share"),
    ("x,1,1,0,300,,LS,R,0,1,0", "gpu_milli = 300 but num_gpu = 0"),
    ("x,1,1,1,0,,LS,R,0,1,0", "num_gpu = 1 but gpu_milli = 0"),
    ("x,1,1,1,1001,,LS,R,0,1,0", "gpu_milli = 1001: out of range"),
    ("x,-5,1,1,100,,LS,R,0,1,0", "cpu_milli = -5: out of range"),
    ("x,1,1,1,100,,LS,R,9,3,0", "deletion_time 3 is before creation_time 9"),
    ("x,1,1,0,0,T4,LS,R,0,1,0", "on a CPU-only pod"),
    ("x,1,1,1,100,T4||G2,LS,R,0,1,0", "empty model name"),
    (",1,1,1,100,,LS,R,0,1,0", "name is empty"),
])
def test_bad_pod_rows_name_file_and_line(row, message):
    with pytest.raises(TraceError) as e:
        parse_pods(HEADER + "ok,1,1,1,100,,LS,R,0,1,0\n" + row + "\n", "pods.csv")
    assert str(e.value).startswith("pods.csv:3: ")
    assert message in str(e.value)


def test_duplicate_pod_and_missing_columns_and_empty_files():
    with pytest.raises(TraceError, match=r"pods.csv:3: pod 'a' already listed on line 2"):
        parse_pods(HEADER + "a,1,1,1,100,,LS,R,0,1,0\na,1,1,1,100,,LS,R,0,1,0\n", "pods.csv")
    with pytest.raises(TraceError, match=r"p.csv:1: header lacks column\(s\) gpu_milli"):
        parse_pods("name,cpu_milli,memory_mib,num_gpu\na,1,1,1\n", "p.csv")
    # a column given twice: which copy a row's value comes from would be a guess (helper-148)
    with pytest.raises(TraceError, match=r"p.csv:1: column\(s\) gpu_milli appear more than once in the header"):
        parse_pods(HEADER.rstrip("\n") + ",gpu_milli\na,1,1,1,100,,LS,R,0,1,0,900\n", "p.csv")
    with pytest.raises(TraceError, match="empty file"):
        parse_pods("", "p.csv")
    with pytest.raises(TraceError, match="no pods"):
        parse_pods(HEADER, "p.csv")
    with pytest.raises(TraceError, match=r"p.csv:3: empty row"):
        parse_pods(HEADER + "a,1,1,1,100,,LS,R,0,1,0\n\nb,1,1,1,100,,LS,R,0,1,0\n", "p.csv")
    # empty lines at the end are no row (an editor's or a script's last newline; nothing follows)
    assert [p.name for p in parse_pods(HEADER + "a,1,1,1,100,,LS,R,0,1,0\n\n \n", "p.csv").pods] == ["a"]
    with pytest.raises(TraceError, match="no pods"):
        parse_pods(HEADER + "\n\n", "p.csv")


def test_a_file_separated_otherwise_than_by_commas_is_named_so():
    """A spreadsheet's ';' or tab export has every column, in one field: 'header lacks column(s)
    name, cpu_milli, ...' alone read as if they were missing."""
    for sep in (";", "\t"):
        with pytest.raises(TraceError, match=rf"p.csv:1: header lacks .* \(the line is separated by {re.escape(repr(sep))}, not commas"):
            parse_pods(sep.join(("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")) + "\na;1;1;1;100\n", "p.csv")
    with pytest.raises(TraceError, match=r"nodes.csv:1: header lacks .*separated by ';'"):
        parse_nodes("sn;cpu_milli;memory_mib;gpu;model\nn;1;1;0;\n", "nodes.csv")
    with pytest.raises(TraceError) as e:  # a comma-separated header without the columns: no such hint
        parse_pods("pod,cpu,mem\na,1,1\n", "p.csv")
    assert "separated" not in str(e.value)


def test_node_list_and_its_errors():
    nodes = parse_nodes("sn,cpu_milli,memory_mib,gpu,model\nn0,32000,262144,0,\nn1,96000,393216,8,G2\n")
    assert nodes.gpu_count == 8 and nodes.nodes[1].model == "G2"
    with pytest.raises(TraceError, match=r"nodes.csv:2: node n0 has 2 GPU\(s\) but no model"):
        parse_nodes("sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,2,\n", "nodes.csv")
    with pytest.raises(TraceError, match=r"nodes.csv:2: node n0 has model 'T4' but 0 GPUs"):
        parse_nodes("sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,0,T4\n", "nodes.csv")


def test_read_errors_name_the_path(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text(HEADER + "a,1,1,1,100,,LS,R,0,1,0\nb,1,x,1,100,,LS,R,0,1,0\n")
    with pytest.raises(TraceError, match=rf"{f}:3: memory_mib = 'x'"):
        read_pods(f)
    with pytest.raises(TraceError, match=r"missing.csv"):
        read_nodes(tmp_path / "missing.csv")


def test_real_openb_files_parse(openb):
    default = read_pods(openb / "openb_pod_list_default.csv")
    assert len(default.pods) == default.rows == 8152 and default.has_times
    multi = read_pods(openb / "openb_pod_list_multigpu20.csv")
    assert not multi.has_times and len(multi.pods) == multi.rows
    spec = read_pods(openb / "openb_pod_list_gpuspec20.csv")
    assert any(p.gpu_spec for p in spec.pods)
    nodes = read_nodes(openb / "openb_node_list_all_node.csv")
    assert len(nodes.nodes) == 1523 and nodes.gpu_count == 6212


def test_cluster_yaml_and_inline_spec(catalog, tmp_path):
    spec = parse_cluster({"nodes": [{"count": 16, "gpu_model": "H100-80GB", "gpus": 8, "mode": "mig", "cpu": 112,
                                     "memory": "1TiB"},
                                    {"count": 2, "cpu": "64000m", "memory": 262144, "name": "cpu"}]}, "c.yaml", catalog)
    assert len(spec.nodes) == 18 and spec.gpu_count == 128
    h = spec.nodes[0]
    assert (h.cpu_milli, h.memory_mib, h.mode, h.model) == (112_000, 1 << 20, "mig", "H100-80GB")
    assert spec.nodes[-1].name == "cpu-001" and spec.nodes[-1].cpu_milli == 64_000
    inline = read_cluster("4x8xH100-80GB", catalog)
    assert inline.gpu_count == 32 and inline.nodes[0].mode == "mig"  # MIG-capable model: mig by default
    assert read_cluster("2x2xT4:mps", catalog).nodes[0].mode == "mps"
    f = tmp_path / "c.yaml"
    f.write_text("nodes:\n  - count: 2\n    gpus: 8\n    gpu_model: H100-80GB\n    colour: red\n")
    with pytest.raises(TraceError, match=r"c.yaml: nodes\[0\]: unknown key\(s\) colour"):
        read_cluster(str(f), catalog)
    f.write_text("nodes: [\n")
    with pytest.raises(TraceError, match="not valid YAML"):
        read_cluster(str(f), catalog)
    with pytest.raises(TraceError, match="expected a cluster YAML file or NODESxGPUSxMODEL"):
        read_cluster(str(tmp_path / "nope.yaml"), catalog)
    with pytest.raises(ValueError, match="expected MiB or a quantity"):
        parse_memory_mib("1 lightyear")
    # a fraction of a MiB or of a millicore is a slip (1.5 meant GiB?), refused, not rounded away
    assert parse_memory_mib("1.5GiB") == 1536 and parse_memory_mib(4096) == 4096
    for bad in (1.5, "1.5", "1.5Mi"):
        with pytest.raises(ValueError, match="not a whole number of MiB"):
            parse_memory_mib(bad)
    assert parse_cpu_milli(96.25) == 96_250 and parse_cpu_milli("0.001") == 1
    for bad in ("1.5m", 0.0015, 0.0001):
        with pytest.raises(ValueError, match="not a whole number of millicores"):
            parse_cpu_milli(bad)
    f.write_text("nodes:\n  - count: 2\n    gpus: 8\n    gpu_model: H100-80GB\n    memory: 1.5\n")
    with pytest.raises(TraceError, match=r"c.yaml: nodes\[0\]: memory 1.5: not a whole number of MiB"):
        read_cluster(str(f), catalog)
    # a typo in the inline mode is named, as in a YAML file (not taken for a missing file)
    with pytest.raises(TraceError, match=r"8x8xH100-80GB:mgi: nodes\[0\]: mode 'mgi': expected mig or mps"):
        read_cluster("8x8xH100-80GB:mgi", catalog)


def test_cluster_keys_and_names_that_are_not_strings_are_named(catalog, tmp_path):
    """YAML keys need not be strings (`1: 2`) and a name may be a mapping: both used to end in a
    traceback or in node names such as "{'a': 1}-000" (review 172)."""
    f = tmp_path / "c.yaml"
    for text, error in (("nodes: [{count: 2, gpus: 8, gpu_model: H100-80GB}]\n1: 2\n", r"unknown key\(s\) 1; expected 'nodes'"),
                        ("nodes: [{count: 2, gpus: 8, gpu_model: H100-80GB, 1: 2, x: 3}]\n",
                         r"nodes\[0\]: unknown key\(s\) 1, x; expected count"),
                        ("nodes: [{count: 2, gpus: 8, gpu_model: H100-80GB, name: {a: 1}}]\n",
                         r"nodes\[0\]: name \{'a': 1\}: expected a node name prefix"),
                        ("nodes: [{count: 2, gpus: 8, gpu_model: H100-80GB, name: 'gpu node'}]\n",
                         r"nodes\[0\]: name 'gpu node': expected a node name prefix")):
        f.write_text(text)
        with pytest.raises(TraceError, match=error):
            read_cluster(str(f), catalog)
    f.write_text("nodes: [{count: 2, gpus: 8, gpu_model: H100-80GB, name: a100_pool.1}]\n")
    assert [n.name for n in read_cluster(str(f), catalog).nodes] == ["a100_pool.1-000", "a100_pool.1-001"]
    # a number, as YAML reads `name: 2024`, and an empty name (the default prefix) as before (review 173)
    f.write_text("nodes: [{count: 1, gpus: 8, gpu_model: H100-80GB, name: 2024}, {count: 1, gpus: 1, "
                 "gpu_model: H100-80GB, name: ''}]\n")
    assert [n.name for n in read_cluster(str(f), catalog).nodes] == ["2024-000", "h100-80gb-000"]


def test_a_node_list_given_as_cluster_says_where_it_goes(catalog, tmp_path):
    """An openb node list passed to --cluster parsed as one YAML string: 'a cluster file is a
    mapping with a non-empty nodes list' did not say that the CSV goes to --nodes."""
    f = tmp_path / "nodes.csv"
    f.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,262144,8,V100M16\n")
    with pytest.raises(TraceError, match=r"nodes.csv: an openb node list \(CSV\) is read by `dynpart bench packing "
                                          r"--nodes`; --cluster takes a cluster YAML file or NODESxGPUSxMODEL"):
        read_cluster(str(f), catalog)


def test_a_replay_cluster_of_two_modes_is_refused_unless_a_mode_is_given(catalog):
    from dynpart.simulations.replay.cluster import ReplayCluster

    mixed = parse_cluster({"nodes": [{"count": 1, "gpu_model": "H100-80GB", "gpus": 8, "mode": "mps"},
                                     {"count": 1, "gpu_model": "H100-80GB", "gpus": 8, "mode": "mig"}]}, "c.yaml", catalog)
    with pytest.raises(SimulationError, match="c.yaml: replay needs GPU nodes of one mode; found mig, mps"):
        ReplayCluster(mixed, catalog, None)
    assert ReplayCluster(mixed, catalog, "mig").mode == "mig"


def test_seeds():
    assert parse_seeds("42-51") == list(range(42, 52))
    assert parse_seeds("1,5,7-8") == [1, 5, 7, 8]
    for bad in ("x", "5-3", "1,1", ""):
        with pytest.raises(SimulationError):
            parse_seeds(bad)


def test_models_no_node_has_are_named(catalog, tmp_path):
    """A gpu_spec naming a model the cluster lacks (a typo: P1OO) is said, with the pods that
    accept no model it has: nothing is skipped silently."""
    from dynpart.simulations.inputs.command_line import load

    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
                    "a,1000,1024,1,500,P1OO\nb,1000,1024,1,500,P1OO|T4\nc,1000,1024,1,500,T4\nd,1000,1024,0,0,\n")
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,65536,2,T4\n")
    data = load(str(pods), str(nodes), None, catalog, default_cluster=None)
    assert data.models_nowhere() == (f"trace {pods}: gpu_spec names GPU model(s) P1OO that no node of the cluster "
                                     "has; 1 pod(s) accept no model it has and will fail")
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\na,1000,1024,1,500,T4\n")
    assert load(str(pods), str(nodes), None, catalog, default_cluster=None).models_nowhere() is None


def test_a_quoted_field_may_hold_a_line_break(tmp_path):
    """Valid CSV (RFC 4180): a quoted field over two lines is read, not taken for an unclosed quote
    (review 83); the row is named by the line it starts on."""
    from dynpart.simulations.inputs.traces import read_pods
    f = tmp_path / "t.csv"
    f.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n"
                 'p1,1000,1024,1,500,,"BE\nnote"\np2,1000,1024,1,500,,LS\n')
    pods = read_pods(str(f)).pods
    assert [p.name for p in pods] == ["p1", "p2"]
