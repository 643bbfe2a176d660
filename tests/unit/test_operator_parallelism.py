"""A pool's parallelism.tensor in the pure builders (operator/parallelism.py, crd_parallel.py): the flags, the
/dev/shm and NCCL settings of a GPU pool, the threads of a CPU pool, nothing at size 1, and command lines the
servers parse. The API server's side (the CEL refusals, the 70B example rendered by a running operator) is
tests/k8s/test_k8s_operator_parallelism.py."""

import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from pdserve.operator import crd_parallel, crd_pod, crds, parallelism, pools, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")


def deployments(path: str = "inferenceservice.yaml", change=None) -> dict[str, dict]:
    isvc = yaml.safe_load((REPO / "examples" / path).read_text())
    isvc["metadata"]["namespace"] = "ns1"
    if change:
        change(isvc["spec"])
    built = [pools.build_prefill_pool(isvc, CONFIG), *pools.build_decode_pools(isvc, CONFIG)]
    return {p["metadata"]["name"]: workloads.build_deployment(p)["spec"]["template"] for p in built}


def container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def opts(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""]) if a.startswith("--")}


def test_the_70b_example_renders_tensor_parallel_4_and_8_with_shm_and_nccl_settings():
    pods = deployments("inferenceservice-llama70b-tp.yaml")
    for name, ranks in (("llama70b-prefill", 4), ("llama70b-decode-main", 8)):
        template = pods[name]
        args = opts(container(template)["args"])
        assert (args["--tensor-parallel-size"], args["--device"]) == (str(ranks), "cuda")
        assert "--threads" not in args  # a GPU rank's threads only launch kernels
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{ranks}Gi"}} in template["spec"][
            "volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container(template)["volumeMounts"]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in container(template)["env"]


def test_size_1_renders_as_before():
    plain = deployments()
    explicit = deployments(change=lambda s: s["prefill"].update(parallelism={"tensor": 1}))
    assert plain == explicit  # no rollout of existing pools when the operator is upgraded
    assert not any("--tensor-parallel-size" in container(t)["args"] for t in plain.values())
    gpu = deployments(change=lambda s: s["prefill"].update(resources={"limits": {"nvidia.com/gpu": 1}}))
    assert "dshm" not in {v["name"] for v in gpu["chat-prefill"]["spec"]["volumes"]}
    assert "NCCL_DEBUG" not in {e["name"] for e in container(gpu["chat-prefill"])["env"]}


def test_the_pools_own_shm_size_and_nccl_debug_win():
    def change(spec):
        spec["prefill"].update(resources={"limits": {"nvidia.com/gpu": 2}}, parallelism={"tensor": 2}, shmSize="3Gi",
                               env=[{"name": "NCCL_DEBUG", "value": "INFO"}])
    template = deployments(change=change)["chat-prefill"]
    assert [v for v in template["spec"]["volumes"] if v["name"] == "dshm"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "3Gi"}}]  # one, the pool's
    assert [m for m in container(template)["volumeMounts"] if m["name"] == "dshm"] == [
        {"name": "dshm", "mountPath": "/dev/shm"}]
    assert [e["value"] for e in container(template)["env"] if e["name"] == "NCCL_DEBUG"] == ["INFO"]


@pytest.mark.parametrize("resources,threads", [
    ({"limits": {"cpu": "4"}, "requests": {"cpu": "1"}}, "2"),  # the limit (the CFS quota) is shared out
    ({"requests": {"cpu": "3"}}, "1"),  # no limit: the request; 3 // 2
    ({"limits": {"cpu": "2500m"}}, "1"),
    ({"limits": {"cpu": 8}}, "4"),
    ({"limits": {"cpu": "1"}}, "1"),  # fewer cpu than ranks: allowed, slow (docs/parallelism.md), one thread each
    ({"limits": {"memory": "4Gi"}}, None),  # no cpu given: torch's own choice
])
def test_a_cpu_pool_shares_its_cpu_between_its_ranks(resources, threads):
    template = deployments(change=lambda s: s["decode"][0].update(resources=resources, parallelism={"tensor": 2}))[
        "chat-decode-main"]
    args = opts(container(template)["args"])
    assert args["--tensor-parallel-size"] == "2" and args.get("--threads") == threads
    assert "--device" not in args and "dshm" not in {v["name"] for v in template["spec"]["volumes"]}
    assert "NCCL_DEBUG" not in {e["name"] for e in container(template)["env"]}  # gloo


def test_extra_args_come_after_so_a_threads_there_wins():
    template = deployments(change=lambda s: s["decode"][0].update(
        resources={"limits": {"cpu": "4"}}, parallelism={"tensor": 2}, engine={"extraArgs": ["--threads", "3"]}))[
        "chat-decode-main"]
    args = container(template)["args"]
    assert args[-2:] == ["--threads", "3"] and args.index("--tensor-parallel-size") < len(args) - 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_server_clis_accept_the_tensor_parallel_command_lines(role):
    module = importlib.import_module(f"pdserve.{role}_server.cli")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    gpu = deployments("inferenceservice-llama70b-tp.yaml")
    name = "llama70b-prefill" if role == "prefill" else "llama70b-decode-main"
    parsed = parser.parse_args(container(gpu[name])["args"][1:])
    assert parsed.tensor_parallel_size == (4 if role == "prefill" else 8) and parsed.device == "cuda"
    cpu = deployments(change=lambda s: [p.update(resources={"limits": {"cpu": "4"}}, parallelism={"tensor": 2})
                                        for p in (s["prefill"], s["decode"][0])])
    parsed = parser.parse_args(container(cpu["chat-prefill" if role == "prefill" else "chat-decode-main"])["args"][1:])
    assert (parsed.tensor_parallel_size, parsed.threads) == (2, 2)


def test_the_schema_bounds_and_the_cel_rules_name_the_field():
    tensor = crd_parallel.PARALLELISM["properties"]["tensor"]
    assert (tensor["minimum"], tensor["maximum"]) == (1, crd_parallel.MAX_TENSOR)
    for crd in (crds.prefillpool_crd(), crds.decodepool_crd()):
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        assert spec["properties"]["parallelism"] == crd_parallel.PARALLELISM
        assert spec["x-kubernetes-validations"] == [*crd_pod.POOL_RULES, *crd_parallel.POOL_RULES]
    # the flag is the operator's now, refused by its own rule (pointing at parallelism.tensor), not the generic one
    assert crd_parallel.FLAG not in crd_pod.OPERATOR_FLAGS["prefill"]
    assert any(crd_parallel.FLAG in r["message"] and "parallelism.tensor" in r["message"]
               for r in crd_parallel.POOL_RULES)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_spelling_the_servers_take_for_the_flag_is_refused(role):
    """argparse takes unique abbreviations: the ones the schema refuses are exactly those naming the flag."""
    module = importlib.import_module(f"pdserve.{role}_server.cli")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    taken = [f for f in (crd_parallel.FLAG[:n] for n in range(3, len(crd_parallel.FLAG) + 1))
             if [o for o in options if o.startswith(f)] == [crd_parallel.FLAG]]
    assert taken == crd_parallel.SPELLINGS


def test_cpu_quantities():
    assert [parallelism.cpu_cores(v) for v in (2, "500m", "1.5", "4000m")] == [2, 0.5, 1.5, 4]


DOC = REPO / "docs" / "parallelism.md"


def rendered_excerpt(template: dict) -> dict:
    """What docs/parallelism.md shows of a pod: its server's flags, environment, resources and mounts, and the
    pod's volumes (the rest is as on every pool: README.md, "On Kubernetes")."""
    c = container(template)
    return {"containers": [{"name": c["name"], "args": c["args"], "env": c["env"], "resources": c["resources"],
                            "volumeMounts": c["volumeMounts"]}],
            "volumes": template["spec"]["volumes"]}


def doc_block(name: str) -> dict:
    """The YAML block after the marker ``<!-- rendered: NAME -->`` in docs/parallelism.md."""
    text = DOC.read_text().split(f"<!-- rendered: {name} -->", 1)[1]
    return yaml.safe_load(text.split("```yaml", 1)[1].split("```", 1)[0])


@pytest.mark.parametrize("name", ["llama70b-prefill", "llama70b-decode-main"])
def test_the_docs_show_the_pods_the_operator_renders(name):
    """docs/parallelism.md's pod specs are the builders' output for examples/inferenceservice-llama70b-tp.yaml
    (operator protocol version 1, no namespace: the pod's own), so the page cannot drift from the code."""
    isvc = yaml.safe_load((REPO / "examples" / "inferenceservice-llama70b-tp.yaml").read_text())
    config = OperatorConfig(default_image="ghcr.io/example/pdserve:0.1.0", protocol_version="1")
    built = [pools.build_prefill_pool(isvc, config), *pools.build_decode_pools(isvc, config)]
    templates = {p["metadata"]["name"]: workloads.build_deployment(p)["spec"]["template"] for p in built}
    assert doc_block(name) == rendered_excerpt(templates[name])
