"""spec.auth (API keys at the OpenAI doors) -> the router and prefill pods: the Secret mounted read-only and
--api-key-file; the decodes untouched; nothing without spec.auth (pure builders; the real API server is
tests/k8s/test_k8s_operator_auth.py)."""

from pathlib import Path

import yaml

from pdserve import defaults
from pdserve.operator import crd_pod, pools, router_workloads, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")
KEY_FILE = f"{defaults.API_KEYS_MOUNT}/{defaults.API_KEYS_FILE}"


def example(auth: dict | None) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"]["namespace"] = "ns1"
    if auth is not None:
        doc["spec"]["auth"] = auth
    return doc


def pod_of(deployment: dict) -> tuple[dict, dict]:
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def deployments(isvc: dict) -> dict[str, dict]:
    prefill = pools.build_prefill_pool(isvc, CONFIG)
    decodes = pools.build_decode_pools(isvc, CONFIG)
    router = router_workloads.build_router_deployment(isvc, CONFIG)
    return {"prefill": workloads.build_deployment(prefill), "decode": workloads.build_deployment(decodes[0]),
            "router": router}


def test_the_secret_reaches_the_router_and_the_prefills_only():
    isvc = example({"apiKeySecret": "chat-keys", "key": "team-keys"})
    assert pools.build_prefill_pool(isvc, CONFIG)["spec"]["auth"] == {"apiKeySecret": "chat-keys", "key": "team-keys"}
    for role, dep in deployments(isvc).items():
        pod, container = pod_of(dep)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        if role == "decode":  # no OpenAI door on a decode
            assert "api-keys" not in volumes and "--api-key-file" not in container["args"]
            continue
        assert volumes["api-keys"]["secret"] == {"secretName": "chat-keys", "defaultMode": 0o440,
                                                 "items": [{"key": "team-keys", "path": defaults.API_KEYS_FILE}]}
        assert mounts["api-keys"] == {"name": "api-keys", "mountPath": defaults.API_KEYS_MOUNT, "readOnly": True}
        args = container["args"]
        assert args[args.index("--api-key-file") + 1] == KEY_FILE, role
        assert {v["name"] for v in pod["volumes"]} <= set(crd_pod.OPERATOR_VOLUMES)
        # the probes and the scrape stay open: the doors never ask them for a key
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


def test_the_secret_key_defaults_and_no_auth_means_no_keys():
    pod, _ = pod_of(deployments(example({"apiKeySecret": "chat-keys"}))["prefill"])
    (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["items"] == [{"key": defaults.API_KEYS_SECRET_KEY, "path": defaults.API_KEYS_FILE}]
    for dep in deployments(example(None)).values():
        pod, container = pod_of(dep)
        assert "--api-key-file" not in container["args"]
        assert "api-keys" not in {v["name"] for v in pod["volumes"]}


def test_the_operator_owns_the_flag_the_volume_and_the_mount_path():
    assert "--api-key-file" in crd_pod.OPERATOR_FLAGS["prefill"]
    assert "api-keys" in crd_pod.OPERATOR_VOLUMES and defaults.API_KEYS_MOUNT in crd_pod.OPERATOR_MOUNT_PATHS
