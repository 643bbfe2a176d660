"""Names, labels and selectors of everything the operator creates: the one place for them.

An InferenceService ``chat`` in namespace ``ns`` becomes:

=========================  =====================================================
``chat-prefill``           PrefillPool, its Deployment, Service, ServiceAccount,
                           Role and RoleBinding (the pods watch EndpointSlices)
``chat-decode-<pool>``     one DecodePool per ``spec.decode[*]``, each with a
                           Deployment and a headless Service
``chat-router``            the router (``spec.router.replicas`` > 0, the default):
                           Deployment, Service (the endpoint in status),
                           ServiceAccount, Role and RoleBinding (its pods watch
                           the prefill Service's EndpointSlices)
``chat-tls``,               with mutual TLS (operator ``--tls``): the Secret its pods
``chat-tls-ca``            mount, and the Secret of its own CA (tls_issuer.py)
``chat-decode``,           NetworkPolicies: decode Session and KV-transfer ports
``chat-prefill``,          admit only this service's prefill pods, the prefill's gRPC
``chat-router``            port only its routers; the HTTP doors stay open (when enabled)
=========================  =====================================================

Every child carries the labels below. Prefill pods find decode pods by watching the
EndpointSlices of the decode Services; the EndpointSlice controller copies a Service's
labels onto its slices, so the selector given to prefill (``decode_selector``) matches
the slices of exactly the compatible decode pools of the same InferenceService. The
router finds prefill pods the same way (``prefill_selector``: the prefill Service, whose
slices list every ready prefill pod with its port named "grpc").
"""

from __future__ import annotations

import re

GROUP = "pdserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# The field manager / managed-by value the operator writes with.
MANAGER = "pdserve-operator"

LABEL_ISVC = "pdserve.io/inference-service"
LABEL_ROLE = "pdserve.io/role"  # prefill | decode | router
LABEL_POOL = "pdserve.io/pool"  # the decode pool name ("prefill" / "router" for those)
LABEL_PROTOCOL = "pdserve.io/protocol-version"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# On a decode Service kept for an older protocol version while the prefills roll (protocol_rollout.py)
LABEL_RETIRED = "pdserve.io/retired"

# Annotation on a pool: the InferenceService's replica count last copied into it. While the
# InferenceService keeps that value, `kubectl scale` on the pool wins; when it changes, it wins.
ANNOTATION_ISVC_REPLICAS = "pdserve.io/isvc-replicas"
# Annotation on a pool (Deployment): the generation of the InferenceService (pool) it was
# built from; statuses report it as observedGeneration, so that field means "applied".
ANNOTATION_OWNER_GENERATION = "pdserve.io/owner-generation"


def owner_generation(obj: dict | None) -> int | None:
    """The owner generation an object was built from (see ANNOTATION_OWNER_GENERATION), or None."""
    value = ((obj or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_OWNER_GENERATION)
    return int(value) if value and value.isdigit() else None

# Longest names the CRD schema admits, chosen so `<isvc>-decode-<pool>` is a valid
# Service name (an RFC 1035 label: at most 63 characters, starting with a letter).
MAX_ISVC_NAME = 40
MAX_POOL_NAME = 15
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # Secrets, classes (<= 253)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_dns_subdomain(name: str) -> bool:
    return 0 < len(name) <= 253 and re.match(DNS_SUBDOMAIN, name) is not None


def prefill_name(isvc: str) -> str:
    return f"{isvc}-prefill"


def decode_name(isvc: str, pool: str) -> str:
    return f"{isvc}-decode-{pool}"


def router_name(isvc: str) -> str:
    return f"{isvc}-router"


def network_policy_name(isvc: str, role: str) -> str:
    return f"{isvc}-{role}"


def tls_secret_name(isvc: str) -> str:
    """The Secret of an InferenceService's certificate (tls.crt, tls.key) and its CA (ca.crt): its pods mount it."""
    return f"{isvc}-tls"


def tls_ca_secret_name(isvc: str) -> str:
    """The Secret of an InferenceService's own CA (its key signs the certificate); no pod mounts it."""
    return f"{isvc}-tls-ca"


def selector_labels(isvc: str, role: str, pool: str) -> dict[str, str]:
    """The labels a pool's Deployment selects its pods by (immutable once created)."""
    return {LABEL_ISVC: isvc, LABEL_ROLE: role, LABEL_POOL: pool}


def common_labels(isvc: str, role: str, pool: str, protocol_version: str) -> dict[str, str]:
    """Labels on every child object and pod of a pool."""
    return {
        **selector_labels(isvc, role, pool),
        LABEL_PROTOCOL: protocol_label(protocol_version),
        LABEL_MANAGED_BY: MANAGER,
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": isvc,
        "app.kubernetes.io/component": role,
    }


def decode_selector(isvc: str, protocol_version: str) -> str:
    """The `--decode-selector` given to prefill: decode pools of this service and protocol version."""
    return f"{LABEL_ISVC}={isvc},{LABEL_ROLE}=decode,{LABEL_PROTOCOL}={protocol_label(protocol_version)}"


def prefill_selector(isvc: str) -> str:
    """The `--prefill-selector` given to the router: the prefill Service of this service.

    No protocol version in it: the prefill Service selects its pods without one (they roll
    in place), and the router checks each prefill's KV-event version itself.
    """
    return f"{LABEL_ISVC}={isvc},{LABEL_ROLE}=prefill"


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def protocol_label(version: object) -> str:
    """A protocol version as a label value; a clear error if it cannot be one."""
    text = str(version)
    if not text or len(text) > 63 or not _LABEL_VALUE.match(text):
        raise ValueError(f"protocol version {text!r} is not a valid label value (1-63 of [A-Za-z0-9-_.])")
    return text


def default_protocol_version() -> str:
    """The gRPC protocol version of the pdserve release this operator belongs to."""
    from pdserve.protos.version import PROTOCOL_VERSION

    return protocol_label(PROTOCOL_VERSION)


# spec.model.cache on a claim (model_cache.py): the claim the operator makes (cache.size), the download
# Job (one per source, endpoint and token Secret: `digest`) and the ServiceAccount, Role and RoleBinding
# that let the Job's pod write its progress into that Job.
def model_cache_claim(isvc: str) -> str:
    return f"{isvc}-model-cache"


def model_download_job(isvc: str, digest: str) -> str:
    return f"{isvc}-model-{digest}"


def model_download_account(isvc: str) -> str:
    return f"{isvc}-model-download"
