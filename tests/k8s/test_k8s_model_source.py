"""spec.model.source on a real control plane (pods do not run here): an hf:// InferenceService gets the
fetch-model init container, the cache volume and --model/--served-model-name on every Deployment; a
pvc:// one mounts its claim; sources of no accepted form, and hf:// settings on other sources, are
refused by the API server with a message naming the field."""

import json

import pytest
import yaml

from harness.operator_harness import get_json, names, wait_for
from harness.procs import REPO

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
HF_MODEL = {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct@main", "tokenSecret": {"name": "hf-token"},
            "endpoint": "http://mirror.example:8080", "cache": {"sizeLimit": "8Gi"}}


def isvc(model: dict) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"] = model
    return doc


def flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}


def pod_spec(kube, ns: str, deployment: str) -> dict:
    return get_json(kube, "deployment", deployment, "-n", ns)["spec"]["template"]["spec"]


def test_hf_source_gets_the_init_container_and_volumes(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(isvc(HF_MODEL)))
    expected = ["chat-decode-big", "chat-decode-main", "chat-prefill", "chat-router"]
    wait_for(kube, lambda: names(kube, "deployments", ns) == expected, "four Deployments", op=operator)
    stored = get_json(kube, "pdis", "chat", "-n", ns)["spec"]["model"]
    assert stored["tokenSecret"] == {"name": "hf-token", "key": "HF_TOKEN"}  # the schema's default key
    for deployment in expected:
        spec = pod_spec(kube, ns, deployment)
        router = deployment == "chat-router"
        (init,) = spec["initContainers"]
        assert init["args"][:4] == ["fetch-model", HF_MODEL["source"], "--dest",
                                    "/model-cache/Qwen/Qwen2.5-0.5B-Instruct/main"]
        assert ("--tokenizer-only" in init["args"]) == router
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
        assert env["HF_ENDPOINT"]["value"] == "http://mirror.example:8080"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model-cache"]["emptyDir"] == ({} if router else {"sizeLimit": "8Gi"})
        server = spec["containers"][0]
        assert not any(e["name"] == "HF_TOKEN" for e in server.get("env", []))
        assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in server["volumeMounts"]
        args = flags(server["args"])
        assert args["--model"] == "/model-cache/Qwen/Qwen2.5-0.5B-Instruct/main"
        if not router:
            assert args["--served-model-name"] == "Qwen2.5-0.5B-Instruct"


def test_pvc_source_mounts_the_claim(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(isvc({"source": "pvc://weights/qwen/v1",
                                                                        "servedModelName": "qwen"})))
    wait_for(kube, lambda: "chat-prefill" in names(kube, "deployments", ns), "the prefill Deployment", op=operator)
    spec = pod_spec(kube, ns, "chat-prefill")
    assert "initContainers" not in spec
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in spec["volumes"]
    args = flags(spec["containers"][0]["args"])
    assert (args["--model"], args["--served-model-name"]) == ("/models/qwen/v1", "qwen")


INVALID = [
    ("no form", {"source": "s3://bucket/model"}, "spec.model.source must be 'builtin:<name>', an absolute path"),
    ("hf without a name", {"source": "hf://just-org"}, "spec.model.source must be"),
    ("hf revision with a slash", {"source": "hf://org/name@a/b"}, "spec.model.source must be"),
    ("pvc without a path", {"source": "pvc://weights"}, "spec.model.source must be"),
    ("pvc climbing out", {"source": "pvc://weights/../x"}, "must not contain '..'"),
    ("token for a path", {"source": "/models/x", "tokenSecret": {"name": "t"}}, "spec.model.tokenSecret is only for"),
    ("cache for builtin", {"source": "builtin:tiny", "cache": {"pvcName": "c"}}, "spec.model.cache is only for"),
    ("both caches", {"source": "hf://org/name", "cache": {"pvcName": "c", "sizeLimit": "1Gi"}},
     "set one of sizeLimit (an emptyDir per pod), pvcName (your claim) or size"),
    ("endpoint not a URL", {"source": "hf://org/name", "endpoint": "mirror"}, "spec.model.endpoint"),
]


@pytest.mark.parametrize("what,model,message", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_model_is_refused_naming_the_field(kube, operator, what, model, message):
    proc = kube.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(isvc(model)),
                        check=False)
    assert proc.returncode != 0, f"{what}: accepted"
    assert message in proc.stderr, f"{what}: {proc.stderr}"
