import pytest

from dynpart.catalog import Catalog, default_catalog, load_catalog
from dynpart.errors import CatalogError, UnknownGpuModel

EXPECTED_MODELS = ["A30-24GB", "A100-40GB", "A100-80GB", "H100-80GB", "H100-94GB", "H200-141GB",
                   "GH200-96GB", "GH200-144GB", "B200-180GB"]


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
    ("models: [", "not valid YAML"),
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
