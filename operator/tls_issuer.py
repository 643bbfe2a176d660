"""Each InferenceService's own CA and certificate, for mutual TLS between its pods (the operator's ``--tls``).

Every InferenceService gets a CA of its own, and its pods trust that CA alone: the servers check a
peer's certificate against ``--tls-ca`` and nothing else (``pdserve/tls.py``), so a pod of another
InferenceService, whose certificate another CA signed, is refused at the handshake. (One CA for the
whole cluster would let every InferenceService's pods into every other's.) Two Secrets per
InferenceService (``naming``), owned by it, so they go when it goes:

- ``<isvc>-tls-ca`` (``kubernetes.io/tls``): the CA's certificate and key; no pod mounts it;
- ``<isvc>-tls`` (``kubernetes.io/tls``): ``tls.crt`` and ``tls.key`` (one certificate for every pod of
  the InferenceService, for both ends of a connection, naming ``tls.SERVER_NAME``) and ``ca.crt`` (the
  CA's certificate): what every router, prefill and decode pod mounts (``tls_pods.py``).

Who makes them (``OperatorConfig.tls``):

- ``self-signed`` (``secrets_to_write``): the operator, with ``pdserve/tls_certs.py`` (the
  ``cryptography`` package). It writes a Secret only when it is missing or no longer usable, so a
  reconcile keeps the certificate the pods have; the certificate is renewed, signed by the same CA,
  when less than a third of its life is left (the handlers check at every reconcile and every
  ``CHECK_INTERVAL_S``). A renewal changes the Secret, the kubelet swaps the mounted files, and the
  servers use the new certificate from their next connection on while open streams keep theirs.
  The CA lasts ``CA_VALID``; a CA that is missing or expired is made anew, with a new certificate
  (pods whose files have not been swapped yet refuse those that have, for up to a kubelet sync).
- ``cert-manager`` (``cert_manager_objects``): cert-manager, through a self-signed Issuer, a CA
  Certificate (``<isvc>-tls-ca``), a CA Issuer and the pods' Certificate (``<isvc>-tls``), which it
  renews itself (``renewBefore``).
"""

from __future__ import annotations

import base64
import datetime

from pdserve.operator import naming
from pdserve.operator.config import OperatorConfig
from pdserve.operator.tls_pods import CA, CERT, KEY

CA_VALID = datetime.timedelta(days=3650)
CERT_VALID = datetime.timedelta(days=30)
RENEW_BEFORE = CERT_VALID / 3  # renew when less than this is left
CHECK_INTERVAL_S = 3600.0  # the handlers' timer: renewals between reconciles
CERT_MANAGER = "cert-manager.io/v1"


def _labels(isvc_name: str) -> dict[str, str]:
    return {naming.LABEL_ISVC: isvc_name, naming.LABEL_MANAGED_BY: naming.MANAGER,
            "app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": isvc_name,
            "app.kubernetes.io/component": "tls"}


def _meta(isvc: dict, name: str) -> dict:
    meta = isvc["metadata"]
    out = {"name": name, "labels": _labels(meta["name"])}
    if meta.get("namespace"):
        out["namespace"] = meta["namespace"]
    return out


def _secret(isvc: dict, name: str, files: dict[str, bytes]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": _meta(isvc, name),
            "data": {k: base64.b64encode(v).decode() for k, v in files.items()}}


def _files(secret: dict | None) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in ((secret or {}).get("data") or {}).items()}


def _usable_ca(files: dict[str, bytes], now: datetime.datetime):
    """The CA certificate of a ``<isvc>-tls-ca`` Secret's files, or None when missing, broken or expired."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(files[CERT])
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except (KeyError, ValueError, x509.ExtensionNotFound):
        return None
    if not constraints.ca or KEY not in files or cert.not_valid_after_utc <= now:
        return None
    return cert


def _usable_leaf(files: dict[str, bytes], ca_cert, ca_pem: bytes, now: datetime.datetime) -> bool:
    """Whether a ``<isvc>-tls`` Secret's files are a certificate of this CA with more than RENEW_BEFORE left."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    if files.get(CA) != ca_pem or KEY not in files:
        return False
    try:
        cert = x509.load_pem_x509_certificate(files[CERT])
        cert.verify_directly_issued_by(ca_cert)
    except (KeyError, ValueError, TypeError, InvalidSignature):  # missing, not PEM, not signed by this CA
        return False
    return cert.not_valid_after_utc - now > RENEW_BEFORE


def _common_name(text: str) -> str:
    """A certificate's common name: at most 64 characters (X.509), so a long namespace/name is cut; nothing
    checks it (clients check the DNS name tls.SERVER_NAME, trust comes from the CA)."""
    return text[:64]


def secrets_to_write(isvc: dict, ca_secret: dict | None, leaf_secret: dict | None,
                     now: datetime.datetime | None = None) -> list[dict]:
    """The Secrets (self-signed mode) that must be written now: none when both are usable; the certificate
    when it is missing, not of this CA or due for renewal; both when the CA is missing or expired."""
    from pdserve import tls, tls_certs

    now = now or datetime.datetime.now(datetime.timezone.utc)
    name = isvc["metadata"]["name"]
    namespace = isvc["metadata"].get("namespace") or "default"
    ca_files = _files(ca_secret)
    ca_cert = _usable_ca(ca_files, now)
    out = []
    if ca_cert is None:
        ca = tls_certs.make_ca(_common_name(f"pdserve CA {namespace}/{name}"), valid=CA_VALID)
        out.append(_secret(isvc, naming.tls_ca_secret_name(name), {CERT: ca.cert, KEY: ca.key}))
    else:
        ca = tls_certs.Issued(ca_files[CERT], ca_files[KEY])
        if _usable_leaf(_files(leaf_secret), ca_cert, ca.cert, now):
            return []
    leaf = tls_certs.issue(ca, _common_name(f"pdserve {namespace}/{name}"), dns=(tls.SERVER_NAME,), ips=(),
                           valid=CERT_VALID)
    out.append(_secret(isvc, naming.tls_secret_name(name), {CERT: leaf.cert, KEY: leaf.key, CA: ca.cert}))
    return out


def _certificate(isvc: dict, name: str, issuer: str, spec: dict) -> dict:
    return {"apiVersion": CERT_MANAGER, "kind": "Certificate", "metadata": _meta(isvc, name),
            "spec": {"secretName": name, "issuerRef": {"name": issuer, "kind": "Issuer", "group": "cert-manager.io"},
                     "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
                     "secretTemplate": {"labels": _labels(isvc["metadata"]["name"])}, **spec}}


def _hours(delta: datetime.timedelta) -> str:
    return f"{int(delta.total_seconds() // 3600)}h"


def cert_manager_objects(isvc: dict) -> list[dict]:
    """The cert-manager objects (cert-manager mode), in creation order: a self-signed Issuer, the CA
    Certificate ``<isvc>-tls-ca``, the CA Issuer ``<isvc>-tls``, the pods' Certificate ``<isvc>-tls``."""
    from pdserve.tls import SERVER_NAME

    name = isvc["metadata"]["name"]
    namespace = isvc["metadata"].get("namespace") or "default"
    ca_name, leaf_name = naming.tls_ca_secret_name(name), naming.tls_secret_name(name)
    self_signed = f"{name}-tls-root"
    return [
        {"apiVersion": CERT_MANAGER, "kind": "Issuer", "metadata": _meta(isvc, self_signed),
         "spec": {"selfSigned": {}}},
        _certificate(isvc, ca_name, self_signed, {
            "isCA": True, "duration": _hours(CA_VALID), "commonName": _common_name(f"pdserve CA {namespace}/{name}")}),
        {"apiVersion": CERT_MANAGER, "kind": "Issuer", "metadata": _meta(isvc, leaf_name),
         "spec": {"ca": {"secretName": ca_name}}},
        _certificate(isvc, leaf_name, leaf_name, {
            "dnsNames": [SERVER_NAME], "duration": _hours(CERT_VALID), "renewBefore": _hours(RENEW_BEFORE),
            "usages": ["digital signature", "key encipherment", "server auth", "client auth"]}),
    ]


def objects(api, isvc: dict, config: OperatorConfig) -> list[dict]:
    """What to apply for ``isvc``'s certificate now (nothing with ``--tls off``); ``api``: a KubeApi."""
    if config.tls == "cert-manager":
        return cert_manager_objects(isvc)
    if config.tls != "self-signed":
        return []
    name, namespace = isvc["metadata"]["name"], isvc["metadata"].get("namespace") or "default"
    return secrets_to_write(isvc, api.get("Secret", namespace, naming.tls_ca_secret_name(name)),
                            api.get("Secret", namespace, naming.tls_secret_name(name)))
