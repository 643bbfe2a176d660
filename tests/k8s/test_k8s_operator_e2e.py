"""The operator on a real control plane (tests/harness/kube.py): helm install, apply, status, scale,
upgrade, invalid objects, garbage collection and a restart mid-reconcile.

The operator runs as a local process with a token of the chart's ServiceAccount, so RBAC is
really exercised (tests/harness/operator_harness.py). There is no kubelet: pods stay Pending, and
where a test needs ready pods it sets their Ready condition through pods/status (see
operator_harness.mark_pods_ready); the ReplicaSet/Deployment controllers do the rest.
"""

import json

import pytest
import yaml

from harness.operator_harness import (CRD_NAMES, IMAGE, OPERATOR_SA, RELEASE_NAMESPACE, condition, get_json,
                                      mark_pods_ready, names, settled_status, wait_for)
from harness.procs import REPO
from pdserve.protos.version import PROTOCOL_VERSION

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"


def owner_kinds(obj):
    return [(o["kind"], o["name"], o.get("controller")) for o in obj["metadata"].get("ownerReferences", [])]


def test_chart_installs_and_crds_are_established(kube, operator):
    for crd in CRD_NAMES:
        doc = get_json(kube, "crd", crd)
        assert condition(doc, "Established")["status"] == "True"
    assert get_json(kube, "deployment", f"{OPERATOR_SA}", "-n", RELEASE_NAMESPACE) is not None
    # The ServiceAccount really is least privilege: it cannot read Secrets.
    denied = kube.kubectl("get", "secrets", "-A", kubeconfig=operator.kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def test_example_creates_pools_deployments_services_with_owners_and_status(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    expected = ["chat-decode-big", "chat-decode-main", "chat-prefill", "chat-router"]
    wait_for(kube, lambda: names(kube, "deployments", ns) == expected, "four Deployments", op=operator)
    assert names(kube, "services", ns) == expected
    assert names(kube, "prefillpools", ns) == ["chat-prefill"]
    assert names(kube, "decodepools", ns) == ["chat-decode-big", "chat-decode-main"]
    assert names(kube, "networkpolicies", ns) == ["chat-decode", "chat-prefill", "chat-router"]

    isvc = get_json(kube, "inferenceservice", "chat", "-n", ns)
    for pool in ("chat-prefill",):
        assert owner_kinds(get_json(kube, "prefillpool", pool, "-n", ns)) == [("InferenceService", "chat", True)]
    for pool in ("chat-decode-big", "chat-decode-main"):
        obj = get_json(kube, "decodepool", pool, "-n", ns)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    for name in expected:
        # the router has no pool object: the InferenceService owns its Deployment and Service
        owner = {"chat-prefill": ("PrefillPool", name), "chat-router": ("InferenceService", "chat")}.get(
            name, ("DecodePool", name))
        assert owner_kinds(get_json(kube, "deployment", name, "-n", ns)) == [(*owner, True)]
        assert owner_kinds(get_json(kube, "service", name, "-n", ns)) == [(*owner, True)]
    for kind in ("serviceaccount", "role", "rolebinding"):
        assert owner_kinds(get_json(kube, kind, "chat-prefill", "-n", ns)) == [("PrefillPool", "chat-prefill", True)]

    deployment = get_json(kube, "deployment", "chat-decode-main", "-n", ns)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE and deployment["spec"]["replicas"] == 2

    isvc = settled_status(kube, ns, "0/3", op=operator)
    status = isvc["status"]
    assert status["observedGeneration"] == isvc["metadata"]["generation"]
    assert status["endpoint"] == f"http://chat-router.{ns}.svc:8000" and status["routerReady"] == "0/1"
    assert condition(isvc, "Ready")["status"] == "False" and condition(isvc, "Ready")["reason"] == "PrefillNotReady"
    assert condition(isvc, "Progressing")["status"] == "True"
    assert condition(isvc, "Degraded")["status"] == "False"
    # Printer columns come from that status.
    table = kube.kubectl("get", "pdis", "chat", "-n", ns).stdout
    assert "0/1" in table and "0/3" in table and "chat-router" in table

    # Ready: prefill and one decode pool get ready pods (as a kubelet would report).
    assert len(mark_pods_ready(kube, ns, "pdserve.io/inference-service=chat,pdserve.io/role=prefill")) == 1
    wait_for(kube, lambda: condition(get_json(kube, "inferenceservice", "chat", "-n", ns), "Ready")["reason"]
             == "NoDecodePoolReady", "Ready=False/NoDecodePoolReady", op=operator)
    assert len(mark_pods_ready(kube, ns, "pdserve.io/pool=big")) == 1
    wait_for(kube, lambda: condition(get_json(kube, "inferenceservice", "chat", "-n", ns), "Ready")["reason"]
             == "RouterNotReady", "Ready=False/RouterNotReady", op=operator)
    assert len(mark_pods_ready(kube, ns, "pdserve.io/role=router")) == 1
    isvc = wait_for(kube, lambda: (lambda o: o if condition(o, "Ready")["status"] == "True" else None)(
        get_json(kube, "inferenceservice", "chat", "-n", ns)), "Ready=True", op=operator)
    assert condition(isvc, "Ready")["reason"] == "Serving"
    assert isvc["status"]["prefillReady"] == "1/1" and isvc["status"]["decodeReady"] == "1/3"
    assert condition(isvc, "Degraded")["reason"] == "PoolUnavailable"  # pool main has no ready pod
    big = get_json(kube, "decodepool", "chat-decode-big", "-n", ns)
    assert condition(big, "Ready")["status"] == "True" and big["status"]["readyReplicas"] == 1


def test_kubectl_scale_on_a_pool_reaches_its_deployment_and_sticks(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: get_json(kube, "deployment", "chat-decode-main", "-n", ns), "decode Deployment", op=operator)
    kube.kubectl("scale", "decodepool", "chat-decode-main", "-n", ns, "--replicas=4")
    wait_for(kube, lambda: get_json(kube, "deployment", "chat-decode-main", "-n", ns)["spec"]["replicas"] == 4,
             "Deployment scaled to 4", op=operator)
    # An unrelated InferenceService change must not undo the scale ...
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p", '{"spec": {"slo": {"ttftMs": 2000}}}')
    wait_for(kube, lambda: get_json(kube, "prefillpool", "chat-prefill", "-n", ns)["spec"]["slo"]["ttftMs"] == 2000,
             "slo change reaching the PrefillPool", op=operator)
    assert get_json(kube, "decodepool", "chat-decode-main", "-n", ns)["spec"]["replicas"] == 4
    scale = json.loads(kube.kubectl("get", "--raw",
                                    f"/apis/pdserve.io/v1alpha1/namespaces/{ns}/decodepools/chat-decode-main/scale").stdout)
    assert scale["spec"]["replicas"] == 4
    # ... but changing the InferenceService's own count for that pool wins.
    patch = [{"op": "replace", "path": "/spec/decode/0/replicas", "value": 1}]
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=json", "-p", json.dumps(patch))
    wait_for(kube, lambda: get_json(kube, "deployment", "chat-decode-main", "-n", ns)["spec"]["replicas"] == 1,
             "Deployment back to the InferenceService's count", op=operator)


def test_upgrade_rolls_both_pools_and_prefill_selects_only_the_new_version(kube, operator, ns):
    old, new = str(PROTOCOL_VERSION), str(PROTOCOL_VERSION + 1)  # this release's protocol, and an upgrade
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: len(names(kube, "deployments", ns)) == 4, "Deployments", op=operator)
    patch = {"spec": {"image": "registry.test/pdserve:2", "protocolVersion": new}}
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p", json.dumps(patch))

    def rolled():
        deps = [get_json(kube, "deployment", n, "-n", ns)
                for n in ("chat-prefill", "chat-decode-main", "chat-decode-big", "chat-router")]
        templates = [d["spec"]["template"] for d in deps]
        return all(t["spec"]["containers"][0]["image"] == "registry.test/pdserve:2"
                   and t["metadata"]["labels"]["pdserve.io/protocol-version"] == new for t in templates)
    wait_for(kube, rolled, f"all pools on image 2 / protocol {new}", op=operator)
    isvc = wait_for(kube, lambda: (lambda o: o
                                   if o.get("status", {}).get("observedGeneration") == o["metadata"]["generation"]
                                   else None)(get_json(kube, "inferenceservice", "chat", "-n", ns)),
                    "observedGeneration to reach the new generation", op=operator)
    assert isvc["metadata"]["generation"] >= 2
    args = get_json(kube, "deployment", "chat-prefill", "-n", ns)["spec"]["template"]["spec"]["containers"][0]["args"]
    selector = args[args.index("--decode-selector") + 1]
    assert f"pdserve.io/protocol-version={new}" in selector
    # The decode Services prefill selects now carry the new version, and select only its pods.
    assert names(kube, "services", ns, selector) == ["chat-decode-big", "chat-decode-main"]
    service = get_json(kube, "service", "chat-decode-main", "-n", ns)
    assert service["spec"]["selector"]["pdserve.io/protocol-version"] == new
    # Old-version prefills still find the old decodes, through retired copies of the Services that stay until
    # the prefills have rolled (no pod gets Ready here, so they stay: test_k8s_operator_discovery.py sees them go)
    retired = [f"chat-decode-big-v{old}", f"chat-decode-main-v{old}"]
    assert names(kube, "services", ns, selector.replace(f"={new}", f"={old}")) == retired
    assert names(kube, "services", ns, "pdserve.io/retired=true") == retired
    # New ReplicaSets exist (the Deployments roll); pods of the new version are being created.
    wait_for(kube, lambda: names(kube, "pods", ns, f"pdserve.io/protocol-version={new},pdserve.io/pool=main"),
             "new-version decode pods", op=operator)


def test_removing_a_decode_pool_deletes_it_and_its_children(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: len(names(kube, "deployments", ns)) == 4, "Deployments", op=operator)
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=json", "-p", '[{"op": "remove", "path": "/spec/decode/1"}]')
    wait_for(kube, lambda: names(kube, "decodepools", ns) == ["chat-decode-main"], "pool big deleted", op=operator)
    wait_for(kube, lambda: names(kube, "deployments", ns) == ["chat-decode-main", "chat-prefill", "chat-router"],
             "its Deployment garbage-collected", op=operator)


def test_deleting_the_inferenceservice_removes_everything_it_owned(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: len(names(kube, "deployments", ns)) == 4, "Deployments", op=operator)
    wait_for(kube, lambda: names(kube, "pods", ns), "pods", op=operator)
    kube.kubectl("delete", "pdis", "chat", "-n", ns, "--wait=false")
    kinds = ["prefillpools", "decodepools", "deployments", "replicasets", "pods", "services", "serviceaccounts",
             "roles", "rolebindings", "networkpolicies"]

    def gone():
        left = {k: names(kube, k, ns) for k in kinds}
        return all(not v for v in left.values())
    wait_for(kube, gone, "the garbage collector to remove every child", timeout=90, op=operator)


INVALID = [
    # (what is wrong, patch applied to a valid spec, text the API server's message must contain)
    ("missing model", {"spec": {"model": None}}, "spec.model: Required value"),
    ("no decode pool", {"spec": {"decode": []}}, "spec.decode"),
    ("unknown transfer backend", {"spec": {"transfer": {"backend": "rdma"}}}, "spec.transfer.backend"),
    ("block size 0", {"spec": {"transfer": {"blockSize": 0}}}, "spec.transfer.blockSize"),
    ("block size too big", {"spec": {"transfer": {"blockSize": 4096}}}, "spec.transfer.blockSize"),
    ("unknown routing policy", {"spec": {"routing": {"policy": "random"}}}, "spec.routing.policy"),
    ("negative replicas", {"spec": {"prefill": {"replicas": -1}}}, "spec.prefill.replicas"),
    ("negative router replicas", {"spec": {"router": {"replicas": -1}}}, "spec.router.replicas"),
    ("negative router load weight", {"spec": {"router": {"loadWeight": -2}}}, "spec.router.loadWeight"),
    ("duplicate decode pool names", {"spec": {"decode": [{"name": "a"}, {"name": "a"}]}},
     "spec.decode pool names must be unique"),
    ("bad pool name", {"spec": {"decode": [{"name": "Main_Pool"}]}}, "spec.decode[0].name"),
    ("relative model path", {"spec": {"model": {"source": "models/qwen"}}}, "spec.model.source"),
    ("model outside its volume", {"spec": {"model": {"source": "/data/q", "pvcName": "w"}}}, "spec.model.source"),
    ("zero TTFT target", {"spec": {"slo": {"ttftMs": 0}}}, "spec.slo.ttftMs"),
    ("SLO class named default", {"spec": {"slo": {"classes": [{"name": "default"}]}}},
     "spec.slo.classes must not declare 'default'"),
    ("duplicate SLO classes", {"spec": {"slo": {"classes": [{"name": "a"}, {"name": "a"}]}}},
     "spec.slo.classes names must be unique"),
    ("duplicate SLO priorities",
     {"spec": {"slo": {"classes": [{"name": "a", "priority": 1}, {"name": "b", "priority": 1}]}}},
     "spec.slo.classes priorities must be unique"),
    ("undeclared default SLO class", {"spec": {"slo": {"defaultClass": "gold"}}}, "spec.slo.defaultClass must be"),
    ("bad SLO class name", {"spec": {"slo": {"classes": [{"name": "Gold Tier"}]}}}, "spec.slo.classes[0].name"),
    ("zero e2e target", {"spec": {"slo": {"classes": [{"name": "b", "e2eMs": 0}]}}}, "spec.slo.classes[0].e2eMs"),
    ("unknown queue policy", {"spec": {"slo": {"queuePolicy": "lifo"}}}, "spec.slo.queuePolicy"),
    ("unknown disaggregation mode", {"spec": {"routing": {"disaggregation": "sometimes"}}},
     "spec.routing.disaggregation"),
    ("unknown quantization", {"spec": {"decode": [{"name": "a", "engine": {"quantization": "awq"}}]}},
     "spec.decode[0].engine.quantization"),
    ("decode's KV dtype differs", {"spec": {"decode": [{"name": "a", "engine": {"kvCacheDtype": "fp8"}}]}},
     "spec.decode pools must use spec.prefill's engine.kvCacheDtype"),
    ("unknown KV dtype", {"spec": {"prefill": {"engine": {"kvCacheDtype": "int4"}}}},
     "spec.prefill.engine.kvCacheDtype"),
    ("vLLM on a MIG slice", {"spec": {"decode": [{"name": "a", "engine": {"name": "vllm"},
                                                  "resources": {"limits": {"nvidia.com/mig-3g.40gb": 1}}}]}},
     "engine.name vllm runs vLLM's CPU build only"),
    ("gpuMemoryUtilization on a CPU pool", {"spec": {"prefill": {"engine": {"gpuMemoryUtilization": 0.8}}}},
     "engine.gpuMemoryUtilization needs a GPU"),
    ("a rollout that replaces nothing", {"spec": {"prefill": {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}}},
     "maxSurge and maxUnavailable cannot both be 0"),
    ("bad resource quantity", {"spec": {"decode": [{"name": "a", "resources": {"limits": {"cpu": "lots"}}}]}},
     "spec.decode[0].resources.limits.cpu"),
    ("bad toleration operator", {"spec": {"decode": [{"name": "a", "tolerations": [{"operator": "Maybe"}]}]}},
     "spec.decode[0].tolerations[0].operator"),
    ("name too long", {"metadata": {"name": "x" * 41}}, "metadata.name must be a DNS label"),
    ("unknown field", {"spec": {"bogus": 1}}, 'unknown field "spec.bogus"'),
]


def _merge(base, patch):
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("what,patch,message", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_inferenceservice_is_rejected_naming_the_field(kube, operator, what, patch, message):
    valid = yaml.safe_load(EXAMPLE.read_text())
    doc = _merge(valid, patch)
    proc = kube.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0, f"{what}: accepted"
    assert message in proc.stderr, f"{what}: {proc.stderr}"
    # The valid base passes the same path, so it is the one change that is rejected.
    ok = kube.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(valid), check=False)
    assert ok.returncode == 0, ok.stderr


SLO_FORMS = [
    ("old", {"ttftMs": 1500, "tbtMs": 80}),
    ("new", {"ttftMs": 1500, "defaultClass": "interactive", "classes": [
        {"name": "interactive", "ttftMs": 2000, "e2eMs": 20000, "earlyReject": True, "priority": 0},
        {"name": "batch-1", "e2eMs": 60000, "priority": 1}, {"name": "batch-2", "e2eMs": 3600000}],
        "queuePolicy": "qlm"}),
]


@pytest.mark.parametrize("form,slo", SLO_FORMS, ids=[f[0] for f in SLO_FORMS])
def test_slo_old_and_new_forms_are_accepted_and_parse_as_the_servers_do(kube, operator, form, slo):
    """The API server takes spec.slo in both forms, fills its defaults, and what it stores is
    what the prefill's parser (pdserve.slo.classes) reads from PDSERVE_SLO_CLASSES."""
    from pdserve.slo import classes

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["slo"] = slo
    proc = kube.kubectl("create", "--dry-run=server", "-o", "json", "-n", "default", "-f", "-", input=json.dumps(doc))
    stored = json.loads(proc.stdout)["spec"]["slo"]
    assert stored.get("queuePolicy") == slo.get("queuePolicy")  # no default filled in: unset stays the servers' fifo
    from pdserve.operator.workloads import slo_json
    parsed = classes.load(slo_json(stored))  # as the prefill pods get it (PDSERVE_SLO_CLASSES)
    default = parsed.by_name["default"]
    assert (default.ttft_ms, default.tbt_ms, default.early_reject) == (1500, slo.get("tbtMs", 100), False)
    if form == "old":
        assert parsed.names() == ["default"] and stored["defaultClass"] == "default"
    else:
        assert parsed.names() == ["default", "interactive", "batch-1", "batch-2"]
        assert parsed.select().name == "interactive" and parsed.select(priority=1).name == "batch-1"
        assert stored["classes"][2]["earlyReject"] is False  # filled in by the schema's default


def test_restart_mid_reconcile_converges_to_the_same_state(kube, operator, ns):
    """SIGKILL the operator as soon as the first child of a new InferenceService appears, then restart it."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["decode"] = [{"name": f"p{i}", "replicas": 1} for i in range(6)]
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
    wait_for(kube, lambda: names(kube, "prefillpools", ns) or names(kube, "decodepools", ns), "a first pool",
             op=operator)
    operator.kill()
    partial = {k: names(kube, k, ns) for k in ("decodepools", "deployments", "services")}
    try:
        expected = sorted(["chat-prefill", "chat-router"] + [f"chat-decode-p{i}" for i in range(6)])
        operator.start()
        wait_for(kube, lambda: names(kube, "deployments", ns) == expected, "all 8 Deployments after restart",
                 op=operator)
        wait_for(kube, lambda: names(kube, "services", ns) == expected, "all 8 Services", op=operator)
        isvc = settled_status(kube, ns, "0/6", op=operator)
        assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
        for name in expected:  # exactly one owner, no duplicates from the repeated reconcile
            assert len(get_json(kube, "deployment", name, "-n", ns)["metadata"]["ownerReferences"]) == 1
    finally:
        if not operator.alive():
            operator.start()
    print(f"state when the operator was killed: {partial}")
