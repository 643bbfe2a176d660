"""Mutual TLS in the operator's pods (pure builders and the self-signed issuer; the real API server is
tests/k8s/test_k8s_operator_tls.py, pods serving over it tests/k8s_node/test_node_tls.py):

- with --tls every router, prefill and decode pod mounts <isvc>-tls (certificate, key, CA; never the CA's
  key) and passes --tls-cert/--tls-key/--tls-ca; without it, nothing changes;
- each InferenceService gets a CA of its own: a real TLS handshake between the certificates of two
  InferenceServices fails, within one it succeeds;
- the Secrets are written only when missing or due: a second reconcile writes nothing; the certificate
  is renewed by the same CA when a third of its life is left; an expired CA is replaced with both;
- cert-manager mode: the Issuer/Certificate chain that ends in the same Secret.
"""

import base64
import datetime
import socket
import ssl
import threading
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from pdserve import tls
from pdserve.operator import naming, pools, router_workloads, tls_issuer, tls_pods, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
ON = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7", tls="self-signed")
OFF = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")
NOW = datetime.datetime.now(datetime.timezone.utc)


def example(name: str = "chat") -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"].update(name=name, namespace="ns1")
    return doc


def deployments(isvc: dict, config: OperatorConfig) -> dict[str, dict]:
    prefill = pools.build_prefill_pool(isvc, config)
    decodes = pools.build_decode_pools(isvc, config)
    return {"prefill": workloads.build_deployment(prefill),
            "router": router_workloads.build_router_deployment(isvc, config),
            **{f"decode-{p['spec']['poolName']}": workloads.build_deployment(p) for p in decodes}}


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_every_pod_mounts_its_services_certificate_and_passes_the_flags():
    deps = deployments(example(), ON)
    assert sorted(deps) == ["decode-big", "decode-main", "prefill", "router"]
    for role, dep in deps.items():
        pod = dep["spec"]["template"]["spec"]
        container = pod["containers"][0]
        (volume,) = [v for v in pod["volumes"] if v["name"] == tls_pods.VOLUME]
        assert volume["secret"] == {"secretName": "chat-tls", "defaultMode": 0o440, "items": [
            {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"},
            {"key": "ca.crt", "path": "ca.crt"}]}, role
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == tls_pods.VOLUME]
        assert mount == {"name": "tls", "mountPath": tls_pods.MOUNT, "readOnly": True} and "subPath" not in mount
        args = container["args"]
        assert (flag(args, "--tls-cert"), flag(args, "--tls-key"), flag(args, "--tls-ca")) == (
            "/etc/pdserve/tls/tls.crt", "/etc/pdserve/tls/tls.key", "/etc/pdserve/tls/ca.crt"), role
    for role, dep in deployments(example(), OFF).items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert not {"--tls-cert", "--tls-key", "--tls-ca"} & set(container["args"]), role
        assert tls_pods.VOLUME not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}


def test_a_bad_tls_mode_is_refused_naming_it():
    with pytest.raises(ValueError, match="tls 'on' must be one of off, self-signed, cert-manager"):
        OperatorConfig(default_image="x", protocol_version="7", tls="on")


def files_of(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def issue_for(name: str) -> dict[str, dict]:
    return {s["metadata"]["name"]: s for s in tls_issuer.secrets_to_write(example(name), None, None)}


def test_first_reconcile_makes_a_ca_and_a_certificate_then_nothing_more():
    made = issue_for("chat")
    assert sorted(made) == ["chat-tls", "chat-tls-ca"]
    assert {s["type"] for s in made.values()} == {"kubernetes.io/tls"}
    assert made["chat-tls"]["metadata"]["labels"][naming.LABEL_ISVC] == "chat"
    ca, leaf = files_of(made["chat-tls-ca"]), files_of(made["chat-tls"])
    assert sorted(leaf) == ["ca.crt", "tls.crt", "tls.key"] and sorted(ca) == ["tls.crt", "tls.key"]
    assert leaf["ca.crt"] == ca["tls.crt"]
    cert = x509.load_pem_x509_certificate(leaf["tls.crt"])
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca["tls.crt"]))
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [tls.SERVER_NAME]
    assert tls_issuer.secrets_to_write(example(), made["chat-tls-ca"], made["chat-tls"]) == []


def test_the_longest_names_fit_a_certificate():
    isvc = example("n" * 40)
    isvc["metadata"]["namespace"] = "s" * 63
    assert len(tls_issuer.secrets_to_write(isvc, None, None)) == 2
    assert len(tls_issuer.cert_manager_objects(isvc)[1]["spec"]["commonName"]) == 64


def test_renewal_keeps_the_ca_and_a_lost_ca_replaces_both():
    made = issue_for("chat")
    ca_pem = files_of(made["chat-tls-ca"])["tls.crt"]
    # from the certificate's own end (issued now, not when this module was imported: xdist may run it much later)
    expires = x509.load_pem_x509_certificate(files_of(made["chat-tls"])["tls.crt"]).not_valid_after_utc
    due = expires - tls_issuer.RENEW_BEFORE + datetime.timedelta(minutes=1)
    assert tls_issuer.secrets_to_write(example(), made["chat-tls-ca"], made["chat-tls"],
                                       now=due - datetime.timedelta(minutes=10)) == []
    (renewed,) = tls_issuer.secrets_to_write(example(), made["chat-tls-ca"], made["chat-tls"], now=due)
    assert renewed["metadata"]["name"] == "chat-tls" and files_of(renewed)["ca.crt"] == ca_pem
    assert files_of(renewed)["tls.crt"] != files_of(made["chat-tls"])["tls.crt"]
    # a certificate of another CA in the Secret (someone wrote it by hand) is replaced by one of ours
    other = issue_for("other")
    (fixed,) = tls_issuer.secrets_to_write(example(), made["chat-tls-ca"], other["other-tls"])
    assert files_of(fixed)["ca.crt"] == ca_pem
    # no CA (deleted) or an expired one: a new CA and a new certificate
    for ca_secret, now in ((None, NOW), (made["chat-tls-ca"], NOW + tls_issuer.CA_VALID + datetime.timedelta(days=1))):
        both = tls_issuer.secrets_to_write(example(), ca_secret, made["chat-tls"], now=now)
        assert [s["metadata"]["name"] for s in both] == ["chat-tls-ca", "chat-tls"]
        assert files_of(both[1])["ca.crt"] == files_of(both[0])["tls.crt"] != ca_pem


def tls_files(tmp: Path, secret: dict) -> tls.TlsFiles:
    tmp.mkdir()
    for key, data in files_of(secret).items():
        (tmp / key).write_bytes(data)
    return tls.TlsFiles(str(tmp / "tls.crt"), str(tmp / "tls.key"), str(tmp / "ca.crt"))


def handshake(server: tls.TlsFiles, client: tls.TlsFiles) -> str | None:
    """A real TLS handshake over a socket pair: None when both ends accept, else the error."""
    a, b = socket.socketpair()
    errors: list[str] = []

    def serve():
        try:
            with server.server_context().wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as e:
            errors.append(f"server: {e}")

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.client_context().wrap_socket(b, server_hostname=tls.SERVER_NAME) as c:
            c.sendall(b"x")
    except (ssl.SSLError, OSError) as e:
        errors.append(f"client: {e}")
    finally:
        b.close()
        t.join(10)
    return "; ".join(errors) or None


def test_a_pod_of_another_inference_service_is_refused_at_the_handshake(tmp_path):
    chat, other = issue_for("chat"), issue_for("other")
    chat_a = tls_files(tmp_path / "a", chat["chat-tls"])
    chat_b = tls_files(tmp_path / "b", chat["chat-tls"])
    stranger = tls_files(tmp_path / "s", other["other-tls"])
    assert handshake(chat_a, chat_b) is None
    for server, client in ((chat_a, stranger), (stranger, chat_a)):
        error = handshake(server, client)
        assert error and "certificate" in error.lower(), error


def test_cert_manager_mode_asks_for_the_same_secret():
    issuer, ca, ca_issuer, leaf = tls_issuer.cert_manager_objects(example())
    assert [o["kind"] for o in (issuer, ca, ca_issuer, leaf)] == ["Issuer", "Certificate", "Issuer", "Certificate"]
    assert issuer["spec"] == {"selfSigned": {}}
    assert ca["spec"]["isCA"] and ca["spec"]["secretName"] == "chat-tls-ca"
    assert ca["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"]
    assert ca_issuer["spec"] == {"ca": {"secretName": "chat-tls-ca"}}
    assert leaf["spec"]["secretName"] == "chat-tls" and leaf["spec"]["issuerRef"]["name"] == "chat-tls"
    assert leaf["spec"]["dnsNames"] == [tls.SERVER_NAME]
    assert {"server auth", "client auth"} <= set(leaf["spec"]["usages"])
    assert all(o["metadata"]["namespace"] == "ns1" for o in (issuer, ca, ca_issuer, leaf))
