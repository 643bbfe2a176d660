"""Engine and pod settings (operator/crd_pod.py, operator/pod_settings.py): GPU pools, engine flags,
pod template additions, pull secrets and PodDisruptionBudgets, from the pure builders (the API
server's side, CEL rules included, is tests/k8s/test_k8s_operator_pod_settings.py)."""

import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from pdserve.operator import crd_pod, crds, naming, pod_settings, pools, router_workloads, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")


def example() -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"]["namespace"] = "ns1"
    return doc

GPU = {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}
EVERY_ENGINE_FIELD = {"name": "sim", "simProfile": "cpu-small", "dtype": "float16", "quantization": "fp8",
                      "kvCacheDtype": "fp8",
                      "kvCacheMemory": "4Gi",
                      "numBlocks": 9, "gpuMemoryUtilization": 0.8, "maxNumSeqs": 64, "maxModelLen": 8192}


def opts(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""]) if a.startswith("--")}


def pool_of(isvc: dict, role: str) -> dict:
    return pools.build_prefill_pool(isvc, CONFIG) if role == "prefill" else pools.build_decode_pools(isvc, CONFIG)[0]


def settings(isvc: dict, role: str) -> dict:
    return isvc["spec"]["prefill"] if role == "prefill" else isvc["spec"]["decode"][0]


def pod(deployment: dict) -> tuple[dict, dict]:
    template = deployment["spec"]["template"]
    return template, template["spec"]["containers"][0]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_gpu_pool_computes_on_cuda_in_bfloat16_and_a_cpu_pool_as_before(role):
    isvc = example()
    cpu = opts(workloads.build_deployment(pool_of(isvc, role))["spec"]["template"]["spec"]["containers"][0]["args"])
    assert not {"--device", "--dtype", "--engine", "--kv-cache-memory", "--num-blocks"} & set(cpu)
    settings(isvc, role)["resources"] = GPU
    gpu = opts(pod(workloads.build_deployment(pool_of(isvc, role)))[1]["args"])
    assert (gpu["--device"], gpu["--dtype"]) == ("cuda", "bfloat16")
    settings(isvc, role)["resources"] = {"requests": {"amd.com/gpu": "2"}}  # requests count too, and AMD GPUs
    assert opts(workloads.build_deployment(pool_of(isvc, role))["spec"]["template"]["spec"]["containers"][0]["args"])[
        "--device"] == "cuda"


def test_engine_fields_become_the_server_flags_and_extra_args_come_last():
    spec = {"resources": GPU, "engine": {**EVERY_ENGINE_FIELD, "extraArgs": ["--kv-checksum", "--threads", "4"]}}
    args = pod_settings.engine_args(spec)
    assert args[-3:] == ["--kv-checksum", "--threads", "4"]
    assert opts(args[:-3]) == {"--engine": "sim", "--sim-profile": "cpu-small", "--device": "cuda",
                               "--dtype": "float16",
                               "--quantization": "fp8", "--kv-cache-dtype": "fp8", "--kv-cache-memory": str(4 << 30),
                               "--gpu-memory-utilization": "0.8", "--num-blocks": "9", "--max-num-seqs": "64",
                               "--max-model-len": "8192"}
    assert pod_settings.engine_args({"engine": {"dtype": "bfloat16"}}) == ["--dtype", "bfloat16"]  # CPU, explicit
    assert pod_settings.engine_args({"resources": {"limits": {"cpu": "4"}}}) == []


@pytest.mark.parametrize("quantity,expected", [("4Gi", 4 << 30), ("512Mi", 512 << 20), ("1.5G", 1_500_000_000),
                                               ("4096", 4096), (4096, 4096), ("1.5", 2), ("2k", 2000)])
def test_kv_cache_memory_quantities_become_bytes(quantity, expected):
    assert pod_settings.quantity_bytes(quantity) == expected


def test_a_bad_quantity_is_a_clear_error():
    with pytest.raises(ValueError, match="not a quantity of bytes"):
        pod_settings.quantity_bytes("lots")


KV_SIZES = [{"kvCacheMemory": "4Gi"}, {"gpuMemoryUtilization": 0.8}, {"numBlocks": 9}]  # the schema takes one


@pytest.mark.parametrize("kv", KV_SIZES, ids=[next(iter(k)) for k in KV_SIZES])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_server_clis_accept_the_gpu_command_lines(role, kv):
    """What a GPU pool with the engine fields runs must parse with the server's own flags."""
    module = importlib.import_module(f"pdserve.{role}_server.cli")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    isvc = example()
    engine = {"name": "builtin", "dtype": "float16", "maxNumSeqs": 64, "maxModelLen": 8192, **kv,
              "quantization": "fp8", "kvCacheDtype": "fp8", "extraArgs": ["--kv-checksum"]}
    settings(isvc, role).update(resources=GPU, engine=engine)
    args = pod(workloads.build_deployment(pool_of(isvc, role)))[1]["args"]
    parsed = parser.parse_args(args[1:])  # SystemExit on a flag the server does not have
    assert (parsed.device, parsed.dtype, parsed.max_num_seqs, parsed.max_model_len) == ("cuda", "float16", 64, 8192)
    assert parsed.quantization == "fp8" and parsed.kv_cache_dtype == "fp8"
    assert parsed.kv_checksum is True


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_flags_the_schema_reserves_are_every_flag_the_operator_writes(role):
    """engine.extraArgs is refused for exactly these (crd_pod.OPERATOR_FLAGS): none may be missing."""
    isvc = example()
    settings(isvc, role).update(resources=GPU, engine=dict(EVERY_ENGINE_FIELD))
    isvc["spec"]["prefill"]["batchStorage"] = {"pvcName": "jobs"}
    args = pod(workloads.build_deployment(pool_of(isvc, role)))[1]["args"]
    assert {a for a in args if a.startswith("--")} <= set(crd_pod.OPERATOR_FLAGS[role])
    assert set(crd_pod.ENGINE_FLAGS) <= {a for a in args if a.startswith("--")}


def test_the_operators_own_env_labels_annotations_and_volumes_are_the_ones_the_schema_reserves():
    isvc = example()
    isvc["spec"]["model"] = {"source": "/models/m", "pvcName": "weights"}
    isvc["spec"]["prefill"].update(batchStorage={"pvcName": "jobs"}, shmSize="1Gi")
    for deployment in [workloads.build_deployment(pools.build_prefill_pool(isvc, CONFIG)),
                       router_workloads.build_router_deployment(isvc, CONFIG)]:
        template, container = pod(deployment)
        assert {e["name"] for e in container["env"]} <= set(crd_pod.OPERATOR_ENV)
        assert {v["name"] for v in template["spec"]["volumes"]} <= set(crd_pod.OPERATOR_VOLUMES)
        assert set(template["metadata"]["annotations"]) <= set(crd_pod.OPERATOR_ANNOTATIONS)
        for key in template["metadata"]["labels"]:
            assert key in crd_pod.OPERATOR_LABELS or key.startswith(crd_pod.LABEL_PREFIX)


def test_the_operators_lists_are_the_servers():
    from pdserve import server_setup

    assert crd_pod.ENGINES == tuple(server_setup.ENGINES)
    parser = argparse.ArgumentParser()
    server_setup.add_engine_arguments(parser)
    dtype = next(a for a in parser._actions if a.dest == "dtype")
    assert set(crd_pod.DTYPES) == set(dtype.choices)
    quantization = next(a for a in parser._actions if a.dest == "quantization")
    enum = crd_pod.engine_schema("decode")["properties"]["quantization"]["enum"]
    assert set(enum) == set(quantization.choices) == {"fp8"}
    kv_dtype = next(a for a in parser._actions if a.dest == "kv_cache_dtype")
    kv_enum = crd_pod.engine_schema("prefill")["properties"]["kvCacheDtype"]["enum"]
    assert set(kv_enum) == set(kv_dtype.choices) == {"auto", "fp8"}


def full_settings() -> dict:
    return {
        "env": [{"name": "HF_HOME", "value": "/tmp/hf"}],
        "envFrom": [{"secretRef": {"name": "hf"}}],
        "affinity": {"podAntiAffinity": {}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                                      {"maxSkew": 2, "topologyKey": "host", "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"app": "other"}}}],
        "runtimeClassName": "nvidia",
        "priorityClassName": "high",
        "podAnnotations": {"team": "llm", "prometheus.io/port": "1"},
        "podLabels": {"team": "llm", naming.LABEL_ROLE: "not-this"},
        "shmSize": "2Gi",
        "extraVolumes": [{"name": "cache", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        "capabilities": ["IPC_LOCK"],
    }


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_pod_settings_reach_the_pods_under_the_operators_own(role):
    isvc = example()
    target = isvc["spec"]["router"] if role == "router" else settings(isvc, role)
    target.update(full_settings())
    deployment = (router_workloads.build_router_deployment(isvc, CONFIG) if role == "router"
                  else workloads.build_deployment(pool_of(isvc, role)))
    template, container = pod(deployment)
    spec = template["spec"]
    names = [e["name"] for e in container["env"]]
    assert names[-1] == "HF_HOME" and "POD_NAME" in names  # after the operator's own
    assert container["envFrom"] == [{"secretRef": {"name": "hf"}}]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "cache", "emptyDir": {}} in spec["volumes"]
    assert {"name": "cache", "mountPath": "/cache"} in container["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] and container["securityContext"]["runAsNonRoot"]
    assert (spec["runtimeClassName"], spec["priorityClassName"], spec["affinity"]) == ("nvidia", "high",
                                                                                       {"podAntiAffinity": {}})
    own, other = spec["topologySpreadConstraints"]
    assert own["labelSelector"] == deployment["spec"]["selector"]  # the pool's own pods
    assert other["labelSelector"] == {"matchLabels": {"app": "other"}}
    labels, annotations = template["metadata"]["labels"], template["metadata"]["annotations"]
    assert labels["team"] == "llm" and labels[naming.LABEL_ROLE] == role  # the operator's labels win
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert annotations["team"] == "llm" and annotations["prometheus.io/port"] != "1"
    assert "team" not in deployment["metadata"]["labels"]  # pod labels are the pods', not the Deployment's


def test_settings_do_not_leak_between_pools_and_the_spec_is_not_changed():
    isvc = example()
    isvc["spec"]["decode"][0].update(full_settings())
    before = yaml.safe_dump(isvc)
    main, big = (workloads.build_deployment(p) for p in pools.build_decode_pools(isvc, CONFIG))
    assert yaml.safe_dump(isvc) == before
    assert "runtimeClassName" in main["spec"]["template"]["spec"]
    assert "runtimeClassName" not in big["spec"]["template"]["spec"]
    assert not any(v["name"] == "dshm" for v in big["spec"]["template"]["spec"]["volumes"])


def test_pool_specs_carry_the_settings_and_the_pool_schemas_keep_them():
    """What pools.shared_spec copies into a pool must be in the pool CRDs' schema, or the API server prunes it."""
    isvc = example()
    isvc["spec"]["prefill"].update(full_settings(), engine={"numBlocks": 9}, disruptionBudget={"minAvailable": 1})
    pool = pools.build_prefill_pool(isvc, CONFIG)
    for key, value in full_settings().items():
        assert pool["spec"][key] == value, key
    assert pool["spec"]["engine"] == {"numBlocks": 9} and pool["spec"]["disruptionBudget"] == {"minAvailable": 1}
    for crd in (crds.prefillpool_crd(), crds.decodepool_crd()):
        properties = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert set(pools.POD_KEYS) | {"imagePullSecrets"} <= set(properties)
    isvc_spec = crds.inferenceservice_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for part in (isvc_spec["properties"]["prefill"], isvc_spec["properties"]["decode"]["items"]):
        assert set(pools.POD_KEYS) <= set(part["properties"])
    assert set(pools.POD_KEYS) - {"engine", "parallelism"} <= set(isvc_spec["properties"]["router"]["properties"])
    for key in ("engine", "parallelism"):  # the router computes nothing
        assert key not in isvc_spec["properties"]["router"]["properties"]


def test_every_pod_pulls_with_the_services_then_the_operators_secrets():
    isvc = example()
    isvc["spec"]["imagePullSecrets"] = [{"name": "regcred"}, {"name": "shared"}]
    config = OperatorConfig(default_image="i:1", protocol_version="7", image_pull_secrets=("shared", "operator-pull"))
    deployments = [workloads.build_deployment(pools.build_prefill_pool(isvc, config)),
                   *(workloads.build_deployment(p) for p in pools.build_decode_pools(isvc, config)),
                   router_workloads.build_router_deployment(isvc, config)]
    for deployment in deployments:
        assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [
            {"name": "regcred"}, {"name": "shared"}, {"name": "operator-pull"}]
    plain = workloads.build_deployment(pools.build_prefill_pool(example(), CONFIG))
    assert "imagePullSecrets" not in plain["spec"]["template"]["spec"]


def test_operator_pull_secrets_come_from_the_flag_or_the_charts_variable(monkeypatch):
    from pdserve.operator import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    monkeypatch.setenv("PDSERVE_IMAGE_PULL_SECRETS", "regcred, mirror")
    assert cli.image_pull_secrets(parser.parse_args([])) == ["regcred", "mirror"]
    assert (cli.image_pull_secrets(parser.parse_args(["--image-pull-secret", "a", "--image-pull-secret", "b"]))
            == ["a", "b"])
    monkeypatch.delenv("PDSERVE_IMAGE_PULL_SECRETS")
    assert cli.image_pull_secrets(parser.parse_args([])) == []
    with pytest.raises(ValueError, match="image pull secret"):
        OperatorConfig(default_image="i:1", protocol_version="1", image_pull_secrets=("Not A Name",))


def test_each_pool_and_the_router_get_a_disruption_budget_selecting_their_pods():
    isvc = example()
    isvc["spec"]["decode"][0]["disruptionBudget"] = {"minAvailable": "50%"}
    isvc["spec"]["router"]["disruptionBudget"] = {"maxUnavailable": 2}
    prefill = workloads.build_children(pools.build_prefill_pool(isvc, CONFIG))
    main = workloads.build_children(pools.build_decode_pools(isvc, CONFIG)[0])
    router = router_workloads.build_router(isvc, CONFIG)
    for children, budget in ((prefill, {"maxUnavailable": 1}), (main, {"minAvailable": "50%"}),
                             (router, {"maxUnavailable": 2})):
        (pdb,) = [c for c in children if c["kind"] == "PodDisruptionBudget"]
        (deployment,) = [c for c in children if c["kind"] == "Deployment"]
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["metadata"]["name"] == deployment["metadata"]["name"]
        assert pdb["metadata"]["namespace"] == "ns1" and pdb["metadata"]["labels"] == deployment["metadata"]["labels"]
        assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
        assert {k: v for k, v in pdb["spec"].items() if k in ("maxUnavailable", "minAvailable")} == budget
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # an unready pod never blocks a drain
    assert ("PodDisruptionBudget", "chat-router") in router_workloads.router_object_names("chat")


def test_the_gpu_example_runs_every_pool_on_cuda_and_the_router_on_the_cpu():
    isvc = yaml.safe_load((REPO / "examples" / "inferenceservice-gpu.yaml").read_text())
    isvc["metadata"]["namespace"] = "ns1"
    for pool in [pools.build_prefill_pool(isvc, CONFIG), *pools.build_decode_pools(isvc, CONFIG)]:
        args = opts(pod(workloads.build_deployment(pool))[1]["args"])
        assert (args["--device"], args["--dtype"]) == ("cuda", "bfloat16")
    assert "--device" not in pod(router_workloads.build_router_deployment(isvc, CONFIG))[1]["args"]


def test_every_container_quotes_its_log_when_it_crashes():
    # the Degraded condition and Events quote the termination message (operator/pod_problems.py)
    isvc = example()
    for deployment in [workloads.build_deployment(pool_of(isvc, "prefill")),
                       workloads.build_deployment(pool_of(isvc, "decode")),
                       router_workloads.build_router_deployment(isvc, CONFIG)]:
        _, container = pod(deployment)
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError", deployment["metadata"]["name"]


@pytest.mark.parametrize("name", ["nvidia.com/mig-3g.40gb", "nvidia.com/mig-1g.10gb", "amd.com/gpu", "nvidia.com/gpu"])
def test_every_gpu_resource_name_makes_a_gpu_pool(name):
    """A MIG slice was not counted before: its pool ran on the CPU without a word."""
    for part in ("limits", "requests"):
        spec = {"resources": {part: {name: 1}}}
        assert pod_settings.uses_gpu(spec)
        assert opts(pod_settings.engine_args(spec))["--device"] == "cuda"
    assert not pod_settings.uses_gpu({"resources": {"limits": {"nvidia.com/gpu-memory": 1, "cpu": 4}}})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_rollout_and_scheduler_reach_the_deployment(role):
    isvc = example()
    assert workloads.build_deployment(pool_of(isvc, role))["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1, "maxUnavailable": 0}  # the default: one new pod first
    settings(isvc, role).update(rollout={"maxSurge": 0, "maxUnavailable": 1}, schedulerName="volcano")
    dep = workloads.build_deployment(pool_of(isvc, role))
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert dep["spec"]["template"]["spec"]["schedulerName"] == "volcano"


def test_a_sim_pool_passes_its_profile():
    spec = {"engine": {"name": "sim", "simProfile": "h200-llama3-8b", "numBlocks": 4096}}
    args = pod_settings.engine_args(spec)
    assert args[:4] == ["--engine", "sim", "--sim-profile", "h200-llama3-8b"] and "--num-blocks" in args
