"""Scaling replicas on the trainers' stall (deploy/k8s/overlays/stall-keda and stall-hpa, and
deploy/prometheus/adapter-rules.yaml), checked offline: the overlays are valid Kubernetes objects (the
ScaledObject, a KEDA custom resource, field by field; tests/deploy/test_deploy.py renders them
with kubectl kustomize too); the query reads metrics the service exports, is the same for
KEDA and prometheus-adapter, and its dead band sits where the in-service autoscaler stops, so the
two never pull the other way; and Prometheus itself (promtool's rule tests, Debian's prometheus
package) computes the bands from sample series as the comments say."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from loader_service.control.autoscale import AutoscalePolicy
from tests.deploy.test_deploy import K8S_VERSIONS, _exported_metrics
from testkit.deploy import K8S, ROOT, _key, render, yaml

KEDA, HPA = K8S / "overlays" / "stall-keda", K8S / "overlays" / "stall-hpa"
ADAPTER = ROOT / "deploy" / "prometheus" / "adapter-rules.yaml"
UP, LOW, DOWN = 0.10, 0.01, 0.05  # the query's bands: above UP as is; LOW..UP reads UP; below LOW reads DOWN
PROMTOOL_REQUIRED = os.environ.get("LOADER_REQUIRE_PROMTOOL", "") not in ("", "0", "false", "no")


def docs_of(path) -> dict:
    return {_key(d): d for d in render(path)}


def scaled_object() -> dict:
    (obj,) = [d for (kind, _, _), d in docs_of(KEDA).items() if kind == "ScaledObject"]
    return obj


def keda_query() -> str:
    (trigger,) = scaled_object()["spec"]["triggers"]
    return trigger["metadata"]["query"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", [KEDA, HPA], ids=["keda", "hpa"])
def test_overlays_are_valid_kubernetes_objects(path, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) missing")
    for key, doc in docs_of(path).items():
        if key[0] not in ("ScaledObject", "PodMonitor"):  # custom resources (KEDA's, the Prometheus
            # Operator's): checked field by field below
            kubernetes_validate.validate(doc, version, strict=True)


def test_keda_replaces_the_cpu_hpa_and_targets_the_statefulset():
    docs = docs_of(KEDA)
    kinds = {k for k, _, _ in docs}
    assert "HorizontalPodAutoscaler" not in kinds  # KEDA makes its own; two would fight
    so = scaled_object()
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["metadata"]["namespace"] == "data-loading"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "loader"}
    (sts,) = [d for (k, _, _), d in docs.items() if k == "StatefulSet"]
    assert spec["minReplicaCount"] <= sts["spec"]["replicas"] <= spec["maxReplicaCount"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "advanced",
                         "triggers", "cooldownPeriod"}
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert float(trigger["metadata"]["threshold"]) == UP
    assert trigger["metadata"]["serverAddress"].startswith("http")


def test_the_hpa_overlay_scales_on_the_external_stall_metric():
    (hpa,) = [d for (k, _, _), d in docs_of(HPA).items() if k == "HorizontalPodAutoscaler"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] == "loader_fleet_stall"
    assert metric["external"]["target"] == {"type": "Value", "value": f"{int(UP * 1000)}m"}
    rule = yaml.safe_load(ADAPTER.read_text())["rules"]["external"][0]
    assert rule["name"]["as"] == "loader_fleet_stall"
    # the same behaviour as the KEDA overlay's HPA
    assert hpa["spec"]["behavior"] == scaled_object()["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]


def test_one_query_for_keda_and_the_adapter_on_exported_metrics():
    keda = keda_query()
    adapter = yaml.safe_load(ADAPTER.read_text())["rules"]["external"][0]["metricsQuery"]
    assert " ".join(adapter.replace("<<.LabelMatchers>>", 'namespace="data-loading"').split()) == " ".join(keda.split())
    used = set(re.findall(r"\bloader_\w+", keda))
    assert used == {"loader_stage_seconds_total", "loader_clients"} and used <= _exported_metrics()


def test_the_dead_band_keeps_replicas_out_of_the_in_service_autoscalers_way():
    """Workers react first: the replica autoscaler adds pods only above the stall at which the
    in-service one adds workers, leaves the band it works in alone, and shrinks slower."""
    policy = AutoscalePolicy(1, 4)
    assert UP > policy.stall_high and LOW == policy.stall_low
    assert f"> {UP:.2f}" in keda_query() and f">= {LOW:.2f}" in keda_query()
    assert f"* 0 + {DOWN:.2f}" in keda_query() and keda_query().rstrip().endswith(f"or on() vector({UP:.2f})")
    behavior = scaled_object()["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert down["stabilizationWindowSeconds"] > up["stabilizationWindowSeconds"] >= 60 > policy.interval_s
    assert down["policies"][0]["value"] == 1


def promtool_or_skip() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        why = "promtool is not installed (apt-get install prometheus)"
        if PROMTOOL_REQUIRED:
            pytest.fail(f"LOADER_REQUIRE_PROMTOOL=1 but {why}", pytrace=False)
        pytest.skip(why)
    return promtool


def test_prometheus_computes_the_bands(tmp_path):
    """promtool's rule unit tests: 4 clients over two pods, waiting 30%, 5%, 0.5% of the time;
    pods scraped with no client at all (shrink); and no series at all, the pods not scraped (hold:
    missing data never shrinks the fleet)."""
    promtool = promtool_or_skip()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "stall", "rules": [{"record": "fleet_stall", "expr": keda_query()}]}]}))
    cases, series, expected = [(0.30, 0.30), (0.05, UP), (0.005, DOWN)], [], []
    for i, (stall, reads) in enumerate(cases):
        ns = f"ns{i}"
        # 4 clients, 2 on each of 2 pods; every pod hears each of its clients' wait seconds
        for pod in ("loader-0", "loader-1"):
            labels = f'namespace="{ns}",pod="{pod}"'
            series.append({"series": f'loader_clients{{{labels}}}', "values": "2+0x20"})
            per_min = 2 * stall * 60
            series.append({"series": f'loader_stage_seconds_total{{stage="client_wait",{labels}}}',
                           "values": f"0+{per_min:g}x20"})
        expected.append((ns, reads))
    tests = []
    for ns, reads in expected:
        expr = keda_query().replace('namespace="data-loading"', f'namespace="{ns}"')
        tests.append({"expr": expr, "eval_time": "10m", "exp_samples": [{"labels": "{}", "value": reads}]})
    for pod in ("loader-0", "loader-1"):  # scraped, serving no trainer (no client has reported a wait)
        series.append({"series": f'loader_clients{{namespace="idle",pod="{pod}"}}', "values": "0+0x20"})
    tests.append({"expr": keda_query().replace('namespace="data-loading"', 'namespace="idle"'), "eval_time": "10m",
                  "exp_samples": [{"labels": "{}", "value": DOWN}]})  # no trainer at all: shrink
    tests.append({"expr": keda_query().replace('namespace="data-loading"', 'namespace="unscraped"'),
                  "eval_time": "10m", "exp_samples": [{"labels": "{}", "value": UP}]})  # no series: hold
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}))
    p = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_scrape_objects_give_the_query_its_labels(tmp_path):
    """What makes the query find series: for the Prometheus Operator (KEDA's serverAddress) a
    PodMonitor that selects the loader pods' http port; for a plain Prometheus, the annotation
    scrape config (promtool checks it), which keeps only annotated pods and sets `namespace`."""
    docs = docs_of(KEDA)
    (pm,) = [d for (kind, _, _), d in docs.items() if kind == "PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["metadata"]["namespace"] == "data-loading"
    assert "release" in pm["metadata"]["labels"]  # what kube-prometheus-stack's podMonitorSelector matches
    (sts,) = [d for (k, _, _), d in docs.items() if k == "StatefulSet"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for c in sts["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports[endpoint["port"]])
    assert "namespace=" in keda_query()  # the operator labels every series with its namespace
    scrape = ROOT / "deploy" / "prometheus" / "kubernetes-pods.yml"
    (job,) = yaml.safe_load(scrape.read_text())["scrape_configs"]
    relabel = job["relabel_configs"]
    meta = {"__address__": "10.0.3.7:5555", "__meta_kubernetes_namespace": "data-loading",
            "__meta_kubernetes_pod_name": "loader-1", "__meta_kubernetes_pod_phase": "Running",
            "__meta_kubernetes_pod_annotation_prometheus_io_scrape": annotations["prometheus.io/scrape"],
            "__meta_kubernetes_pod_annotation_prometheus_io_port": annotations["prometheus.io/port"],
            "__meta_kubernetes_pod_annotation_prometheus_io_path": annotations["prometheus.io/path"]}
    target = relabelled(relabel, meta)  # a loader pod, as its data port's target
    assert target is not None and target["__address__"] == "10.0.3.7:8080" and target["__metrics_path__"] == "/metrics"
    assert (target["namespace"], target["pod"]) == ("data-loading", "loader-1")
    assert relabelled(relabel, {**meta, "__meta_kubernetes_pod_annotation_prometheus_io_scrape": ""}) is None
    assert relabelled(relabel, {**meta, "__meta_kubernetes_pod_phase": "Pending"}) is None
    promtool = promtool_or_skip()
    p = subprocess.run([promtool, "check", "config", "--syntax-only", str(scrape)], capture_output=True, text=True,
                       timeout=120)
    if "field kubernetes_sd_configs not found" in p.stdout + p.stderr:
        return  # Debian's promtool is built without Kubernetes discovery: it cannot parse any such config
    assert p.returncode == 0, p.stdout + p.stderr


def relabelled(rules: list, labels: dict):
    """Prometheus' relabelling (keep, drop, replace; anchored regexes, ';'-joined sources, $n
    replacements) applied to ``labels``: the target's labels, or None if it is dropped."""
    labels = dict(labels)
    for r in rules:
        value = r.get("separator", ";").join(labels.get(s, "") for s in r.get("source_labels", []))
        m = re.fullmatch(r.get("regex", "(.*)"), value)
        action = r.get("action", "replace")
        if action == "keep" and not m or action == "drop" and m:
            return None
        if action == "replace" and m:
            labels[r["target_label"]] = re.sub(r"\$(\d+)", lambda g: m.group(int(g.group(1))) or "",
                                               r.get("replacement", "$1"))
    return labels
