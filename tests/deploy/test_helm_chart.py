"""The Helm chart (deploy/helm/remote-loader), linted and rendered by Helm's own Go SDK (the
helm-python-sdk wheel: no helm binary comes from PyPI or Debian) and held to the Kustomize files:
at its defaults it renders deploy/k8s/base object for object; with the example overlay's values
it renders the overlay's workload; its stall scaling modes render the stall-keda ScaledObject and
the stall-hpa HPA. Every object it renders is valid for the Kubernetes API (KEDA's custom resource
aside, which tests/deploy/test_scaling_deploy.py checks)."""

from __future__ import annotations

import pytest

from tests.deploy.test_deploy import K8S_VERSIONS, _normalize
from testkit.deploy import BASE, K8S, OVERLAY, ROOT, render, yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) missing")

CHART = ROOT / "deploy" / "helm" / "remote-loader"
NS = "data-loading"
EXAMPLE = {
    "replicas": 4,
    "image": {"repository": "registry.example.com/ml/loader-service", "tag": "0.1.0"},
    "resources": {"requests": {"cpu": "15", "memory": "16Gi"}, "limits": {"cpu": "15", "memory": "20Gi"}},
    "shmSize": "4Gi",
    "datasetClaim": "imagenet",
    "config": {"LOADER_DEMO": "0", "LOADER_DATA": "/data", "LOADER_WORKERS": "14", "LOADER_MAX_SHM_MB": "3072"},
    "scaling": {"minReplicas": 4, "maxReplicas": 16},
}


def chart(values: dict, namespace: str = NS) -> dict:
    """The chart rendered with ``values``: (kind, name) -> object, without metadata.namespace."""
    with helm.Chart.load(str(CHART)) as c:
        out = c.render(values, name="loader", namespace=namespace)
    docs = [d for text in out.values() for d in yaml.safe_load_all(text) if d]
    return {(d["kind"], d["metadata"]["name"]): _normalize(d) for d in docs}


def kustomize(path) -> dict:
    out = {}
    for d in render(path):
        d["metadata"].pop("namespace", None)
        out[(d["kind"], d["metadata"]["name"])] = _normalize(d)
    return out


def test_lint_is_clean():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def test_defaults_render_the_kustomize_base():
    assert chart({}) == kustomize(BASE)


def test_example_values_render_the_example_overlays_workload():
    ours, theirs = chart(EXAMPLE), kustomize(OVERLAY)
    for key in (("StatefulSet", "loader"), ("ConfigMap", "loader-config"), ("HorizontalPodAutoscaler", "loader")):
        assert ours[key] == theirs[key], key
    # the overlay also makes the namespace, the PVC and an example token: out of the chart's scope
    assert set(theirs) - set(ours) == {("Namespace", NS), ("PersistentVolumeClaim", "imagenet"),
                                       ("Secret", "loader-api-token")}


@pytest.mark.parametrize("mode, overlay, kind", [("keda", "stall-keda", "ScaledObject"),
                                                 ("external", "stall-hpa", "HorizontalPodAutoscaler")])
def test_stall_modes_render_the_stall_overlays(mode, overlay, kind):
    ours = chart({**EXAMPLE, "scaling": {"mode": mode, "minReplicas": 2, "maxReplicas": 16}})
    theirs = kustomize(K8S / "overlays" / overlay)
    mine, other = ours[(kind, "loader")], theirs[(kind, "loader")]
    if kind == "ScaledObject":  # one query, however it is indented
        for obj in (mine, other):
            meta = obj["spec"]["triggers"][0]["metadata"]
            meta["query"] = " ".join(meta["query"].split())
    assert mine == other
    assert sum(k == "HorizontalPodAutoscaler" for k, _ in ours) == (mode == "external")
    # the scrape the query needs, for the Prometheus Operator: the overlay's PodMonitor
    assert ours[("PodMonitor", "loader")] == kustomize(K8S / "overlays" / "stall-keda")[("PodMonitor", "loader")]
    off = chart({**EXAMPLE, "scaling": {"mode": mode, "podMonitor": {"enabled": False}}})
    assert ("PodMonitor", "loader") not in off


def test_scaling_mode_none_and_a_bad_mode():
    assert not {k for k, _ in chart({"scaling": {"mode": "none"}})} & {"HorizontalPodAutoscaler", "ScaledObject"}
    with pytest.raises(helm.HelmError, match='scaling.mode must be cpu, keda, external or none, got "gpu"'):
        chart({"scaling": {"mode": "gpu"}})


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("mode", ["cpu", "external", "keda"])
def test_rendered_objects_are_valid(mode, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) missing")
    for (kind, _), doc in chart({**EXAMPLE, "scaling": {"mode": mode}}).items():
        if kind not in ("ScaledObject", "PodMonitor"):  # custom resources: compared with the overlays'
            kubernetes_validate.validate(doc, version, strict=True)


def test_keys_name_the_rendered_objects():
    docs = chart({"name": "feed", "keys": {"apiTokenSecret": "tok", "curveKeysSecret": "curve"}})
    assert {name for _, name in docs} == {"feed", "feed-headless", "feed-config"}
    sts = docs[("StatefulSet", "feed")]["spec"]
    volumes = {v["name"]: v for v in sts["template"]["spec"]["volumes"]}
    assert volumes["api-token"]["secret"]["secretName"] == "tok"
    assert volumes["curve-keys"]["secret"]["secretName"] == "curve"
    assert sts["serviceName"] == "feed-headless"
    # ready pods only: a terminating pod leaves the name at once (the base's headless Service too)
    assert docs[("Service", "feed-headless")]["spec"]["publishNotReadyAddresses"] is False
