#!/usr/bin/env python3
"""Server-side dry run of rendered manifests against a real kube-apiserver (no kubectl needed).

    python charts/tools/dry_run.py --kubeconfig KUBECONFIG [--crd CRD.yaml ...] MANIFESTS.yaml ...

For every object: POST it to its collection with `?dryRun=All&fieldValidation=Strict`, so the
API server decodes it (unknown or duplicate fields are errors), defaults it, validates it and runs
the admission chain, then stores nothing. Beforehand, and for real (idempotently):

* the namespaces the objects live in are created when missing (a namespaced dry-run create is
  refused in a namespace that does not exist);
* the CRDs given with --crd are created when missing and waited for (Established), so custom
  resources such as a ServiceMonitor are validated by their real schema.

Exits 1 listing every object the server refused. Needs PyYAML; the kubeconfig must carry its
credentials inline or as files (client certificate, or a bearer token).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterable

import yaml


class ApiError(Exception):
    def __init__(self, status: int, body: bytes, what: str):
        self.status = status
        try:
            self.message = json.loads(body).get("message") or body.decode(errors="replace")
        except ValueError:
            self.message = body.decode(errors="replace")
        super().__init__(f"{what}: HTTP {status}: {self.message}")


class Client:
    """Just enough of a Kubernetes client: JSON over HTTPS with a kubeconfig's credentials."""

    def __init__(self, kubeconfig: str | os.PathLike, context: str | None = None):
        cfg = yaml.safe_load(Path(kubeconfig).read_text())
        ctx_name = context or cfg.get("current-context")
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next((u["user"] for u in cfg.get("users", []) if u["name"] == ctx.get("user")), {})
        self.server = cluster["server"].rstrip("/")
        self._tmp = tempfile.TemporaryDirectory(prefix="dynpart-dry-run-")
        base = Path(kubeconfig).resolve().parent

        def material(data_key: str, file_key: str, src: dict[str, Any]) -> str | None:
            if src.get(data_key):
                path = Path(self._tmp.name) / data_key
                path.write_bytes(base64.b64decode(src[data_key]))
                return str(path)
            if src.get(file_key):
                return str(base / src[file_key])
            return None

        if cluster.get("insecure-skip-tls-verify"):
            self.ssl = ssl._create_unverified_context()
        else:
            self.ssl = ssl.create_default_context(
                cafile=material("certificate-authority-data", "certificate-authority", cluster))
        cert = material("client-certificate-data", "client-certificate", user)
        key = material("client-key-data", "client-key", user)
        if cert and key:
            self.ssl.load_cert_chain(cert, key)
        self.token = user.get("token")
        if not self.token and user.get("tokenFile"):
            self.token = Path(base / user["tokenFile"]).read_text().strip()
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                  urllib.request.HTTPSHandler(context=self.ssl))
        self._resources: dict[str, dict[str, dict[str, Any]]] = {}

    def request(self, method: str, path: str, body: Any = None, what: str = "") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with self.opener.open(req, timeout=30) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, e.read(), what or f"{method} {path}") from None

    def resource(self, api_version: str, kind: str) -> dict[str, Any]:
        """Discovery: the API resource (name, namespaced) serving `kind` in `api_version`."""
        if api_version not in self._resources:
            base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            try:
                listing = self.request("GET", base)
            except ApiError as e:
                if e.status == 404:
                    raise ApiError(404, b"", f"{api_version} is not served by this API server") from None
                raise
            self._resources[api_version] = {r["kind"]: r for r in listing["resources"] if "/" not in r["name"]}
        try:
            return self._resources[api_version][kind]
        except KeyError:
            raise ApiError(404, b"", f"{api_version} has no kind {kind}") from None

    def collection(self, obj: dict[str, Any]) -> str:
        api_version, kind = obj["apiVersion"], obj["kind"]
        res = self.resource(api_version, kind)
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        if res["namespaced"]:
            ns = obj["metadata"].get("namespace") or "default"
            return f"{base}/namespaces/{urllib.parse.quote(ns)}/{res['name']}"
        return f"{base}/{res['name']}"

    def create(self, obj: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        query = "?fieldValidation=Strict" + ("&dryRun=All" if dry_run else "")
        return self.request("POST", self.collection(obj) + query, obj, what=describe(obj))

    def delete(self, obj: dict[str, Any]) -> None:
        """Delete `obj` (gone already is fine)."""
        try:
            self.request("DELETE", f"{self.collection(obj)}/{urllib.parse.quote(obj['metadata']['name'])}",
                         what=f"delete {describe(obj)}")
        except ApiError as e:
            if e.status != 404:
                raise

    def ensure(self, obj: dict[str, Any]) -> bool:
        """Create `obj` for real unless it exists; True when created."""
        try:
            self.create(obj, dry_run=False)
            return True
        except ApiError as e:
            if e.status == 409:
                return False
            raise

    def close(self) -> None:
        self._tmp.cleanup()


def describe(obj: dict[str, Any]) -> str:
    md = obj.get("metadata") or {}
    ns = f"{md['namespace']}/" if md.get("namespace") else ""
    return f"{obj.get('kind')} {ns}{md.get('name')} ({obj.get('apiVersion')})"


def load_objects(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    objs: list[dict[str, Any]] = []
    for p in paths:
        for doc in yaml.safe_load_all(Path(p).read_text()):
            if not doc:
                continue
            if doc.get("kind", "").endswith("List") and "items" in doc:
                objs.extend(doc["items"])
            else:
                objs.append(doc)
    return objs


def wait_established(client: Client, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        crd = client.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conds = {c["type"]: c["status"] for c in ((crd.get("status") or {}).get("conditions") or [])}
        if conds.get("Established") == "True":
            return
        if time.monotonic() > deadline:
            raise ApiError(0, b"", f"CRD {name} not Established after {timeout:.0f}s ({conds})")
        time.sleep(0.2)


def dry_run(client: Client, objects: list[dict[str, Any]], crds: list[dict[str, Any]] = (),
            log=print) -> list[str]:
    """Set up (namespaces, CRDs) for real, dry-run every object; return the failures."""
    for crd in crds:
        if client.ensure(crd):
            log(f"created {describe(crd)}")
        wait_established(client, crd["metadata"]["name"])
    if crds:
        client._resources.clear()  # rediscover: the new groups are served now
    namespaces = sorted({o["metadata"]["namespace"] for o in objects if (o.get("metadata") or {}).get("namespace")})
    for ns in namespaces:
        if client.ensure({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}):
            log(f"created Namespace {ns}")
    failures = []
    for obj in objects:
        try:
            client.create(obj, dry_run=True)
            log(f"ok     {describe(obj)}")
        except ApiError as e:
            failures.append(str(e))
            hint = ("\n       (this API server runs without --allow-privileged=true, which kubeadm, kind "
                    "and managed clusters set)" if "privileged: Forbidden: disallowed by cluster policy" in str(e) else "")
            log(f"FAILED {e}{hint}")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), required="KUBECONFIG" not in os.environ)
    p.add_argument("--context")
    p.add_argument("--crd", action="append", default=[], help="CRD manifest to create (for real) first")
    p.add_argument("manifests", nargs="+")
    args = p.parse_args(argv)
    client = Client(args.kubeconfig, args.context)
    try:
        objects = load_objects(args.manifests)
        crds = [o for o in load_objects(args.crd) if o.get("kind") == "CustomResourceDefinition"]
        failures = dry_run(client, objects, crds)
    except ApiError as e:
        print(f"dry_run: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if failures:
        print(f"{len(failures)} of {len(objects)} objects refused by the API server", file=sys.stderr)
        return 1
    print(f"server-side dry run: all {len(objects)} objects accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
