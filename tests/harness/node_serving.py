"""The user's path on the one-node cluster (tests/harness/kube_node.py), step by step:

    helm_install(cluster)                  # charts/pdserve, operator image = the built image
    served = apply_example(cluster)        # examples/inferenceservice.yaml -> Ready -> first streamed token
    stream_chat(served.base_url, model)    # one streamed chat completion with the openai client
    pod_servers(cluster, ns, "decode")     # the pods' HTTP ports (pod IPs: reachable from this machine)
    helm_test(cluster, url)                # `helm test`: the chart's test pod, one completion via url

The example asks for more CPU than the node has (prefill 1, decodes 1 + 1 + 1, router 0.25, while
the node has the machine's 2 cores), so `fit_to_node` lowers every CPU *request* to 100m and keeps
the limits and everything else. That is the only change to the file, and the test reports it. The
example selects no node labels (its "big" pool's nodeSelector is a comment); should a decode pool
name one, `apply_example` labels the node to match.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import yaml

from harness.conditions import wait_until
from harness.operator_harness import CHART, CRD_NAMES, condition, get_json, wait_crds_established
from harness.procs import REPO
from pdserve import defaults

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
RELEASE, RELEASE_NAMESPACE = "pdserve", "pdserve-system"
NAMESPACE = "user-path"
CPU_REQUEST = "100m"
READY_TIMEOUT_S = 600.0
SERVICE_HANG_GUARD_S = 60.0  # only a hang guard: kube-proxy programs a new Service's rules within seconds


def helm_install(cluster) -> None:
    """`helm install` as a user would, with the locally built image; waits for the operator pod."""
    repository, tag = cluster.image.rsplit(":", 1)
    cluster.helm("install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
                 "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
                 # this node builds no CUDA image (make image-cuda): a GPU pool here runs the CPU image, and fails
                 # for want of a GPU as the GPU-pool test expects, instead of waiting on an image never pulled
                 "--set", f"image.cuda.repository={repository}", "--set", f"image.cuda.tag={tag}",
                 "--set", "image.pullPolicy=Never", "--wait", "--timeout", "10m", timeout=700)
    wait_crds_established(cluster, CRD_NAMES)


def helm_test(cluster, url: str) -> str:
    """`helm test` of the release, its test pod aimed at ``url`` (set by `helm upgrade --reuse-values`:
    this node has no cluster DNS, so the Service's name would not resolve); returns its output with the
    pod's log. Raises KubeCommandError (with the log) when the pod fails."""
    cluster.helm("upgrade", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--reuse-values", "--set", f"test.url={url}",
                 "--wait", "--timeout", "5m", timeout=400)
    return cluster.helm("test", RELEASE, "-n", RELEASE_NAMESPACE, "--logs", "--timeout", "5m", timeout=400).stdout


def fit_to_node(doc: dict) -> dict:
    """The example with every CPU request at CPU_REQUEST (limits kept); see the module docstring."""
    spec = doc["spec"]
    for part in [spec.get("router") or {}, spec["prefill"], *spec["decode"]]:
        resources = part.setdefault("resources", {})
        resources.setdefault("requests", {})["cpu"] = CPU_REQUEST
    return doc


@dataclass
class Served:
    """An InferenceService that answered: where, and how long each step took (seconds)."""

    namespace: str
    name: str
    base_url: str
    model: str
    first_text: str
    timings: dict[str, float] = field(default_factory=dict)


def isvc_ready(cluster, namespace: str, name: str) -> bool:
    cond = condition(get_json(cluster, "inferenceservice", name, "-n", namespace), "Ready")
    return bool(cond and cond["status"] == "True")


def apply_example(cluster, namespace: str = NAMESPACE) -> Served:
    doc = fit_to_node(yaml.safe_load(EXAMPLE.read_text()))
    name = doc["metadata"]["name"]
    for selector in doc["spec"]["decode"]:
        for key, value in (selector.get("nodeSelector") or {}).items():
            cluster.kubectl("label", "node", cluster.node_name, f"{key}={value}", "--overwrite")
    cluster.kubectl("create", "namespace", namespace)
    start = time.monotonic()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    return wait_served(cluster, namespace, name, start)


def wait_served(cluster, namespace: str, name: str, start: float, timeout: float = READY_TIMEOUT_S) -> Served:
    """The InferenceService `name` once it is Ready and has streamed a first completion through its
    endpoint; timings from `start` (time.monotonic() of the apply). The TimeoutError describes the namespace."""
    try:
        cluster.wait_until(lambda: isvc_ready(cluster, namespace, name), timeout, 1.0,
                           f"InferenceService {namespace}/{name} to be Ready")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{describe(cluster, namespace)}") from None
    ready = time.monotonic()
    status = get_json(cluster, "inferenceservice", name, "-n", namespace)["status"]
    # The endpoint is http://<service>.<namespace>.svc:<port>; this machine has no cluster DNS, so
    # it goes to the Service's ClusterIP (kube-proxy's rules route it to a router pod).
    service = status["endpoint"].split("//", 1)[1].split(".", 1)[0]
    base_url = f"http://{cluster.cluster_ip(namespace, service)}:{defaults.HTTP_PORT}/v1"
    model = first_model(base_url)
    first_token_at, text, _ = stream_chat(base_url, model, "Say hello to Kubernetes.", max_tokens=16)
    return Served(namespace, name, base_url, model, text, {
        "apply_to_ready_s": ready - start, "apply_to_first_token_s": first_token_at - start})


def advertise(cluster, resource: str, count: int | None) -> None:
    """Set (None: remove) the node's capacity and allocatable of an extended resource (e.g. nvidia.com/gpu)
    through its status subresource, as a device plugin would report it; the scheduler counts it from then on."""
    value = None if count is None else str(count)
    patch = {"status": {"capacity": {resource: value}, "allocatable": {resource: value}}}
    cluster.kubectl("patch", "node", cluster.node_name, "--subresource=status", "--type=merge", "-p", json.dumps(patch))


def first_model(base_url: str, timeout: float = 60.0) -> str:
    """The first model the endpoint lists, once its Service routes. An InferenceService is Ready when its
    pods are; kube-proxy programs the Service's ClusterIP rules a moment later, and until then a connection
    to it is refused (seen in CI: test_node_hf_model, right after Ready). A refused connection is waited
    out (``SERVICE_HANG_GUARD_S``, only a hang guard); any other error is raised."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=timeout, max_retries=0)

    def listed() -> str | None:
        try:
            return client.models.list().data[0].id
        except openai.APIConnectionError as exc:
            if isinstance(exc, openai.APITimeoutError):
                raise
            return None

    return wait_until(listed, f"the Service at {base_url} to accept connections", SERVICE_HANG_GUARD_S, 0.2)


def stream_chat(base_url: str, model: str, prompt: str, max_tokens: int = 16, timeout: float = 120.0,
                ignore_eos: bool = False):
    """(monotonic time of the first streamed token, the whole text, finish_reason); raises on an error
    event or a stream without finish_reason. The text may be empty only with finish_reason "stop" (the
    built-in model's random weights can pick end-of-sequence first). ignore_eos: exactly max_tokens."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=timeout, max_retries=0)
    first, parts, finish = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, stream=True,
                                                extra_body={"ignore_eos": True} if ignore_eos else None):
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                first = first or time.monotonic()
                parts.append(choice.delta.content)
            finish = choice.finish_reason or finish
    if finish is None or (not parts and finish != "stop"):
        raise AssertionError(f"the stream ended without tokens or finish_reason (finish={finish}, text={parts})")
    return first or time.monotonic(), "".join(parts), finish


@dataclass
class PodServer:
    """A pod's HTTP port as harness.pd_cluster's leak checks want it (.name, .url)."""

    name: str
    ip: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def pod_servers(cluster, namespace: str, role: str, pool: str | None = None) -> list[PodServer]:
    """Running, ready pods of a role (and decode pool) with their HTTP ports."""
    selector = f"pdserve.io/role={role}" + (f",pdserve.io/pool={pool}" if pool else "")
    port = defaults.DECODE_HTTP_PORT if role == "decode" else defaults.HTTP_PORT
    out = []
    for pod in cluster.pods(namespace, selector):
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
        if ready and not pod["metadata"].get("deletionTimestamp"):
            out.append(PodServer(pod["metadata"]["name"], pod["status"]["podIP"], port))
    return out


def describe(cluster, namespace: str) -> str:
    """What a user would look at when it does not come up: objects, pods, events, pod logs."""
    parts = [cluster.kubectl("get", "pdserve,deploy,pods,svc,endpointslices", "-n", namespace, "-o", "wide",
                             check=False).stdout,
             cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False).stdout
                      or '{"items": []}')
    for pod in pods["items"]:
        name = pod["metadata"]["name"]
        parts.append(f"--- logs {name} ---\n" + cluster.kubectl("logs", name, "-n", namespace, "--tail=30",
                                                               check=False).stdout)
    return "\n".join(parts)
