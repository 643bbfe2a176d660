"""The operator's pure builders: InferenceService -> pools -> Deployments, Services, RBAC, NetworkPolicies."""

import argparse
import copy
from pathlib import Path

import pytest
import yaml

from pdserve import defaults
from pdserve.operator import crds, naming, pools, router_workloads, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")


def example() -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"]["namespace"] = "ns1"
    return doc


def test_prefill_pool_carries_everything_its_children_need():
    pool = pools.build_prefill_pool(example(), CONFIG)
    assert pool["kind"] == "PrefillPool" and pool["metadata"]["name"] == "chat-prefill"
    assert pool["metadata"]["namespace"] == "ns1"
    spec = pool["spec"]
    assert spec["inferenceService"] == "chat"
    assert spec["image"] == "registry.local/pdserve:1"  # the operator's default
    assert spec["protocolVersion"] == "7"
    assert spec["replicas"] == 1
    assert spec["model"] == {"source": "builtin:tiny", "mountPath": "/models"}
    assert spec["transfer"] == {"backend": "tcp", "blockSize": 64}
    assert spec["routing"] == {"policy": "wrr"} and spec["slo"] == {"ttftMs": 1000, "tbtMs": 100}
    assert spec["resources"]["limits"]["memory"] == "4Gi"
    labels = pool["metadata"]["labels"]
    assert labels[naming.LABEL_ISVC] == "chat" and labels[naming.LABEL_ROLE] == "prefill"
    assert labels[naming.LABEL_PROTOCOL] == "7"


def test_spec_slo_queue_policy_reaches_the_prefills_flag_and_not_their_classes():
    from pdserve.prefill_server.cli import add_arguments
    from pdserve.slo import classes

    plain = workloads.build_deployment(pools.build_prefill_pool(example(), CONFIG))
    assert "--queue-policy" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]  # unset: the default
    isvc = example()
    isvc["spec"]["slo"] = {"ttftMs": 800, "queuePolicy": "qlm"}
    container = workloads.build_deployment(pools.build_prefill_pool(isvc, CONFIG))["spec"]["template"]["spec"][
        "containers"][0]
    args = container["args"]
    assert args[args.index("--queue-policy") + 1] == "qlm"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(args[1:]).queue_policy == "qlm"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "queuePolicy" not in env[defaults.ENV_SLO_CLASSES]
    assert classes.load(None, env).select().ttft_ms == 800  # the servers parse the classes as before


def test_spec_routing_disaggregation_reaches_the_prefills_flag():
    from pdserve.prefill_server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plain = workloads.build_deployment(pools.build_prefill_pool(example(), CONFIG))
    args = plain["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--disaggregation" not in args  # unset: the server's default
    assert parser.parse_args(args[1:]).disaggregation == defaults.DISAGGREGATION
    isvc = example()
    isvc["spec"]["routing"] = {"disaggregation": "auto"}
    pool = pools.build_prefill_pool(isvc, CONFIG)
    assert pool["spec"]["routing"] == {"policy": crds.DEFAULT_POLICY, "disaggregation": "auto"}
    args = workloads.build_deployment(pool)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert parser.parse_args(args[1:]).disaggregation == "auto"
    schema = crds.inferenceservice_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = schema["properties"]["spec"]["properties"]["routing"]["properties"]["disaggregation"]
    assert field["enum"] == list(defaults.DISAGGREGATION_MODES) and "default" not in field


def test_prefill_pods_get_the_slo_classes_the_servers_parse():
    from pdserve.slo import classes

    isvc = example()
    isvc["spec"]["slo"] = {"ttftMs": 800, "defaultClass": "interactive", "classes": [
        {"name": "interactive", "ttftMs": 2000, "e2eMs": 20000, "earlyReject": True, "priority": 0},
        {"name": "batch", "e2eMs": 3600000}]}
    pool = pools.build_prefill_pool(isvc, CONFIG)
    env = {e["name"]: e.get("value") for e in
           workloads.build_deployment(pool)["spec"]["template"]["spec"]["containers"][0]["env"]}
    parsed = classes.load(None, env)
    assert parsed.names() == ["default", "interactive", "batch"] and parsed.select().name == "interactive"
    assert (parsed.by_name["default"].ttft_ms, parsed.by_name["default"].tbt_ms) == (800, 100)  # tbtMs: the default
    assert parsed.select(priority=0).early_reject and parsed.by_name["batch"].e2e_ms == 3600000
    # the old form: the class 'default' alone; decode pods get no SLO
    old = classes.load(None, {e["name"]: e.get("value") for e in workloads.build_deployment(
        pools.build_prefill_pool(example(), CONFIG))["spec"]["template"]["spec"]["containers"][0]["env"]})
    assert old.names() == ["default"] and (old.select().ttft_ms, old.select().tbt_ms) == (1000, 100)
    decode = workloads.build_deployment(pools.build_decode_pools(example(), CONFIG)[0])
    assert defaults.ENV_SLO_CLASSES not in {e["name"]
                                            for e in decode["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_children_record_the_owner_generation_they_were_built_from():
    isvc = example()
    isvc["metadata"]["generation"] = 7
    pool = pools.build_decode_pools(isvc, CONFIG)[0]
    assert pool["metadata"]["annotations"][naming.ANNOTATION_OWNER_GENERATION] == "7"
    pool["metadata"]["generation"] = 2
    deployment = workloads.build_deployment(pool)
    assert deployment["metadata"]["annotations"][naming.ANNOTATION_OWNER_GENERATION] == "2"
    assert naming.ANNOTATION_OWNER_GENERATION not in deployment["spec"]["template"]["metadata"]["annotations"]


def test_decode_pools_one_per_entry_with_their_own_hardware():
    isvc = example()  # the example's "big" pool runs on any node; pinned here as its comment shows
    isvc["spec"]["decode"][1]["nodeSelector"] = {"pdserve.io/node-class": "large"}
    decodes = pools.build_decode_pools(isvc, CONFIG)
    assert [p["metadata"]["name"] for p in decodes] == ["chat-decode-main", "chat-decode-big"]
    main, big = decodes
    assert main["spec"]["poolName"] == "main" and main["spec"]["replicas"] == 2
    assert big["spec"]["nodeSelector"] == {"pdserve.io/node-class": "large"}
    assert big["spec"]["tolerations"][0]["key"] == "pdserve.io/dedicated"
    assert "nodeSelector" not in main["spec"]


def test_spec_image_and_protocol_override_the_operator_defaults():
    isvc = example()
    isvc["spec"]["image"] = "other/pdserve:2"
    isvc["spec"]["protocolVersion"] = "8"
    pool = pools.build_prefill_pool(isvc, CONFIG)
    assert pool["spec"]["image"] == "other/pdserve:2" and pool["spec"]["protocolVersion"] == "8"


def test_scaled_pool_keeps_its_replicas_until_the_isvc_count_changes():
    isvc = example()
    first = pools.build_decode_pools(isvc, CONFIG)[0]
    scaled = copy.deepcopy(first)
    scaled["spec"]["replicas"] = 5  # kubectl scale decodepool chat-decode-main --replicas=5
    again = pools.build_decode_pools(isvc, CONFIG, {"chat-decode-main": scaled})[0]
    assert again["spec"]["replicas"] == 5
    isvc["spec"]["decode"][0]["replicas"] = 3  # the InferenceService's own count changes: it wins
    changed = pools.build_decode_pools(isvc, CONFIG, {"chat-decode-main": scaled})[0]
    assert changed["spec"]["replicas"] == 3
    assert changed["metadata"]["annotations"][naming.ANNOTATION_ISVC_REPLICAS] == "3"


def test_stale_decode_pools_are_those_no_longer_listed():
    isvc = example()
    assert (pools.stale_decode_pools(isvc, ["chat-decode-main", "chat-decode-old", "chat-decode-big"])
            == ["chat-decode-old"])


def _opts(args: list[str]) -> dict[str, str]:
    return dict(zip(args[1::2], args[2::2]))


def test_prefill_command_line_matches_the_server_cli():
    pool = pools.build_prefill_pool(example(), CONFIG)
    deployment = workloads.build_deployment(pool)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["pdserve"]
    args = container["args"]
    assert args[0] == "prefill"
    assert _opts(args) == {
        "--host": "0.0.0.0", "--port": str(defaults.HTTP_PORT), "--grpc-port": str(defaults.PREFILL_GRPC_PORT),
        "--model": "builtin:tiny", "--served-model-name": "tiny", "--discovery": "kubernetes", "--namespace": "ns1",
        "--decode-selector": "pdserve.io/inference-service=chat,pdserve.io/role=decode,pdserve.io/protocol-version=7",
        "--policy": "wrr", "--transfer": "tcp", "--block-size": "64", "--drain-timeout": str(workloads.DRAIN_TIMEOUT_S),
    }


def test_decode_command_line_matches_the_server_cli():
    pool = pools.build_decode_pools(example(), CONFIG)[1]
    container = workloads.build_deployment(pool)["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "decode"
    assert _opts(args) == {
        "--host": "0.0.0.0", "--advertise-host": "$(POD_IP)", "--port": str(defaults.DECODE_GRPC_PORT),
        "--http-port": str(defaults.DECODE_HTTP_PORT), "--kv-port": str(defaults.KV_TRANSFER_PORT),
        "--model": "builtin:tiny", "--served-model-name": "tiny", "--transfer": "tcp", "--block-size": "64",
        "--drain-timeout": str(workloads.DRAIN_TIMEOUT_S),
    }
    # $(POD_IP) is expanded by the kubelet from the container's environment.
    assert any(e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
               for e in container["env"])


def _parser_of(module_name: str) -> argparse.ArgumentParser | None:
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_server_clis_accept_the_command_lines_the_operator_writes(role):
    """Once the servers' CLI modules exist, they must parse exactly what the pods run."""
    parser = _parser_of(f"pdserve.{role}_server.cli")
    assert parser is not None, f"pdserve.{role}_server.cli has no add_arguments"
    isvc = example()
    pool = pools.build_prefill_pool(isvc, CONFIG) if role == "prefill" else pools.build_decode_pools(isvc, CONFIG)[0]
    args = workloads.build_deployment(pool)["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = parser.parse_args(args[1:])  # exits (SystemExit) on any flag it does not know
    assert parsed is not None


def test_prefill_batch_storage_mounts_the_claim_and_points_batch_db_at_it():
    from pdserve.prefill_server import cli

    isvc = example()
    plain = workloads.build_deployment(pools.build_prefill_pool(isvc, CONFIG))["spec"]["template"]["spec"]
    assert "--batch-db" not in plain["containers"][0]["args"]  # the default: under HOME=/tmp, the emptyDir
    assert not any(v["name"] == "batch" for v in plain["volumes"])
    isvc["spec"].setdefault("prefill", {})["batchStorage"] = {"pvcName": "jobs"}
    pool = pools.build_prefill_pool(isvc, CONFIG)
    assert pool["spec"]["batchStorage"] == {"pvcName": "jobs"}
    pod = workloads.build_deployment(pool)["spec"]["template"]["spec"]
    assert {"name": "batch", "persistentVolumeClaim": {"claimName": "jobs"}} in pod["volumes"]
    container = pod["containers"][0]
    assert {"name": "batch", "mountPath": defaults.BATCH_DATA_MOUNT} in container["volumeMounts"]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    db = parser.parse_args(container["args"][1:]).batch_db
    assert db == workloads.BATCH_DB_IN_POD and db.startswith(defaults.BATCH_DATA_MOUNT + "/")
    decode = workloads.build_deployment(pools.build_decode_pools(isvc, CONFIG)[0])["spec"]["template"]["spec"]
    assert not any(v["name"] == "batch" for v in decode["volumes"])


def test_pods_are_secure_by_default_and_probe_health_and_ready():
    deployments = [workloads.build_deployment(pool) for pool in
                   [pools.build_prefill_pool(example(), CONFIG), *pools.build_decode_pools(example(), CONFIG)]]
    deployments.append(router_workloads.build_router_deployment(example(), CONFIG))  # a router relays streams too
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        assert container["readinessProbe"]["httpGet"]["port"] == http


def test_only_prefill_pods_get_an_api_token():
    prefill = workloads.build_deployment(pools.build_prefill_pool(example(), CONFIG))["spec"]["template"]["spec"]
    decode = workloads.build_deployment(pools.build_decode_pools(example(), CONFIG)[0])["spec"]["template"]["spec"]
    assert prefill["serviceAccountName"] == "chat-prefill" and prefill["automountServiceAccountToken"] is True
    assert decode["automountServiceAccountToken"] is False and "serviceAccountName" not in decode


def test_prefill_role_allows_only_watching_endpointslices_and_services():
    sa, role, binding = workloads.build_prefill_rbac(pools.build_prefill_pool(example(), CONFIG))
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["name"] == "chat-prefill"
    verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert verbs == {("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
                     ("", "services"): {"get", "list", "watch"}}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-prefill", "namespace": "ns1"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_deployment_selector_is_stable_across_version_changes_but_the_template_rolls():
    isvc = example()
    before = workloads.build_deployment(pools.build_decode_pools(isvc, CONFIG)[0])
    isvc["spec"]["protocolVersion"] = "8"
    isvc["spec"]["image"] = "registry.local/pdserve:2"
    after = workloads.build_deployment(pools.build_decode_pools(isvc, CONFIG)[0])
    assert before["spec"]["selector"] == after["spec"]["selector"]  # immutable field: must not change
    assert naming.LABEL_PROTOCOL not in before["spec"]["selector"]["matchLabels"]
    assert after["spec"]["template"]["metadata"]["labels"][naming.LABEL_PROTOCOL] == "8"
    assert after["spec"]["template"] != before["spec"]["template"]  # so the Deployment rolls
    assert before["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert before["spec"]["minReadySeconds"] == workloads.MIN_READY_S > 0  # the new pod is routable before the old goes


def test_decode_service_is_selected_by_prefill_only_at_the_same_protocol_version():
    isvc = example()
    prefill = pools.build_prefill_pool(isvc, CONFIG)
    selector = dict(kv.split("=") for kv in _opts(workloads.prefill_args(prefill))["--decode-selector"].split(","))
    for decode in pools.build_decode_pools(isvc, CONFIG):
        service = workloads.build_service(decode)
        assert service["spec"]["clusterIP"] == "None"
        assert selector.items() <= service["metadata"]["labels"].items()
        assert service["spec"]["selector"][naming.LABEL_PROTOCOL] == "7"
        assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "http", "kv"}
    isvc["spec"]["protocolVersion"] = "8"
    newer = workloads.build_service(pools.build_decode_pools(isvc, CONFIG)[0])
    assert not selector.items() <= newer["metadata"]["labels"].items()


def test_model_on_a_volume_is_mounted_read_only():
    isvc = example()
    isvc["spec"]["model"] = {"source": "/models/qwen", "pvcName": "weights"}
    pod = workloads.build_deployment(pools.build_decode_pools(isvc, CONFIG)[0])["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert _opts(pod["containers"][0]["args"])["--model"] == "/models/qwen"


def test_network_policy_admits_session_and_kv_ports_only_from_same_service_prefill():
    decode_policy, prefill_policy = pools.build_network_policies(example(), CONFIG)
    assert decode_policy["spec"]["podSelector"]["matchLabels"] == {naming.LABEL_ISVC: "chat",
                                                                   naming.LABEL_ROLE: "decode"}
    session, health = decode_policy["spec"]["ingress"]
    assert session["from"] == [{"podSelector": {"matchLabels": {naming.LABEL_ISVC: "chat",
                                                                naming.LABEL_ROLE: "prefill"}}}]
    assert {p["port"] for p in session["ports"]} == {defaults.DECODE_GRPC_PORT, defaults.KV_TRANSFER_PORT}
    assert "from" not in health and [p["port"] for p in health["ports"]] == [defaults.DECODE_HTTP_PORT]
    http, grpc = prefill_policy["spec"]["ingress"]
    assert "from" not in http and [p["port"] for p in http["ports"]] == [defaults.HTTP_PORT]
    # gRPC (Generate, KV events, load reports: no API key) only from the service's routers while it has them
    assert [p["port"] for p in grpc["ports"]] == [defaults.PREFILL_GRPC_PORT]
    assert grpc["from"] == [{"podSelector": {"matchLabels": {naming.LABEL_ISVC: "chat", naming.LABEL_ROLE: "router"}}}]
    no_router = example()
    no_router["spec"]["router"] = {"replicas": 0}
    assert "from" not in pools.build_network_policies(no_router, CONFIG)[1]["spec"]["ingress"][1]
    nixl = example()
    nixl["spec"]["transfer"] = {"backend": "nixl"}
    session = pools.build_network_policies(nixl, CONFIG)[0]["spec"]["ingress"][0]
    assert "ports" not in session and session["from"][0]["podSelector"]["matchLabels"][naming.LABEL_ISVC] == "chat"


def test_children_names_fit_in_a_service_name():
    isvc = example()
    isvc["metadata"]["name"] = "a" * naming.MAX_ISVC_NAME
    isvc["spec"]["decode"] = [{"name": "b" * naming.MAX_POOL_NAME}]
    for pool in [pools.build_prefill_pool(isvc, CONFIG), *pools.build_decode_pools(isvc, CONFIG)]:
        for child in workloads.build_children(pool):
            assert len(child["metadata"]["name"]) <= 63


def test_bad_operator_config_is_a_clear_error():
    with pytest.raises(ValueError, match="protocol version"):
        OperatorConfig(default_image="x", protocol_version="has space")
    with pytest.raises(ValueError, match="default image"):
        OperatorConfig(default_image="", protocol_version="1")
    with pytest.raises(ValueError, match="CUDA image 'reg/p cuda:1' must be .* without spaces"):
        OperatorConfig(default_image="reg/p:1", cuda_image="reg/p cuda:1", protocol_version="1")


def test_nvidia_gpu_pools_run_the_cuda_image_and_the_rest_the_default():
    """The image per kind (the chart's image.cuda): a pool asking for an NVIDIA GPU (a whole one or a MIG slice)
    runs the CUDA image; a CPU or AMD pool and the router the default; spec.image wins for all; without a CUDA
    image every pool runs the default (as before)."""
    config = OperatorConfig(default_image="reg/p:1", cuda_image="reg/p-cuda:1", protocol_version="1")
    isvc = example()
    isvc["spec"]["prefill"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    isvc["spec"]["decode"] = [{"name": "mig", "resources": {"limits": {"nvidia.com/mig-1g.10gb": 1}}},
                              {"name": "amd", "resources": {"limits": {"amd.com/gpu": 1}}},
                              {"name": "cpu", "resources": {"limits": {"cpu": "4"}}}]

    def images(config):
        built = [pools.build_prefill_pool(isvc, config), *pools.build_decode_pools(isvc, config)]
        return {p["metadata"]["name"]: p["spec"]["image"] for p in built}

    assert images(config) == {"chat-prefill": "reg/p-cuda:1", "chat-decode-mig": "reg/p-cuda:1",
                              "chat-decode-amd": "reg/p:1", "chat-decode-cpu": "reg/p:1"}
    assert set(images(CONFIG).values()) == {CONFIG.default_image}
    isvc["spec"]["image"] = "mine:2"
    assert set(images(config).values()) == {"mine:2"}


def test_protocol_version_comes_from_the_protos_package():
    from pdserve.protos.version import PROTOCOL_VERSION

    assert naming.default_protocol_version() == str(PROTOCOL_VERSION)


def test_pods_carry_the_metric_labels_of_their_service_and_pool():
    from pdserve.defaults import ENV_INFERENCE_SERVICE, ENV_POOL
    from pdserve.metrics import ServerMetrics

    isvc = example()
    built = [pools.build_prefill_pool(isvc, CONFIG), *pools.build_decode_pools(isvc, CONFIG)]
    seen = set()
    for pool in built:
        env = {e["name"]: e.get("value") for e in
               workloads.build_deployment(pool)["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[ENV_INFERENCE_SERVICE] == isvc["metadata"]["name"]
        seen.add(env[ENV_POOL])
    assert "prefill" in seen and len(seen) == len(built)  # one label value per pool
    # and the servers' metrics read them from there
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {ENV_INFERENCE_SERVICE: "chat", ENV_POOL: "main"}):
        m = ServerMetrics.from_env(role="decode")
    assert (m.inference_service, m.pool) == ("chat", "main")


def test_a_pod_that_goes_drains_for_as_long_as_a_request_may_run():
    """Scale-down and rolling updates kill no request: preStop lets the endpoint removal spread, then
    SIGTERM gives the requests --drain-timeout (the longest a request may run), within the grace period."""
    deployments = [workloads.build_deployment(pool) for pool in
                   [pools.build_prefill_pool(example(), CONFIG), *pools.build_decode_pools(example(), CONFIG)]]
    deployments.append(router_workloads.build_router_deployment(example(), CONFIG))  # a router relays streams too
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(workloads.PRESTOP_SLEEP_S)]
        drain = int(_opts(container["args"])["--drain-timeout"])
        assert drain >= defaults.REQUEST_TIMEOUT_S
        assert pod["terminationGracePeriodSeconds"] > workloads.PRESTOP_SLEEP_S + drain


def test_network_policy_admits_the_per_rank_push_ports_of_tensor_parallel_pools():
    """tcp: rank r's receiver on KV_TRANSFER_PORT + 1 + r; where the prefill has more ranks than a decode pool
    (a decode rank then holds several prefill ranks' heads), the head slices' receivers after them
    (decode_server/rank_ports.py)."""
    def kv_rule(prefill: int, decodes: list[int]) -> dict:
        isvc = example()
        isvc["spec"]["prefill"]["parallelism"] = {"tensor": prefill}
        isvc["spec"]["decode"] = [{"name": f"d{i}", "parallelism": {"tensor": n}} for i, n in enumerate(decodes)]
        session = pools.build_network_policies(isvc, CONFIG)[0]["spec"]["ingress"][0]
        return next(p for p in session["ports"] if p["port"] == defaults.KV_TRANSFER_PORT)

    assert "endPort" not in kv_rule(1, [1])
    assert kv_rule(1, [2])["endPort"] == defaults.KV_TRANSFER_PORT + 2  # slices are packed by the prefill
    assert kv_rule(2, [1])["endPort"] == defaults.KV_TRANSFER_PORT + defaults.KV_SLICE_PORTS
    assert kv_rule(4, [2, 8])["endPort"] == defaults.KV_TRANSFER_PORT + 8 + defaults.KV_SLICE_PORTS
