"""Mutual TLS rendered by the operator on a real control plane (its own process under the chart's
ServiceAccount, so RBAC is real: the chart grants Secrets because tls.enabled is on by default):

- self-signed: each InferenceService gets <name>-tls-ca and <name>-tls, owned by it; every router, prefill
  and decode Deployment mounts <name>-tls and passes the --tls-* flags; two InferenceServices have two
  CAs (a certificate of one does not verify against the other's CA); a later reconcile keeps the
  certificate the pods have;
- cert-manager: with cert-manager's CRDs in the cluster (stand-ins: fixtures/cert-manager-crds-minimal.yaml),
  the operator asks for the same Secret through Issuers and Certificates; nothing here issues them, so the
  Secret itself is not checked in that mode.
Pods serving over TLS: tests/k8s_node/test_node_tls.py."""

import base64
import json

import pytest
import yaml
from cryptography import x509

from harness.operator_harness import OperatorProcess, get_json, install_chart, names, wait_for
from harness.procs import REPO

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
DEPLOYMENTS = ["chat-decode-big", "chat-decode-main", "chat-prefill", "chat-router"]
CERT_MANAGER_CRDS = REPO / "tests" / "k8s" / "fixtures" / "cert-manager-crds-minimal.yaml"


@pytest.fixture
def tls_operator(kube, ns, tmp_path):
    """An operator with --tls MODE watching only this test's namespace (so it never meets another test's
    operator); stopped at the test's end."""
    started = []

    def start(mode: str) -> OperatorProcess:
        op = OperatorProcess(kube, tmp_path / "operator", extra_args=("--tls", mode), scope=("--namespace", ns))
        op.start()
        started.append(op)
        return op

    install_chart(kube)
    yield start
    for op in started:
        op.stop()


def apply_isvc(kube, ns: str, name: str = "chat") -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))


def secret_files(kube, ns: str, name: str) -> dict[str, bytes] | None:
    secret = get_json(kube, "secret", name, "-n", ns)
    return None if secret is None else {k: base64.b64decode(v) for k, v in secret["data"].items()}


def pod_template(kube, ns: str, deployment: str) -> dict:
    return get_json(kube, "deployment", deployment, "-n", ns)["spec"]["template"]["spec"]


def assert_mounts_tls(pod: dict, secret: str, what: str) -> None:
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == secret, what
    assert sorted(i["key"] for i in volume["secret"]["items"]) == ["ca.crt", "tls.crt", "tls.key"], what
    args = pod["containers"][0]["args"]
    for flag, file in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt")):
        assert args[args.index(flag) + 1] == f"/etc/pdserve/tls/{file}", what


def test_self_signed_each_service_its_own_ca_mounted_by_every_pod(kube, ns, tls_operator):
    op = tls_operator("self-signed")
    apply_isvc(kube, ns)
    wait_for(kube, lambda: names(kube, "deployments", ns) == DEPLOYMENTS, "four Deployments", op=op)
    leaf, ca = secret_files(kube, ns, "chat-tls"), secret_files(kube, ns, "chat-tls-ca")
    assert leaf and ca, "the operator wrote both Secrets before the Deployments"
    ca_cert = x509.load_pem_x509_certificate(ca["tls.crt"])
    x509.load_pem_x509_certificate(leaf["tls.crt"]).verify_directly_issued_by(ca_cert)
    assert leaf["ca.crt"] == ca["tls.crt"] and "ca.key" not in leaf
    isvc_uid = get_json(kube, "inferenceservice", "chat", "-n", ns)["metadata"]["uid"]
    for secret in ("chat-tls", "chat-tls-ca"):
        owners = get_json(kube, "secret", secret, "-n", ns)["metadata"]["ownerReferences"]
        assert [o["uid"] for o in owners] == [isvc_uid], secret  # deleted with the InferenceService
    for deployment in DEPLOYMENTS:
        assert_mounts_tls(pod_template(kube, ns, deployment), "chat-tls", deployment)
    pool = get_json(kube, "prefillpool", "chat-prefill", "-n", ns)
    assert pool["spec"]["tlsSecret"] == "chat-tls"  # kept by the pool's schema, not pruned

    # a second InferenceService: a CA of its own, which does not vouch for the first one's pods
    apply_isvc(kube, ns, "other")
    wait_for(kube, lambda: secret_files(kube, ns, "other-tls") is not None, "other-tls", op=op)
    other = secret_files(kube, ns, "other-tls")
    assert other["ca.crt"] != leaf["ca.crt"]
    with pytest.raises(ValueError):  # the issuer names differ: not signed by this CA
        x509.load_pem_x509_certificate(other["tls.crt"]).verify_directly_issued_by(ca_cert)

    # a reconcile (here: a spec change that rolls the prefills) keeps the certificate the pods have
    before = get_json(kube, "secret", "chat-tls", "-n", ns)["metadata"]["resourceVersion"]
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p", '{"spec": {"prefill": {"replicas": 2}}}')
    wait_for(kube, lambda: get_json(kube, "deployment", "chat-prefill", "-n", ns)["spec"]["replicas"] == 2,
             "the prefill Deployment at 2 replicas", op=op)
    assert get_json(kube, "secret", "chat-tls", "-n", ns)["metadata"]["resourceVersion"] == before


def test_cert_manager_mode_asks_cert_manager_for_the_same_secret(kube, ns, tls_operator):
    kube.kubectl("apply", "-f", str(CERT_MANAGER_CRDS))
    kube.helm("upgrade", "--install", "pdop", str(REPO / "charts" / "pdserve"), "-n", "pdserve-operator-test",
              "--reuse-values", "--set", "tls.issuer=cert-manager")  # the chart then grants cert-manager.io
    try:
        op = tls_operator("cert-manager")
        apply_isvc(kube, ns)
        wait_for(kube, lambda: names(kube, "deployments", ns) == DEPLOYMENTS, "four Deployments", op=op)
        certs = {c["metadata"]["name"]: c["spec"] for c in json.loads(kube.kubectl(
            "get", "certificates.cert-manager.io", "-n", ns, "-o", "json").stdout)["items"]}
        issuers = {i["metadata"]["name"]: i["spec"] for i in json.loads(kube.kubectl(
            "get", "issuers.cert-manager.io", "-n", ns, "-o", "json").stdout)["items"]}
        assert certs["chat-tls"]["secretName"] == "chat-tls" and certs["chat-tls"]["issuerRef"]["name"] == "chat-tls"
        assert certs["chat-tls-ca"]["isCA"] is True
        assert issuers["chat-tls"] == {"ca": {"secretName": "chat-tls-ca"}}
        assert issuers[certs["chat-tls-ca"]["issuerRef"]["name"]] == {"selfSigned": {}}
        assert get_json(kube, "secret", "chat-tls", "-n", ns) is None  # the operator writes none itself
        for deployment in DEPLOYMENTS:
            assert_mounts_tls(pod_template(kube, ns, deployment), "chat-tls", deployment)
    finally:
        kube.kubectl("delete", "-f", str(CERT_MANAGER_CRDS), "--wait=false", check=False)
        install_chart(kube)  # back to the default values for the modules after this one
