"""Deployment files, checked offline and fast (no Docker, no cluster):

* Kubernetes: the kustomize base and the example overlay are rendered (by ``kubectl
  kustomize`` where kubectl exists, and always by the small renderer below, which must agree
  with it), every manifest is validated against the Kubernetes API schemas with
  ``kubernetes-validate`` (strict: unknown fields fail), and the pieces are checked to fit
  together (selectors, ports, probes, /dev/shm, the token file, the service's own config).
* Compose: docker-compose.yml and the host-network and air-gapped overrides, parsed as YAML:
  shm_size, healthchecks, ports, profiles, dependencies, the files they mount, the Dockerfile
  targets and build settings (online by default, offline with the air-gapped override).
* Images: the Dockerfile, its allow-list build context, and deploy/docker/pip-install.sh's
  choice between the wheels (--no-index) and the package index, run with a stand-in pip.
* Monitoring: Prometheus configs, the Grafana provisioning and the dashboard's metric names
  against the metrics the service exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields

import pytest

from loader_service.config import ServiceConfig
from testkit.deploy import (  # noqa: F401 (what this module and its tests use)
    BASE, CLUSTER_SCOPED, K8S, OVERLAY, ROOT, Unsupported, _ComposeLoader, _KUSTOMIZATION_KEYS, _VAR, _compose, _containers, _key, _merge, _one, _split_image, interpolate, render, yaml)


# Oldest and newest API versions we check against (kubernetes-validate ships both).
K8S_VERSIONS = ("1.29.0", "1.37.0")
SERVICE_USER = 10001
# LOADER_* variables read outside ServiceConfig.
EXTRA_ENV = {"LOADER_CACHE_DIR"}


# ============================================================================ a tiny kustomize


def _normalize(obj):
    """Order-insensitive form for comparing renderings: named lists sorted by name."""
    if isinstance(obj, dict):
        return {k: _normalize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        items = [_normalize(x) for x in obj]
        if items and all(isinstance(x, dict) and "name" in x for x in items):
            items.sort(key=lambda x: str(x["name"]))
        return items
    return obj


@pytest.fixture(scope="module", params=["base", "overlay"])
def rendered(request):
    path = BASE if request.param == "base" else OVERLAY
    docs = render(path)
    return request.param, {_key(d): d for d in docs}


def _named(docs: dict, kind: str, name: str) -> dict:
    found = [d for (k, _, n), d in docs.items() if k == kind and n == name]
    assert found, f"no {kind}/{name} in the rendering"
    return found[0]


# ---------------------------------------------------------------------------- kubernetes
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed: the built-in renderer is used alone")
@pytest.mark.parametrize("path", [BASE, OVERLAY, K8S / "overlays" / "stall-keda", K8S / "overlays" / "stall-hpa"],
                         ids=["base", "overlay", "stall-keda", "stall-hpa"])
def test_builtin_renderer_agrees_with_kubectl_kustomize(path):
    p = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    theirs = {_key(d): _normalize(d) for d in yaml.safe_load_all(p.stdout) if d}
    ours = {_key(d): _normalize(d) for d in render(path)}
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert ours[key] == theirs[key], f"{key} differs between the test renderer and kubectl kustomize"


def test_renderer_refuses_what_it_does_not_handle(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(Unsupported, match="commonLabels"):
        render(tmp_path)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_are_valid_kubernetes_objects(rendered, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) missing")

    _, docs = rendered
    errors = []
    for key, doc in docs.items():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{key}: {exc.message} at {'/'.join(map(str, exc.path))}")
    assert not errors, "\n".join(errors)


def test_workload_fits_together(rendered):
    which, docs = rendered
    sts = _one(docs, "StatefulSet")
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert set(sts["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())

    # headless Service for per-pod DNS, a regular one for the REST API
    headless = _named(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # ready pods only: a terminating pod (a scale-down, a rolling update) leaves the name at once
    assert headless["spec"]["publishNotReadyAddresses"] is False
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {"data", "http"} <= set(ports)
    for svc in [d for (k, _, _), d in docs.items() if k == "Service"]:
        assert set(svc["spec"]["selector"].items()) <= set(labels.items()), svc["metadata"]["name"]
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"{svc['metadata']['name']}: targetPort {p['targetPort']} not a port name"

    # config: the ConfigMap is a valid service configuration and agrees with the pod
    cm_name = c["envFrom"][0]["configMapRef"]["name"]
    env = _named(docs, "ConfigMap", cm_name)["data"]
    fields_env = {f"LOADER_{f.name.upper()}" for f in fields(ServiceConfig)}
    assert set(env) - fields_env - EXTRA_ENV == set(), "unknown LOADER_* variables"
    config = ServiceConfig.from_env(environ=env)  # raises if a value is invalid
    assert config.host == "0.0.0.0"
    assert (config.data_port, config.http_port) == (ports["data"], ports["http"])
    if which == "overlay":
        assert not config.demo and config.data == ("/data",)

    # probes
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"

    # /dev/shm: RAM-backed, bounded, bigger than the service's cap, inside the memory limit
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    shm_bytes = _quantity(shm["sizeLimit"])
    assert config.max_shm_bytes < shm_bytes, "LOADER_MAX_SHM_MB must stay below the /dev/shm sizeLimit"
    res = c["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(res[kind]), f"resources.{kind} needs cpu and memory"
    assert _quantity(res["limits"]["memory"]) > shm_bytes, "memory limit must cover /dev/shm (it counts)"
    assert config.workers <= _quantity(res["limits"]["cpu"]), "more workers than CPUs"

    # non-root, read-only root filesystem with writable /tmp and cache
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == SERVICE_USER
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    if c["securityContext"].get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts and env.get("LOADER_CACHE_DIR") in mounts

    # the API token: a Secret mounted as a file that LOADER_API_TOKEN_FILE names
    token_dir, token_file = os.path.split(env["LOADER_API_TOKEN_FILE"])
    secret_vol = volumes[mounts[token_dir]["name"]]["secret"]
    assert token_file in [i["path"] for i in secret_vol.get("items", [{"path": token_file}])]
    if which == "overlay":
        secret = _named(docs, "Secret", secret_vol["secretName"])
        assert "token" in secret["data"]

    # the dataset volume
    assert mounts["/data"]["readOnly"] is True
    if which == "overlay":
        claim = volumes[mounts["/data"]["name"]]["persistentVolumeClaim"]["claimName"]
        _named(docs, "PersistentVolumeClaim", claim)

    # Prometheus scrape annotations point at the REST port
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == ports["http"]

    # PDB and HPA act on this StatefulSet
    pdb = _one(docs, "PodDisruptionBudget")
    assert set(pdb["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())
    hpa = _one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": sts["metadata"]["name"]}
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert hpa["spec"]["minReplicas"] <= sts["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def test_overlay_customizes_the_base():
    docs = {_key(d): d for d in render(OVERLAY)}
    sts = _one(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 4
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/ml/loader-service:0.1.0"
    for kind, ns, name in docs:
        if kind not in CLUSTER_SCOPED:
            assert ns == "data-loading", f"{kind}/{name} not in the overlay's namespace"


def _quantity(q) -> float:
    """Kubernetes quantity -> number (bytes or cores)."""
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(q))
    assert m, f"bad quantity {q!r}"
    mult = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
            "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * mult


# ============================================================================ compose


# Compose's merge tags in override files: keep the value, remember the tag.
for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, lambda loader, node, tag=_tag: {
        "__tag__": tag, "value": (loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else
                                  loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else
                                  loader.construct_scalar(node))})


def _size(s: str) -> int:
    m = re.fullmatch(r"(\d+)([bkmg]?)", s.lower())
    assert m, f"bad size {s!r}"
    return int(m.group(1)) * {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2)]


def test_compose_service_settings():
    c = _compose("docker-compose.yml")
    svc = c["services"]["loader"]
    env = {k: interpolate(v) for k, v in svc["environment"].items()}
    assert set(env) - {f"LOADER_{f.name.upper()}" for f in fields(ServiceConfig)} - EXTRA_ENV == set()
    config = ServiceConfig.from_env(environ=env)  # the defaults make a valid configuration
    assert config.demo and config.host == "0.0.0.0"
    # /dev/shm: set, and larger than what the service may put there
    shm = _size(interpolate(svc["shm_size"]))
    assert shm >= 256 * 2**20 and config.max_shm_bytes < shm
    # healthcheck in exec form against the REST port; restart policy; graceful stop
    hc = svc["healthcheck"]
    assert hc["test"][0] == "CMD" and "/readyz" in " ".join(hc["test"])
    assert {"interval", "timeout", "retries", "start_period"} <= set(hc)
    assert svc["restart"] in ("unless-stopped", "always", "on-failure")
    assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert svc["read_only"] is True and "/tmp" in svc["tmpfs"] and svc["cap_drop"] == ["ALL"]
    # ports 5555 (data) and 8080 (REST) inside, published on the host
    published = {interpolate(p).split(":")[-1] for p in svc["ports"]}
    assert published == {str(config.data_port), str(config.http_port)}
    mounts = [interpolate(v).split(":") for v in svc["volumes"]]
    assert ["dataset", "/data", "ro"] in mounts and any(m[1] == env["LOADER_CACHE_DIR"] for m in mounts)
    # a user's folder is mounted at its own path, so the service names it as `serve --data` does
    assert interpolate(svc["environment"]["LOADER_DATA"], {"DATASET_DIR": "/srv/x"}) == "/srv/x"
    assert ["/srv/x", "/srv/x", "ro"] in [interpolate(v, {"DATASET_DIR": "/srv/x"}).split(":") for v in svc["volumes"]]
    # LOADER_DEMO stays on by default: the service serves the demo only when no dataset is given
    with_data = ServiceConfig.from_env(environ={k: interpolate(v, {"DATASET_DIR": "/srv/x"})
                                                for k, v in svc["environment"].items()})
    assert with_data.data == ("/srv/x",) and with_data.demo
    assert "profiles" not in svc


def test_compose_trainer_and_profiles():
    c = _compose("docker-compose.yml")
    services = c["services"]
    trainer = services["trainer"]
    assert trainer["depends_on"]["loader"]["condition"] == "service_healthy"
    cmd = [interpolate(x) for x in trainer["command"]]
    assert cmd[:3] == ["python3", "-m", "client.demo"]
    assert cmd[cmd.index("--endpoint") + 1] == "tcp://loader:5555"
    assert "profiles" not in trainer
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], f"{name} belongs to the monitoring profile"
    # the files compose mounts exist
    for svc in services.values():
        for v in svc.get("volumes", []):
            src = interpolate(v).split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{src} is mounted but missing"
    # build targets exist in the Dockerfile; the ordinary build: the Dockerfile's public base
    # image and the build network of the engine (the package index must be reachable)
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", dockerfile, re.M | re.I)
    for name in ("loader", "trainer"):
        b = services[name]["build"]
        assert b["target"] in stages
        assert interpolate(b["args"]["BASE_IMAGE"]) == _dockerfile_arg("BASE_IMAGE") == PUBLIC_BASE
        assert interpolate(b["args"]["BASE_IMAGE"], {"BASE_IMAGE": "my/base:1"}) == "my/base:1"
        assert "network" not in b, "the ordinary build needs the network (air-gapped: docker-compose.airgap.yml)"
        assert "WHEELS" not in b["args"], "the ordinary build uses wheels when present, the index otherwise"
    assert services["loader"]["build"]["target"] == "service" and services["trainer"]["build"]["target"] == "trainer"
    torch_index = interpolate(services["trainer"]["build"]["args"]["TORCH_INDEX_URL"])
    assert torch_index == _dockerfile_arg("TORCH_INDEX_URL") and torch_index.endswith("/cpu"), \
        "the trainer's torch must be the CPU build (PyPI's is the CUDA one)"
    assert set(c["volumes"]) >= {"dataset", "loader-cache"}


def test_airgap_override_makes_the_build_offline():
    base = _compose("docker-compose.yml")["services"]
    over = _compose("docker-compose.airgap.yml")["services"]
    built = {name for name, svc in base.items() if "build" in svc}
    assert set(over) == built == {"loader", "trainer"}, "the override covers exactly the services that build"
    for name, svc in over.items():
        assert set(svc) == {"build"}, f"{name}: the air-gapped override changes the build only"
        b = svc["build"]
        assert b["network"] == "none", "no network during the build (and bridge-less engines cannot give one)"
        assert b["args"]["WHEELS"] == "required", "wheels only: no fallback to the package index"
        assert interpolate(b["args"]["BASE_IMAGE"]) == "loader-base:bookworm", "the debootstrapped base image"
        assert interpolate(b["args"]["BASE_IMAGE"], {"BASE_IMAGE": "my/base:1"}) == "my/base:1"
    # build-base.sh makes the image the override names
    assert re.search(r"^BASE_IMAGE=\$\{BASE_IMAGE:-loader-base:bookworm\}",
                     (ROOT / "deploy/docker/build-base.sh").read_text(), re.M)


def test_hostnet_override_covers_every_service():
    base = _compose("docker-compose.yml")["services"]
    over = _compose("docker-compose.hostnet.yml")["services"]
    assert set(over) == set(base), "every service needs network_mode: host in the override"
    for name, svc in over.items():
        assert svc["network_mode"] == "host", name
        if "ports" in base[name]:
            assert svc.get("ports") == {"__tag__": "!reset", "value": []}, f"{name}: reset its ports"
    env = over["loader"]["environment"]
    assert interpolate(env["LOADER_DATA_PORT"], {"DATA_PORT": "15555"}) == "15555"
    assert interpolate(env["LOADER_HTTP_PORT"], {"HTTP_PORT": "18080"}) == "18080"
    cmd = [interpolate(x, {"DATA_PORT": "15555"}) for x in over["trainer"]["command"]]
    assert cmd[cmd.index("--endpoint") + 1] == "tcp://127.0.0.1:15555"
    prom = over["prometheus"]["volumes"]
    assert prom["__tag__"] == "!override" and (ROOT / prom["value"][0].split(":")[0]).exists()


def test_colocated_override_shares_the_loaders_shared_memory_with_the_trainer():
    """docker-compose.colocated.yml: the trainer joins the loader's IPC namespace (host networking
    alone does not share /dev/shm) and asks for batches in place; nothing else changes, so it
    combines with the host-network and air-gapped files (tests/container/test_compose_colocated.py
    runs it)."""
    base = _compose("docker-compose.yml")["services"]
    over = _compose("docker-compose.colocated.yml")["services"]
    assert over == {"loader": {"ipc": "shareable"},
                    "trainer": {"ipc": "service:loader", "environment": {"TRAINER_LOCAL": "1"}}}
    assert interpolate(base["trainer"]["environment"]["TRAINER_LOCAL"]) == "0"
    assert interpolate(base["trainer"]["environment"]["TRAINER_LOCAL"], {"TRAINER_LOCAL": "1"}) == "1"
    users = re.findall(r"^USER (\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert users and set(users) == {"10001:10001"}, "the segments are 0600: loader and trainer need one user"


PUBLIC_BASE = "python:3.11-slim-bookworm"


def _dockerfile_arg(name: str) -> str:
    """The default of an ARG in the Dockerfile (the same wherever it is declared)."""
    values = set(re.findall(rf"^ARG {name}=(\S+)", (ROOT / "Dockerfile").read_text(), re.M))
    assert len(values) == 1, f"ARG {name}: {values or 'no default'}"
    return values.pop()


def test_dockerfile_and_context():
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M), "a syntax line makes BuildKit pull a frontend image"
    assert _dockerfile_arg("BASE_IMAGE") == PUBLIC_BASE, "the default build starts from the public Python image"
    assert _dockerfile_arg("WHEELS") == "auto"
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I)
    assert {"service", "trainer"} <= set(stages) and stages[-1] == "service", "service is the default target"
    assert re.search(rf"^USER {SERVICE_USER}", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD", text, re.M) and "/healthz" in text
    assert re.search(r'^ENTRYPOINT \["/usr/bin/tini", "--"', text, re.M)
    # the base stage adds tini (python:slim has none) where the base lacks it, at the path used above
    assert "[ -x /usr/bin/tini ] || pkgs=" in text
    assert text.count("pip-install.sh deps") == 2 and text.count("pip-install.sh project") == 2
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") if "*" in ignore else 0] == "*", ".dockerignore is an allow-list"
    # everything the Dockerfile copies from the context is admitted by the allow-list and exists
    # in a fresh checkout: the wheels folders through their tracked .keep files
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        for src in line.split()[:-1]:
            src = src.rstrip("/")
            if "[" in src:  # README.m[d]: optional by design
                continue
            assert any(src == a[1:].rstrip("/") or src.startswith(a[1:]) for a in ignore if a.startswith("!")), \
                f"COPY {src}: not in .dockerignore's allow-list"
            assert (ROOT / src).exists(), f"COPY {src}: missing"
    for target in ("service", "trainer"):
        keep = f"deploy/docker/wheels/{target}/.keep"
        assert (ROOT / keep).is_file(), f"{keep} keeps the folder the Dockerfile copies"
        if shutil.which("git") and (ROOT / ".git").exists():
            ignored = subprocess.run(["git", "check-ignore", "-q", keep], cwd=ROOT, timeout=30).returncode
            assert ignored == 1, f"{keep} must not be git-ignored (the folder would vanish from a clone)"
            wheel = f"deploy/docker/wheels/{target}/x-1-py3-none-any.whl"
            assert subprocess.run(["git", "check-ignore", "-q", wheel], cwd=ROOT, timeout=30).returncode == 0, \
                "downloaded wheels must stay out of git"


@pytest.fixture
def pip_install(tmp_path):
    """Run deploy/docker/pip-install.sh as the build does, with a stand-in `pip` that logs its
    arguments, and the project's pyproject.toml and requirements.py in a stand-in /src."""
    src, wheels, bin_ = tmp_path / "src", tmp_path / "wheels", tmp_path / "bin"
    for d in (src, wheels / "service", wheels / "trainer", bin_):
        d.mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "deploy/docker/requirements.py", src)
    log = tmp_path / "pip.log"
    (bin_ / "pip").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_ / "pip").chmod(0o755)
    (bin_ / "python3").symlink_to(shutil.which("python3") if sys.version_info < (3, 11) else sys.executable)

    def run(step, target, wheels_for=(), **env):
        for t in wheels_for:
            (wheels / t / "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
        log.write_text("")
        p = subprocess.run(["sh", str(ROOT / "deploy/docker/pip-install.sh"), step, target], capture_output=True,
                           text=True, timeout=60, env={"PATH": f"{bin_}:/usr/bin:/bin", "WHEELS_DIR": str(wheels),
                                                        "SRC_DIR": str(src), **env})
        return p.returncode, p.stderr, log.read_text().splitlines()

    return run


def test_pip_install_without_wheels_uses_the_index(pip_install):
    rc, err, calls = pip_install("deps", "service")
    assert rc == 0, err
    assert calls == [f"install -r {calls[0].split()[-1]}"] and "from the package index" in err
    rc, err, calls = pip_install("project", "service")
    assert rc == 0 and calls == [f"install --no-deps {calls[0].split()[-1]}"], (err, calls)
    # the trainer: torch from the CPU index first, then the rest from the index
    rc, err, calls = pip_install("deps", "trainer")
    assert rc == 0, err
    assert calls[0].startswith("install --index-url https://download.pytorch.org/whl/cpu torch"), calls
    assert calls[1].startswith("install -r ") and len(calls) == 2
    rc, err, calls = pip_install("deps", "trainer", TORCH_INDEX_URL="http://mirror.example/torch-cpu")
    assert calls[0].startswith("install --index-url http://mirror.example/torch-cpu torch"), calls


def test_pip_install_with_wheels_is_offline(pip_install):
    rc, err, calls = pip_install("deps", "service", wheels_for=["service"], WHEELS="required")
    assert rc == 0, err
    assert len(calls) == 1 and calls[0].startswith("install --no-index --find-links ") and "/wheels/service" in calls[0]
    rc, err, calls = pip_install("project", "trainer", wheels_for=["trainer"])
    assert rc == 0, err
    assert len(calls) == 1 and calls[0].startswith("install --no-index") and "--no-deps" in calls[0]
    assert "/wheels/trainer" in calls[0] and "/wheels/service" in calls[0], "the build backend is in service/"


def test_pip_install_airgapped_without_wheels_fails_at_once(pip_install):
    for step in ("deps", "project"):
        rc, err, calls = pip_install(step, "trainer", WHEELS="required")
        assert rc == 3 and calls == [] and "fetch-wheels.sh" in err, (rc, err, calls)
    rc, err, calls = pip_install("deps", "service", WHEELS="sometimes")
    assert rc == 2 and calls == []


def test_requirements_split_keeps_torch_out_of_the_service():
    import runpy

    mod = runpy.run_path(str(ROOT / "deploy" / "docker" / "requirements.py"))
    service = mod["requirements"]("service", str(ROOT / "pyproject.toml"))
    trainer = mod["requirements"]("trainer", str(ROOT / "pyproject.toml"))
    assert not any(r.lower().startswith("torch") for r in service)
    assert any(r.lower().startswith("torch") for r in trainer)
    assert any(r.lower().startswith("fastapi") for r in service) and any(r.startswith("pyzmq") for r in service)


@pytest.mark.parametrize("script", [".ci/container-prereqs.sh", ".ci/apt-install.sh", ".ci/dns-prereqs.sh",
                                    ".ci/scaling-prereqs.sh", "deploy/install-prerequisites.sh",
                                    "deploy/docker/build-base.sh",
                                    "deploy/docker/fetch-wheels.sh", "deploy/docker/pip-install.sh"])
def test_shell_scripts_parse(script):
    path = ROOT / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    p = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("compose, engine_up, rc, says", [
    ("2.40.3", True, 0, "next: from the repository root, docker compose run --rm trainer"),
    ("1.29.2", True, 1, "missing: compose-v2"),
    ("v2.20.2", True, 1, "missing: compose-v2"),  # older than the overrides need
    ("2.40.3", False, 1, "missing: engine-running"),
])
def test_prerequisites_check_names_what_is_missing_and_the_next_step(tmp_path, compose, engine_up, rc, says):
    """deploy/install-prerequisites.sh --check against a stand-in docker CLI: ready means an engine
    it can reach and Compose v2 >= 2.24; either way it ends with the next command."""
    stub = tmp_path / "docker"
    stub.write_text("#!/bin/sh\n"
                    f'[ "$1" = compose ] && {{ echo {compose}; exit 0; }}\n'
                    f'[ "$1" = version ] && {{ {"echo Docker Engine 28.2.2; exit 0" if engine_up else "exit 1"}; }}\n'
                    "exit 2\n")
    stub.chmod(0o755)
    p = subprocess.run(["sh", str(ROOT / "deploy/install-prerequisites.sh"), "--check"], capture_output=True,
                       text=True, timeout=30, env=dict(os.environ, DOCKER=str(stub)))
    assert p.returncode == rc, p.stdout + p.stderr
    assert says in p.stdout and "next: " in p.stdout, p.stdout


# ============================================================================ monitoring
def _exported_metrics() -> set:
    """Metric names the service exports, as Prometheus exposes them."""
    src = (ROOT / "loader_service" / "control" / "metrics.py").read_text()
    names = set()
    for m in re.finditer(r'(Counter|Gauge)MetricFamily\(\s*"(loader_\w+)"', src):
        names.add(m.group(2) + ("_total" if m.group(1) == "Counter" else ""))
    for m in re.finditer(r'\(\s*"(loader_\w+)",\s*"\w+",\s*"[^"]*"\s*\)', src):  # the counters table
        names.add(m.group(1) + "_total")
    return names


def test_prometheus_configs():
    for name, target in (("prometheus.yml", "loader:8080"), ("prometheus.hostnet.yml", "127.0.0.1:8080")):
        cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / name).read_text())
        (job,) = cfg["scrape_configs"]
        assert job["metrics_path"] == "/metrics"
        assert job["static_configs"][0]["targets"] == [target]


def test_grafana_dashboard_uses_exported_metrics():
    exported = _exported_metrics()
    assert {"loader_samples_total", "loader_workers_target", "loader_stage_seconds_total"} <= exported
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "loader-service.json").read_text())
    assert dash["uid"] and dash["panels"]
    used = set()
    for panel in dash["panels"]:
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "prometheus"
            used |= set(re.findall(r"\bloader_\w+", t["expr"]))
    assert used - exported == set(), f"dashboard queries metrics the service does not export: {used - exported}"
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus"
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/loader-service.yml").read_text())
    grafana = _compose("docker-compose.yml")["services"]["grafana"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounted[prov["providers"][0]["options"]["path"]] == "./deploy/grafana/dashboards"
