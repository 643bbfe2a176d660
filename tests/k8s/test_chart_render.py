"""The Helm chart: lint, render, and what the rendered objects say (no cluster needed, only helm).

helm comes from `make k8s-tools` (tools/k8s/build.sh); when it is missing these tests fail
with the command to run, like every other k8s test.
"""

import argparse
import json
import re

import pytest
import yaml

from harness.chart import CHART, by_kind, helm, render
from harness.procs import REPO

pytestmark = pytest.mark.k8s


def operator_args(docs: list[dict]) -> list[str]:
    (deployment,) = by_kind(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["pdserve"]
    return container["args"]


def parse_operator_cli(args: list[str]) -> argparse.Namespace:
    from pdserve.operator import cli

    assert args[0] == "operator"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(args[1:])  # SystemExit on any flag the CLI does not have


def test_helm_lint_strict():
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out


def test_every_values_key_has_a_comment():
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^\s*[A-Za-z_][\w.-]*:")
    for i, line in enumerate(lines):
        if key.match(line):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#"), f"values.yaml line {i + 1} ({line.strip()}) has no comment above it"


def test_default_render_runs_the_operator_cli_cluster_wide_and_securely():
    docs = render()
    args = parse_operator_cli(operator_args(docs))
    assert args.all_namespaces and args.peering is None
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDSERVE_IMAGE"] == "ghcr.io/pdserve/pdserve:0.1.0" and env["PDSERVE_NETWORK_POLICY"] == "true"
    assert env["PDSERVE_CUDA_IMAGE"] == "ghcr.io/pdserve/pdserve-cuda:0.1.0"
    (sa,) = by_kind(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == "rel-pdserve-operator"
    assert by_kind(docs, "NetworkPolicy") and not by_kind(docs, "ServiceMonitor")


def test_one_image_per_kind_reaches_the_operator():
    """image.cuda defaults to image.repository + "-cuda" and image.tag; each can be set on its own, and the
    operator's CLI reads both from the environment the chart sets."""
    def images(*sets: str) -> tuple[str, str]:
        (deployment,) = by_kind(render(*sets), "Deployment")
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        return env["PDSERVE_IMAGE"], env["PDSERVE_CUDA_IMAGE"]

    assert images("image.repository=reg.example/p", "image.tag=v7") == ("reg.example/p:v7", "reg.example/p-cuda:v7")
    assert images("image.repository=localhost/pdserve", "image.tag=abc", "image.cuda.repository=localhost/pdserve-cuda",
                  "image.cuda.tag=def") == ("localhost/pdserve:abc", "localhost/pdserve-cuda:def")
    default, cuda = images("image.cuda.tag=v9")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDSERVE_IMAGE", default)
        env.setenv("PDSERVE_CUDA_IMAGE", cuda)
        args = parse_operator_cli(["operator"])
    assert (args.default_image, args.cuda_image) == ("ghcr.io/pdserve/pdserve:0.1.0", "ghcr.io/pdserve/pdserve-cuda:v9")


def test_rbac_is_least_privilege():
    docs = render()
    roles = by_kind(docs, "ClusterRole")
    assert {r["metadata"]["name"] for r in roles} == {"rel-pdserve-operator", "rel-pdserve-operator-cluster-read"}
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            assert not {"nodes", "clusterroles", "clusterrolebindings"} & set(rule["resources"])
            if "secrets" in rule["resources"]:  # mutual TLS: each InferenceService's certificate (test_chart_tls.py)
                assert rule["resources"] == ["secrets"] and set(rule["verbs"]) == {"get", "create", "patch"}
            if "pods" in rule["resources"]:  # watched for pool problems; patched for the pod-deletion-cost annotation
                assert rule["resources"] == ["pods"] and set(rule["verbs"]) == {"get", "list", "watch", "patch"}
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    main = next(r for r in roles if r["metadata"]["name"] == "rel-pdserve-operator")
    isvc = next(r for r in main["rules"] if r["resources"] == ["inferenceservices"])
    assert "create" not in isvc["verbs"] and "delete" not in isvc["verbs"]  # users own InferenceServices
    cluster_read = next(r for r in roles if r["metadata"]["name"] == "rel-pdserve-operator-cluster-read")
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in cluster_read["rules"])


def test_operator_can_grant_prefill_and_router_pods_only_what_it_holds():
    """RBAC forbids granting what one does not hold: the prefill and router Roles must be subsets of the operator's rules."""  # noqa: E501
    from pdserve.operator import pools, router_workloads, workloads
    from pdserve.operator.config import OperatorConfig

    held = set()
    for role in by_kind(render(), "ClusterRole"):
        for rule in role["rules"]:
            held |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    isvc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    isvc["metadata"]["namespace"] = "ns"
    config = OperatorConfig(default_image="i:1", protocol_version="1")
    _, prefill_role, _ = workloads.build_prefill_rbac(pools.build_prefill_pool(isvc, config))
    (router_role,) = [o for o in router_workloads.build_router(isvc, config) if o["kind"] == "Role"]
    for rule in prefill_role["rules"] + router_role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                for v in rule["verbs"]:
                    assert (g, r, v) in held


def test_watching_namespaces_uses_roles_and_namespaced_peering():
    docs = render("operator.watchNamespaces={team-a,team-b}", "operator.replicas=2")
    args = parse_operator_cli(operator_args(docs))
    assert args.namespace == ["team-a", "team-b"] and not args.all_namespaces and args.peering == "pdserve"
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(any("kopfpeerings" in rule["resources"] for rule in r["rules"]) for r in roles)
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == ["rel-pdserve-operator-cluster-read"]
    assert sorted(p["metadata"]["namespace"] for p in by_kind(docs, "KopfPeering")) == ["team-a", "team-b"]
    assert not by_kind(docs, "ClusterKopfPeering")


def test_replicas_turn_on_cluster_peering():
    docs = render("operator.replicas=3")
    assert parse_operator_cli(operator_args(docs)).peering == "pdserve"
    (peering,) = by_kind(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "pdserve"
    cluster_read = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("-cluster-read"))
    assert any("clusterkopfpeerings" in rule["resources"] for rule in cluster_read["rules"])


def test_dashboards_become_configmaps_with_the_sidecar_label():
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert files, "charts/pdserve/dashboards/*.json are expected (the observability work writes them)"
    maps = by_kind(render(), "ConfigMap")
    assert len(maps) == len(files)
    for cm, path in zip(sorted(maps, key=lambda m: m["metadata"]["name"]), files):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())
    assert not by_kind(render("dashboards.enabled=false"), "ConfigMap")


def test_service_monitor_when_enabled():
    (monitor,) = by_kind(render("serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom"), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "pdserve-operator"}
    assert monitor["spec"]["endpoints"][0]["port"] == "http" and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_network_policy_switch_reaches_the_operator():
    docs = render("networkPolicy.enabled=false")
    assert not by_kind(docs, "NetworkPolicy")
    (deployment,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PDSERVE_NETWORK_POLICY"] == "false"


def test_dockerfile_entrypoint_and_user_match_the_chart():
    from pdserve.operator import workloads

    text = (REPO / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["pdserve"\]', text, re.M)
    assert re.search(rf"^USER {workloads.RUN_AS_USER}", text, re.M)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == workloads.RUN_AS_USER
    assert re.search(r"^ARG BASE=", text, re.M), "the CUDA vs CPU base is a build argument"


def test_the_prometheus_url_reaches_the_operator_only_when_set():
    def env(docs):
        (deployment,) = by_kind(docs, "Deployment")
        return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert "PDSERVE_PROMETHEUS_URL" not in env(render())
    url = "http://prometheus.monitoring:9090"
    assert env(render(f"autoscaling.prometheusUrl={url}"))["PDSERVE_PROMETHEUS_URL"] == url
    rules = [r for role in by_kind(render(), "ClusterRole") for r in role["rules"]]
    assert any(r["resources"] == ["prefillpools/scale", "decodepools/scale"] and "patch" in r["verbs"] for r in rules)


def _notes(*sets: str) -> str:
    args = ["install", "rel", str(CHART), "-n", "pdserve-system", "--dry-run=client"]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    return out[out.index("NOTES:"):]


def test_notes_speak_of_the_users_service_and_name_no_missing_url():
    """NOTES.txt named a raw GitHub URL that does not exist and always the example's service; now it prints
    the curl for the InferenceService and model the values name, and says how to get the image."""
    notes = _notes("test.inferenceService=llama", "test.namespace=serving", "test.model=Llama-3.1-8B")
    assert "https://" not in notes
    assert "kubectl port-forward -n serving svc/llama-router 8000:8000" in notes
    assert '"model": "Llama-3.1-8B"' in notes and "kubectl describe pdis llama -n serving" in notes
    assert "publishes no registry image" in notes and "make image" in notes
    assert "make image-cuda" in notes and "not there yet" not in notes
    assert "run ghcr.io/pdserve/pdserve-cuda:0.1.0." in " ".join(notes.split())  # the GPU pools' image
    assert "svc/chat-router" in _notes()  # the example's, by default
