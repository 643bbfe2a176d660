"""What the operator is told at start-up (command line / environment), validated once."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.operator import naming

TLS_MODES = ("off", "self-signed", "cert-manager")


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Settings that shape the children the operator builds.

    default_image: the image pods run when an InferenceService names none (the chart
        passes the operator's own image, so operator and servers come from one release).
    cuda_image: the image prefill and decode pools that ask for an NVIDIA GPU
        (``pod_settings.uses_nvidia_gpu``) run when an InferenceService names none (the chart's
        image.cuda: `make image-cuda`); None: they run default_image too.
    protocol_version: the protocol version pods are labelled with when an
        InferenceService names none (this release's ``PROTOCOL_VERSION``).
    network_policy: whether each InferenceService gets NetworkPolicies that admit the
        decode Session and KV-transfer ports only from its own prefill pods.
    prometheus_url: where autoscaling (spec.autoscaling) queries the pools' metrics; without
        it the operator scrapes the ready pods' /metrics itself.
    tls: mutual TLS between every pod of an InferenceService (TLS_MODES): "off"; "self-signed": the operator
        makes each InferenceService its own CA and certificate (tls_issuer.py); "cert-manager": it asks
        cert-manager for them (Issuer and Certificate objects). Either way the pods mount ``<isvc>-tls``.
    image_pull_secrets: Secrets every pod the operator creates pulls its image with (the
        chart's imagePullSecrets), after the InferenceService's own spec.imagePullSecrets; each
        must exist in the InferenceService's namespace.
    """

    default_image: str
    protocol_version: str
    cuda_image: str | None = None
    network_policy: bool = False
    prometheus_url: str | None = None  # autoscaling reads metrics here (PromQL); None: the pods' own /metrics
    image_pull_secrets: tuple[str, ...] = ()
    tls: str = "off"

    def __post_init__(self) -> None:
        images = {"default image": self.default_image, "CUDA image": self.cuda_image}
        for what, image in images.items():
            if (image is not None or what == "default image") and (not image or any(c.isspace() for c in image)):
                raise ValueError(f"{what} {image!r} must be a non-empty image reference without spaces")
        naming.protocol_label(self.protocol_version)  # raises with a clear message
        if self.prometheus_url is not None and not self.prometheus_url.startswith(("http://", "https://")):
            raise ValueError(f"prometheus URL {self.prometheus_url!r} must start with http:// or https://")
        if self.tls not in TLS_MODES:
            raise ValueError(f"tls {self.tls!r} must be one of {', '.join(TLS_MODES)}")
        for secret in self.image_pull_secrets:
            if not naming.is_dns_subdomain(secret):
                raise ValueError(f"image pull secret {secret!r} is not a Secret name (a DNS subdomain)")
