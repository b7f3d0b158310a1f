import pytest

from dynpart.catalog import Catalog, GpuModel, default_catalog, load_catalog
from dynpart.errors import CatalogError, UnknownGpuModel

EXPECTED_MODELS = ["A30-24GB", "A100-40GB", "A100-80GB", "H100-80GB", "H100-94GB", "H200-141GB",
                   "GH200-96GB", "GH200-144GB", "B200-180GB", "GB200-186GB"]


def test_catalog_has_every_model_of_the_issue():
    assert set(EXPECTED_MODELS) <= set(default_catalog().names)


@pytest.mark.parametrize("label,model", [
    ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA-A100-80GB-PCIe", "A100-80GB"),
    ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
    ("NVIDIA-H100-PCIe", "H100-80GB"),
    ("NVIDIA-H100-NVL", "H100-94GB"),
    ("A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA-A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA-A100-SXM4-40GB-SHARED", "A100-40GB"),
    ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-40GB"),
    ("NVIDIA-A30", "A30-24GB"),
    ("NVIDIA-H200", "H200-141GB"),
    ("NVIDIA-H200-NVL", "H200-141GB"),
    ("NVIDIA-GH200-480GB", "GH200-96GB"),
    ("NVIDIA-GH200-144G-HBM3e", "GH200-144GB"),
    ("NVIDIA-B200", "B200-180GB"),
    ("H100-80GB", "H100-80GB"),
])
def test_product_labels_resolve(label, model):
    assert default_catalog().resolve(label).name == model


# issue 10: product labels users run that resolved to no model, with the model whose profile set
# the facts file gives them (section 1, "Other GPUs users run")
ISSUE_10_LABELS = [
    ("NVIDIA-H20", "GH200-96GB"),
    ("NVIDIA-H20-MIG-1g.12gb", "GH200-96GB"),
    ("NVIDIA-H20-3e", "H200-141GB"),  # undocumented: mapped by its 141 GB (catalog comment)
    ("NVIDIA-H800", "H100-80GB"),
    ("NVIDIA-H800-PCIe", "H100-80GB"),
    ("NVIDIA-H800-80GB-HBM3", "H100-80GB"),
    ("NVIDIA-H800-SHARED", "H100-80GB"),
    ("NVIDIA-A800-SXM4-80GB", "A100-80GB"),
    ("NVIDIA-A800-80GB-PCIe", "A100-80GB"),
    ("NVIDIA-A800-PCIe-80GB", "A100-80GB"),
    ("NVIDIA-A800-SXM4-40GB", "A100-40GB"),
    ("NVIDIA-A800-PCIe-40GB", "A100-40GB"),
    ("NVIDIA-A800-40GB-Active", "A100-40GB"),
    ("NVIDIA-GB200", "GB200-186GB"),
    ("NVIDIA-GB200-MIG-7g.186gb", "GB200-186GB"),
    ("NVIDIA-H100", "H100-80GB"),
    ("NVIDIA-GH200-120GB", "GH200-96GB"),
    ("NVIDIA H20", "GH200-96GB"),  # NVML's name, as `dynpart agent probe` resolves it
    ("NVIDIA GB200", "GB200-186GB"),
]


@pytest.mark.parametrize("label,model", ISSUE_10_LABELS)
def test_issue_10_product_labels_resolve(label, model):
    assert default_catalog().resolve(label).name == model


@pytest.mark.parametrize("label,model", [
    ("NVIDIA-H200", "H200-141GB"), ("NVIDIA-H20-3", None), ("NVIDIA-H2000", None), ("NVIDIA-H100-SXM5-94GB", None),
    ("NVIDIA-A800", None),  # no memory size in the label: A100-40GB or A100-80GB cannot be told
    ("NVIDIA-A8000", None), ("NVIDIA-GB2000", None), ("NVIDIA-GH200-120GB-x", None), ("NVIDIA-H800x", None),
])
def test_new_patterns_match_whole_labels_only(label, model):
    """Near names resolve to their own model or to none (a clear error)."""
    if model is None:
        with pytest.raises(UnknownGpuModel):
            default_catalog().resolve(label)
    else:
        assert default_catalog().resolve(label).name == model


def _names(model: str) -> list[str]:
    return [p.name for p in default_catalog().models[model].mig_profiles]


def test_issue_10_profile_sets():
    cat = default_catalog()
    # same sets as the facts file's rows for these models
    assert _names("GH200-96GB") == ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"]
    assert cat.resolve("NVIDIA-H800").mig_profiles == cat.models["H100-80GB"].mig_profiles
    # GB200: names, GI ids and max counts as the facts file lists them (mig-parted #227/#228)
    gb200 = cat.models["GB200-186GB"]
    assert (gb200.memory_gb, gb200.memory_slices, gb200.compute_slices) == (186, 8, 7)
    assert [(p.name, p.gi_profile_id, p.max) for p in gb200.mig_profiles] == [
        ("1g.23gb", 19, 7), ("1g.23gb+me", 20, 1), ("1g.47gb", 15, 4), ("2g.47gb", 14, 3),
        ("3g.93gb", 9, 2), ("4g.93gb", 5, 1), ("7g.186gb", 0, 1)]
    # starts inferred like B200's (same memory fractions)
    b200 = cat.models["B200-180GB"]
    assert [(p.compute, p.memory, p.starts, p.nvml) for p in gb200.mig_profiles] == [
        (p.compute, p.memory, p.starts, p.nvml) for p in b200.mig_profiles]


def test_unknown_model_is_a_clear_error():
    with pytest.raises(UnknownGpuModel, match="unknown GPU model 'NVIDIA-Tesla-T4'.*--catalog"):
        default_catalog().resolve("NVIDIA-Tesla-T4")


def test_kubernetes_names_of_profiles():
    h100 = default_catalog().models["H100-80GB"]
    assert [p.resource_name for p in h100.mig_profiles] == [
        "nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb.me", "nvidia.com/mig-1g.20gb",
        "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb", "nvidia.com/mig-4g.40gb", "nvidia.com/mig-7g.80gb"]
    a100 = default_catalog().models["A100-40GB"]
    assert {p.name: p.gi_profile_id for p in a100.mig_profiles} == {
        "1g.5gb": 19, "1g.5gb+me": 20, "1g.10gb": 15, "2g.10gb": 14, "3g.20gb": 9, "4g.20gb": 5, "7g.40gb": 0}


RTX_LIKE = """
models:
  - name: RTX-LIKE-96GB   # schema test only: ids from the facts file, counts and starts made up
    memory_gb: 96
    products: ['RTX-LIKE']
    memory_slices: 4
    compute_slices: 4
    mig_profiles:
      - {name: 1g.24gb,        id: 14, nvml: NVML_GPU_INSTANCE_PROFILE_1_SLICE,        compute: 1, memory: 1, max: 4, starts: [0, 1, 2, 3]}
      - {name: 1g.24gb+me,     id: 21, nvml: NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,   compute: 1, memory: 1, max: 1, starts: [0, 1, 2, 3]}
      - {name: 1g.24gb+gfx,    id: 47, nvml: NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX,    compute: 1, memory: 1, max: 4, starts: [0, 1, 2, 3]}
      - {name: 1g.24gb+me.all, id: 65, nvml: NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, compute: 1, memory: 1, max: 1, starts: [0, 1, 2, 3]}
      - {name: 1g.24gb-me,     id: 67, nvml: NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME,  compute: 1, memory: 1, max: 4, starts: [0, 1, 2, 3]}
"""


def test_schema_takes_rtx_pro_variants(tmp_path):
    f = tmp_path / "rtx.yaml"
    f.write_text(RTX_LIKE)
    model = load_catalog([f]).resolve("NVIDIA-RTX-LIKE")
    rows = [(p.name, p.variant, p.media_extensions, p.resource_name) for p in model.mig_profiles]
    assert rows == [
        ("1g.24gb", "", False, "nvidia.com/mig-1g.24gb"),
        ("1g.24gb+me", "+me", True, "nvidia.com/mig-1g.24gb.me"),
        ("1g.24gb+gfx", "+gfx", False, "nvidia.com/mig-1g.24gb.gfx"),
        ("1g.24gb+me.all", "+me.all", True, "nvidia.com/mig-1g.24gb.me.all"),
        ("1g.24gb-me", "-me", False, "nvidia.com/mig-1g.24gb-me"),
    ]


@pytest.mark.parametrize("name", ["1g.24gb+gfx+me", "1g.24gb.me", "1g.24gb-gfx", "1g.24gb+me.al", "1g.24gb+ME",
                                  "1g.24gb-me.all", "1g.24gb+all", "1g.24gb "])
def test_schema_refuses_other_suffixes(tmp_path, name):
    f = tmp_path / "bad.yaml"
    f.write_text(RTX_LIKE.replace("1g.24gb-me,", f"'{name}',"))
    with pytest.raises(CatalogError, match=r"mig_profiles\.4\.name"):
        load_catalog([f])


def test_no_shipped_model_has_rtx_pro_variants():
    """The facts file gives no full RTX PRO profile set: only the schema supports the variants."""
    assert {p.variant for m in default_catalog().models.values() for p in m.mig_profiles} == {"", "+me"}


def test_user_catalog_file_adds_and_overrides(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text("""
models:
  - name: T4-16GB
    memory_gb: 16
    products: ['Tesla-T4']
  - name: A30-24GB
    memory_gb: 24
    products: ['A30']
    memory_slices: 4
    compute_slices: 4
    mig_profiles:
      - {name: 4g.24gb, id: 0, nvml: NVML_GPU_INSTANCE_PROFILE_4_SLICE, compute: 4, memory: 4, max: 1, starts: [0]}
""")
    cat = load_catalog([f])
    assert cat.resolve("NVIDIA-Tesla-T4").name == "T4-16GB"
    assert not cat.models["T4-16GB"].supports_mig
    assert [p.name for p in cat.models["A30-24GB"].mig_profiles] == ["4g.24gb"]
    assert "H100-80GB" in cat.names


@pytest.mark.parametrize("body,message", [
    ("models: 3", "must be a mapping with a 'models' list"),
    ("models:\n  - {name: X, memory_gb: -1}", r"models\[0\] \(X\)\.memory_gb"),
    ("models:\n  - {name: X, memory_gb: 8, memory_slices: 2, compute_slices: 2, mig_profiles: "
     "[{name: 1g.4gb, id: 1, nvml: NVML_GPU_INSTANCE_PROFILE_1_SLICE, compute: 1, memory: 1, max: 2, starts: [0, 2]}]}",
     "start 2 does not fit"),
    ("models: [", r"bad.yaml:1:\d+: not valid YAML: [^\n]*$"),
    ("models:\n  - {name: X, memory_gb: 8, memory_mib: 0}", r"models\[0\] \(X\)\.memory_mib"),
    # (review 172) one file naming a model twice: the second silently won
    ("models:\n  - {name: X, memory_gb: 24}\n  - {name: X, memory_gb: 48}",
     r"bad.yaml: models\[1\] \(X\): the name of models\[0\] too \(a file names each model once"),
    # a missing field: named, without the entry around it shown as its value
    ("models:\n  - {memory_gb: 24}", r"models\[0\] \(\?\)\.name: Field required$"),
])
def test_malformed_catalog_names_the_problem(tmp_path, body, message):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(CatalogError, match=message):
        load_catalog([f])


def test_missing_catalog_file():
    with pytest.raises(CatalogError, match="catalog file /nonexistent.yaml"):
        load_catalog(["/nonexistent.yaml"])


def test_catalog_is_an_ordered_mapping_later_wins():
    base = default_catalog()
    again = Catalog([*base.models.values()])
    assert again.names == base.names


def test_mps_capacity_follows_the_memory_nvml_reports_where_measured():
    cat = default_catalog()
    # measured on real GPUs (tests/fixtures/nvml): 81,559 and 143,771 MiB, of which the driver
    # reserves 480 and 616 MiB, free even on an idle GPU: 81,079 and 143,155 MiB
    h100, h200 = cat.models["H100-80GB"], cat.models["H200-141GB"]
    assert (h100.memory_mib, h100.reserved_mib, h100.mps_capacity_gb) == (81559, 480, 79)
    assert (h200.memory_mib, h200.reserved_mib, h200.mps_capacity_gb) == (143771, 616, 139)
    assert 140 * 1024 > 143771 - 616  # what the total alone gave: 204 MiB more than an idle H200 has free
    # not measured: the nominal size
    assert (cat.models["A100-80GB"].memory_mib, cat.models["A100-80GB"].mps_capacity_gb) == (None, 80)


def test_dynpart_catalog_shows_the_mps_bounds(capsys):
    import json

    from dynpart.cli import main

    assert main(["catalog", "H100-80GB"]) == 0
    assert "MPS capacity 79 GB (at most 48 slices a GPU)" in capsys.readouterr().out.splitlines()[0]
    assert main(["catalog", "H100-80GB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["mps_capacity_gb"], doc["mps_max_clients"]) == (79, 48)


@pytest.mark.parametrize("fields, problem", [
    ({"reserved_mib": 100}, "reserved_mib 100 needs a memory_mib above it"),
    ({"memory_mib": 1000, "reserved_mib": 1000}, "reserved_mib 1000 needs a memory_mib above it"),
    ({"memory_mib": 1000, "reserved_mib": -1}, "reserved_mib"),
])
def test_a_reserved_memory_beyond_the_total_is_refused(fields, problem):
    with pytest.raises(ValueError, match=problem):
        GpuModel(name="X-1GB", memory_gb=1, **fields)
