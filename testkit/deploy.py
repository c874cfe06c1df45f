"""The deployment files read as a cluster and compose would: a renderer for the subset of
kustomize this repository uses (refusing anything else), and compose files with their
variables interpolated. Shared by the deployment and security tests."""

from __future__ import annotations

from testkit.paths import REPO_ROOT
import base64
import copy
import re
from pathlib import Path

import pytest


yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the deployment files (dev extra)")


ROOT = Path(REPO_ROOT)


K8S = ROOT / "deploy" / "k8s"


BASE, OVERLAY = K8S / "base", K8S / "overlays" / "example"


CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass"}


class Unsupported(ValueError):
    pass


_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "secretGenerator",
                       "configMapGenerator", "generatorOptions", "patches"}


def render(path: Path) -> list:
    """Render a kustomization with the subset of kustomize this repo uses: resources (files and
    kustomization dirs), generators from literals without hash suffixes, strategic-merge
    patches by file (``$patch: delete`` removes the object), then namespace, images and replicas. Anything else raises Unsupported,
    so a new feature in a kustomization cannot be silently ignored here."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(k) - _KUSTOMIZATION_KEYS
    if unknown:
        raise Unsupported(f"{path}: kustomization fields {sorted(unknown)} are not handled by the test renderer")
    docs = []
    for res in k.get("resources", []):
        p = (path / res).resolve()
        if p.is_dir():
            docs += render(p)
        else:
            docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    no_hash = k.get("generatorOptions", {}).get("disableNameSuffixHash", False)
    for key, kind in (("secretGenerator", "Secret"), ("configMapGenerator", "ConfigMap")):
        for gen in k.get(key, []):
            if set(gen) - {"name", "literals", "options", "type"}:
                raise Unsupported(f"{path}: {key} fields {sorted(set(gen) - {'name', 'literals', 'options', 'type'})}")
            if not (no_hash or gen.get("options", {}).get("disableNameSuffixHash")):
                raise Unsupported(f"{path}: {key} {gen['name']} needs disableNameSuffixHash for the test renderer")
            data = dict(lit.split("=", 1) for lit in gen.get("literals", []))
            obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}}
            if kind == "Secret":
                obj["type"] = gen.get("type", "Opaque")
                obj["data"] = {a: base64.b64encode(b.encode()).decode() for a, b in data.items()}
            else:
                obj["data"] = data
            docs.append(obj)
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise Unsupported(f"{path}: only `patches: - path: FILE` (strategic merge) is handled, got {patch}")
        for pd in yaml.safe_load_all((path / patch["path"]).read_text()):
            hits = [i for i, d in enumerate(docs) if d["kind"] == pd["kind"]
                    and d["metadata"]["name"] == pd["metadata"]["name"]]
            if len(hits) != 1:
                target = f"{pd['kind']}/{pd['metadata']['name']}"
                raise ValueError(f"patch {patch['path']}: {len(hits)} targets for {target}")
            if pd.get("$patch") == "delete":
                del docs[hits[0]]
            else:
                docs[hits[0]] = _merge(docs[hits[0]], pd)
    ns = k.get("namespace")
    for d in docs:
        if ns and d["kind"] not in CLUSTER_SCOPED:
            d["metadata"]["namespace"] = ns
        for c in _containers(d):
            for img in k.get("images", []):
                name, tag = _split_image(c["image"])
                if name == img["name"]:
                    c["image"] = img.get("newName", name) + (
                        "@" + img["digest"] if "digest" in img else ":" + img["newTag"] if "newTag" in img
                        else (":" + tag if tag else ""))
        for r in k.get("replicas", []):
            if d["kind"] in ("Deployment", "StatefulSet", "ReplicaSet") and d["metadata"]["name"] == r["name"]:
                d["spec"]["replicas"] = r["count"]
    return docs


def _merge(base, patch):
    """Strategic merge, as far as these manifests need it: maps merge (null deletes a key),
    lists of named maps merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = _merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and base + patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = copy.deepcopy(base)
        for item in patch:
            i = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
            if i is None:
                out.append(_merge({}, item))
            else:
                out[i] = _merge(out[i], item)
        return out
    return copy.deepcopy(patch)


def _split_image(image: str):
    if "@" in image:
        return image.split("@", 1)[0], None
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return image, None
    return name, tag


def _containers(doc: dict) -> list:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def _key(doc):
    return (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])


def _one(docs: dict, kind: str) -> dict:
    found = [d for (k, _, _), d in docs.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


class _ComposeLoader(yaml.SafeLoader):
    pass


def _compose(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+])([^}]*))?\}")


def interpolate(value: str, env: dict = {}) -> str:  # noqa: B006 (read-only default)
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:+alt} with `env` (default: empty)."""

    def sub(m):
        name, op, arg = m.group(1), m.group(2), m.group(3)
        val = env.get(name)
        if op == ":-":
            return val if val else arg
        if op == "-":
            return val if val is not None else arg
        if op == ":+":
            return arg if val else ""
        return val or ""

    return _VAR.sub(sub, str(value))
