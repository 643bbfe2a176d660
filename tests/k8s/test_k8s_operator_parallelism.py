"""A pool's parallelism.tensor on a real control plane (crd_parallel.py, parallelism.py): the 70B-class example
(a tensor-parallel 4 prefill, a tensor-parallel 8 decode, hf:// source) becomes pods that say so
(--tensor-parallel-size, the GPUs, a /dev/shm of 1Gi per rank, NCCL_DEBUG=WARN); a CPU pool's ranks get a
share of its cpu as threads; the API server refuses a GPU count per pod other than the size (naming both),
several GPU resources in one pool, MIG slices at size > 1, and --tensor-parallel-size in extraArgs."""

import json

import pytest
import yaml

from harness.operator_harness import get_json, names, wait_for
from harness.procs import REPO

pytestmark = pytest.mark.k8s
EXAMPLE = REPO / "examples" / "inferenceservice-llama70b-tp.yaml"
CPU_EXAMPLE = REPO / "examples" / "inferenceservice.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def template(kube, ns: str, name: str) -> dict:
    return get_json(kube, "deployment", name, "-n", ns)["spec"]["template"]


def flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""]) if a.startswith("--")}


def check_tensor_parallel_pod(pod: dict, ranks: int) -> dict[str, str]:
    """What every GPU pod of size ``ranks`` carries; its flags."""
    container = pod["spec"]["containers"][0]
    args = flags(container["args"])
    assert (args["--tensor-parallel-size"], args["--device"], args["--dtype"]) == (str(ranks), "cuda", "bfloat16")
    assert "--disaggregation" not in args  # P/D between tensor-parallel servers (the engine's part) is not assumed away
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(ranks)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{ranks}Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_DEBUG"] == "WARN"
    assert not pod["spec"].get("hostIPC")  # the ranks are processes of one container: one IPC namespace already
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["args"][:2] == ["fetch-model", "hf://meta-llama/Llama-3.1-70B-Instruct"]
    assert args["--model"] == "/model-cache/meta-llama/Llama-3.1-70B-Instruct/main"
    return args


def test_the_70b_example_renders_a_tensor_parallel_4_prefill_and_a_tensor_parallel_8_decode(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    expected = ["llama70b-decode-main", "llama70b-prefill", "llama70b-router"]
    wait_for(kube, lambda: names(kube, "deployments", ns, "pdserve.io/inference-service=llama70b") == expected,
             "three Deployments", op=operator)

    prefill = check_tensor_parallel_pod(template(kube, ns, "llama70b-prefill"), 4)
    assert prefill["--gpu-memory-utilization"] == "0.9" and prefill["--max-model-len"] == "32768"
    decode = check_tensor_parallel_pod(template(kube, ns, "llama70b-decode-main"), 8)
    assert decode["--max-num-seqs"] == "256" and decode["--transfer"] == "nixl"
    assert get_json(kube, "decodepool", "llama70b-decode-main", "-n", ns)["spec"]["parallelism"] == {"tensor": 8}
    router = template(kube, ns, "llama70b-router")["spec"]
    assert "--tensor-parallel-size" not in router["containers"][0]["args"] and "dshm" not in {
        v["name"] for v in router["volumes"]}

    # The pool's own shmSize and NCCL_DEBUG win; the size follows the spec (and so the pods roll).
    patch = {"spec": {"decode": [{**example()["spec"]["decode"][0], "shmSize": "16Gi",
                                  "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                  "parallelism": {"tensor": 4},
                                  "resources": {"limits": {"nvidia.com/gpu": 4, "cpu": "16", "memory": "192Gi"}}}]}}
    kube.kubectl("patch", "pdis", "llama70b", "-n", ns, "--type=merge", "-p", json.dumps(patch))

    def rolled():
        pod = template(kube, ns, "llama70b-decode-main")
        return flags(pod["spec"]["containers"][0]["args"])["--tensor-parallel-size"] == "4" and pod
    pod = wait_for(kube, rolled, "the decode pool at tensor-parallel size 4", op=operator)
    container = pod["spec"]["containers"][0]
    assert [v["emptyDir"] for v in pod["spec"]["volumes"] if v["name"] == "dshm"] == [
        {"medium": "Memory", "sizeLimit": "16Gi"}]
    assert [e["value"] for e in container["env"] if e["name"] == "NCCL_DEBUG"] == ["INFO"]


def test_a_cpu_pool_runs_its_ranks_with_a_share_of_its_cpu_each(kube, operator, ns):
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["spec"]["decode"][1]["parallelism"] = {"tensor": 2}  # big: cpu requests 1, limits 4
    doc["spec"]["decode"][1]["resources"]["requests"]["cpu"] = "2"
    doc["spec"]["prefill"]["parallelism"] = {"tensor": 2}  # cpu requests 1, limits 2 -> raised to 2
    doc["spec"]["prefill"]["resources"]["requests"]["cpu"] = "2000m"
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
    wait_for(kube, lambda: len(names(kube, "deployments", ns)) == 4, "four Deployments", op=operator)
    big = template(kube, ns, "chat-decode-big")
    args = flags(big["spec"]["containers"][0]["args"])
    assert (args["--tensor-parallel-size"], args["--threads"]) == ("2", "2")  # 4 cpu (the limit) / 2 ranks
    assert "--device" not in args and "dshm" not in {v["name"] for v in big["spec"]["volumes"]}
    assert "NCCL_DEBUG" not in {e["name"] for e in big["spec"]["containers"][0]["env"]}  # gloo, not NCCL
    prefill = flags(template(kube, ns, "chat-prefill")["spec"]["containers"][0]["args"])
    assert (prefill["--tensor-parallel-size"], prefill["--threads"]) == ("2", "1")
    main = template(kube, ns, "chat-decode-main")["spec"]["containers"][0]["args"]
    assert not {"--tensor-parallel-size", "--threads"} & set(main)  # no parallelism: as before


def _gpus(pool: dict, resources: dict, tensor: int | None) -> None:
    pool["resources"] = resources
    pool.pop("parallelism", None)
    if tensor is not None:
        pool["parallelism"] = {"tensor": tensor}


REFUSED = [
    # (what is wrong, change to example()'s spec, texts the API server's message must contain)
    ("fewer GPUs than ranks", lambda s: _gpus(s["prefill"], {"limits": {"nvidia.com/gpu": 2}}, 4),
     ["spec.prefill.parallelism", "parallelism.tensor is 4 (default 1) but resources give each pod 2 GPUs"]),
    ("more GPUs than ranks", lambda s: _gpus(s["decode"][0], {"limits": {"nvidia.com/gpu": "8"}}, 4),
     ["spec.decode[0].parallelism", "parallelism.tensor is 4 (default 1) but resources give each pod 8 GPUs"]),
    ("several GPUs without parallelism", lambda s: _gpus(s["decode"][0], {"limits": {"nvidia.com/gpu": 4}}, None),
     ["spec.decode[0].parallelism", "parallelism.tensor is 1 (default 1) but resources give each pod 4 GPUs"]),
    ("AMD GPUs counted", lambda s: _gpus(s["prefill"], {"limits": {"amd.com/gpu": 8}}, 4),
     ["parallelism.tensor is 4 (default 1) but resources give each pod 8 GPUs (amd.com/gpu)"]),
    ("GPUs only in requests counted", lambda s: _gpus(s["prefill"], {"requests": {"nvidia.com/gpu": 2}}, 4),
     ["parallelism.tensor is 4 (default 1) but resources give each pod 2 GPUs"]),
    ("MIG slices counted", lambda s: _gpus(s["prefill"], {"limits": {"nvidia.com/mig-3g.40gb": 2}}, None),
     ["parallelism.tensor is 1 (default 1) but resources give each pod 2 GPUs (nvidia.com/mig-3g.40gb)"]),
    ("MIG slices at size 2", lambda s: _gpus(s["prefill"], {"limits": {"nvidia.com/mig-3g.40gb": 2}}, 2),
     ["spec.prefill.parallelism", "must be 1 on MIG slices"]),
    ("a GPU count not written as a whole number", lambda s: _gpus(s["prefill"], {"limits": {"nvidia.com/gpu": "4000m"}},
                                                                      4),
     ["parallelism.tensor is 4 (default 1) but resources give each pod 4000m GPUs (nvidia.com/gpu)"]),
    ("two GPU resources", lambda s: _gpus(s["prefill"], {"limits": {"nvidia.com/gpu": 2, "amd.com/gpu": 2}}, 4),
     ["spec.prefill.resources", "must name one GPU resource"]),
    ("the vLLM backend at size 2", lambda s: _gpus(s["decode"][0], {"limits": {"cpu": "4"}}, 2) or
     s["decode"][0].update(engine={"name": "vllm", "dtype": "bfloat16"}),
     ["spec.decode[0].parallelism", "parallelism.tensor above 1 needs engine.name builtin"]),
    ("the sim at size 4", lambda s: s["prefill"]["engine"].update(name="sim", simProfile="cpu-small"),
     ["spec.prefill.parallelism", "parallelism.tensor above 1 needs engine.name builtin"]),
    ("the flag in extraArgs", lambda s: s["prefill"]["engine"].update(extraArgs=["--tensor-parallel-size", "4"]),
     ["spec.prefill.engine.extraArgs", "must not set --tensor-parallel-size: use parallelism.tensor"]),
    ("flag=value in extraArgs", lambda s: s["decode"][0]["engine"].update(extraArgs=["--tensor-parallel-size=8"]),
     ["spec.decode[0].engine.extraArgs", "use parallelism.tensor"]),
    ("an abbreviation of the flag", lambda s: s["prefill"]["engine"].update(extraArgs=["--tensor-par", "2"]),
     ["spec.prefill.engine.extraArgs", "use parallelism.tensor"]),
    ("an abbreviation with a value", lambda s: s["prefill"]["engine"].update(extraArgs=["--te=2"]),
     ["spec.prefill.engine.extraArgs", "use parallelism.tensor"]),
    ("size 0", lambda s: s["prefill"].update(parallelism={"tensor": 0}), ["spec.prefill.parallelism.tensor"]),
    ("size above one node's GPUs", lambda s: s["prefill"].update(parallelism={"tensor": 17}),
     ["spec.prefill.parallelism.tensor"]),
]


@pytest.mark.parametrize("what,change,messages", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_parallelism_that_cannot_run_is_refused_naming_the_numbers(kube, operator, what, change, messages):
    doc = example()
    change(doc["spec"])
    proc = kube.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0, f"{what}: accepted"
    for message in messages:
        assert message in proc.stderr, f"{what}: {proc.stderr}"


ACCEPTED = [
    ("the example as it is", lambda s: None),
    ("AMD GPUs at size 8", lambda s: _gpus(s["decode"][0], {"limits": {"amd.com/gpu": 8}}, 8)),
    ("one MIG slice", lambda s: _gpus(s["prefill"], {"limits": {"nvidia.com/mig-1g.10gb": 1}}, None)),
    ("a CPU pool without cpu resources", lambda s: _gpus(s["decode"][0], {"limits": {"memory": "8Gi"}}, 2)),
    ("a CPU pool with a cpu per rank", lambda s: _gpus(s["decode"][0], {"requests": {"cpu": "4000m"}}, 4)),
    ("other flags beginning alike",
     lambda s: s["prefill"]["engine"].update(extraArgs=["--threads", "4", "--tls-ca=/etc/ca.pem"])),
    ("a CPU pool with fewer cpu than ranks (slow, documented)",
     lambda s: _gpus(s["decode"][0], {"limits": {"cpu": "1"}}, 2)),
]


@pytest.mark.parametrize("what,change", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_a_parallelism_that_can_run_is_accepted(kube, operator, what, change):
    doc = example()
    change(doc["spec"])
    for pool in (doc["spec"]["prefill"], doc["spec"]["decode"][0]):  # the changes may make a CPU pool
        pool["engine"].pop("gpuMemoryUtilization")  # (GPU-only)
        pool["engine"]["dtype"] = "bfloat16"  # (the pools' dtypes must agree)
    proc = kube.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode == 0, f"{what}: {proc.stderr}"


def test_the_pool_objects_refuse_it_too(kube, operator, ns):
    """A DecodePool made by hand (not through an InferenceService) passes the same rules."""
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: get_json(kube, "decodepool", "llama70b-decode-main", "-n", ns), "the DecodePool",
             op=operator)
    pool = get_json(kube, "decodepool", "llama70b-decode-main", "-n", ns)
    doc = {"apiVersion": pool["apiVersion"], "kind": "DecodePool", "metadata": {"name": "by-hand", "namespace": ns},
           "spec": {**pool["spec"], "parallelism": {"tensor": 2}}}
    proc = kube.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0 and "parallelism.tensor is 2 (default 1) but resources give each pod 8 GPUs" in (
        proc.stderr), proc.stderr
