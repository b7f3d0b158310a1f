"""The GPU catalog: which GPU models exist, their MIG profiles and how node labels name them.

The data lives in `dynpart/data/gpu-catalog.yaml`; users extend it with files of the same
schema. `Catalog` is immutable and cheap to pass around; `load_catalog` is the only function
here that reads files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dynpart import yaml_text
from dynpart.errors import CatalogError, UnknownGpuModel, read_problem, yaml_problem
from dynpart.kube.conventions import MIG_RESOURCE_PREFIX

# Suffixes a MIG profile name may carry after `<N>g.<M>gb`, as the driver names them: `+me` with
# media extensions, `+me.all` with all media engines, `-me` without media engines, `+gfx` with
# graphics (the last three on RTX PRO 5000/6000 Blackwell; facts file section 1, "Other GPUs
# users run").
MIG_PROFILE_VARIANTS: tuple[str, ...] = ("+me", "+me.all", "-me", "+gfx")
# Profiles that take media engines: at most one of them per GPU (`dynpart.mig.MigRules`). `+me.all`
# takes all of them, so it is counted with `+me` (a conservative reading: never a plan the driver refuses).
MEDIA_VARIANTS: frozenset[str] = frozenset({"+me", "+me.all"})
# Bounded and ASCII as an annotation key carries it (`dynpart.annotations.slice_token`): a profile
# named otherwise could be reported or listed, planned, and then not be written in a spec
MIG_PROFILE_PATTERN = r"[1-9][0-9]?g\.[1-9][0-9]{0,3}gb(?:" + "|".join(re.escape(v) for v in MIG_PROFILE_VARIANTS) + ")?"


def profile_variant(name: str) -> str:
    """The suffix of a MIG profile name after `<N>g.<M>gb` (`""` for a plain profile)."""
    return name[name.index("gb") + 2:] if "gb" in name else ""


class MigProfile(BaseModel):
    """One GPU-instance profile of one GPU model, with its placement rules."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    name: str = Field(pattern=rf"^{MIG_PROFILE_PATTERN}$")
    gi_profile_id: int = Field(alias="id", ge=0)
    nvml: str = Field(pattern=r"^NVML_GPU_INSTANCE_PROFILE_\w+$")
    compute: int = Field(ge=1)
    memory: int = Field(ge=1)
    max: int = Field(ge=1)
    starts: tuple[int, ...] = Field(min_length=1)

    @property
    def variant(self) -> str:
        """`""`, `+me`, `+me.all`, `-me` or `+gfx` (see MIG_PROFILE_VARIANTS)."""
        return profile_variant(self.name)

    @property
    def media_extensions(self) -> bool:
        """Takes media engines (`+me`, `+me.all`): at most one such instance per GPU."""
        return self.variant in MEDIA_VARIANTS

    @property
    def resource_name(self) -> str:
        """Kubernetes extended resource (device plugin, mixed strategy): `+` is written `.`
        (`1g.24gb+me.all` -> `nvidia.com/mig-1g.24gb.me.all`; `-me` stays `-me`)."""
        return MIG_RESOURCE_PREFIX + self.name.replace("+", ".")


class GpuModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    memory_gb: int = Field(gt=0)  # nominal size, the product's name
    # the total NVML reports, where measured (a little less than the nominal size: 81,559 MiB on
    # an H100 80GB HBM3); the MPS capacity follows it
    memory_mib: int | None = Field(default=None, gt=0)
    # what the driver keeps of that total for itself, where measured (NVML's `reserved`, 480 MiB on
    # that H100): not free even on an idle GPU, so not in the MPS capacity; a node's agent reads it
    # from its driver, and uses this figure only where the driver cannot say (no nvmlMemory_v2)
    reserved_mib: int | None = Field(default=None, ge=0)
    products: tuple[str, ...] = ()
    memory_slices: int = Field(default=0, ge=0)
    compute_slices: int = Field(default=0, ge=0)
    mig_profiles: tuple[MigProfile, ...] = ()
    # NVML reports wrong max instance counts for this model (A30: mig-parted hard-codes its
    # profiles for that reason): the catalog's `max` wins over the driver's, and a difference is
    # not a disagreement.
    nvml_counts_unreliable: bool = False
    # MPS: the most client processes an MPS server serves on one GPU (48 from Volta on, 16 before;
    # NVIDIA's MPS guide): more slices than that on a GPU leave the extra pods unable to start
    # CUDA. None: no bound (the packing benchmark's GPUs, shared by milli as in FGD's protocol).
    mps_max_clients: int | None = Field(default=None, ge=1)
    # Set on a model built from a node agent's capability report (`dynpart.capability`) that
    # differs from the catalog: the catalog model (or, for a GPU the catalog lacks, the product)
    # it describes. Pods selecting that model accept it.
    family: str | None = None

    @property
    def mps_capacity_gb(self) -> int:
        """What one GPU holds of MPS slices, in GiB (the unit of an MPS memory limit "<N>G"): the
        memory NVML reports less what the driver reserves, where known, as a node's agent plans
        with, else the nominal size."""
        if not self.memory_mib:
            return self.memory_gb
        return max(1, (self.memory_mib - (self.reserved_mib or 0)) // 1024)

    @model_validator(mode="after")
    def _check_profiles(self) -> GpuModel:
        if self.reserved_mib is not None and (self.memory_mib is None or self.reserved_mib >= self.memory_mib):
            raise ValueError(f"model {self.name}: reserved_mib {self.reserved_mib} needs a memory_mib above it "
                             f"(the total it is part of)")
        seen: set[str] = set()
        for p in self.mig_profiles:
            if p.name in seen:
                raise ValueError(f"model {self.name}: profile {p.name!r} listed twice")
            seen.add(p.name)
            if p.compute > self.compute_slices or p.memory > self.memory_slices:
                raise ValueError(
                    f"model {self.name}: profile {p.name} needs {p.compute} compute / {p.memory} "
                    f"memory slices, the GPU has {self.compute_slices} / {self.memory_slices}"
                )
            for s in p.starts:
                if s < 0 or s + p.memory > self.memory_slices:
                    raise ValueError(
                        f"model {self.name}: profile {p.name} start {s} does not fit in "
                        f"{self.memory_slices} memory slices"
                    )
        for pattern in self.products:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"model {self.name}: products pattern {pattern!r}: {e}") from None
        return self

    @property
    def family_name(self) -> str:
        """The name a pod's GPU-model selector matches: the catalog model this one describes."""
        return self.family or self.name

    @property
    def supports_mig(self) -> bool:
        return bool(self.mig_profiles)

    @property
    def profiles_by_name(self) -> dict[str, MigProfile]:
        # cached beside the fields, checked against the profiles it was built from: model_copy()
        # copies the instance dict, so a cached_property would outlive an update of mig_profiles
        cached = self.__dict__.get("_profiles_by_name")
        if cached is None or cached[0] is not self.mig_profiles:
            cached = (self.mig_profiles, {p.name: p for p in self.mig_profiles})
            self.__dict__["_profiles_by_name"] = cached
        by_name: dict[str, MigProfile] = cached[1]
        return by_name

    def profile(self, name: str) -> MigProfile:
        try:
            return self.profiles_by_name[name]
        except KeyError:
            raise CatalogError(
                f"GPU model {self.name} has no MIG profile {name!r}; "
                f"its profiles: {', '.join(self.profiles_by_name)}"
            ) from None


def _normalise_product(label: str) -> str:
    value = label.strip()
    value = re.sub(r"^NVIDIA[- ]", "", value, flags=re.IGNORECASE)
    value = re.sub(r"-(SHARED|MIG-.*)$", "", value, flags=re.IGNORECASE)
    return value.replace(" ", "-")


class Catalog:
    """An ordered set of GPU models. Later definitions of a name replace earlier ones."""

    def __init__(self, models: Iterable[GpuModel]):
        by_name: dict[str, GpuModel] = {}
        for m in models:
            by_name[m.name] = m
        self.models: dict[str, GpuModel] = by_name
        self._matchers = [
            (m, [re.compile(p, re.IGNORECASE) for p in m.products]) for m in by_name.values()
        ]
        self._cache: dict[str, GpuModel] = {}

    @classmethod
    def from_documents(cls, documents: Iterable[tuple[str, object]]) -> Catalog:
        """Build from parsed YAML documents (any shape: checked here), each given with a name for
        error messages."""
        models: list[GpuModel] = []
        for source, doc in documents:
            if not isinstance(doc, dict) or not isinstance(doc.get("models"), list):
                raise CatalogError(f"{source}: a catalog file must be a mapping with a 'models' list")
            named: dict[str, int] = {}  # name -> its entry in this file
            for i, entry in enumerate(doc["models"]):
                try:
                    model = GpuModel.model_validate(entry)
                except ValidationError as e:
                    first = e.errors()[0]
                    loc = ".".join(str(x) for x in first["loc"])
                    name = entry.get("name", "?") if isinstance(entry, dict) else "?"
                    # (a missing field's "input" is the entry around it: not a value to show)
                    value = "" if first["type"] == "missing" else f" (value {first.get('input')!r})"
                    raise CatalogError(
                        f"{source}: models[{i}] ({name}){'.' + loc if loc else ''}: {first['msg']}{value}"
                    ) from None
                if model.name in named:  # a later file replaces a model; one file naming it twice is a slip
                    raise CatalogError(f"{source}: models[{i}] ({model.name}): the name of models[{named[model.name]}] "
                                       "too (a file names each model once; a later file may replace it)")
                named[model.name] = i
                models.append(model)
        return cls(models)

    def extended(self, other: Catalog) -> Catalog:
        return Catalog([*self.models.values(), *other.models.values()])

    @property
    def names(self) -> list[str]:
        return list(self.models)

    def resolve(self, value: str, where: str = "gpu model") -> GpuModel:
        """Map a catalog name or a `nvidia.com/gpu.product` label value to a model."""
        hit = self._cache.get(value)
        if hit is not None:
            return hit
        model = self.models.get(value)
        if model is None:
            normalised = _normalise_product(value)
            for candidate, patterns in self._matchers:
                if candidate.name.lower() == normalised.lower() or any(
                    p.fullmatch(normalised) for p in patterns
                ):
                    model = candidate
                    break
        if model is None:
            raise UnknownGpuModel(value, self.names, where)
        self._cache[value] = model
        return model

    def mig_profile_names(self) -> set[str]:
        return {p.name for m in self.models.values() for p in m.mig_profiles}


def _read_yaml(path: Path | str, text: str) -> object:
    try:
        return yaml_text.load(text)
    except yaml.YAMLError as e:
        raise CatalogError(yaml_problem(path, e)) from None


_default: Catalog | None = None


def default_catalog() -> Catalog:
    """The catalog shipped with dynpart (cached)."""
    global _default
    if _default is None:
        text = resources.files("dynpart").joinpath("data/gpu-catalog.yaml").read_text()
        _default = Catalog.from_documents([("gpu-catalog.yaml", _read_yaml("gpu-catalog.yaml", text))])
    return _default


def load_catalog(extra_files: Iterable[Path | str] = ()) -> Catalog:
    """The shipped catalog extended with the users' files (later files win)."""
    catalog = default_catalog()
    for f in extra_files:
        path = Path(f)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CatalogError(f"catalog file {path}: {read_problem(e)}") from None
        catalog = catalog.extended(Catalog.from_documents([(str(path), _read_yaml(path, text))]))
    return catalog
