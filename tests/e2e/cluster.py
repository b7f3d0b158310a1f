#!/usr/bin/env python3
"""A real, local Kubernetes control plane for the end-to-end tests.

Starts etcd, kube-apiserver and kube-scheduler (real binaries, built by
``bash tests/e2e/build.sh`` into ``.cache/e2e/bin``), all listening on
127.0.0.1 only, on free ports picked at start-up.  There is no kubelet, no
kube-controller-manager and no container runtime: tests create Node objects
themselves (status through the ``nodes/status`` subresource) and the real
scheduler binds pods to them.  Consequences worth knowing:

* no controller adds ``node.kubernetes.io/not-ready`` taints, nor creates the
  ``default`` ServiceAccounts, nor finalizes deleted namespaces, nor garbage
  collects by ownerReferences;
* the ``ServiceAccount`` admission plugin is disabled (it would reject every
  pod, the default ServiceAccount never being created), and so is
  ``TaintNodesByCondition`` (it taints every new Node
  ``node.kubernetes.io/not-ready:NoSchedule``, a taint that only the node
  lifecycle controller removes): new nodes are untainted, set their ``Ready``
  condition anyway;
* a pod bound to a node has nobody to confirm its termination: delete it with
  ``grace_period_seconds=0`` or it stays ``Terminating``.

Command line (Python 3.11, stdlib only; ``openssl`` CLI for the PKI)::

    python tests/e2e/cluster.py up [--workdir DIR] [--detach]
    python tests/e2e/cluster.py down [--workdir DIR]

``up`` prints the admin kubeconfig path on stdout (``export KUBECONFIG=...``)
and stays in the foreground until Ctrl-C/SIGTERM, then stops everything.  With
``--detach`` it returns once the cluster is ready and leaves the processes
running; ``down`` stops them (it also stops a foreground ``up``).  The state
(pids, ports, paths) is kept in ``DIR/cluster.json``; DIR defaults to
``.cache/e2e/run``.  Logs: ``DIR/logs/{etcd,kube-apiserver,kube-scheduler}.log``.

From Python::

    cluster = start_cluster(workdir)      # -> Cluster, ready to use
    cluster.kubeconfig, cluster.server    # admin kubeconfig path, https URL
    cluster.stop()                        # also: `with start_cluster(d) as c:`
    cluster.restart("etcd")               # same command line: ports, flags, data (fault tests)

Environment: ``E2E_CACHE`` (default ``<repo>/.cache/e2e``), ``E2E_ETCD`` (an
etcd binary to use instead of ``$E2E_CACHE/bin/etcd`` or ``etcd`` on PATH).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import ctypes
import dataclasses
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
STATE_FILE = "cluster.json"
COMPONENTS = ("etcd", "kube-apiserver", "kube-scheduler")


class ClusterError(RuntimeError):
    """A component failed to start or died; the message names it and has its log tail."""

    def __init__(self, component: str, message: str, log: Path | None = None):
        self.component = component
        text = f"{component}: {message}"
        if log is not None:
            text += f"\n--- last lines of {log} ---\n{log_tail(log)}"
        super().__init__(text)


class BinariesMissing(ClusterError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("E2E_CACHE") or REPO_ROOT / ".cache" / "e2e")


def default_workdir() -> Path:
    return cache_dir() / "run"


@dataclasses.dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path


def find_binaries() -> Binaries:
    """Locate the binaries, or raise BinariesMissing naming the missing ones."""
    bindir = cache_dir() / "bin"
    found: dict[str, Path | None] = {}
    etcd = os.environ.get("E2E_ETCD")
    if etcd:
        found["etcd"] = Path(etcd) if os.access(etcd, os.X_OK) else None
    else:
        cand = bindir / "etcd"
        which = shutil.which("etcd")
        found["etcd"] = cand if os.access(cand, os.X_OK) else (Path(which) if which else None)
    for name in ("kube-apiserver", "kube-scheduler"):
        cand = bindir / name
        found[name] = cand if os.access(cand, os.X_OK) else None
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise BinariesMissing(
            "e2e binaries",
            f"not built: {', '.join(missing)} (looked in {bindir}); run: bash tests/e2e/build.sh",
        )
    return Binaries(found["etcd"], found["kube-apiserver"], found["kube-scheduler"])  # type: ignore[arg-type]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(data.splitlines()[-lines:]) or "(empty log)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------- PKI


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError("pki", f"openssl {' '.join(args)} failed:\n{proc.stderr.strip()}")


def _new_key(pki: Path, name: str) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", f"{name}.key", cwd=pki)


def _sign(pki: Path, name: str, subject: str, ext: str, ca: str = "ca") -> None:
    """Key ``name.key`` + certificate ``name.crt`` signed by ``ca``.crt with extensions ``ext``."""
    _new_key(pki, name)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    (pki / f"{name}.ext").write_text(f"[v3]\n{ext}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "365", "-sha256", "-extfile", f"{name}.ext",
             "-extensions", "v3", "-out", f"{name}.crt", cwd=pki)


def generate_pki(pki: Path) -> None:
    """CA, apiserver serving cert, client certs (admin, scheduler), service-account keys."""
    if shutil.which("openssl") is None:
        raise ClusterError("pki", "the openssl command is needed to generate the certificates")
    pki.mkdir(parents=True, exist_ok=True)
    _new_key(pki, "ca")
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=dynpart-e2e-ca", "-days", "365",
             "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", "ca.crt", cwd=pki)
    sans = ",".join([
        "IP:127.0.0.1", "IP:10.0.0.1", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local",
    ])
    _sign(pki, "apiserver", "/CN=kube-apiserver",
          "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
          f"extendedKeyUsage=serverAuth\nsubjectAltName={sans}")
    client_ext = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                  "extendedKeyUsage=clientAuth")
    _sign(pki, "admin", "/O=system:masters/CN=kubernetes-admin", client_ext)
    _sign(pki, "scheduler", "/CN=system:kube-scheduler", client_ext)
    # Front proxy (aggregation layer), as kubeadm sets it up: a second CA.
    _new_key(pki, "front-proxy-ca")
    _openssl("req", "-x509", "-new", "-key", "front-proxy-ca.key", "-subj", "/CN=dynpart-e2e-front-proxy-ca",
             "-days", "365", "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", "front-proxy-ca.crt", cwd=pki)
    _sign(pki, "front-proxy-client", "/CN=front-proxy-client", client_ext, ca="front-proxy-ca")
    _new_key(pki, "sa")
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for p in pki.iterdir():
        if p.suffix in (".key",):
            p.chmod(0o600)


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A kubeconfig (JSON, which is valid YAML) with the certificates embedded."""
    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "dynpart-e2e",
                      "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(f"{user}.crt"),
                                          "client-key-data": b64(f"{user}.key")}}],
        "contexts": [{"name": "dynpart-e2e", "context": {"cluster": "dynpart-e2e", "user": user}}],
        "current-context": "dynpart-e2e",
        "preferences": {},
    }
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    path.chmod(0o600)


# --------------------------------------------------------------- processes

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("KUBECONFIG", "ETCDCTL_API"):
        env.pop(k, None)
    no_proxy = "127.0.0.1,localhost"
    for k in ("NO_PROXY", "no_proxy"):
        env[k] = f"{env[k]},{no_proxy}" if env.get(k) else no_proxy
    return env


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_component(pid: int, name: str) -> bool:
    """Whether ``pid`` still runs the binary ``name`` (and is not a reused pid)."""
    argv0 = _pid_cmdline(pid).split(" ", 1)[0]
    return _pid_alive(pid) and (argv0 == name or argv0.endswith("/" + name))


def _terminate_pid(pid: int, timeout: float = 15.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _port_in_use(log: Path) -> bool:
    return "address already in use" in log_tail(log, 80).lower()


@dataclasses.dataclass
class Cluster:
    """A running control plane. ``stop()`` is idempotent; also a context manager."""

    workdir: Path
    kubeconfig: Path  # admin (O=system:masters)
    scheduler_kubeconfig: Path
    server: str  # https://127.0.0.1:<port>
    ca_file: Path
    etcd_url: str
    logs: dict[str, Path]
    pids: dict[str, int]
    etcd_data_dir: Path
    _procs: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict, repr=False)
    _stopped: bool = dataclasses.field(default=False, repr=False)
    # each component's command line, kept for restart(): same ports, flags and data dir
    _argv: dict[str, list[str]] = dataclasses.field(default_factory=dict, repr=False)
    _tie_to_parent: bool = dataclasses.field(default=False, repr=False)  # children get SIGTERM if we die
    _detachable: bool = dataclasses.field(default=False, repr=False)

    def ssl_context(self) -> ssl.SSLContext:
        """TLS context that trusts the cluster CA and presents the admin client cert."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        pki = self.workdir / "pki"
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return ctx

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """GET ``path`` on the apiserver as admin; returns (status, body)."""
        return _https_get(self.server + path, self.ssl_context(), timeout)

    def check(self) -> None:
        """Raise ClusterError if a component started by this process has exited."""
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise ClusterError(name, f"exited with code {proc.returncode}", self.logs[name])

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for name in reversed(COMPONENTS):
            proc = self._procs.get(name)
            if proc is not None:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            elif name in self.pids and _is_component(self.pids[name], name):
                _terminate_pid(self.pids[name])
        shutil.rmtree(self.etcd_data_dir, ignore_errors=True)
        (self.workdir / STATE_FILE).unlink(missing_ok=True)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """Start one component (its output appended to its log) and remember its command line."""
        log = self.logs[name]
        # PDEATHSIG fires when the *thread* that forked exits: only tie from the main thread (a
        # restart run in a worker thread leaves it to stop() and the atexit hook)
        tie = self._tie_to_parent and threading.current_thread() is threading.main_thread()
        with open(log, "ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                env=_child_env(), start_new_session=True,
                preexec_fn=_die_with_parent if tie else None,
            )
        self._procs[name] = proc
        self._argv[name] = list(argv)
        self.pids[name] = proc.pid
        return proc

    # --- restarts (the fault tests): same command line, so same ports, flags and etcd data ---

    def kill(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Stop one component this process started (SIGKILL after `timeout` if `sig` is not enough);
        `start(name)` brings it back. etcd's data dir is kept."""
        proc = self._procs.get(name)
        if proc is None:
            raise ClusterError(name, "not started by this process: cannot be restarted from here")
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def start(self, name: str, extra_args: list[str] | None = None, timeout: float = 60.0) -> float:
        """Start a stopped component again with its command line, plus `extra_args` for this run
        only (a repeated flag's last value wins; the next start goes back to the original line);
        return once it is ready (etcd healthy, the API server's /readyz, the scheduler's /readyz):
        the seconds that took."""
        proc = self._procs.get(name)
        if name not in self._argv:
            raise ClusterError(name, "not started by this process: cannot be restarted from here")
        if proc is not None and proc.poll() is None:
            raise ClusterError(name, "is still running")
        started = time.monotonic()
        base = self._argv[name]
        proc = self._spawn(name, base + list(extra_args or []))
        self._argv[name] = base
        _wait_until(name, proc, self.logs[name], timeout, self._ready_probe(name), "readiness after a restart")
        self.save_state(supervisor_pid=None if self._detachable else os.getpid())
        return time.monotonic() - started

    def restart(self, name: str, sig: int = signal.SIGTERM, down_s: float = 0.0,
                extra_args: list[str] | None = None, timeout: float = 60.0) -> float:
        """kill(name, sig), `down_s` seconds down, start(name): the seconds from the signal to ready."""
        began = time.monotonic()
        self.kill(name, sig)
        if down_s > 0:
            time.sleep(down_s)
        self.start(name, extra_args, timeout)
        return time.monotonic() - began

    def revive(self, timeout: float = 60.0) -> list[str]:
        """Start again every component that exited (a kube-scheduler exits when it loses its lease
        during a long API outage; a kubelet would restart it): the names started."""
        out = []
        for name in COMPONENTS:
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None and not self._stopped:
                self.start(name, timeout=timeout)
                out.append(name)
        return out

    def running(self, name: str) -> bool:
        proc = self._procs.get(name)
        return proc is not None and proc.poll() is None

    def _ready_probe(self, name: str):
        if name == "etcd":
            def etcd_healthy():
                status, body = _https_get(self.etcd_url + "/health", None, 2)
                return True if status == 200 and json.loads(body).get("health") == "true" else f"{status} {body[:200]!r}"
            return etcd_healthy
        if name == "kube-apiserver":
            return _readyz(self.server + "/readyz", self.ssl_context())
        port = next(a.split("=", 1)[1] for a in self._argv[name] if a.startswith("--secure-port="))
        return _readyz(f"https://127.0.0.1:{port}/readyz", _unverified_context())

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def save_state(self, supervisor_pid: int | None) -> None:
        state = {
            "server": self.server, "kubeconfig": str(self.kubeconfig),
            "scheduler_kubeconfig": str(self.scheduler_kubeconfig), "ca_file": str(self.ca_file),
            "etcd_url": self.etcd_url, "etcd_data_dir": str(self.etcd_data_dir),
            "logs": {k: str(v) for k, v in self.logs.items()}, "pids": self.pids,
            "supervisor_pid": supervisor_pid,
        }
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.workdir / STATE_FILE)


def _https_get(url: str, ctx: ssl.SSLContext | None, timeout: float) -> tuple[int, bytes]:
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if ctx is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ctx))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _readyz(url: str, ctx: ssl.SSLContext | None):
    """A readiness probe of `url` (a component's /readyz) for _wait_until."""
    def ready():
        status, body = _https_get(url, ctx, 5)
        return True if status == 200 else f"HTTP {status}: {body[-300:].decode(errors='replace')}"
    return ready


def _unverified_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # self-signed serving cert generated by the scheduler
    return ctx


def _wait_until(name: str, proc: subprocess.Popen, log: Path, timeout: float, probe, what: str) -> None:
    """Poll ``probe()`` (truthy = ready) until ``timeout``; fail fast if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    last = "not probed yet"
    while True:
        if proc.poll() is not None:
            raise ClusterError(name, f"exited with code {proc.returncode} while waiting for {what}", log)
        try:
            result = probe()
            if result is True:
                return
            last = str(result)
        except (OSError, ValueError, http.client.HTTPException) as e:  # connection refused, TLS not up yet, ...
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise ClusterError(name, f"not ready after {timeout:.0f}s waiting for {what} (last: {last})", log)
        time.sleep(0.25)


ETCD_DATA_PREFIX = "dynpart-e2e-etcd-"


def _remove_stale_etcd_dirs(parent: Path, min_age: float = 120.0) -> None:
    """Remove etcd data dirs left by killed runs (no live process names them)."""
    stale = [p for p in parent.glob(ETCD_DATA_PREFIX + "*")
             if p.is_dir() and time.time() - p.stat().st_mtime > min_age]
    if not stale:
        return
    in_use = " ".join(_pid_cmdline(int(d.name)) for d in Path("/proc").iterdir() if d.name.isdigit())
    for p in stale:
        if f"--data-dir={p} " not in in_use + " ":
            shutil.rmtree(p, ignore_errors=True)


def start_cluster(workdir: str | os.PathLike | None = None, *, timeout: float = 120.0,
                  detachable: bool = False, verbosity: int = 2) -> Cluster:
    """Start etcd, kube-apiserver, kube-scheduler; return once the scheduler leads.

    ``workdir`` holds pki/, kubeconfigs, logs/ and cluster.json (any previous
    content from an earlier, stopped run is replaced).  With ``detachable`` the
    processes do not die with this process (for ``up --detach``); otherwise they
    get SIGTERM if it dies, and are stopped at interpreter exit at the latest.
    Raises BinariesMissing, or ClusterError naming the failing component (and
    with the tail of its log); nothing is left running in that case.
    """
    bins = find_binaries()
    workdir = Path(workdir) if workdir is not None else default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    workdir = workdir.resolve()
    _refuse_if_running(workdir)
    for sub in ("pki", "logs", "scheduler-certs"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    pki, logs = workdir / "pki", workdir / "logs"
    logs.mkdir()
    generate_pki(pki)

    # etcd's data on tmpfs when there is one: fsync on CI disks is slow.
    shm = Path("/dev/shm")
    data_parent = shm if shm.is_dir() and os.access(shm, os.W_OK) else workdir
    _remove_stale_etcd_dirs(data_parent)
    etcd_data = Path(tempfile.mkdtemp(prefix=ETCD_DATA_PREFIX, dir=data_parent))

    cluster = Cluster(
        workdir=workdir, kubeconfig=workdir / "admin.kubeconfig",
        scheduler_kubeconfig=workdir / "scheduler.kubeconfig", server="", ca_file=pki / "ca.crt",
        etcd_url="", logs={name: logs / f"{name}.log" for name in COMPONENTS}, pids={},
        etcd_data_dir=etcd_data,
    )
    # Only tie the children's life to ours from the main thread: PDEATHSIG fires
    # when the *thread* that forked them exits.
    cluster._tie_to_parent = not detachable and threading.current_thread() is threading.main_thread()
    cluster._detachable = detachable
    spawn = cluster._spawn

    def start_with_retries(name: str, start) -> None:
        for attempt in range(3):
            try:
                start()
                return
            except ClusterError:
                proc = cluster._procs.get(name)
                if attempt < 2 and proc is not None and proc.poll() is not None and _port_in_use(cluster.logs[name]):
                    continue  # lost a race for a "free" port: pick others
                raise

    def start_etcd() -> None:
        client, peer = free_port(), free_port()
        cluster.etcd_url = f"http://127.0.0.1:{client}"
        shutil.rmtree(etcd_data, ignore_errors=True)
        proc = spawn("etcd", [
            str(bins.etcd), "--name=e2e", f"--data-dir={etcd_data}",
            f"--listen-client-urls={cluster.etcd_url}", f"--advertise-client-urls={cluster.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=e2e=http://127.0.0.1:{peer}", "--initial-cluster-state=new",
            "--logger=zap", "--log-outputs=stderr",
        ])

        def healthy():
            status, body = _https_get(cluster.etcd_url + "/health", None, 2)
            return True if status == 200 and json.loads(body).get("health") == "true" else f"{status} {body[:200]!r}"

        _wait_until("etcd", proc, cluster.logs["etcd"], timeout, healthy, "/health")

    def start_apiserver() -> None:
        port = free_port()
        cluster.server = f"https://127.0.0.1:{port}"
        proc = spawn("kube-apiserver", [
            str(bins.kube_apiserver),
            f"--etcd-servers={cluster.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",  # as kubeadm: the GPU agent DaemonSets are privileged
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Loopback addresses are invalid in Endpoints: do not publish any
            # for the "kubernetes" service (there is no pod network anyway).
            "--endpoint-reconciler-type=none",
            # No kube-controller-manager: nothing would create the "default"
            # ServiceAccounts (ServiceAccount admission then rejects every pod),
            # nor remove the not-ready taint TaintNodesByCondition puts on new
            # nodes once they report Ready (the node lifecycle controller does).
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            "--profiling=false",
            f"--v={verbosity}",
        ])
        _wait_until("kube-apiserver", proc, cluster.logs["kube-apiserver"], timeout,
                    _readyz(cluster.server + "/readyz", cluster.ssl_context()), "/readyz")

    def start_scheduler() -> None:
        port = free_port()
        write_kubeconfig(cluster.scheduler_kubeconfig, cluster.server, pki, "scheduler")
        kcfg = str(cluster.scheduler_kubeconfig)
        proc = spawn("kube-scheduler", [
            str(bins.kube_scheduler),
            f"--kubeconfig={kcfg}", f"--authentication-kubeconfig={kcfg}", f"--authorization-kubeconfig={kcfg}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={workdir / 'scheduler-certs'}",
            "--leader-elect=true", "--profiling=false", f"--v={verbosity}",
        ])
        _wait_until("kube-scheduler", proc, cluster.logs["kube-scheduler"], timeout,
                    _readyz(f"https://127.0.0.1:{port}/readyz", _unverified_context()), "/readyz")
        ctx = cluster.ssl_context()

        def leading():
            status, body = _https_get(
                cluster.server + "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler",
                ctx, 5)
            if status != 200:
                return f"lease kube-system/kube-scheduler: HTTP {status}"
            holder = json.loads(body).get("spec", {}).get("holderIdentity")
            return True if holder else "lease has no holder yet"

        _wait_until("kube-scheduler", proc, cluster.logs["kube-scheduler"], timeout, leading, "the leader lease")

    try:
        start_with_retries("etcd", start_etcd)
        start_with_retries("kube-apiserver", start_apiserver)
        write_kubeconfig(cluster.kubeconfig, cluster.server, pki, "admin")
        start_with_retries("kube-scheduler", start_scheduler)
        cluster.save_state(supervisor_pid=None if detachable else os.getpid())
    except BaseException:
        cluster.stop()
        raise
    if not detachable:
        atexit.register(cluster.stop)
    return cluster


def _load_state(workdir: Path) -> dict | None:
    try:
        return json.loads((workdir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _refuse_if_running(workdir: Path) -> None:
    state = _load_state(workdir)
    if not state:
        return
    alive = [name for name, pid in state.get("pids", {}).items() if _is_component(pid, name)]
    if alive:
        raise ClusterError("cluster", f"already running in {workdir} ({', '.join(alive)}): "
                           f"run `python {Path(__file__).name} down --workdir {workdir}` first")
    (workdir / STATE_FILE).unlink(missing_ok=True)


def stop_cluster(workdir: str | os.PathLike | None = None) -> bool:
    """Stop a cluster started (detached or in another process) in ``workdir``.

    Returns False when nothing was running there.
    """
    workdir = Path(workdir) if workdir is not None else default_workdir()
    state = _load_state(workdir)
    if not state:
        return False
    sup = state.get("supervisor_pid")
    if sup and sup != os.getpid() and "cluster.py" in _pid_cmdline(sup):
        _terminate_pid(sup, timeout=60)  # a foreground `up`: it stops its own children
    for name in reversed(COMPONENTS):
        pid = state.get("pids", {}).get(name)
        if pid and _is_component(pid, name):
            _terminate_pid(pid)
    if state.get("etcd_data_dir"):
        shutil.rmtree(state["etcd_data_dir"], ignore_errors=True)
    (workdir / STATE_FILE).unlink(missing_ok=True)
    return True


# -------------------------------------------------------------------- CLI


def _cmd_up(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster = start_cluster(args.workdir, timeout=args.timeout, detachable=args.detach)
    except ClusterError as e:
        print(f"cluster.py up: FAILED: {e}", file=sys.stderr)
        return 1
    print(cluster.kubeconfig, flush=True)
    print(f"cluster ready: server {cluster.server}, logs in {cluster.workdir / 'logs'}", file=sys.stderr)
    if args.detach:
        print(f"stop it with: python {__file__} down --workdir {cluster.workdir}", file=sys.stderr)
        return 0
    print("Ctrl-C or SIGTERM to stop", file=sys.stderr)
    rc = 0
    try:
        while not stop.wait(1.0):
            cluster.check()
    except ClusterError as e:
        print(f"cluster.py up: {e}", file=sys.stderr)
        rc = 1
    finally:
        cluster.stop()
    print("cluster stopped", file=sys.stderr)
    return rc


def _cmd_down(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else default_workdir()
    if stop_cluster(workdir):
        print(f"stopped the cluster in {workdir}", file=sys.stderr)
    else:
        print(f"no cluster running in {workdir}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster; print the admin kubeconfig path")
    up.add_argument("--workdir", default=None, help="default: .cache/e2e/run")
    up.add_argument("--detach", action="store_true", help="return once ready, leave it running")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds per component (default 120)")
    down = sub.add_parser("down", help="stop the cluster started in --workdir")
    down.add_argument("--workdir", default=None, help="default: .cache/e2e/run")
    args = parser.parse_args(argv)
    return _cmd_up(args) if args.cmd == "up" else _cmd_down(args)


if __name__ == "__main__":
    sys.exit(main())
