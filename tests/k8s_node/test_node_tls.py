"""Mutual TLS in real pods (the chart's default, tls.enabled: the operator makes the InferenceService's CA
and certificate, every router, prefill and decode pod mounts <isvc>-tls and runs with --tls-*):

- the user's InferenceService (the `chat` fixture: its first completion already went router -> prefill ->
  decode) streams another completion, and every server pod runs with the --tls flags;
- at a decode's KV and gRPC ports (from this machine, by pod IP): a client with the Secret's certificate
  completes the handshake and is shown that certificate; one without a certificate, or with a valid
  certificate of another CA (another InferenceService's), is refused;
- rotation: a new certificate of the same CA written into the Secret (what the operator's renewal writes)
  reaches the running pods through the kubelet's in-place update of the Secret volume; the decode shows it
  at the next connection, with no pod restarted, and completions keep streaming.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from harness import node_serving
from harness.operator_harness import get_json
from pdserve import defaults, tls, tls_certs

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
HANG_GUARD_S = 10.0  # a refusal or a handshake takes milliseconds
KUBELET_UPDATE_S = 120.0  # the kubelet re-syncs Secret volumes every syncFrequency (10 s here) and a cache TTL


def secret_files(cluster, ns: str, name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in get_json(cluster, "secret", name, "-n", ns)["data"].items()}


def write_files(folder: Path, files: dict[str, bytes]) -> tuple[str, str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return str(folder / "tls.crt"), str(folder / "tls.key"), str(folder / "ca.crt")


def probe(ip: str, port: int, cert: tuple[str, str] | None, ca: str | None) -> bytes | str:
    """A TLS client at ip:port showing ``cert`` (None: none), checking the server against ``ca`` (None: not
    at all, as a stranger that only wants in). The server's certificate (DER) when the server accepts us,
    else the refusal in words. gRPC wants ALPN h2; the KV port ignores it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is None:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((ip, port), timeout=HANG_GUARD_S) as raw, \
                ctx.wrap_socket(raw, server_hostname=tls.SERVER_NAME) as sock:
            peer = sock.getpeercert(binary_form=True)
            sock.settimeout(1.0)
            try:  # TLS 1.3: a server's verdict on our certificate arrives after the client's handshake
                got = sock.recv(1)
            except TimeoutError:  # accepted: the server waits for our first frame
                return peer
            except (ssl.SSLError, OSError) as exc:
                return f"{type(exc).__name__}: {exc}"
            # gRPC's server speaks first (its SETTINGS frame): data means we are in; EOF means refused
            return peer if got else "closed by the server after the handshake"
    except (ssl.SSLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


def der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


def test_pods_serve_over_mutual_tls_refuse_strangers_and_take_a_renewed_certificate(node_kube, chat, tmp_path):
    ns = chat.namespace
    def serving() -> list[dict]:  # Running and not on its way out (a test before may have scaled a pool down)
        return [p for p in node_kube.pods(ns, "pdserve.io/inference-service=chat")
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    def roles() -> set[str]:
        return {p["metadata"]["labels"].get("pdserve.io/role") for p in serving()}
    node_kube.wait_until(lambda: {"router", "prefill", "decode"} <= roles(), 180, 1.0,
                         "a router, a prefill and a decode pod running, not terminating")
    pods = serving()  # every one of them (however many a test before left) runs with the Secret's files
    for pod in pods:
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--tls-ca") + 1] == "/etc/pdserve/tls/ca.crt", pod["metadata"]["name"]
    _, text, finish = node_serving.stream_chat(chat.base_url, chat.model, "Over TLS?", max_tokens=8, ignore_eos=True)
    assert text and finish == "length"

    ours = secret_files(node_kube, ns, "chat-tls")
    cert, key, ca = write_files(tmp_path / "ours", ours)
    other_ca = tls_certs.make_ca("another InferenceService's CA")
    other = tls_certs.issue(other_ca, "stranger", dns=(tls.SERVER_NAME,), ips=())
    o_cert, o_key, _ = write_files(tmp_path / "other", {"tls.crt": other.cert, "tls.key": other.key,
                                                        "ca.crt": other_ca.cert})
    decode = node_serving.pod_servers(node_kube, ns, "decode", "main")[0]
    ports = {"kv": defaults.KV_TRANSFER_PORT, "grpc": defaults.DECODE_GRPC_PORT}
    for what, port in ports.items():
        assert probe(decode.ip, port, (cert, key), ca) == der(ours["tls.crt"]), what
        for stranger, shown in (("no certificate", None), ("another CA's certificate", (o_cert, o_key))):
            refused = probe(decode.ip, port, shown, None)
            assert isinstance(refused, str), f"{what} port accepted a client with {stranger}"

    # rotation: a renewed certificate of the same CA, written as the operator's renewal writes it
    ca_files = secret_files(node_kube, ns, "chat-tls-ca")
    renewed = tls_certs.issue(tls_certs.Issued(ca_files["tls.crt"], ca_files["tls.key"]), "renewed",
                              dns=(tls.SERVER_NAME,), ips=())
    restarts = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"] for p in pods}
    data = {"tls.crt": base64.b64encode(renewed.cert).decode(), "tls.key": base64.b64encode(renewed.key).decode()}
    node_kube.kubectl("patch", "secret", "chat-tls", "-n", ns, "--type=merge", "-p", json.dumps({"data": data}))
    node_kube.wait_until(lambda: probe(decode.ip, ports["kv"], (cert, key), ca) == der(renewed.cert),
                         KUBELET_UPDATE_S, 1.0, "the decode's KV port to show the renewed certificate")
    node_kube.wait_until(lambda: probe(decode.ip, ports["grpc"], (cert, key), ca) == der(renewed.cert),
                         KUBELET_UPDATE_S, 1.0, "the decode's gRPC port to show the renewed certificate")
    _, text, finish = node_serving.stream_chat(chat.base_url, chat.model, "After the renewal?", max_tokens=8,
                                               ignore_eos=True)
    assert text and finish == "length"
    after = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
             for p in node_kube.pods(ns, "pdserve.io/inference-service=chat") if p["metadata"]["name"] in restarts}
    assert after == restarts, "no pod restarted for the new certificate"
