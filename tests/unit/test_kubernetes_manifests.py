"""deploy/kubernetes and deploy/image, checked offline (no cluster, no registry): every core object and both pod
templates of the LeaderWorkerSet against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field fails),
the LeaderWorkerSet's and the PodMonitor's own fields against their v1 APIs (written here from their Go types), both
watchdog configs through the watchdog's own loader and `watchdog config check`, every restart step an argv, the
PrometheusRule generated from the rules file, pinned images, a sized /dev/shm, and the Pod Security level the
capabilities need (docs/kubernetes.md). The restart step itself runs in test_kubernetes_restart_step.py."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from watchdog.cli.main import build_parser
from watchdog.config.load import Config, load
from watchdog.config.restart_plan import plan
from watchdog.core.types import base_url
from watchdog.evidence.collect.discover import is_server_argv, url_port

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(K8S.glob("*.yaml"))
RULES = ROOT / "deploy" / "prometheus" / "watchdog-rules.yml"
BUILDER = ROOT / "deploy" / "image" / "build.py"
VERSION = "1.33"
LEADER_ADDRESS = "vllm-0.vllm.vllm"  # what LeaderWorkerSet puts in LWS_LEADER_ADDRESS for group 0 of this set
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}  # Pod Security Standards, baseline
SHELLS = {"sh", "bash", "dash", "zsh", "ash"}

_OBJ = {"type": "object"}
LWS_SPEC = {  # leaderworkerset.x-k8s.io/v1, api/leaderworkerset/v1/leaderworkerset_types.go (v0.10)
    "type": "object", "additionalProperties": False, "required": ["leaderWorkerTemplate"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "rolloutStrategy": _OBJ,
        "networkConfig": {"type": "object",
                          "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
        "leaderWorkerTemplate": {
            "type": "object", "additionalProperties": False, "required": ["workerTemplate"],
            "properties": {
                "leaderTemplate": _OBJ, "workerTemplate": _OBJ,  # PodTemplateSpecs: kubernetes-validate, below
                "size": {"type": "integer", "minimum": 1},
                "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
                "subGroupPolicy": _OBJ,
                "volumeClaimTemplates": {"type": "array", "items": _OBJ},  # PersistentVolumeClaims: below
                "persistentVolumeClaimRetentionPolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"whenDeleted": {"enum": ["Retain", "Delete"]},
                                   "whenScaled": {"enum": ["Retain", "Delete"]}}},
            },
        },
    },
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string"}}, "separator": {"type": "string"},
    "targetLabel": {"type": "string"}, "regex": {"type": "string"}, "modulus": {"type": "integer"},
    "replacement": {"type": "string"},
    "action": {"type": "string", "pattern": "(?i)^(replace|keep|drop|hashmod|labelmap|labeldrop|labelkeep|lowercase"
                                            "|uppercase|keepequal|dropequal)$"}}}
PODMONITOR_SPEC = {  # monitoring.coreos.com/v1, pkg/apis/monitoring/v1/podmonitor_types.go: the fields used here
    "type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
    "properties": {
        "jobLabel": {"type": "string"}, "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
            "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
        "selector": {"type": "object", "additionalProperties": False, "properties": {
            "matchLabels": _STRINGS, "matchExpressions": {"type": "array", "items": _OBJ}}},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "properties": {
                "port": {"type": "string"}, "portNumber": {"type": "integer"}, "path": {"type": "string"},
                "scheme": {"enum": ["http", "https"]}, "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                "scrapeTimeout": {"type": "string"}, "honorLabels": {"type": "boolean"},
                "relabelings": {"type": "array", "items": _RELABEL},
                "metricRelabelings": {"type": "array", "items": _RELABEL}}}},
    },
}


def documents() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def check(doc: dict[str, Any]) -> None:
    """Raises when the object does not fit its schema."""
    kind = doc["kind"]
    if kind not in ("LeaderWorkerSet", "PodMonitor"):
        kubernetes_validate.validate(doc, VERSION, strict=True)
        return
    assert doc["apiVersion"] == {"LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
                                 "PodMonitor": "monitoring.coreos.com/v1"}[kind]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, VERSION,
                                 strict=True)  # the object's metadata, as any object's
    if kind == "PodMonitor":
        jsonschema.validate(doc["spec"], PODMONITOR_SPEC)
        return
    jsonschema.validate(doc["spec"], LWS_SPEC)
    lwt = doc["spec"]["leaderWorkerTemplate"]
    for name in ("leaderTemplate", "workerTemplate"):
        if (template := lwt.get(name)) is not None:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name.lower()},
                                          "template": template}, VERSION, strict=True)
    for claim in lwt.get("volumeClaimTemplates", []):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PersistentVolumeClaim", **claim}, VERSION,
                                     strict=True)


def by_kind(kind: str) -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == kind]
    return doc


def lws_template() -> dict[str, Any]:
    return dict(by_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"])


def pod(role: str) -> dict[str, Any]:
    return dict(lws_template()[f"{role}Template"]["spec"])


def containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def config_of(role: str) -> tuple[str, str]:
    """(the TOML the role's pods mount as their watchdog config, the path they see it at)."""
    [volume] = [v for v in pod(role)["volumes"] if "configMap" in v]
    [item] = volume["configMap"]["items"]
    [mount] = [m for m in containers(pod(role))["engine-watchdog"]["volumeMounts"] if m["name"] == volume["name"]]
    assert volume["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]
    return by_kind("ConfigMap")["data"][item["key"]], f"{mount['mountPath']}/{item['path']}"


def loaded(role: str, tmp_path: Path) -> Config:
    path = tmp_path / f"{role}.toml"
    path.write_text(config_of(role)[0])
    return load(path)  # the watchdog's own loader: unknown keys and wrong types fail here


def test_there_are_manifests() -> None:
    assert {d["kind"] for d in documents()} >= {"Namespace", "ConfigMap", "LeaderWorkerSet", "Service", "PodMonitor"}


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
    bad_claim = copy.deepcopy(lws)
    bad_claim["spec"]["leaderWorkerTemplate"]["volumeClaimTemplates"][0]["spec"]["acessModes"] = []
    bad_monitor = copy.deepcopy(by_kind("PodMonitor"))
    bad_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["target_label"] = "job"
    for doc in (typo, bad_policy, bad_probe, bad_claim, bad_monitor):
        with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
            check(doc)


def test_both_configs_load_and_say_what_each_side_does(tmp_path: Path) -> None:
    leader, worker = loaded("leader", tmp_path), loaded("worker", tmp_path)
    assert leader.exporter.listen == "0.0.0.0" and leader.exporter.port and leader.restart.steps
    assert worker.exporter.port == 0 and not worker.probe.enabled  # no port of its own, no second probe request
    assert worker.restart.steps == () and plan(worker.restart) == []  # it never restarts
    sidecar = containers(pod("worker"))["engine-watchdog"]
    assert "ports" not in sidecar and not {"livenessProbe", "readinessProbe", "startupProbe"} & set(sidecar)
    url = sidecar["command"][sidecar["command"].index("--url") + 1]
    assert "$(LWS_LEADER_ADDRESS)" in url  # the leader's page, its address put in by LeaderWorkerSet
    page = worker.with_overrides(engine={"url": url.replace("$(LWS_LEADER_ADDRESS)", LEADER_ADDRESS)}).engine.url
    assert base_url(page) == f"http://{LEADER_ADDRESS}:{url_port(leader.engine.url)}"


def test_every_restart_step_is_an_argv_with_no_shell(tmp_path: Path) -> None:
    commands = plan(loaded("leader", tmp_path).restart)
    assert commands
    for command in commands:
        assert Path(command.argv[0]).name not in SHELLS and "-c" not in command.argv, command.argv


def test_a_config_typo_stops_before_the_sidecar_starts(tmp_path: Path) -> None:
    assert lws_template()["restartPolicy"] == "RecreateGroupAfterStart"  # a Pending pod's failures recreate nothing
    for role in ("leader", "worker"):
        text, path = config_of(role)
        every = containers(pod(role))
        [check_cmd] = [c["command"] for c in pod(role)["initContainers"] if c["command"][1:3] == ["config", "check"]]
        assert check_cmd[check_cmd.index("--config") + 1] == path
        run = every["engine-watchdog"]["command"]
        assert run[1] == "run" and run[run.index("--config") + 1] == path  # the file checked is the file run
        for command in (check_cmd, run, *(c["lifecycle"]["preStop"]["exec"]["command"] for c in every.values()
                                          if "exec" in c.get("lifecycle", {}).get("preStop", {}))):
            build_parser().parse_args(command[1:])  # the CLI takes it (bad arguments exit)
        good, typo = tmp_path / f"{role}.toml", tmp_path / f"{role}-typo.toml"
        good.write_text(text)
        typo.write_text(text.replace("process_prefix", "process_prefx"))
        for file, code in ((good, 0), (typo, 64)):
            r = subprocess.run([sys.executable, "-m", "watchdog", "config", "check", "--config", str(file)],
                               capture_output=True, text=True, timeout=60, check=False)
            assert r.returncode == code, r.stderr
        assert "capture.process_prefx" in r.stderr


def test_the_worker_pods_ranks_are_read_before_the_group_is_deleted() -> None:
    spec = pod("worker")
    every = containers(spec)
    held = every["vllm-worker"]["lifecycle"]["preStop"]["sleep"]["seconds"]
    dump = every["engine-watchdog"]["lifecycle"]["preStop"]["exec"]["command"]
    assert dump[1] == "dump" and held >= 25  # two rounds of py-spy, each up to capture.timeout (10 s), and the gap
    assert spec["terminationGracePeriodSeconds"] > held


def test_the_sidecars_see_the_engine_and_keep_their_state(tmp_path: Path) -> None:
    claims = {c["metadata"]["name"] for c in lws_template()["volumeClaimTemplates"]}
    for role in ("leader", "worker"):
        spec, cfg = pod(role), loaded(role, tmp_path)
        assert spec["shareProcessNamespace"] is True and not spec.get("hostPID")
        sidecar = containers(spec)["engine-watchdog"]
        assert "SYS_PTRACE" in sidecar["securityContext"]["capabilities"]["add"]
        assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(sidecar)  # its restart recreates all
        [state] = [m for m in sidecar["volumeMounts"] if m["mountPath"] == cfg.state.dir]
        assert state["name"] in claims and state["name"] not in {v["name"] for v in spec["volumes"]}
        engine = next(c for name, c in containers(spec).items() if name.startswith("vllm-"))
        assert is_server_argv([*engine["command"], *engine["args"]])  # known by its command line while starting
    leader, engine = loaded("leader", tmp_path), containers(pod("leader"))["vllm-leader"]
    assert engine["args"][engine["args"].index("--port") + 1] == str(url_port(leader.engine.url))
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        assert engine[probe]["httpGet"] == {"path": path, "port": leader.exporter.port}, probe


def test_every_image_is_pinned() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {c["image"] for role in ("leader", "worker") for c in containers(pod(role)).values()}
    for image in images:  # a digest, or a tag that names one exact release (never latest, never a branch)
        assert "@sha256:" in image or re.fullmatch(r"v?\d+\.\d+\.\d+", image.rpartition(":")[2]), image
    assert {i for i in images if i.endswith("/engine-watchdog:" + version)}, images  # the project's own build
    assert {i for i in images if i.startswith("vllm/vllm-openai:")}, images


def test_dev_shm_is_a_sized_memory_volume() -> None:
    for role in ("leader", "worker"):
        volumes = {v["name"]: v for v in pod(role)["volumes"]}
        mounts = [m for c in containers(pod(role)).values() for m in c.get("volumeMounts", [])
                  if m["mountPath"] == "/dev/shm"]
        assert mounts, role
        for m in mounts:
            shm = volumes[m["name"]]["emptyDir"]
            assert shm["medium"] == "Memory" and re.fullmatch(r"\d+(Mi|Gi)", shm["sizeLimit"]), shm


def test_the_namespace_admits_the_capabilities_the_sidecars_add() -> None:
    namespace = by_kind("Namespace")
    added = {cap for role in ("leader", "worker") for c in containers(pod(role)).values()
             for cap in c.get("securityContext", {}).get("capabilities", {}).get("add", [])}
    assert added - BASELINE_CAPS  # beyond the baseline level: only the privileged level admits these pods
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for doc in documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace["metadata"]["name"], doc["kind"]


def test_the_service_and_the_podmonitor_pick_the_leader_pods() -> None:
    lws = by_kind("LeaderWorkerSet")
    labels = {role: {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                     **lws_template()[f"{role}Template"]["metadata"]["labels"]} for role in ("leader", "worker")}
    service = by_kind("Service")
    assert service["metadata"]["name"] != lws["metadata"]["name"]  # LWS's own headless Service has that name
    monitor = by_kind("PodMonitor")["spec"]
    for selector in (service["spec"]["selector"], monitor["selector"]["matchLabels"]):
        assert selector.items() <= labels["leader"].items() and not selector.items() <= labels["worker"].items()
    [endpoint] = monitor["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in containers(pod("leader"))["engine-watchdog"]["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["port"] in ports
    [job] = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    selected = {j for e in exprs for j in re.findall(r'\bjob="([^"]+)"', e)}
    assert selected == {job}, selected  # the rules' selectors, read from the rules file


def generated(*args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, str(K8S / "prometheusrule.py"), *args], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    assert isinstance(doc, dict)
    return doc


def test_the_prometheusrule_holds_exactly_the_rules_files_groups() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    plain = generated()
    assert plain["apiVersion"] == "monitoring.coreos.com/v1" and plain["kind"] == "PrometheusRule"
    assert plain["metadata"]["namespace"] == by_kind("Namespace")["metadata"]["name"]
    assert plain["spec"] == {"groups": groups}
    base = "https://wiki.example.org/runbooks"
    published = generated("--runbook-base", base, "--label", "release=kube-prometheus-stack")
    assert published["metadata"]["labels"] == {"release": "kube-prometheus-stack"}
    assert "RUNBOOK_BASE" in RULES.read_text() and "RUNBOOK_BASE" not in json.dumps(published)
    assert json.dumps(published["spec"]["groups"]) == json.dumps(groups).replace("RUNBOOK_BASE", base)


def test_the_image_is_the_projects_own_build_and_pinned(tmp_path: Path) -> None:
    """deploy/image/build.py (built and run in Docker by tests/engine/test_docker_sidecar.py): its entrypoint is the
    one the manifests' watchdog containers run, every runtime dependency is pinned, pkill's package is in it."""
    spec = importlib.util.spec_from_file_location("image_build", BUILDER)
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    pins = dict(line.split("==") for line in (ROOT / "deploy/image/constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    needed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in needed:
        assert re.split(r"[<>=!;\s\[]", requirement, maxsplit=1)[0] in pins, requirement
    [entry] = builder.ENTRYPOINT
    for role in ("leader", "worker"):
        assert {c["command"][0] for c in containers(pod(role)).values() if "engine-watchdog" in c["image"]} == {entry}
    [step] = plan(loaded("leader", tmp_path).restart)
    assert step.argv[0] != "pkill" or "procps" in builder.PACKAGES  # pkill is in procps
