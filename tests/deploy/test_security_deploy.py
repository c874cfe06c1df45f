"""Safe defaults in the deployment files (docs/security.md): loopback-bound compose ports, no
Grafana admin/admin, CURVE keys mounted read-only, a NetworkPolicy in front of the data port."""

from __future__ import annotations

import pytest

from testkit.deploy import BASE, OVERLAY, _compose, _key, _one, interpolate, render


def test_compose_publishes_on_loopback_unless_told():
    services = _compose("docker-compose.yml")["services"]
    for name, svc in services.items():
        for p in svc.get("ports", []):
            host = interpolate(p).rsplit(":", 2)[0]
            assert host == "127.0.0.1", f"{name}: {p} must bind LOADER_BIND (default 127.0.0.1)"
            assert interpolate(p, {"LOADER_BIND": "10.0.0.5"}).startswith("10.0.0.5:"), f"{name}: {p}"
    hostnet = _compose("docker-compose.hostnet.yml")["services"]["loader"]["environment"]["LOADER_HOST"]
    assert "LOADER_BIND:-127.0.0.1" in hostnet


def test_grafana_has_no_default_admin():
    env = _compose("docker-compose.yml")["services"]["grafana"]["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env, "no admin/admin default"
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == "true"
    assert env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and env["GF_AUTH_BASIC_ENABLED"] == "false"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_compose_curve_override():
    base = _compose("docker-compose.yml")
    over = _compose("docker-compose.curve.yml")
    keys = over["services"]["keys"]
    assert keys["command"] == ["keys", "/keys", "--if-missing"] and keys["network_mode"] == "none"
    assert interpolate(keys["image"]) == interpolate(base["services"]["loader"]["image"])
    for name in ("loader", "trainer"):
        svc = over["services"][name]
        assert svc["environment"]["LOADER_CURVE_KEYS"] == "/keys"
        assert interpolate(svc["volumes"][0]) == "loader-keys:/keys:ro", name
        assert interpolate(svc["volumes"][0], {"LOADER_KEYS": "/srv/keys"}) == "/srv/keys:/keys:ro"
    assert over["services"]["loader"]["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert "loader-keys" in over["volumes"]


@pytest.mark.parametrize("path", [BASE, OVERLAY], ids=["base", "overlay"])
def test_k8s_curve_keys_and_network_policy(path):
    docs = {_key(d): d for d in render(path)}
    sts = _one(docs, "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = _one(docs, "ConfigMap")["data"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    keys = mounts[env["LOADER_CURVE_KEYS"]]
    assert keys["readOnly"] is True
    vol = {v["name"]: v for v in spec["volumes"]}[keys["name"]]
    assert vol["secret"]["secretName"] == "loader-curve-keys" and vol["secret"]["defaultMode"] == 0o440

    pol = _one(docs, "NetworkPolicy")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert set(pol["spec"]["podSelector"]["matchLabels"].items()) <= set(labels.items())
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    by_port = {r["ports"][0]["port"]: r["from"] for r in pol["spec"]["ingress"]}
    assert set(by_port) == {"data", "http"}
    assert by_port["data"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"remote-loader/trainer": "true"}}}]
    names = {p["name"] for p in c["ports"]}
    assert set(by_port) <= names
