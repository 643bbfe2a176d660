"""The operator's router: InferenceService -> router Deployment, Service, RBAC, NetworkPolicy, and the status
that points at it (pure builders; the real apiserver is tests/k8s/test_k8s_operator_router.py)."""

import argparse
import copy
from pathlib import Path

import pytest
import yaml

from pdserve import defaults
from pdserve.operator import naming, pools, router_workloads, status, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")


def example(**router) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"].update(namespace="ns1", generation=4)
    if router:
        doc["spec"]["router"] = router
    return doc


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def opts(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}


def test_router_objects_are_named_labelled_and_the_deployment_follows_spec_router():
    isvc = example(replicas=3, nodeSelector={"pool": "cpu"}, resources={"requests": {"cpu": "1"}})
    objs = router_workloads.build_router(isvc, CONFIG)
    assert [o["kind"] for o in objs] == ["ServiceAccount", "Role", "RoleBinding", "Service", "Deployment",
                                        "PodDisruptionBudget"]
    assert {o["metadata"]["name"] for o in objs} == {"chat-router"}
    for o in objs:
        assert o["metadata"]["namespace"] == "ns1"
        assert o["metadata"]["labels"][naming.LABEL_ROLE] == "router"
        assert o["metadata"]["labels"][naming.LABEL_ISVC] == "chat"
    dep = by_kind(objs)["Deployment"]
    assert dep["spec"]["replicas"] == 3
    assert dep["metadata"]["annotations"][naming.ANNOTATION_OWNER_GENERATION] == "4"
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-router" and pod["automountServiceAccountToken"] is True
    assert pod["nodeSelector"] == {"pool": "cpu"}
    container = pod["containers"][0]
    assert container["image"] == "registry.local/pdserve:1" and container["resources"] == {"requests": {"cpu": "1"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": defaults.HTTP_PORT}
    assert container["securityContext"] == workloads.container_security()
    assert dep["spec"]["selector"]["matchLabels"] == naming.selector_labels("chat", "router", "router")
    svc = by_kind(objs)["Service"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": defaults.HTTP_PORT, "targetPort": "http",
                                     "protocol": "TCP"}]


def test_router_discovers_the_prefill_service_with_a_role_like_the_prefills():
    isvc = example()
    args = router_workloads.router_args(isvc, CONFIG)
    o = opts(args)
    assert args[0] == "router" and o["--discovery"] == "kubernetes" and o["--namespace"] == "ns1"
    assert o["--model"] == "builtin:tiny" and o["--port"] == str(defaults.HTTP_PORT)
    # the selector matches the labels of the prefill Service (whose slices name port "grpc")
    selector = dict(kv.split("=") for kv in o["--prefill-selector"].split(","))
    prefill_service = workloads.build_service(pools.build_prefill_pool(isvc, CONFIG))
    assert selector.items() <= prefill_service["metadata"]["labels"].items()
    assert "grpc" in {p["name"] for p in prefill_service["spec"]["ports"]}
    for decode in pools.build_decode_pools(isvc, CONFIG):
        assert not selector.items() <= workloads.build_service(decode)["metadata"]["labels"].items()
    assert not selector.items() <= router_workloads.build_router_service(isvc, CONFIG)["metadata"]["labels"].items()
    role = by_kind(router_workloads.build_router(isvc, CONFIG))["Role"]
    _, prefill_role, _ = workloads.build_prefill_rbac(pools.build_prefill_pool(isvc, CONFIG))
    assert role["rules"] == prefill_role["rules"]
    assert "--load-weight" not in o
    assert opts(router_workloads.router_args(example(loadWeight=16), CONFIG))["--load-weight"] == "16"


def test_router_cli_accepts_the_command_line_the_operator_writes():
    from pdserve.router import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    parsed = parser.parse_args(router_workloads.router_args(example(loadWeight=2.5), CONFIG)[1:])
    assert parsed.discovery == "kubernetes" and parsed.load_weight == 2.5
    cli.make_discovery(parsed)  # a valid namespace and selector (raises ValueError otherwise)
    parsed.prefill_selector = "no-value"
    with pytest.raises(ValueError, match="--prefill-selector must be label=value"):
        cli.make_discovery(parsed)


@pytest.mark.parametrize("model", [{"source": "/models/qwen", "pvcName": "weights"}, {"source": "pvc://weights/qwen"}])
def test_a_router_mounts_no_model_claim_and_takes_its_tokenizer_from_a_prefill(model):
    # a ReadWriteOnce claim would pin the router to the pools' node: the prefill serves it the files instead
    from pdserve.router import cli

    isvc = example()
    isvc["spec"]["model"] = model
    pod = router_workloads.build_router_deployment(isvc, CONFIG)["spec"]["template"]["spec"]
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}]  # where the fetched files go, briefly
    (container,) = pod["containers"]
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}] and "initContainers" not in pod
    args = router_workloads.router_args(isvc, CONFIG)
    assert "--tokenizer-from-prefill" in args and "--model" not in args and container["args"] == args
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    assert parsed.tokenizer_from_prefill and parsed.tokenizer_wait == defaults.TOKENIZER_WAIT_S
    # the pools still mount the claim and read the model from it
    prefill = workloads.build_deployment(pools.build_prefill_pool(isvc, CONFIG))["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in prefill["volumes"]
    assert opts(prefill["containers"][0]["args"])["--model"] == "/models/qwen"


def test_the_router_cli_refuses_both_a_model_and_a_tokenizer_from_a_prefill(capsys):
    from pdserve.router import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "tiny", "--tokenizer-from-prefill"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_zero_replicas_means_no_router_and_the_names_to_delete_cover_everything_it_makes():
    assert router_workloads.build_router(example(replicas=0), CONFIG) == []
    assert router_workloads.router_replicas(example()) == 1  # default: one router
    policy_config = OperatorConfig(default_image="i:1", protocol_version="7", network_policy=True)
    made = {(o["kind"], o["metadata"]["name"]) for o in router_workloads.build_router(example(), policy_config)}
    assert made == set(router_workloads.router_object_names("chat"))
    assert router_workloads.router_object_names("chat")[0] == ("Deployment", "chat-router")


def test_router_network_policy_opens_only_its_http_port():
    policy_config = OperatorConfig(default_image="i:1", protocol_version="7", network_policy=True)
    policy = by_kind(router_workloads.build_router(example(), policy_config))["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {naming.LABEL_ISVC: "chat", naming.LABEL_ROLE: "router"}
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": defaults.HTTP_PORT}]}]
    assert "NetworkPolicy" not in by_kind(router_workloads.build_router(example(), CONFIG))


def test_router_names_fit_in_a_service_name():
    isvc = example()
    isvc["metadata"]["name"] = "a" * naming.MAX_ISVC_NAME
    for o in router_workloads.build_router(isvc, CONFIG):
        assert len(o["metadata"]["name"]) <= 63


# ---- status ------------------------------------------------------------------------------------

def deployment(replicas: int, ready: int, generation: str = "4") -> dict:
    return {"metadata": {"generation": 1, "annotations": {naming.ANNOTATION_OWNER_GENERATION: generation}},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas}}


def serving_pools(isvc: dict):
    prefill = pools.build_prefill_pool(isvc, CONFIG)
    decodes = pools.build_decode_pools(isvc, CONFIG)
    return ((prefill, status.pool_status(prefill, deployment(1, 1), "s")),
            [(d, status.pool_status(d, deployment(d["spec"]["replicas"], d["spec"]["replicas"]), "s"))
             for d in decodes])


def conds(st: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_status_endpoint_is_the_router_and_ready_waits_for_a_router_pod():
    isvc = example(replicas=2)
    prefill, decodes = serving_pools(isvc)
    missing = status.isvc_status(isvc, prefill, decodes, None)
    assert conds(missing)["Ready"] == ("False", "PoolsMissing") and "router" in missing["conditions"][0]["message"]
    assert "observedGeneration" not in missing
    assert missing["endpoint"] == "http://chat-router.ns1.svc:8000"
    waiting = status.isvc_status(isvc, prefill, decodes, deployment(2, 0))
    assert conds(waiting)["Ready"] == ("False", "RouterNotReady")
    assert waiting["routerReady"] == "0/2" and waiting["router"]["ready"] is False
    serving = status.isvc_status(isvc, prefill, decodes, deployment(2, 1))
    assert (conds(serving)["Ready"] == ("True", "Serving")
            and conds(serving)["Progressing"] == ("True", "PoolsRollingOut"))
    assert serving["routerReady"] == "1/2" and serving["observedGeneration"] == 4
    assert (conds(status.isvc_status(isvc, prefill, decodes, deployment(2, 2, generation="3")))["Progressing"][0]
            == "False")
    assert status.isvc_status(isvc, prefill, decodes, deployment(2, 2, generation="3"))["observedGeneration"] == 3


def test_without_a_router_the_prefill_is_the_endpoint_and_router_fields_are_removed():
    isvc = example(replicas=0)
    prefill, decodes = serving_pools(isvc)
    st = status.isvc_status(isvc, prefill, decodes, None)
    assert st["endpoint"] == "http://chat-prefill.ns1.svc:8000"
    assert conds(st)["Ready"] == ("True", "Serving")
    # merge-patched: None deletes what a router left behind
    assert st["router"] is None and st["routerReady"] is None
    before = copy.deepcopy(st)
    assert status.isvc_status(isvc, prefill, decodes, deployment(1, 1)) == before  # a leftover Deployment is ignored


def test_named_slo_classes_turn_the_routers_queue_on_with_the_prefills_classes():
    plain = opts(router_workloads.router_args(example(), CONFIG))
    assert "--slo-classes" not in plain  # the default two targets alone: no queue in the router
    isvc = example()
    isvc["spec"]["slo"] = {"defaultClass": "interactive", "classes": [{"name": "interactive", "ttftMs": 500},
                                                                     {"name": "batch", "e2eMs": 3600000}]}
    args = router_workloads.router_args(isvc, CONFIG)
    prefill_env = {e["name"]: e.get("value") for e in workloads.pod_env(pools.build_prefill_pool(isvc, CONFIG)["spec"],
                                                                      "prefill", "prefill")}
    assert opts(args)["--slo-classes"] == prefill_env[defaults.ENV_SLO_CLASSES]
    from pdserve.router.cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    from pdserve.slo import classes
    assert classes.load(parsed.slo_classes).names() == classes.load(prefill_env[defaults.ENV_SLO_CLASSES]).names()
    assert parsed.queue_policy is None  # unset: the router's default
    isvc["spec"]["slo"]["queuePolicy"] = "edf"
    assert parser.parse_args(router_workloads.router_args(isvc, CONFIG)[1:]).queue_policy == "edf"
