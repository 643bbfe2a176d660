"""`helm test`: the chart's test pod (templates/tests/completion.yaml) sends one completion through an
InferenceService's Service and fails on an error.

Pods do not run on this tier (no kubelet), so: the pod renders as a `helm test` hook with the Service's
URL and the model from values; the API server accepts it (server-side dry run) in a namespace that
enforces the restricted Pod Security profile; and the script the pod runs, taken from the rendered pod,
answers 0 against a stand-in of the OpenAI API and 1, with the reason, when the server refuses the
model or does not answer. Running the pod itself needs the kubelet tier (tests/k8s_node)."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.chart import by_kind, render, render_error
from pdserve.prefill_server.openai_api import error_body

pytestmark = pytest.mark.k8s
SERVED = "tiny"  # what the built-in model is served as (pdserve/server_setup.py served_model_name)


def rendered_test_pod(*sets: str) -> dict:
    (pod,) = [p for p in by_kind(render(*sets), "Pod") if p["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    return pod


def env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def test_the_pod_is_a_test_hook_aimed_at_the_router_service_by_default():
    pod = rendered_test_pod()
    assert pod["metadata"]["name"] == "rel-pdserve-test-completion"
    assert pod["metadata"]["namespace"] == "pdserve-system"
    assert pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/pdserve/pdserve:0.1.0"  # the chart's image: its Python runs the script
    assert container["command"] == ["python", "-c"]
    assert env(pod) == {"PDSERVE_TEST_URL": "http://chat-router.default.svc:8000", "PDSERVE_TEST_MODEL": "",
                        "PDSERVE_TEST_TIMEOUT_S": "120"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_values_name_the_inference_service_its_service_and_the_model():
    pod = rendered_test_pod("test.inferenceService=qa", "test.namespace=team-a", "test.model=qa-model",
                            "test.port=8001", "test.timeoutSeconds=30")
    assert env(pod) == {"PDSERVE_TEST_URL": "http://qa-router.team-a.svc:8001", "PDSERVE_TEST_MODEL": "qa-model",
                        "PDSERVE_TEST_TIMEOUT_S": "30"}
    pod = rendered_test_pod("test.service=qa-prefill", "test.namespace=", "imagePullSecrets={regcred}")
    assert env(pod)["PDSERVE_TEST_URL"] == "http://qa-prefill.pdserve-system.svc:8000"  # empty: the release's
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert not [p for p in by_kind(render("test.enabled=false"), "Pod")]
    assert "test.inferenceService" in render_error("test.inferenceService=")
    # a whole URL instead (no cluster DNS, an Ingress); the schema refuses one that is not http(s)
    assert env(rendered_test_pod("test.url=http://10.0.0.7:8000"))["PDSERVE_TEST_URL"] == "http://10.0.0.7:8000"
    assert "url" in render_error("test.url=chat-router:8000")


def test_the_api_server_accepts_the_pod_under_the_restricted_pod_security_profile(kube, ns):
    kube.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    pod = rendered_test_pod()
    pod["metadata"]["namespace"] = ns
    out = kube.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod)).stdout
    accepted = json.loads(out)["spec"]["containers"][0]
    assert {e["name"]: e.get("value", "") for e in accepted["env"]} == env(pod)  # the API drops empty values
    assert accepted["args"] == pod["spec"]["containers"][0]["args"]
    # The profile is really enforced here, so the acceptance above means something.
    pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refused = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


class OpenAIStandIn(BaseHTTPRequestHandler):
    """/v1/models and /v1/completions as a pdserve server answers them (400 model_not_found included)."""

    asked: list[str] = []

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {"object": "list", "data": [{"id": SERVED, "object": "model", "owned_by": "pdserve"}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.asked.append(request["model"])
        if request["model"] != SERVED:
            self.reply(400, error_body(f"model {request['model']!r} does not exist; this server serves {SERVED!r}",
                                       param="model", code="model_not_found"))
        else:
            self.reply(200, {"object": "text_completion", "model": SERVED,
                             "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}]})

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), OpenAIStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    OpenAIStandIn.asked = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_the_pods_script(url: str, *sets: str) -> subprocess.CompletedProcess:
    pod = rendered_test_pod(*sets)
    container = pod["spec"]["containers"][0]
    return subprocess.run([sys.executable, "-c", container["args"][0]], capture_output=True, text=True, timeout=60,
                          env={**env(pod), "PDSERVE_TEST_URL": url})


def test_the_script_asks_for_the_listed_model_and_passes(stand_in):
    proc = run_the_pods_script(stand_in)
    assert proc.returncode == 0, proc.stderr
    assert OpenAIStandIn.asked == [SERVED] and f"model '{SERVED}' answered ' hi'" in proc.stdout


def test_the_script_fails_with_the_servers_reason(stand_in):
    proc = run_the_pods_script(stand_in, "test.model=builtin:tiny")  # the source, not the served name
    assert proc.returncode == 1
    assert "HTTP 400" in proc.stderr and "model_not_found" in proc.stderr, proc.stderr


def test_the_script_fails_when_nothing_answers():
    proc = run_the_pods_script("http://127.0.0.1:9", "test.timeoutSeconds=5")
    assert proc.returncode == 1 and proc.stderr.startswith("FAIL: http://127.0.0.1:9/v1/models"), proc.stderr
