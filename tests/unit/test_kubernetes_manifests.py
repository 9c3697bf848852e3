"""deploy/kubernetes, checked offline (no cluster runs here): every core object and both pod templates of the
LeaderWorkerSet against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field fails), the
LeaderWorkerSet's own fields against its v1 API (leaderworkerset.x-k8s.io/v1: the enums and fields of
api/leaderworkerset/v1/leaderworkerset_types.go), the watchdog's config in the ConfigMap through the watchdog's own
loader, and what docs/load-balancers.md promises of them (probes on the watchdog, the shared process namespace,
CAP_SYS_PTRACE, the group recreated on a restart)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from watchdog.config.load import load

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S = "1.33"

_TEMPLATE = {"type": "object"}  # a PodTemplateSpec: checked by kubernetes-validate as a PodTemplate, below
LWS_SPEC = {
    "type": "object", "additionalProperties": False, "required": ["leaderWorkerTemplate"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "rolloutStrategy": {"type": "object"},
        "networkConfig": {"type": "object",
                          "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
        "leaderWorkerTemplate": {
            "type": "object", "additionalProperties": False, "required": ["workerTemplate"],
            "properties": {
                "leaderTemplate": _TEMPLATE, "workerTemplate": _TEMPLATE,
                "size": {"type": "integer", "minimum": 1},
                "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
                "subGroupPolicy": {"type": "object"},
                "volumeClaimTemplates": {"type": "array"},
                "persistentVolumeClaimRetentionPolicy": {"type": "object"},
            },
        },
    },
}


def documents() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def check(doc: dict[str, Any]) -> None:
    """Raises when the object does not fit its schema."""
    if doc["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, K8S, strict=True)
        return
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    jsonschema.validate(doc["spec"], LWS_SPEC)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, K8S,
                                 strict=True)  # the object's metadata, as any object's
    for name in ("leaderTemplate", "workerTemplate"):
        template = doc["spec"]["leaderWorkerTemplate"].get(name)
        if template is not None:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name.lower()},
                                          "template": template}, K8S, strict=True)


def by_kind(kind: str) -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == kind]
    return doc


def test_there_are_manifests() -> None:
    assert {d["kind"] for d in documents()} >= {"LeaderWorkerSet", "ConfigMap", "Service"}


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_object_fits_its_schema(doc: dict[str, Any]) -> None:
    check(doc)


def test_the_check_can_fail() -> None:
    lws = by_kind("LeaderWorkerSet")
    typo = copy.deepcopy(lws)
    typo["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["readinesProbe"] = {}
    bad_policy = copy.deepcopy(lws)
    bad_policy["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroup"
    bad_probe = copy.deepcopy(lws)
    bad_probe["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["livenessProbe"][
        "periodSeconds"] = "ten"
    for doc in (typo, bad_policy, bad_probe):
        with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
            check(doc)


def test_the_watchdogs_config_loads_and_the_probes_point_at_it(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(by_kind("ConfigMap")["data"]["config.toml"])
    cfg = load(config)  # the watchdog's own loader: unknown keys and wrong types fail here
    assert cfg.exporter.listen == "0.0.0.0" and cfg.restart.steps
    lws = by_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    assert lws["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = lws["leaderTemplate"]["spec"]
    assert leader["shareProcessNamespace"] is True and not leader.get("hostPID")
    containers = {c["name"]: c for c in leader["containers"]}
    sidecar = containers["engine-watchdog"]
    assert "SYS_PTRACE" in sidecar["securityContext"]["capabilities"]["add"]
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(sidecar)  # its restart recreates the group
    engine = containers["vllm-leader"]
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        assert engine[probe]["httpGet"] == {"path": path, "port": cfg.exporter.port}, probe
    mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert cfg.state.dir in mounts and "/etc/engine-watchdog" in mounts
    assert by_kind("PersistentVolumeClaim")["metadata"]["name"] in {
        v.get("persistentVolumeClaim", {}).get("claimName") for v in leader["volumes"]}
