"""`dynpart catalog`: show the GPU models and MIG geometries dynpart knows."""

from __future__ import annotations

import argparse
import json
from typing import TypedDict

from dynpart.catalog import load_catalog
from dynpart.mig import maximal_geometries


class _ModelRow(TypedDict):
    name: str
    memory_gb: int
    mig_profiles: list[str]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("catalog", help="list GPU models, MIG profiles and maximal geometries",
                       description="List the GPU catalog (shipped models plus --catalog files).")
    p.add_argument("model", nargs="?", help="a model name or nvidia.com/gpu.product value: show its profiles "
                   "and maximal geometries")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    catalog = load_catalog(args.catalog)
    if args.model is None:
        rows: list[_ModelRow] = [{"name": m.name, "memory_gb": m.memory_gb, "mig_profiles": [p.name for p in m.mig_profiles]}
                for m in catalog.models.values()]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                print(f"{r['name']:<14} {r['memory_gb']:>4} GB  {' '.join(r['mig_profiles']) or '(no MIG)'}")
        return 0
    model = catalog.resolve(args.model, where="model")
    geometries = maximal_geometries(model) if model.supports_mig else []
    if args.json:
        print(json.dumps({"name": model.name, "mps_capacity_gb": model.mps_capacity_gb,
                          "mps_max_clients": model.mps_max_clients,
                          "profiles": [p.model_dump(by_alias=True) for p in model.mig_profiles],
                          "maximal_geometries": [dict(g) for g in geometries]}, indent=2))
        return 0
    reserved = f", {model.reserved_mib} reserved" if model.reserved_mib is not None else ""
    measured = f" (NVML reports {model.memory_mib} MiB{reserved})" if model.memory_mib else ""
    clients = f" (at most {model.mps_max_clients} slices a GPU)" if model.mps_max_clients else ""
    print(f"{model.name}: {model.memory_gb} GB{measured}, MPS capacity {model.mps_capacity_gb} GB{clients}, "
          f"{model.compute_slices} compute / {model.memory_slices} memory slices")
    for p in model.mig_profiles:
        print(f"  {p.name:<12} id {p.gi_profile_id:>2}  {p.resource_name:<28} max {p.max}  starts {list(p.starts)}")
    print(f"  {len(geometries)} maximal geometries")
    for g in geometries:
        print("   ", " + ".join(f"{c} x {n}" if c > 1 else n for n, c in g))
    return 0
