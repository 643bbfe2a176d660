"""Pure builders: mutual TLS in a server pod (router, prefill, decode) of an InferenceService.

With the operator's ``--tls`` (the chart's ``tls.enabled``, on by default) every pool spec and the
router's carry ``tlsSecret``: the Secret ``<isvc>-tls`` (``naming.tls_secret_name``) that holds this
InferenceService's certificate, its key and its own CA (``tls_issuer.py`` makes it, or cert-manager
does). Each pod mounts it read-only at ``MOUNT`` (a Secret volume, never ``subPath``: the kubelet
swaps the files in place when the Secret changes, and the servers re-read them at their next
connection, ``pdserve/tls.py``) and passes ``--tls-cert``, ``--tls-key`` and ``--tls-ca``. Only those
three keys are projected; the CA's key lives in another Secret no pod mounts.
"""

from __future__ import annotations

VOLUME = "tls"
MOUNT = "/etc/pdserve/tls"
CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"  # the keys of a kubernetes.io/tls Secret (cert-manager's too)
FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")  # pdserve/tls.py's, for each of CERT, KEY, CA


def tls_args(spec: dict) -> list[str]:
    """--tls-cert/--tls-key/--tls-ca where ``tls_volumes`` mounts the Secret (nothing without spec.tlsSecret)."""
    if not spec.get("tlsSecret"):
        return []
    return [part for flag, key in zip(FLAGS, (CERT, KEY, CA)) for part in (flag, f"{MOUNT}/{key}")]


def tls_volumes(spec: dict) -> tuple[list[dict], list[dict]]:
    """The Secret of spec.tlsSecret (its certificate, key and CA only), mounted read-only at MOUNT;
    readable by the pod's group (fsGroup) only. Nothing without spec.tlsSecret."""
    secret = spec.get("tlsSecret")
    if not secret:
        return [], []
    items = [{"key": k, "path": k} for k in (CERT, KEY, CA)]
    return ([{"name": VOLUME, "secret": {"secretName": secret, "items": items, "defaultMode": 0o440}}],
            [{"name": VOLUME, "mountPath": MOUNT, "readOnly": True}])
