"""What a node's GPUs can do, as the driver says: the capability report a node agent writes in
`dynpart.io/status-capability`, its codec, and the GPU model that both the planner and the agent
plan that node with (`node_model`). Pure code, no I/O.

Wire format (docs/protocol.md), compact JSON, GPUs of one kind described once:

    {"v": 1,
     "kinds": [{"product": "NVIDIA H100 80GB HBM3", "memory_mib": 81079, "slices": [8, 7],
                "profiles": [["1g.10gb", 19, "1_SLICE", 1, 1, 7, [0, 1, 2, 3, 4, 5, 6]], ...]}],
     "gpus": [[0, "on"], [0, "on"], ...]}

A profile row is [name, GI profile id, NVML_GPU_INSTANCE_PROFILE_ suffix, compute slices,
memory slices, max count, legal starts]; `slices` is [memory slices, compute slices] of the GPU;
a GPU is [its kind's index, MIG mode: "on", "off", "on-pending" (on after a reset), "off-pending"
or "unsupported"]. A MIG-capable GPU's profiles are read whatever its MIG mode (a real H200 on
driver 580 lists them with MIG mode off: tests/fixtures/nvml), but a driver may list none while
MIG mode is off, so a kind without profiles on a MIG-capable GPU means "not known yet", not "none".

Decoding is strict: unknown fields, wrong types or values out of range are refused with a
message naming the field, and a report larger than MAX_CAPABILITY_BYTES is not parsed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dynpart.catalog import MIG_PROFILE_PATTERN, Catalog, GpuModel, MigProfile
from dynpart.errors import DynpartError, field_path

CAPABILITY_VERSION = 1
# 8 GPUs of one kind with 20 profiles take about 1.5 KB; a node of 16 GPUs of 4 kinds, 6 KB.
MAX_CAPABILITY_BYTES = 16 * 1024
MAX_GPUS = 64
MAX_PROFILES = 64
MAX_SLICES = 32
# the MPS clients per GPU of a model the catalog lacks: every GPU a current driver runs is Volta
# or later (NVIDIA's MPS guide: 48 client CUDA contexts per device)
MPS_MAX_CLIENTS = 48

MigState = Literal["on", "off", "on-pending", "off-pending", "unsupported"]
_Small = Annotated[int, Field(ge=0, le=MAX_SLICES)]
_Positive = Annotated[int, Field(ge=1, le=MAX_SLICES)]
_ProfileRow = tuple[
    Annotated[str, Field(pattern=rf"^{MIG_PROFILE_PATTERN}$")],
    Annotated[int, Field(ge=0, le=255)],
    Annotated[str, Field(pattern=r"^\w{1,40}$")],
    _Positive, _Positive, _Positive,
    Annotated[tuple[_Small, ...], Field(min_length=1, max_length=MAX_SLICES)],
]


class CapabilityError(DynpartError):
    """A capability report that cannot be read; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ProfileCapability(_Strict):
    """One GPU-instance profile as the driver offers it."""

    name: str
    id: int = Field(ge=0)
    nvml: str  # NVML_GPU_INSTANCE_PROFILE_<nvml>
    # bounded as the catalog's MigProfile is: a profile the driver describes as taking no slice,
    # allowing no instance or no start is not one to plan with (the reader leaves it out)
    compute: int = Field(ge=1, le=MAX_SLICES)
    memory: int = Field(ge=1, le=MAX_SLICES)
    max: int = Field(ge=1, le=MAX_SLICES)
    starts: tuple[int, ...] = Field(min_length=1)

    def row(self) -> tuple[str, int, str, int, int, int, tuple[int, ...]]:
        return (self.name, self.id, self.nvml, self.compute, self.memory, self.max, self.starts)


class GpuKind(_Strict):
    """What the driver says of one kind of GPU of the node."""

    product: str = Field(min_length=1, max_length=96)
    memory_mib: int = Field(ge=1, le=1 << 24)
    memory_slices: int = Field(default=0, ge=0, le=MAX_SLICES)
    compute_slices: int = Field(default=0, ge=0, le=MAX_SLICES)
    profiles: tuple[ProfileCapability, ...] = Field(default=(), max_length=MAX_PROFILES)

    @model_validator(mode="after")
    def _consistent(self) -> GpuKind:
        seen: set[str] = set()
        for p in self.profiles:
            where = f"profile {p.name}"
            if p.name in seen:
                raise ValueError(f"{where} is listed twice")
            seen.add(p.name)
            if p.compute > self.compute_slices or p.memory > self.memory_slices:
                raise ValueError(f"{where} takes {p.compute} compute / {p.memory} memory slices, the GPU has "
                                 f"{self.compute_slices} / {self.memory_slices}")
            bad = [s for s in p.starts if s + p.memory > self.memory_slices]
            if bad:
                raise ValueError(f"{where}: start {bad[0]} does not fit in {self.memory_slices} memory slices")
            if len(set(p.starts)) != len(p.starts):
                raise ValueError(f"{where}: a start is listed twice")
        return self


class GpuReport(_Strict):
    kind: int = Field(ge=0)
    mig: MigState


class NodeCapability(_Strict):
    """The capability report of one node: its GPUs, by index, and their kinds."""

    kinds: tuple[GpuKind, ...] = Field(min_length=1, max_length=MAX_GPUS)
    gpus: tuple[GpuReport, ...] = Field(min_length=1, max_length=MAX_GPUS)

    @model_validator(mode="after")
    def _kinds_used(self) -> NodeCapability:
        for i, g in enumerate(self.gpus):
            if g.kind >= len(self.kinds):
                raise ValueError(f"gpus[{i}] is of kind {g.kind}, but only {len(self.kinds)} kind(s) are listed")
        return self

    def kind_of(self, gpu: int) -> GpuKind:
        return self.kinds[self.gpus[gpu].kind]


# --- the codec ----------------------------------------------------------------------------------


class _WireKind(_Strict):
    product: str
    memory_mib: int
    slices: tuple[_Small, _Small]
    profiles: tuple[_ProfileRow, ...] = Field(default=(), max_length=MAX_PROFILES)


class _Wire(_Strict):
    v: int
    kinds: tuple[_WireKind, ...]
    gpus: tuple[tuple[Annotated[int, Field(ge=0, le=MAX_GPUS)], MigState], ...]


def encode_capability(cap: NodeCapability) -> str:
    wire = {
        "v": CAPABILITY_VERSION,
        "kinds": [{"product": k.product, "memory_mib": k.memory_mib, "slices": [k.memory_slices, k.compute_slices],
                   "profiles": [list(p.row()) for p in k.profiles]} for k in cap.kinds],
        "gpus": [[g.kind, g.mig] for g in cap.gpus],
    }
    return json.dumps(wire, separators=(",", ":"))


@lru_cache(maxsize=1024)  # the planner reads every node's report each round; most never change
def decode_capability(text: str) -> NodeCapability:
    """The report in an annotation value; CapabilityError naming the field when it is not one."""
    if len(text) > MAX_CAPABILITY_BYTES:
        raise CapabilityError(f"capability report of {len(text)} bytes, more than the {MAX_CAPABILITY_BYTES} "
                              "an agent writes; not read")
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise CapabilityError(f"capability report is not JSON ({e})") from None
    except RecursionError:  # nested deeper than json's recursion limit: no report of ours is
        raise CapabilityError("capability report is nested too deeply to be one; not read") from None
    if not isinstance(raw, dict) or raw.get("v") != CAPABILITY_VERSION:
        version = raw.get("v") if isinstance(raw, dict) else None
        raise CapabilityError(f"capability report version {version!r} is not one this dynpart reads "
                              f"(it reads version {CAPABILITY_VERSION})")
    try:
        wire = _Wire.model_validate_json(text)  # strict, JSON arrays as tuples
        return NodeCapability(
            kinds=tuple(GpuKind(product=k.product, memory_mib=k.memory_mib, memory_slices=k.slices[0],
                                compute_slices=k.slices[1],
                                profiles=tuple(ProfileCapability(name=r[0], id=r[1], nvml=r[2], compute=r[3],
                                                                 memory=r[4], max=r[5], starts=tuple(r[6]))
                                               for r in k.profiles))
                        for k in wire.kinds),
            gpus=tuple(GpuReport(kind=g[0], mig=g[1]) for g in wire.gpus),
        )
    except ValidationError as e:
        err = e.errors()[0]
        shown = repr(err.get("input"))
        value = f" = {shown if len(shown) <= 60 else shown[:57] + '...'}" if not isinstance(err.get("input"), dict) else ""
        where = f"{field_path(err['loc'])}{value}: " if err["loc"] else ""
        raise CapabilityError(f"capability report: {where}{err['msg'].removeprefix('Value error, ')}") from None


# --- the model a node is planned with -----------------------------------------------------------


@dataclass(frozen=True)
class NodeModel:
    """The GPU model a node is planned with, and how the driver's report differs from the
    catalog (each difference a sentence; the driver's value is the one used)."""

    model: GpuModel
    disagreements: tuple[str, ...] = ()
    from_report: bool = True


def _normalised_product(product: str) -> str:
    value = re.sub(r"^NVIDIA[- ]", "", product.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", value).strip("-") or "unknown-gpu"


def _profile(p: ProfileCapability, max_count: int | None = None) -> MigProfile:
    return MigProfile(name=p.name, gi_profile_id=p.id, nvml=f"NVML_GPU_INSTANCE_PROFILE_{p.nvml}", compute=p.compute,
                      memory=p.memory, max=max_count if max_count is not None else p.max, starts=p.starts)


def _compare(kind: GpuKind, base: GpuModel) -> tuple[list[MigProfile], list[str]]:
    """The profiles to plan with (the driver's, where the catalog allows them) and the differences."""
    notes: list[str] = []
    if (kind.memory_slices, kind.compute_slices) != (base.memory_slices, base.compute_slices):
        notes.append(f"the driver reports {kind.memory_slices} memory / {kind.compute_slices} compute slices, "
                     f"the catalog {base.memory_slices} / {base.compute_slices}")
    driver = {p.name: p for p in kind.profiles}
    renamed: set[str] = set()
    out: list[MigProfile] = []
    for want in base.mig_profiles:
        got = driver.get(want.name)
        if got is None:
            # one profile, another name (drivers name memory sizes differently: 7g.79gb for 7g.80gb,
            # 1g.23gb for 1g.24gb): the same NVML profile and shape is the catalog's, under the driver's name
            same = [p for p in kind.profiles if p.name not in base.profiles_by_name and p.name not in renamed
                    and f"NVML_GPU_INSTANCE_PROFILE_{p.nvml}" == want.nvml
                    and (p.compute, p.memory) == (want.compute, want.memory)]
            if not same:
                notes.append(f"{want.name}: in the catalog, not offered by the driver; not planned")
                continue
            got = same[0]
            renamed.add(got.name)
            notes.append(f"{want.name}: the driver names it {got.name}; planned as {got.name} (pods ask for "
                         f"nvidia.com/mig-{got.name.replace('+', '.')})")
        diffs = []
        for label, theirs, ours in (("GI profile id", got.id, want.gi_profile_id),
                                    ("compute slices", got.compute, want.compute),
                                    ("memory slices", got.memory, want.memory),
                                    ("starts", list(got.starts), list(want.starts))):
            if theirs != ours:
                diffs.append(f"{label} {theirs} (catalog {ours})")
        if got.max != want.max and not base.nvml_counts_unreliable:
            diffs.append(f"max count {got.max} (catalog {want.max})")
        if diffs:
            notes.append(f"{want.name}: the driver reports " + ", ".join(diffs) + "; the driver's values are used")
        out.append(_profile(got, want.max if base.nvml_counts_unreliable else None))
    for name in driver:
        if name not in base.profiles_by_name and name not in renamed:
            notes.append(f"{name}: offered by the driver, not in the catalog's {base.name} (the allow-list); "
                         "not planned")
    return out, notes


def _same(a: GpuModel, b: GpuModel) -> bool:
    keys = ("memory_gb", "mps_capacity_gb", "memory_slices", "compute_slices", "mig_profiles")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


@lru_cache(maxsize=256)
def _kind_model(kind: GpuKind, mig_known: bool, catalog: Catalog) -> NodeModel:
    try:
        base: GpuModel | None = catalog.resolve(kind.product)
    except DynpartError:
        base = None
    # the nominal size (the catalog's; the driver's in GiB for a GPU the catalog lacks) and what the
    # agent reports (NVML's total less what the driver reserves), which the MPS capacity follows
    # (GiB: what an MPS memory limit of N "G" means)
    memory_gb = base.memory_gb if base is not None else max(1, kind.memory_mib // 1024)
    notes: list[str] = []
    if base is None:
        family = _normalised_product(kind.product)
        profiles = [_profile(p) for p in kind.profiles]
        slices = (kind.memory_slices, kind.compute_slices) if profiles else (0, 0)
        products: tuple[str, ...] = (re.escape(family),)
    else:
        family, products = base.name, ()
        if mig_known:
            profiles, notes = _compare(kind, base)
            slices = (kind.memory_slices, kind.compute_slices) if profiles else (0, 0)
        else:  # the driver listed none (MIG mode off on a driver that lists none then): the catalog's
            profiles, slices = list(base.mig_profiles), (base.memory_slices, base.compute_slices)
        # memory is not a disagreement: the catalog's is the nominal size, the driver's a little
        # less (81,559 MiB on an H100-80GB, 480 of them reserved by the driver); MPS slices add up
        # to at most what the agent reports
    model = GpuModel(name=family, memory_gb=memory_gb, memory_mib=kind.memory_mib, products=products,
                     memory_slices=slices[0],
                     compute_slices=slices[1], mig_profiles=tuple(profiles),
                     nvml_counts_unreliable=base.nvml_counts_unreliable if base else False,
                     mps_max_clients=base.mps_max_clients if base else MPS_MAX_CLIENTS)
    if base is not None and _same(model, base):
        return NodeModel(base, tuple(notes))
    # a name of its own (two nodes with one product may report different profiles, e.g. two
    # driver versions), and the family a pod's GPU-model selector matches
    digest = hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:8]
    return NodeModel(model.model_copy(update={"name": f"{family}~{digest}", "family": family}), tuple(notes))


def node_model(cap: NodeCapability, catalog: Catalog) -> NodeModel:
    """The model to plan a node with, from its agent's report: the driver's profiles, placements
    and memory, narrowed to the catalog's profiles where the catalog knows the product. Raises
    CapabilityError for a node whose GPUs are of different kinds (dynpart plans one model a node)."""
    kinds = {g.kind for g in cap.gpus}
    if len(kinds) > 1:
        products = sorted({cap.kinds[k].product for k in kinds})
        raise CapabilityError(f"the node's GPUs are of {len(kinds)} kinds ({', '.join(products)}); "
                              "dynpart plans nodes whose GPUs are all of one kind")
    kind = cap.kinds[kinds.pop()]
    mig_known = bool(kind.profiles) or all(g.mig == "unsupported" for g in cap.gpus)
    choice = _kind_model(kind, mig_known, catalog)
    if not mig_known and not choice.model.supports_mig:
        raise CapabilityError(f"{kind.product}: the catalog does not know this GPU and its driver lists no MIG "
                              "profile while MIG mode is off; the node is planned once its agent reports them")
    return choice


def model_catalog(catalog: Catalog, models: list[GpuModel]) -> Catalog:
    """`catalog` with the node models it lacks: what plan() resolves the nodes' models in."""
    extra = {m.name: m for m in models if catalog.models.get(m.name) is not m}
    return catalog if not extra else catalog.extended(Catalog(extra.values()))


__all__ = [
    "CAPABILITY_VERSION", "CapabilityError", "GpuKind", "GpuReport", "MAX_CAPABILITY_BYTES", "NodeCapability",
    "NodeModel", "ProfileCapability", "decode_capability", "encode_capability", "model_catalog", "node_model",
]
