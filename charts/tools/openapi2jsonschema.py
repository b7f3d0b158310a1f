#!/usr/bin/env python3
"""Kubernetes OpenAPI v2 (swagger.json) -> standalone JSON schemas, one per kind, for kubeconform.

    python charts/tools/openapi2jsonschema.py [--strict] SWAGGER_JSON OUT_DIR

Writes OUT_DIR/<kind>-<group>-<version>.json (core group: <kind>-<version>.json), the file names
kubeconform looks up with `-schema-location DIR -kubernetes-version X` (DIR/vX-standalone[-strict]/),
plus OUT_DIR/all.json (kind -> file). The swagger.json is the one Kubernetes publishes in its
repository and in the Go module k8s.io/kubernetes (api/openapi-spec/swagger.json), i.e. what the
kube-apiserver of that version serves at /openapi/v2.

The conversion follows the rules of the schemas kubeconform downloads by default
(yannh/kubernetes-json-schema, made by instrumenta/openapi2jsonschema `--kubernetes --stand-alone`):

* each kind that has `x-kubernetes-group-version-kind` gets one self-contained file: the
  definitions it reaches are copied under `definitions` and `$ref`s point there (recursive types,
  e.g. CRD's JSONSchemaProps, stay finite);
* `format: int-or-string` becomes `oneOf: [string, integer]`; a resource.Quantity accepts a string
  or a number (the API server decodes both);
* optional fields accept `null` (the API server treats null as unset); so do the shared
  definitions a `$ref` points to (keeps error messages short; a required field set to null is
  then left to the API server);
* `apiVersion` and `kind` are restricted to the file's own values;
* with --strict every object schema that lists `properties` gets `additionalProperties: false`
  (kubectl's and the API server's strict field validation: unknown fields are errors);
* `x-kubernetes-*` vendor extensions are dropped.

Standard library only.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

REF_PREFIX = "#/definitions/"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"


def _refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF_PREFIX):
            out.add(ref[len(REF_PREFIX):])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def reachable(defs: dict[str, Any], root: str) -> list[str]:
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in defs:
            raise SystemExit(f"openapi2jsonschema: dangling $ref to {name!r}")
        seen.add(name)
        found: set[str] = set()
        _refs(defs[name], found)
        todo.extend(sorted(found - seen))
    return sorted(seen)


def transform(node: Any, strict: bool) -> Any:
    """The conversion rules above, applied recursively to one schema (returns a new object)."""
    if isinstance(node, list):
        return [transform(v, strict) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("format") == "int-or-string":
        out: dict[str, Any] = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
        if "description" in node:
            out["description"] = node["description"]
        return out
    out = {}
    for k, v in node.items():
        if k.startswith("x-"):
            continue
        if k == "properties" and isinstance(v, dict):
            required = set(node.get("required") or [])
            out[k] = {name: _nullable(transform(s, strict)) if name not in required else transform(s, strict)
                      for name, s in v.items()}
        else:
            out[k] = transform(v, strict)
    if strict and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _nullable(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    t = schema.get("type")
    if isinstance(t, str) and t != "null":
        return {**schema, "type": [t, "null"]}
    if "oneOf" in schema:
        return {**schema, "oneOf": [*schema["oneOf"], {"type": "null"}]}
    return schema  # a $ref: the definitions themselves accept null (see convert)


def gvk_filename(gvk: dict[str, str]) -> str:
    group = gvk.get("group") or ""
    parts = [gvk["kind"].lower()]
    if group:
        parts.append(group.split(".")[0].lower())
    parts.append(gvk["version"].lower())
    return "-".join(parts) + ".json"


def convert(swagger: dict[str, Any], out_dir: Path, strict: bool) -> dict[str, str]:
    defs: dict[str, Any] = copy.deepcopy(swagger["definitions"])
    if QUANTITY in defs:
        desc = defs[QUANTITY].get("description")
        defs[QUANTITY] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
        if desc:
            defs[QUANTITY]["description"] = desc
    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}
    for name, schema in sorted(defs.items()):
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            group, version, kind = gvk.get("group") or "", gvk["version"], gvk["kind"]
            api_version = f"{group}/{version}" if group else version
            root = transform(schema, strict)
            props = root.setdefault("properties", {})
            props["apiVersion"] = {**props.get("apiVersion", {}), "type": "string", "enum": [api_version]}
            props["kind"] = {**props.get("kind", {}), "type": "string", "enum": [kind]}
            reach = reachable(defs, name)
            recursive = any(name in _collect(defs[d]) for d in reach)
            deps = [d for d in reach if d != name or recursive]
            doc: dict[str, Any] = {"$schema": "http://json-schema.org/draft-07/schema#", **root}
            if deps:
                # null is accepted where a definition is used (optional fields: see _nullable;
                # a required field set to null is left to the API server to refuse)
                doc["definitions"] = {d: _nullable(transform(defs[d], strict)) for d in deps}
            fname = gvk_filename(gvk)
            if fname in index.values():
                continue  # same kind/group-prefix/version from another full group name: first wins
            (out_dir / fname).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            index[f"{api_version}/{kind}"] = fname
    (out_dir / "all.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def _collect(node: Any) -> set[str]:
    found: set[str] = set()
    _refs(node, found)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strict", action="store_true", help="additionalProperties: false on every object")
    p.add_argument("swagger", type=Path)
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    swagger = json.loads(args.swagger.read_text())
    if swagger.get("swagger") != "2.0" or "definitions" not in swagger:
        print(f"openapi2jsonschema: {args.swagger}: not an OpenAPI v2 document", file=sys.stderr)
        return 1
    index = convert(swagger, args.out_dir, args.strict)
    print(f"{len(index)} schemas written to {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
