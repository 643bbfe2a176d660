"""Engine and pod settings on a real control plane: an InferenceService with GPU pools and every
pod setting (crd_pod.py) becomes Deployments whose pods say so (--device cuda, the dtype, the KV
flags, env, volumes, /dev/shm, capabilities, scheduling, pull secrets on every pod) and a
PodDisruptionBudget per pool and router, which follow the spec; invalid settings are refused by
the API server with a message naming the field. Also: the chart hands its imagePullSecrets to the
operator.

The operator here runs with --image-pull-secret operator-pull (what the chart's
imagePullSecrets turn into), so its Secret lands on every pod after the InferenceService's own,
and with --cuda-image (the chart's image.cuda, as $PDSERVE_CUDA_IMAGE), which the pools that ask
for an NVIDIA GPU run; every other pod runs the default (CPU) image.
"""

import copy
import json

import pytest
import yaml

from harness.chart import by_kind, render
from harness.operator_harness import IMAGE, OperatorProcess, get_json, install_chart, names, wait_for
from harness.procs import REPO

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
GPU = {"limits": {"nvidia.com/gpu": 1, "rdma/hca_shared_devices_a": 1, "memory": "64Gi"}}
CUDA_IMAGE = "registry.test/pdserve-cuda:1"


@pytest.fixture(scope="module")
def operator(kube, tmp_path_factory):
    """The chart installed and one operator that adds the Secret operator-pull to every pod's pull secrets."""
    install_chart(kube)
    op = OperatorProcess(kube, tmp_path_factory.mktemp("operator"),
                         extra_args=("--network-policy", "--image-pull-secret", "operator-pull",
                                     "--cuda-image", CUDA_IMAGE))
    op.start()
    try:
        yield op
    finally:
        op.stop()


def gpu_isvc() -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["imagePullSecrets"] = [{"name": "regcred"}]
    spec["prefill"] = {
        "replicas": 2,
        "resources": GPU,
        "engine": {"kvCacheMemory": "4Gi", "maxNumSeqs": 64, "maxModelLen": 8192, "extraArgs": ["--kv-checksum"]},
        "env": [{"name": "HF_HOME", "value": "/tmp/hf"},
                {"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tokens", "key": "api"}}}],
        "envFrom": [{"secretRef": {"name": "hf-token"}}, {"configMapRef": {"name": "tuning"}, "prefix": "T_"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu.example/model", "operator": "In", "values": ["h100"]}]}]}}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "runtimeClassName": "nvidia",
        "priorityClassName": "inference-high",
        "podAnnotations": {"example.com/team": "llm"},
        "podLabels": {"team": "llm"},
        "shmSize": "2Gi",
        "extraVolumes": [{"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}}],
        "extraVolumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        "capabilities": ["IPC_LOCK"],
        "disruptionBudget": {"minAvailable": 1},
    }
    spec["decode"] = [
        {"name": "gpu", "replicas": 3, "resources": GPU, "engine": {"gpuMemoryUtilization": 0.85, "name": "builtin"}},
        {"name": "amd", "replicas": 1, "resources": {"limits": {"amd.com/gpu": 1}},
         "engine": {"numBlocks": 4096, "dtype": "bfloat16"}},
        {"name": "mig", "replicas": 1, "resources": {"limits": {"nvidia.com/mig-3g.40gb": 1}}},
    ]
    spec["router"] = {"replicas": 2, "podLabels": {"team": "llm"}, "disruptionBudget": {"maxUnavailable": "50%"}}
    return doc


def pod_spec(kube, ns: str, name: str) -> dict:
    return get_json(kube, "deployment", name, "-n", ns)["spec"]["template"]


def flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""]) if a.startswith("--")}


def test_gpu_pools_and_pod_settings_reach_the_pods_and_each_pool_gets_a_disruption_budget(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(gpu_isvc()))
    expected = ["chat-decode-amd", "chat-decode-gpu", "chat-decode-mig", "chat-prefill", "chat-router"]
    wait_for(kube, lambda: names(kube, "deployments", ns) == expected, "five Deployments", op=operator)
    wait_for(kube, lambda: names(kube, "poddisruptionbudgets", ns) == expected, "five PodDisruptionBudgets",
             op=operator)
    # The image per kind: NVIDIA GPU pools (a whole GPU or a MIG slice) the CUDA image, the rest the default.
    images = {name: pod_spec(kube, ns, name)["spec"]["containers"][0]["image"] for name in expected}
    assert images == {"chat-prefill": CUDA_IMAGE, "chat-decode-gpu": CUDA_IMAGE, "chat-decode-mig": CUDA_IMAGE,
                      "chat-decode-amd": IMAGE, "chat-router": IMAGE}

    prefill = pod_spec(kube, ns, "chat-prefill")
    container = prefill["spec"]["containers"][0]
    args = flags(container["args"])
    assert (args["--device"], args["--dtype"]) == ("cuda", "bfloat16")
    assert args["--kv-cache-memory"] == str(4 << 30) and args["--max-num-seqs"] == "64"
    assert args["--max-model-len"] == "8192" and container["args"][-1] == "--kv-checksum"
    assert container["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"  # any resource name passes
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"]["value"] == "/tmp/hf" and env["API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tokens"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # the operator's stay
    assert container["envFrom"] == [{"secretRef": {"name": "hf-token"}},
                                    {"configMapRef": {"name": "tuning"}, "prefix": "T_"}]
    volumes = {v["name"]: v for v in prefill["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "10Gi"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["cache"] == "/cache" and mounts["tmp"] == "/tmp"
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    pod = prefill["spec"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"] == ["h100"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == {"pdserve.io/inference-service": "chat",
                                                      "pdserve.io/role": "prefill", "pdserve.io/pool": "prefill"}
    assert (pod["runtimeClassName"], pod["priorityClassName"]) == ("nvidia", "inference-high")
    assert prefill["metadata"]["labels"]["team"] == "llm"
    assert prefill["metadata"]["labels"]["pdserve.io/role"] == "prefill"
    assert prefill["metadata"]["annotations"]["example.com/team"] == "llm"
    assert prefill["metadata"]["annotations"]["prometheus.io/scrape"] == "true"

    gpu_args = flags(pod_spec(kube, ns, "chat-decode-gpu")["spec"]["containers"][0]["args"])
    assert (gpu_args["--device"], gpu_args["--dtype"], gpu_args["--gpu-memory-utilization"]) == (
        "cuda", "bfloat16", "0.85")
    assert gpu_args["--engine"] == "builtin"
    amd_args = flags(pod_spec(kube, ns, "chat-decode-amd")["spec"]["containers"][0]["args"])
    assert (amd_args["--device"], amd_args["--dtype"], amd_args["--num-blocks"]) == ("cuda", "bfloat16", "4096")
    router = pod_spec(kube, ns, "chat-router")
    assert not {"--device", "--dtype"} & set(router["spec"]["containers"][0]["args"])  # the router computes nothing
    assert router["metadata"]["labels"]["team"] == "llm"

    for name in expected:  # every pod the operator creates pulls with the service's and the operator's Secrets
        assert pod_spec(kube, ns, name)["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "operator-pull"}]

    def budget(name: str) -> dict:
        return get_json(kube, "poddisruptionbudget", name, "-n", ns)

    prefill_pdb = budget("chat-prefill")
    assert prefill_pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in prefill_pdb["spec"]
    assert prefill_pdb["spec"]["selector"]["matchLabels"] == get_json(
        kube, "deployment", "chat-prefill", "-n", ns)["spec"]["selector"]["matchLabels"]
    assert prefill_pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert [(o["kind"], o["name"]) for o in prefill_pdb["metadata"]["ownerReferences"]] == [
        ("PrefillPool", "chat-prefill")]
    assert budget("chat-decode-gpu")["spec"]["maxUnavailable"] == 1  # the default
    assert budget("chat-router")["spec"]["maxUnavailable"] == "50%"
    assert [o["kind"] for o in budget("chat-router")["metadata"]["ownerReferences"]] == ["InferenceService"]

    # The budgets follow the spec: a changed budget is applied, a router scaled to 0 loses its own.
    patch = {"spec": {"prefill": {"disruptionBudget": {"maxUnavailable": 2, "minAvailable": None}},
                      "router": {"replicas": 0}}}
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p", json.dumps(patch))
    wait_for(kube, lambda: budget("chat-prefill")["spec"].get("maxUnavailable") == 2, "the prefill budget updated",
             op=operator)
    assert "minAvailable" not in budget("chat-prefill")["spec"]
    wait_for(kube, lambda: "chat-router" not in names(kube, "poddisruptionbudgets", ns), "the router budget deleted",
             op=operator)


def test_cpu_pools_compute_as_before_and_their_settings_change_the_pods(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: len(names(kube, "deployments", ns)) == 4, "Deployments", op=operator)
    assert {pod_spec(kube, ns, name)["spec"]["containers"][0]["image"] for name in names(kube, "deployments", ns)} == {
        IMAGE}  # no pool asks for a GPU: the CPU image everywhere
    args = pod_spec(kube, ns, "chat-decode-main")["spec"]["containers"][0]["args"]
    assert not {"--device", "--dtype", "--kv-cache-memory", "--num-blocks"} & set(args)
    patch = [{"op": "add", "path": "/spec/decode/0/engine", "value": {"kvCacheMemory": "512Mi", "dtype": "float32"}},
             {"op": "add", "path": "/spec/decode/0/shmSize", "value": "1Gi"}]
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=json", "-p", json.dumps(patch))

    def rolled():
        template = pod_spec(kube, ns, "chat-decode-main")
        return flags(template["spec"]["containers"][0]["args"]).get("--kv-cache-memory") == str(512 << 20) and template
    template = wait_for(kube, rolled, "the decode pool's new engine flags", op=operator)
    container = template["spec"]["containers"][0]
    assert flags(container["args"])["--dtype"] == "float32" and "--device" not in container["args"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert template["spec"]["imagePullSecrets"] == [{"name": "operator-pull"}]


INVALID = [
    # (what is wrong, change to gpu_isvc()'s spec, texts the API server's message must contain)
    ("flag the operator sets", lambda s: s["prefill"]["engine"].update(extraArgs=["--dtype", "float16"]),
     ["spec.prefill.engine.extraArgs", "--dtype"]),
    ("flag=value the operator sets", lambda s: s["decode"][0]["engine"].update(extraArgs=["--model=/x"]),
     ["spec.decode[0].engine.extraArgs", "--model=/x"]),
    ("unknown dtype", lambda s: s["prefill"]["engine"].update(dtype="int8"), ["spec.prefill.engine.dtype"]),
    ("unknown engine", lambda s: s["prefill"]["engine"].update(name="trt"), ["spec.prefill.engine.name"]),
    ("utilization above 1", lambda s: s["decode"][0]["engine"].update(gpuMemoryUtilization=1.5),
     ["spec.decode[0].engine.gpuMemoryUtilization"]),
    ("utilization 0", lambda s: s["decode"][0]["engine"].update(gpuMemoryUtilization=0),
     ["spec.decode[0].engine.gpuMemoryUtilization"]),
    ("utilization on a CPU pool", lambda s: s["decode"][0].update(resources={"limits": {"cpu": "4"}}) or
     s["decode"][0]["engine"].update(dtype="bfloat16"),
     ["spec.decode[0].engine.gpuMemoryUtilization", "needs a GPU"]),
    ("two KV sizes", lambda s: s["prefill"]["engine"].update(numBlocks=100), ["spec.prefill.engine", "at most one"]),
    ("bad KV size", lambda s: s["prefill"]["engine"].update(kvCacheMemory="lots"),
     ["spec.prefill.engine.kvCacheMemory"]),
    ("negative KV size", lambda s: s["prefill"]["engine"].update(kvCacheMemory=-5),
     ["spec.prefill.engine.kvCacheMemory"]),
    ("zero blocks", lambda s: s["decode"][1]["engine"].update(numBlocks=0), ["spec.decode[1].engine.numBlocks"]),
    ("dtypes differ", lambda s: s["decode"][1].update(resources={}, engine={"numBlocks": 4096}),
     ["spec: Invalid value", "spec.decode pools must compute in spec.prefill's dtype"]),
    ("explicit dtypes differ", lambda s: s["decode"][1]["engine"].update(dtype="float16"),
     ["spec.decode pools must compute in spec.prefill's dtype"]),
    ("operator env", lambda s: s["prefill"]["env"].append({"name": "POD_IP", "value": "1.2.3.4"}),
     ["spec.prefill.env", "POD_IP"]),
    ("env without a name", lambda s: s["prefill"]["env"].append({"value": "x"}), ["spec.prefill.env[2].name"]),
    ("envFrom naming both", lambda s: s["prefill"]["envFrom"][0].update(configMapRef={"name": "c"}),
     ["spec.prefill.envFrom[0]", "exactly one"]),
    ("operator label", lambda s: s["decode"][0].update(podLabels={"pdserve.io/role": "x"}),
     ["spec.decode[0].podLabels", "must not set the operator's labels"]),
    ("operator managed-by label", lambda s: s["router"].update(podLabels={"app.kubernetes.io/managed-by": "me"}),
     ["spec.router.podLabels"]),
    ("bad label value", lambda s: s["prefill"].update(podLabels={"team": "has space"}),
     ["spec.prefill.podLabels.team"]),
    ("operator annotation", lambda s: s["router"].update(podAnnotations={"prometheus.io/port": "1"}),
     ["spec.router.podAnnotations"]),
    ("capability outside the set", lambda s: s["prefill"].update(capabilities=["SYS_ADMIN"]),
     ["spec.prefill.capabilities[0]"]),
    ("operator volume name", lambda s: s["prefill"]["extraVolumes"].append({"name": "tmp", "emptyDir": {}}),
     ["spec.prefill.extraVolumes", "tmp"]),
    ("mount over /dev/shm", lambda s: s["prefill"]["extraVolumeMounts"].append({"name": "cache",
                                                                                "mountPath": "/dev/shm"}),
     ["spec.prefill.extraVolumeMounts", "shmSize"]),
    ("mount without a path", lambda s: s["prefill"]["extraVolumeMounts"].append({"name": "cache"}),
     ["spec.prefill.extraVolumeMounts[1].mountPath"]),
    ("bad shm size", lambda s: s["prefill"].update(shmSize="big"), ["spec.prefill.shmSize"]),
    ("both budgets", lambda s: s["prefill"]["disruptionBudget"].update(maxUnavailable=1),
     ["spec.prefill.disruptionBudget", "not both"]),
    ("budget neither count nor percentage",
     lambda s: s["decode"][0].update(disruptionBudget={"maxUnavailable": "half"}),
     ["spec.decode[0].disruptionBudget.maxUnavailable"]),
    ("spread without a key", lambda s: s["prefill"]["topologySpreadConstraints"][0].pop("topologyKey"),
     ["spec.prefill.topologySpreadConstraints[0].topologyKey"]),
    ("bad runtime class", lambda s: s["prefill"].update(runtimeClassName="Not_A_Name"),
     ["spec.prefill.runtimeClassName"]),
    ("pull secret without a name", lambda s: s.update(imagePullSecrets=[{}]), ["spec.imagePullSecrets[0].name"]),
]


@pytest.mark.parametrize("what,change,messages", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_settings_are_refused_naming_the_field(kube, operator, what, change, messages):
    doc = gpu_isvc()
    change(doc["spec"])
    proc = kube.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0, f"{what}: accepted"
    for message in messages:
        assert message in proc.stderr, f"{what}: {proc.stderr}"


def test_the_valid_spec_is_stored_as_written(kube, operator):
    """The base of the refusals passes, and the API server keeps the core objects (affinity, volumes, valueFrom)
    it does not know the schema of, as the operator then copies them into the pods."""
    doc = gpu_isvc()
    proc = kube.kubectl("create", "--dry-run=server", "-o", "json", "-n", "default", "-f", "-", input=json.dumps(doc))
    stored = json.loads(proc.stdout)["spec"]
    expected = copy.deepcopy(doc["spec"])
    for key in ("affinity", "extraVolumes", "env", "topologySpreadConstraints", "engine"):
        assert stored["prefill"][key] == expected["prefill"][key], key
    assert stored["imagePullSecrets"] == [{"name": "regcred"}]


def test_the_charts_pull_secrets_reach_the_operator():
    def env(docs):
        (deployment,) = by_kind(docs, "Deployment")
        return deployment, {e["name"]: e.get("value")
                            for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}

    deployment, plain = env(render())
    assert ("PDSERVE_IMAGE_PULL_SECRETS" not in plain
            and "imagePullSecrets" not in deployment["spec"]["template"]["spec"])
    deployment, with_secrets = env(render("imagePullSecrets={regcred,mirror}"))
    assert with_secrets["PDSERVE_IMAGE_PULL_SECRETS"] == "regcred,mirror"
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    rules = [r for role in by_kind(render(), "ClusterRole") for r in role["rules"]]
    assert any(r["apiGroups"] == ["policy"] and r["resources"] == ["poddisruptionbudgets"] and "delete" in r["verbs"]
               for r in rules)


def test_the_gpu_example_is_accepted(kube, operator):
    proc = kube.kubectl("create", "--dry-run=server", "-o", "json", "-n", "default", "-f",
                        REPO / "examples" / "inferenceservice-gpu.yaml")
    stored = json.loads(proc.stdout)["spec"]
    assert stored["prefill"]["resources"]["limits"]["nvidia.com/gpu"] == 1 and stored["decode"][0]["shmSize"] == "8Gi"
