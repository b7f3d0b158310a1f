"""The node-annotation protocol between the planner and the node agent. Pure code, no I/O.

The planner writes the desired layout of a node as `dynpart.io/spec-*` annotations with a new
plan id; the agent applies it and answers with `dynpart.io/status-*` annotations naming the
plan id it applied. MIG and MPS nodes use the same keys and the same handshake. The format,
the handshake and examples are in docs/protocol.md; in short:

    dynpart.io/spec-plan: "<plan id>"              dynpart.io/status-plan: "<plan id applied>"
    dynpart.io/spec-mode: "mig" | "mps"            dynpart.io/status-mode: "mig" | "mps"
    dynpart.io/spec-gpu-0-1g.10gb: "2@0,1"         dynpart.io/status-gpu-0-1g.10gb-free: "1@1"
    dynpart.io/spec-gpu-0-3g.40gb: "1@4"           dynpart.io/status-gpu-0-1g.10gb-used: "1@0"
    dynpart.io/spec-gpu-1-1g.10gb.me: "1@6"        dynpart.io/status-error: "<one problem a line>"
    dynpart.io/spec-gpu-0-10gb: "2"  (MPS)         dynpart.io/status-heartbeat: "2025-01-31T12:00:00Z"

A MIG value is `<count>@<start>,<start>...` (the placements, in memory slices); an MPS value is
a count of slices of that size. A profile is written in keys as NVIDIA's device plugin writes it
in resource names, `+` as `.` (annotation names allow `[A-Za-z0-9._-]` only): `1g.10gb.me`,
`1g.24gb.me.all`, `1g.24gb.gfx`, and `1g.24gb-me` unchanged. That last `-` is part of the
profile: a key splits as `gpu-<index>-<profile>[-free|-used]`, where `<profile>` may end in `-me`.

Decoding is strict and total: a malformed key or value, or an instance that breaks the GPU's
MIG rules, is reported as a sentence in `problems` and ignored; decoding never raises. A key under
`spec-`/`status-` that is neither one of the fixed keys nor a slice key (`gpu-...`) is another
version's (a newer planner or agent): it is listed in `unknown`, not in `problems`, so it never
makes a spec refused or a status unreadable (docs/protocol.md, "Versions").
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, TypeGuard

from dynpart.catalog import GpuModel
from dynpart.kube.conventions import (
    PARTITIONING_LABEL,
    PREFIX,
    SPEC_DRAIN,
    SPEC_MODE,
    SPEC_PLAN,
    SPEC_PODS,
    SPEC_PREFIX,
    SPEC_REVOKES,
    SPEC_TERM,
    STATUS_CAPABILITY,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_MODE,
    STATUS_PLAN,
    STATUS_PREFIX,
    STATUS_UNHEALTHY,
)
from dynpart.mig import MigRules
from dynpart.resources import mig_profile_suffix
from dynpart.snapshot import GpuLayout, MigInstance, Mode, MpsSlice, NodeLayout

MAX_GPU_INDEX = 255
MAX_PLAN_ID = 128
MAX_ERROR_CHARS = 4096
MAX_TERM = 999_999  # _INT's six digits
# spec-pods: a node holds at most a few hundred pods (the kubelet's maxPods, 110 by default), of
# ~100 characters each. Written up to 32 KiB (what agents before 64 KiB was read accept), read up
# to 64 KiB; the node's annotations together must stay under 256 KiB
MAX_PODS_CHARS = 64 * 1024
WRITE_PODS_CHARS = 32 * 1024
_POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", re.ASCII)

_PLAN_ID = re.compile(rf"[!-~]{{1,{MAX_PLAN_ID}}}", re.ASCII)  # printable ASCII, no space
_INT = re.compile(r"0|[1-9][0-9]{0,5}", re.ASCII)  # canonical, short: int() never sees 4300 digits
_POSITIVE = re.compile(r"[1-9][0-9]{0,5}", re.ASCII)
_MIG_SLICE = re.compile(r"([1-9][0-9]?g\.[1-9][0-9]{0,3}gb)(\.me|\.me\.all|\.gfx|-me)?", re.ASCII)
_NO_ME = "me"  # the key piece after the `-` of a `-me` profile
_MPS_SLICE = re.compile(r"([1-9][0-9]{0,5})gb", re.ASCII)
_MIG_VALUE = re.compile(r"([^@]*)@(.*)", re.ASCII | re.DOTALL)
_HEARTBEAT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"

SliceState = Literal["free", "used"]
_RESERVED = frozenset({SPEC_PLAN, SPEC_MODE, SPEC_TERM, SPEC_PODS, SPEC_REVOKES, SPEC_DRAIN,
                       STATUS_PLAN, STATUS_MODE, STATUS_ERROR, STATUS_HEARTBEAT, STATUS_CAPABILITY,
                       STATUS_UNHEALTHY})


# --- keys -------------------------------------------------------------------------------------


def slice_token(profile: str) -> str:
    """A MIG profile as written in a key: `1g.10gb+me` -> `1g.10gb.me`, `1g.24gb+me.all` ->
    `1g.24gb.me.all`, `1g.24gb+gfx` -> `1g.24gb.gfx`, `1g.24gb-me` unchanged."""
    token = profile.replace("+", ".")
    if not _MIG_SLICE.fullmatch(token):
        raise ValueError(f"MIG profile {profile!r} cannot be written in an annotation key")
    return token


def mps_token(size: object) -> str:
    """An MPS slice size as written in a key: 10 -> `10gb`; anything but a positive integer is refused."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"MPS slice size {size!r} must be a positive integer")
    return f"{size}gb"


def spec_key(gpu: int, token: str) -> str:
    return f"{SPEC_PREFIX}gpu-{gpu}-{token}"


def status_key(gpu: int, token: str, state: SliceState) -> str:
    return f"{STATUS_PREFIX}gpu-{gpu}-{token}-{state}"


def format_heartbeat(at: datetime) -> str:
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return at.strftime(_HEARTBEAT_FORMAT)


# --- canonical layouts --------------------------------------------------------------------------


def canonical_gpu(gpu: GpuLayout, keep_used: bool) -> GpuLayout:
    """Only what the protocol carries: placements (and used flags), sorted."""
    mig = sorted(
        (MigInstance(profile=m.profile, start=m.start, used=m.used and keep_used) for m in gpu.mig),
        key=lambda m: (m.start, m.profile, m.used),
    )
    mps = sorted(
        (MpsSlice(size=s.size, used=s.used and keep_used) for s in gpu.mps),
        key=lambda s: (-s.size, not s.used),
    )
    return GpuLayout(index=gpu.index, mig=mig, mps=mps)


def canonical_layout(layout: NodeLayout, keep_used: bool = False) -> NodeLayout:
    """The layout as the annotations carry it: GPUs without instances or slices dropped, pods,
    counters and whole-GPU assignments dropped, everything sorted. `decode_spec(encode_spec(x))`
    gives `canonical_layout(x)`; `decode_status(encode_status(x))` gives it with `keep_used`."""
    gpus = [canonical_gpu(g, keep_used) for g in sorted(layout.gpus, key=lambda g: g.index)]
    if layout.mode == "mig":
        gpus = [GpuLayout(index=g.index, mig=g.mig) for g in gpus if g.mig]
    else:
        gpus = [GpuLayout(index=g.index, mps=g.mps) for g in gpus if g.mps]
    return NodeLayout(node=layout.node, mode=layout.mode, gpus=gpus)


# --- encoding ---------------------------------------------------------------------------------


def is_plan_id(value: object) -> TypeGuard[str]:
    """Whether `value` can be written as a plan id (1 to 128 printable ASCII, no spaces)."""
    return isinstance(value, str) and _PLAN_ID.fullmatch(value) is not None


def is_pod_key(value: object) -> TypeGuard[str]:
    """Whether `value` is a pod's `namespace/name` as the API server allows them (what a spec's
    `spec-pods` may name)."""
    return isinstance(value, str) and _POD_NAME.fullmatch(value) is not None


def _check_plan_id(plan_id: object) -> str:
    if not isinstance(plan_id, str) or not _PLAN_ID.fullmatch(plan_id):
        raise ValueError(
            f"plan id {plan_id!r} must be 1 to {MAX_PLAN_ID} printable ASCII characters without spaces"
        )
    return plan_id


def _slice_values(gpu: GpuLayout, mode: Mode, with_state: bool) -> dict[tuple[str, SliceState], str]:
    """(key token, state) -> value for one GPU; state is "free" when not `with_state`."""
    if gpu.index < 0 or gpu.index > MAX_GPU_INDEX:
        raise ValueError(f"GPU index {gpu.index} is outside 0..{MAX_GPU_INDEX}")
    out: dict[tuple[str, SliceState], str] = {}
    if mode == "mig":
        starts: dict[tuple[str, SliceState], list[int]] = defaultdict(list)
        for m in gpu.mig:
            state: SliceState = "used" if with_state and m.used else "free"
            starts[(slice_token(m.profile), state)].append(m.start)
        for k, ss in starts.items():
            out[k] = f"{len(ss)}@{','.join(str(s) for s in sorted(ss))}"
    else:
        counts: Counter[tuple[str, SliceState]] = Counter()
        for s in gpu.mps:
            counts[(mps_token(s.size), "used" if with_state and s.used else "free")] += 1
        out = {k: str(n) for k, n in counts.items()}
    return out


def encode_spec(layout: NodeLayout, plan_id: str, *, term: int | None = None,
                pods: Iterable[str] = ()) -> dict[str, str]:
    """The `dynpart.io/spec-*` annotations of a planned node layout (every instance or slice of
    the layout, used or free, with its placement), the writer's leader `term`, the `pods` the
    plan puts on the node and the GPUs it drains (`GpuLayout.drain`). Raises ValueError on a layout that cannot be written (the planner's
    bug, not the user's): it is never given to a node half-written."""
    out = {SPEC_PLAN: _check_plan_id(plan_id), SPEC_MODE: layout.mode}
    if term is not None:
        if not 0 <= term <= MAX_TERM:
            raise ValueError(f"leader term {term} is outside 0..{MAX_TERM}")
        out[SPEC_TERM] = str(term)
    names = sorted(set(pods))
    if names:
        bad = [p for p in names if not _POD_NAME.fullmatch(p)]
        if bad:
            raise ValueError(f"pod name {bad[0]!r} is not namespace/name")
        text = ",".join(names)
        if len(text) > WRITE_PODS_CHARS:
            # never a spec its agent refuses: the names that fit (docs/protocol.md: what a pod left
            # out loses)
            text = text[: text.rfind(",", 0, WRITE_PODS_CHARS + 1)]
        out[SPEC_PODS] = text
    drain = sorted({g.index for g in layout.gpus if g.drain})
    if drain:
        out[SPEC_DRAIN] = ",".join(map(str, drain))
    for gpu in layout.gpus:
        for (token, _), value in _slice_values(gpu, layout.mode, with_state=False).items():
            out[spec_key(gpu.index, token)] = value
    return out


def encode_status(layout: NodeLayout, plan_id: str | None, errors: list[str] | tuple[str, ...] = (),
                  heartbeat: datetime | None = None, unhealthy: Iterable[int] = ()) -> dict[str, str]:
    """The `dynpart.io/status-*` annotations the agent writes: every instance or slice on the
    node as free or used, the plan id it applied (None: none yet), its errors, a heartbeat, the
    GPUs the driver reports unhealthy."""
    out: dict[str, str] = {STATUS_MODE: layout.mode}
    if plan_id is not None:
        out[STATUS_PLAN] = _check_plan_id(plan_id)
    sick = sorted(set(unhealthy))
    if sick:
        if not all(0 <= i <= MAX_GPU_INDEX for i in sick):
            raise ValueError(f"unhealthy GPU indices {sick} are not all in 0..{MAX_GPU_INDEX}")
        out[STATUS_UNHEALTHY] = ",".join(map(str, sick))
    for gpu in layout.gpus:
        for (token, state), value in _slice_values(gpu, layout.mode, with_state=True).items():
            out[status_key(gpu.index, token, state)] = value
    if errors:
        out[STATUS_ERROR] = _join_errors(errors)
    if heartbeat is not None:
        out[STATUS_HEARTBEAT] = format_heartbeat(heartbeat)
    return out


def _join_errors(errors: list[str] | tuple[str, ...]) -> str:
    lines = [" ".join(str(e).split()) for e in errors]  # one line each
    text = ""
    for i, line in enumerate(lines):
        candidate = line if not text else text + "\n" + line
        if len(candidate) > MAX_ERROR_CHARS:
            if not text:  # the first problem alone is too long: cut it, never drop it
                more = f" ... ({len(lines) - 1} more)" if len(lines) > 1 else " ..."
                return line[: MAX_ERROR_CHARS - len(more)] + more
            return text + f"\n... ({len(lines) - i} more)"
        text = candidate
    return text


def error_text(error: str) -> str:
    """One error as `encode_status` writes it into STATUS_ERROR: one line, cut to MAX_ERROR_CHARS
    (an exception's message may be any length and span lines)."""
    return _join_errors([error])


def annotation_patch(old: Mapping[str, str] | None, new: Mapping[str, str],
                     prefix: str = SPEC_PREFIX) -> dict[str, str | None]:
    """A JSON merge patch of `metadata.annotations` turning `old` into `new` for the keys under
    `prefix` (default: the spec): keys whose value changes are set, keys under `prefix` that
    `new` lacks are removed (None). Other keys are left alone. Empty when nothing changes."""
    old = dict(old or {})
    patch: dict[str, str | None] = {k: v for k, v in new.items() if old.get(k) != v}
    old_keys: list[object] = list(old)  # as read from the API: a malformed object's keys may not be strings
    for k in old_keys:
        if isinstance(k, str) and k.startswith(prefix) and k not in new:
            patch[k] = None
    return patch


# --- decoding ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedSpec:
    """What a node's spec annotations ask for. `layout` is None when the node has no spec (the
    agent then changes nothing); GPUs without keys are absent from it (meaning: no instances).
    Unpacks as `layout, plan_id, problems` (typed code reads the attributes)."""

    layout: NodeLayout | None
    plan_id: str | None
    problems: list[str] = field(default_factory=list)
    term: int | None = None  # the writer's leader term (None: not written, e.g. no leader election)
    pods: tuple[str, ...] = ()  # the pods the plan puts on the node
    drain: tuple[int, ...] = ()  # the GPUs to drain: each slice destroyed once nothing uses it
    unknown: list[str] = field(default_factory=list)  # keys of another version, ignored (module docstring)

    def __iter__(self) -> Iterator[NodeLayout | str | list[str] | None]:
        return iter((self.layout, self.plan_id, self.problems))


@dataclass(frozen=True)
class DecodedStatus:
    """What an agent reported. `layout` has `used` set per instance or slice; None when the
    node has no status. Unpacks as `layout, plan_id, problems`."""

    layout: NodeLayout | None
    plan_id: str | None
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    heartbeat: datetime | None = None
    # a slice or mode key could not be read: `layout` may lack a slice that is in use
    layout_incomplete: bool = False
    unknown: list[str] = field(default_factory=list)  # keys of another version, ignored (module docstring)
    # MIG GPUs holding instances of profiles the model lacks (an agent that plans with another
    # model: a capability report this reader cannot read), their keys well formed, left out of
    # `layout`: GPU -> those profiles. Their instances' shapes are unknown, so such a GPU can
    # only be kept as it is (`kept_spec`); the other GPUs read as usual.
    foreign: dict[int, tuple[str, ...]] = field(default_factory=dict)
    kept_spec: dict[str, str] = field(default_factory=dict)  # the spec keys that keep `foreign` as it is
    unhealthy: tuple[int, ...] = ()  # GPUs the driver reports unhealthy (`status-unhealthy`)

    def __iter__(self) -> Iterator[NodeLayout | str | list[str] | None]:
        return iter((self.layout, self.plan_id, self.problems))


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(key: object, value: object, why: str) -> str:
    return f"annotation {_show(key)} = {_show(value)}: {why}; ignored"


@dataclass
class _Item:
    """One parsed slice key: a MIG profile with starts, or an MPS size with a count."""

    key: str
    value: str
    gpu: int
    state: SliceState
    profile: str | None = None  # MIG
    starts: tuple[int, ...] = ()
    size: int = 0  # MPS
    count: int = 0
    known: bool = True  # False: a MIG profile the model lacks, read only where `foreign` is asked for

    @property
    def mode(self) -> Mode:
        return "mig" if self.profile is not None else "mps"


def _parse_slice_key(key: str, value: object, name: str, with_state: bool,
                     model: GpuModel, problems: list[str], foreign_ok: bool = False) -> _Item | None:
    """`name` is the key without its `spec-`/`status-` prefix: `gpu-<i>-<slice>[-<state>]`;
    `<slice>` may itself contain one `-`, that of a `-me` profile (`gpu-0-1g.24gb-me-free`).
    `foreign_ok`: a well-formed key of a MIG profile the model lacks is returned (`known` False)."""
    parts = name.split("-")
    want = 4 if with_state else 3
    if len(parts) == want + 1 and parts[3] == _NO_ME:
        parts = [*parts[:2], f"{parts[2]}-{_NO_ME}", *parts[4:]]
    if len(parts) != want or parts[0] != "gpu":
        shape = "gpu-<index>-<profile or size>" + ("-free|used" if with_state else "")
        problems.append(_bad(key, value, f"unknown key; expected {SPEC_PREFIX if not with_state else STATUS_PREFIX}{shape}"))
        return None
    index_text, token = parts[1], parts[2]
    state: SliceState = "free"
    if with_state:
        if parts[3] not in ("free", "used"):
            problems.append(_bad(key, value, f"state {parts[3]!r} is neither 'free' nor 'used'"))
            return None
        state = "used" if parts[3] == "used" else "free"
    if not _INT.fullmatch(index_text) or int(index_text) > MAX_GPU_INDEX:
        problems.append(_bad(key, value, f"GPU index {index_text!r} is not an integer in 0..{MAX_GPU_INDEX}"))
        return None
    gpu = int(index_text)
    if not isinstance(value, str):
        problems.append(_bad(key, value, "the value is not a string"))
        return None
    if m := _MIG_SLICE.fullmatch(token):
        profile = m.group(1) + mig_profile_suffix(m.group(2) or "")
        known = profile in model.profiles_by_name
        if not known and not foreign_ok:
            names = ", ".join(p.replace("+", ".") for p in model.profiles_by_name) or "none"
            problems.append(_bad(key, value, f"{model.name} has no MIG profile {profile!r} (profiles: {names})"))
            return None
        vm = _MIG_VALUE.fullmatch(value)
        if vm is None:
            problems.append(_bad(key, value, "a MIG value must be <count>@<start>,<start>... (e.g. '2@0,1')"))
            return None
        count_text, starts_text = vm.groups()
        if not _POSITIVE.fullmatch(count_text):
            problems.append(_bad(key, value, f"count {count_text!r} is not a positive integer"))
            return None
        start_texts = starts_text.split(",")
        bad = [s for s in start_texts if not _INT.fullmatch(s)]
        if bad:
            problems.append(_bad(key, value, f"start {bad[0]!r} is not a non-negative integer"))
            return None
        starts = tuple(int(s) for s in start_texts)
        if len(starts) != int(count_text):
            problems.append(_bad(key, value, f"count {count_text} does not match the {len(starts)} starts listed"))
            return None
        if len(set(starts)) != len(starts):
            problems.append(_bad(key, value, "a start is listed twice"))
            return None
        return _Item(key, value, gpu, state, profile=profile, starts=starts, known=known)
    if m := _MPS_SLICE.fullmatch(token):
        if not _POSITIVE.fullmatch(value):
            problems.append(_bad(key, value, "an MPS value must be a positive integer count of slices"))
            return None
        return _Item(key, value, gpu, state, size=int(m.group(1)), count=int(value))
    problems.append(_bad(key, value, f"{token!r} is neither a MIG profile (e.g. 1g.10gb, 1g.10gb.me) "
                                     "nor an MPS slice size (e.g. 10gb)"))
    return None


def _decode_slices(annotations: Mapping[str, object], model: GpuModel, prefix: str, mode_key: str,
                   node: str, capacity: int | None, with_state: bool, problems: list[str],
                   unknown: list[str], foreign: dict[int, list[_Item]] | None = None) -> NodeLayout | None:
    """The per-GPU layout carried by the slice keys under `prefix` (shared by spec and status).
    With `foreign` (a status), the GPUs holding instances of MIG profiles the model lacks are put
    there, with all their keys, instead of in the layout."""
    mode_value = annotations.get(mode_key)
    mode: Mode | None = None
    if mode_value is not None:
        if mode_value in ("mig", "mps"):
            mode = mode_value
        else:
            problems.append(_bad(mode_key, mode_value, "the mode must be 'mig' or 'mps'"))
    items: list[_Item] = []
    for key in sorted(annotations):
        if not key.startswith(prefix) or key in _RESERVED:
            continue
        if not key[len(prefix):].startswith("gpu-"):
            # another version's key (not a slice: no slice can hide behind it): reported, ignored
            unknown.append(f"annotation {_show(key)}: not a key this dynpart version knows (written by a newer "
                           "planner or agent?); ignored")
            continue
        item = _parse_slice_key(key, annotations[key], key[len(prefix):], with_state, model, problems,
                                foreign_ok=foreign is not None)
        if item is not None:
            items.append(item)
    if mode is None:
        shapes = {i.mode for i in items}
        if not items and mode_value is None:
            return None
        if len(shapes) != 1:
            problems.append(f"annotation {mode_key} is missing or invalid and the keys mix MIG and MPS "
                            "slices; every slice key is ignored")
            return None
        mode = shapes.pop()
    if mode == "mig" and not model.supports_mig:
        problems.append(_bad(mode_key, "mig", f"GPU model {model.name} does not support MIG"))
    layouts: dict[int, GpuLayout] = {}
    by_gpu: dict[int, list[_Item]] = defaultdict(list)
    for item in items:
        if item.mode != mode:
            problems.append(_bad(item.key, item.value, f"{'a MIG' if item.mode == 'mig' else 'an MPS'} slice on a node in {mode} mode"))
            continue
        by_gpu[item.gpu].append(item)
    for gpu, gitems in sorted(by_gpu.items()):
        if foreign is not None and not all(it.known for it in gitems):
            foreign[gpu] = gitems  # an instance of unknown shape: nothing of the GPU can be checked
            continue
        if mode == "mig":
            mig = _accept_mig(gitems, model, problems)
            if mig:
                layouts[gpu] = GpuLayout(index=gpu, mig=mig)
        else:
            mps = _accept_mps(gitems, capacity if capacity is not None else model.mps_capacity_gb, problems)
            if mps:
                layouts[gpu] = GpuLayout(index=gpu, mps=mps)
    return NodeLayout(node=node, mode=mode, gpus=[layouts[i] for i in sorted(layouts)])


def _accept_mig(items: list[_Item], model: GpuModel, problems: list[str]) -> list[MigInstance]:
    """Add the instances one by one, in (start, profile) order; one that would break the MIG
    rules with those already accepted is reported and left out."""
    if not model.supports_mig:
        return []
    rules = MigRules.of(model)
    cands = sorted(
        ((s, it.profile or "", it.state == "used", it) for it in items for s in it.starts),
        key=lambda c: (c[0], c[1], c[2]),
    )
    accepted: list[tuple[str, int]] = []
    out: list[MigInstance] = []
    for start, profile, used, it in cands:
        broken = rules.violations([*accepted, (profile, start)])
        if broken:
            why = broken[0]
            if f"{profile}@{start}" not in why and f"start at memory slice {start}" not in why:
                why = f"{profile}@{start}: {why}"
            problems.append(_bad(it.key, it.value, why))
            continue
        accepted.append((profile, start))
        out.append(MigInstance(profile=profile, start=start, used=used))
    return out


def _accept_mps(items: list[_Item], capacity: int, problems: list[str]) -> list[MpsSlice]:
    """Used slices first, then larger first; a key whose slices do not fit in what is left of
    the GPU's capacity is reported and left out."""
    out: list[MpsSlice] = []
    total = 0
    for it in sorted(items, key=lambda i: (i.state != "used", -i.size, i.key)):
        need = it.size * it.count
        if total + need > capacity:
            problems.append(_bad(it.key, it.value, f"{it.count} x {it.size}gb does not fit: GPU {it.gpu} has "
                                                   f"{capacity - total} of {capacity} GB left"))
            continue
        total += need
        out.extend(MpsSlice(size=it.size, used=it.state == "used") for _ in range(it.count))
    return sorted(out, key=lambda s: (-s.size, not s.used))


def _decode_plan(annotations: Mapping[str, object], key: str, problems: list[str]) -> str | None:
    value = annotations.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not _PLAN_ID.fullmatch(value):
        problems.append(_bad(key, value, f"a plan id is 1 to {MAX_PLAN_ID} printable ASCII characters "
                                         "without spaces"))
        return None
    return value


def _ours(annotations: object) -> dict[str, object]:
    """Our keys of a node's annotations as read from the API (any value: decoding never raises)."""
    if not isinstance(annotations, Mapping):
        return {}
    return {k: v for k, v in annotations.items() if isinstance(k, str) and k.startswith(PREFIX)}


def decode_spec(annotations: Mapping[str, str] | None, model: GpuModel, *, node: str = "",
                capacity: int | None = None) -> DecodedSpec:
    """Read a node's desired layout (see the module docstring). `capacity` is the MPS capacity
    of one GPU in GB (default: the model's memory). Never raises."""
    problems: list[str] = []
    ours = _ours(annotations)
    plan_id = _decode_plan(ours, SPEC_PLAN, problems)
    unknown: list[str] = []
    layout = _decode_slices(ours, model, SPEC_PREFIX, SPEC_MODE, node, capacity, False, problems, unknown)
    return DecodedSpec(layout, plan_id, problems, *decode_fencing(ours, problems), drain=_decode_drain(ours, problems),
                       unknown=unknown)


def _decode_drain(annotations: Mapping[str, object], problems: list[str]) -> tuple[int, ...]:
    """The GPUs the spec drains; a malformed value is reported (and the agent refuses the spec)."""
    return _decode_gpu_list(annotations, SPEC_DRAIN, "drained GPUs", problems)


def _decode_gpu_list(annotations: Mapping[str, object], key: str, what: str, problems: list[str]) -> tuple[int, ...]:
    """GPU indices, comma separated, sorted; a malformed value is reported and read as none."""
    raw = annotations.get(key)
    if raw is None:
        return ()
    parts = raw.split(",") if isinstance(raw, str) and len(raw) <= 4 * (MAX_GPU_INDEX + 1) else None
    if parts is None or not all(_INT.fullmatch(p) and int(p) <= MAX_GPU_INDEX for p in parts):
        problems.append(_bad(key, raw, f"{what} are indices in 0..{MAX_GPU_INDEX}, comma separated"))
        return ()
    return tuple(sorted({int(p) for p in parts}))


def decode_fencing(annotations: Mapping[str, object], problems: list[str]) -> tuple[int | None, tuple[str, ...]]:
    """The spec's leader term and planned pods (see encode_spec); malformed values are reported
    and read as absent."""
    term: int | None = None
    raw = annotations.get(SPEC_TERM)
    if raw is not None:
        if isinstance(raw, str) and _INT.fullmatch(raw) and int(raw) <= MAX_TERM:
            term = int(raw)
        else:
            problems.append(_bad(SPEC_TERM, raw, f"a leader term is an integer in 0..{MAX_TERM}"))
    pods: tuple[str, ...] = ()
    raw = annotations.get(SPEC_PODS)
    if raw is not None:
        names = raw.split(",") if isinstance(raw, str) and len(raw) <= MAX_PODS_CHARS else None
        if names is None or not all(_POD_NAME.fullmatch(n) for n in names):
            problems.append(_bad(SPEC_PODS, raw, f"planned pods are namespace/name, comma separated, at most "
                                                 f"{MAX_PODS_CHARS} characters"))
        else:
            pods = tuple(names)
    return term, pods


def decode_status(annotations: Mapping[str, str] | None, model: GpuModel, *, node: str = "",
                  capacity: int | None = None) -> DecodedStatus:
    """Read what a node's agent reported. Never raises."""
    problems: list[str] = []
    ours = _ours(annotations)
    plan_id = _decode_plan(ours, STATUS_PLAN, problems)
    slice_problems: list[str] = []
    unknown: list[str] = []
    foreign: dict[int, list[_Item]] = {}
    layout = _decode_slices(ours, model, STATUS_PREFIX, STATUS_MODE, node, capacity, True, slice_problems,
                            unknown, foreign)
    problems.extend(slice_problems)
    errors: list[str] = []
    raw_errors = ours.get(STATUS_ERROR)
    if raw_errors is not None:
        if isinstance(raw_errors, str):
            errors = [line for line in raw_errors.split("\n") if line.strip()]
        else:
            problems.append(_bad(STATUS_ERROR, raw_errors, "the value is not a string"))
    heartbeat: datetime | None = None
    raw_beat = ours.get(STATUS_HEARTBEAT)
    if raw_beat is not None:
        try:
            if not isinstance(raw_beat, str):
                raise ValueError
            heartbeat = datetime.strptime(raw_beat, _HEARTBEAT_FORMAT).replace(tzinfo=UTC)
        except ValueError:
            problems.append(_bad(STATUS_HEARTBEAT, raw_beat, "a heartbeat is a UTC time like 2025-01-31T12:00:00Z"))
    unhealthy = _decode_gpu_list(ours, STATUS_UNHEALTHY, "unhealthy GPUs", problems)
    return DecodedStatus(layout, plan_id, problems, errors, heartbeat, bool(slice_problems), unknown,
                         {gpu: tuple(sorted({it.profile or "" for it in items if not it.known}))
                          for gpu, items in foreign.items()},
                         _kept_spec(foreign), unhealthy)


def keeping_spec(layout: NodeLayout | None, gpus: Iterable[int]) -> dict[str, str]:
    """The spec keys asking for what `layout` (a decoded status) holds on these GPUs, used or
    free: a spec with them keeps those GPUs as they are (a GPU without a slice needs no key)."""
    if layout is None:
        return {}
    chosen = set(gpus)
    out: dict[str, str] = {}
    for gpu in layout.gpus:
        if gpu.index in chosen:
            for (token, _), value in _slice_values(gpu, layout.mode, with_state=False).items():
                out[spec_key(gpu.index, token)] = value
    return out


def _kept_spec(foreign: Mapping[int, list[_Item]]) -> dict[str, str]:
    """The spec keys asking for the instances a status reports on these GPUs, used or free: a spec
    that keeps the GPUs as they are."""
    starts: dict[str, set[int]] = defaultdict(set)
    for gpu, items in foreign.items():
        for it in items:
            starts[spec_key(gpu, slice_token(it.profile or ""))].update(it.starts)
    return {key: f"{len(ss)}@{','.join(map(str, sorted(ss)))}" for key, ss in sorted(starts.items())}


__all__ = [
    "DecodedSpec", "DecodedStatus", "PARTITIONING_LABEL", "PREFIX", "SPEC_DRAIN", "SPEC_MODE", "SPEC_PLAN", "SPEC_PODS",
    "SPEC_PREFIX", "SPEC_TERM", "STATUS_CAPABILITY", "STATUS_ERROR", "STATUS_HEARTBEAT", "STATUS_MODE",
    "STATUS_PLAN", "STATUS_PREFIX", "STATUS_UNHEALTHY", "annotation_patch", "canonical_layout", "decode_fencing", "decode_spec",
    "decode_status", "encode_spec", "encode_status", "error_text", "format_heartbeat", "is_plan_id", "keeping_spec",
]
