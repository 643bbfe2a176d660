"""spec.model.source (builtin, path, hf://, pvc://) -> parsed source, served name, and the pods' specs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdserve import model_source
from pdserve.operator import crds, model_pods, pools, router_workloads, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")


def example(**model) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"]["namespace"] = "ns1"
    doc["spec"]["model"] = model
    return doc


def opts(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}


def pod_specs(isvc: dict) -> dict[str, dict]:
    """role -> pod spec of the prefill, the first decode pool and the router."""
    deployments = {
        "prefill": workloads.build_deployment(pools.build_prefill_pool(isvc, CONFIG)),
        "decode": workloads.build_deployment(pools.build_decode_pools(isvc, CONFIG)[0]),
        "router": router_workloads.build_router_deployment(isvc, CONFIG),
    }
    return {role: d["spec"]["template"]["spec"] for role, d in deployments.items()}


@pytest.mark.parametrize("text, kind, fields, served", [
    ("builtin:tiny", "builtin", {}, "tiny"),
    ("/models/qwen/", "path", {"path": "/models/qwen/"}, "qwen"),
    ("hf://Qwen/Qwen2.5-0.5B-Instruct", "hf", {"repo": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "main"},
     "Qwen2.5-0.5B-Instruct"),
    ("hf://org/name@v1.0", "hf", {"repo": "org/name", "revision": "v1.0"}, "name"),
    ("hf://org/name@0123456789abcdef0123456789abcdef01234567", "hf",
     {"revision": "0123456789abcdef0123456789abcdef01234567"}, "name"),
    ("pvc://weights/qwen/v1", "pvc", {"claim": "weights", "path": "qwen/v1"}, "v1"),
])
def test_sources_parse_with_their_default_served_name(text, kind, fields, served):
    source = model_source.parse(text)
    assert source.kind == kind and source.text == text
    assert {k: getattr(source, k) for k in fields} == fields
    assert source.default_served_name == served


@pytest.mark.parametrize("text", ["tiny", "builtin:", "hf://noslash", "hf://a/b/c", "hf://org/name@", "hf://org/name@a/b",
                                  "hf://org/na me", "pvc://Weights/x", "pvc://weights", "pvc://weights/", "s3://b/k",
                                  "pvc://weights/../etc"])
def test_bad_sources_are_refused_naming_the_forms(text):
    with pytest.raises(ValueError, match="builtin:|relative"):
        model_source.parse(text)


def test_the_crd_checks_the_same_patterns_with_a_message_naming_the_field():
    rules = crds.MODEL["x-kubernetes-validations"]
    source_rule = next(r for r in rules if "matches" in r["rule"])
    assert model_source.HF_PATTERN in source_rule["rule"] and model_source.PVC_PATTERN in source_rule["rule"]
    assert "\\" not in source_rule["rule"]  # CEL string literals: no escapes needed
    assert source_rule["message"].startswith("spec.model.source must be") and source_rule["fieldPath"] == ".source"
    for text in ("hf://Qwen/Qwen2.5-0.5B-Instruct", "hf://org/name@v1.0", "pvc://weights/qwen/v1"):
        assert re.search(model_source.HF_PATTERN, text) or re.search(model_source.PVC_PATTERN, text)
    props = crds.MODEL["properties"]
    assert props["tokenSecret"]["properties"]["key"]["default"] == model_pods.DEFAULT_TOKEN_KEY
    assert set(props) >= {"source", "servedModelName", "tokenSecret", "cache", "endpoint", "pvcName", "mountPath"}


def test_hf_source_gets_an_init_container_that_downloads_into_the_cache():
    isvc = example(source="hf://Qwen/Qwen2.5-0.5B-Instruct@v2", tokenSecret={"name": "hf"},
                   endpoint="http://mirror.local:8080", cache={"sizeLimit": "20Gi"})
    for role, spec in pod_specs(isvc).items():
        (init,) = spec["initContainers"]
        router = role == "router"
        assert init["name"] == "fetch-model" and init["command"] == ["pdserve"]
        assert init["args"] == ["fetch-model", "hf://Qwen/Qwen2.5-0.5B-Instruct@v2", "--dest",
                                "/model-cache/Qwen/Qwen2.5-0.5B-Instruct/v2", *(["--tokenizer-only"] if router else [])]
        assert init["image"] == "registry.local/pdserve:1"
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
        assert env["HF_ENDPOINT"]["value"] == "http://mirror.local:8080"
        assert {"name": "model-cache", "mountPath": "/model-cache"} in init["volumeMounts"]
        assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]
        # the cache: the emptyDir with its size limit (the router's own, without a limit: tokenizer files only)
        cache = next(v for v in spec["volumes"] if v["name"] == "model-cache")
        assert cache == {"name": "model-cache", "emptyDir": {} if router else {"sizeLimit": "20Gi"}}
        (server,) = spec["containers"]
        assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in server["volumeMounts"]
        # the token is the init container's alone
        assert not any(e["name"] in ("HF_TOKEN", "HF_ENDPOINT") for e in server["env"])
        assert "envFrom" not in server
        o = opts(server["args"])
        assert o["--model"] == "/model-cache/Qwen/Qwen2.5-0.5B-Instruct/v2"
        if router:  # /v1/models is relayed to a prefill, which names the model
            assert "--served-model-name" not in o
        else:
            assert o["--served-model-name"] == "Qwen2.5-0.5B-Instruct"


def test_hf_cache_on_a_claim_is_mounted_read_only_and_waited_for_without_the_token():
    """A claim cache (pvcName): no download in the pods (the operator's Job does it once: test_operator_model_cache)."""
    isvc = example(source="hf://org/private", tokenSecret={"name": "hf", "key": "token"}, cache={"pvcName": "hf-cache"},
                   servedModelName="my-model")
    specs = pod_specs(isvc)
    for role in ("prefill", "decode"):
        spec = specs[role]
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache", "readOnly": True}} in \
            spec["volumes"]
        (wait,) = spec["initContainers"]
        assert wait["name"] == "wait-model" and wait["args"][-1] == "--wait"
        assert not any(e["name"] in ("HF_TOKEN", "HF_ENDPOINT") for e in wait["env"])
        o = opts(spec["containers"][0]["args"])
        assert o["--model"] == "/model-cache/org/private/main" and o["--served-model-name"] == "my-model"
    # the router mounts no claim and downloads nothing: its tokenizer files come from a prefill
    assert "initContainers" not in specs["router"]
    assert not any("persistentVolumeClaim" in v for v in specs["router"]["volumes"])
    assert "--tokenizer-from-prefill" in specs["router"]["containers"][0]["args"]


def test_pvc_source_mounts_the_claim_read_only_in_the_pools_and_not_in_the_router():
    isvc = example(source="pvc://weights/qwen/v1")
    specs = pod_specs(isvc)
    router = specs.pop("router")
    for spec in specs.values():
        assert "initContainers" not in spec
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in spec["volumes"]
        server = spec["containers"][0]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
        o = opts(server["args"])
        assert o["--model"] == "/models/qwen/v1" and o["--served-model-name"] == "v1"
    # the router: no claim (it may run on any node), its tokenizer files from a prefill
    assert "initContainers" not in router
    assert not any("persistentVolumeClaim" in v for v in router["volumes"])
    assert not any(m["name"] == "model" for m in router["containers"][0]["volumeMounts"])
    args = router["containers"][0]["args"]
    assert "--tokenizer-from-prefill" in args and "--model" not in args


def test_the_router_plan_of_a_model_on_a_claim_is_empty():
    for model in ({"source": "pvc://weights/qwen/v1"}, {"source": "/models/qwen", "pvcName": "weights"}):
        spec = {"model": model, "image": "registry.local/pdserve:1"}
        assert workloads.model_plan(spec, tokenizer_only=True) == model_pods.ModelPlan(None)
        assert workloads.model_plan(spec).volumes  # a server's plan mounts the claim


def test_builtin_and_path_sources_keep_their_pods():
    specs = pod_specs(example(source="builtin:tiny"))
    assert all("initContainers" not in s for s in specs.values())
    assert [v["name"] for v in specs["decode"]["volumes"]] == ["tmp"]
    assert opts(specs["decode"]["containers"][0]["args"])["--served-model-name"] == "tiny"
    router_args = specs["router"]["containers"][0]["args"]
    assert opts(router_args)["--model"] == "builtin:tiny" and "--tokenizer-from-prefill" not in router_args
    specs = pod_specs(example(source="/models/qwen", pvcName="weights", servedModelName="qwen-7b"))
    assert opts(specs["prefill"]["containers"][0]["args"])["--model"] == "/models/qwen"
    assert opts(specs["prefill"]["containers"][0]["args"])["--served-model-name"] == "qwen-7b"
