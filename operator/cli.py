"""Run the Kubernetes operator: InferenceService -> PrefillPool/DecodePools -> Deployments and Services.

Credentials: in a pod, its ServiceAccount; elsewhere --kubeconfig or $KUBECONFIG. Several
replicas may run at once with --peering NAME (kopf peering: the one with the highest
--priority works, the others wait); without it the operator runs standalone.
"""

from __future__ import annotations

import argparse
import os


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=None, metavar="NS",
                       help="watch only this namespace (repeatable; globs like 'team-*' work); "
                            "default: $PDSERVE_WATCH_NAMESPACE if set, else all namespaces")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (needs a ClusterRole)")
    parser.add_argument("--peering", metavar="NAME", default=os.environ.get("PDSERVE_PEERING") or None,
                        help="kopf peering object for high availability (KopfPeering when namespaced, "
                             "ClusterKopfPeering with --all-namespaces); default $PDSERVE_PEERING, else standalone")
    parser.add_argument("--priority", type=int, default=int(os.environ.get("PDSERVE_PEERING_PRIORITY", "0")),
                        help="peering priority: among peers, the highest works (default 0)")
    parser.add_argument("--default-image", default=os.environ.get("PDSERVE_IMAGE") or None,
                        help="image for InferenceServices that name none (default $PDSERVE_IMAGE; required "
                             "one way or the other)")
    parser.add_argument("--cuda-image", default=os.environ.get("PDSERVE_CUDA_IMAGE") or None,
                        help="image for the prefill and decode pools that ask for an NVIDIA GPU, when their "
                             "InferenceService names none (default $PDSERVE_CUDA_IMAGE; else --default-image)")
    parser.add_argument("--protocol-version", default=None,
                        help="protocol version for InferenceServices that name none (default: this release's)")
    parser.add_argument("--network-policy", action="store_true", default=_env_flag("PDSERVE_NETWORK_POLICY"),
                        help="give each InferenceService NetworkPolicies admitting decode Session/KV ports only "
                             "from its own prefill pods (default $PDSERVE_NETWORK_POLICY)")
    parser.add_argument("--tls", default=os.environ.get("PDSERVE_TLS") or "off", metavar="MODE",
                        help="mutual TLS between the pods of each InferenceService, each with a CA of its own: off, "
                             "self-signed (the operator makes the CA and certificate) or cert-manager (it asks "
                             "cert-manager for them); default $PDSERVE_TLS, else off (docs/security.md)")
    parser.add_argument("--prometheus-url", default=os.environ.get("PDSERVE_PROMETHEUS_URL") or None, metavar="URL",
                        help="autoscaling (spec.autoscaling) reads the pools' metrics from this Prometheus, e.g. "
                             "http://prometheus.monitoring:9090 (default $PDSERVE_PROMETHEUS_URL; else the operator "
                             "scrapes the ready pods' /metrics itself)")
    parser.add_argument("--image-pull-secret", action="append", default=None, metavar="NAME",
                        help="a Secret every pod the operator creates pulls its image with (repeatable; each "
                             "InferenceService's namespace must hold one of that name); default "
                             "$PDSERVE_IMAGE_PULL_SECRETS, comma-separated")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    parser.add_argument("--liveness", default=os.environ.get("PDSERVE_LIVENESS") or None, metavar="URL",
                        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def image_pull_secrets(args: argparse.Namespace) -> list[str]:
    """--image-pull-secret, else $PDSERVE_IMAGE_PULL_SECRETS (what the chart sets from its imagePullSecrets)."""
    if args.image_pull_secret is not None:
        return args.image_pull_secret
    return [s.strip() for s in os.environ.get("PDSERVE_IMAGE_PULL_SECRETS", "").split(",") if s.strip()]


def run(args: argparse.Namespace) -> int:
    import kopf

    from pdserve.operator import autoscaling, handlers  # noqa: F401 - importing registers the handlers
    from pdserve.operator.config import OperatorConfig
    from pdserve.operator.naming import default_protocol_version

    if not args.default_image:
        raise SystemExit("pdserve operator: --default-image (or $PDSERVE_IMAGE) is required: "
                         "the image pods run when an InferenceService names none")
    try:
        config = OperatorConfig(default_image=args.default_image, cuda_image=args.cuda_image,
                                protocol_version=args.protocol_version or default_protocol_version(),
                                network_policy=args.network_policy, prometheus_url=args.prometheus_url,
                                image_pull_secrets=tuple(image_pull_secrets(args)), tls=args.tls)
    except ValueError as e:
        raise SystemExit(f"pdserve operator: {e}") from None
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    namespaces = args.namespace
    if namespaces is None and not args.all_namespaces and os.environ.get("PDSERVE_WATCH_NAMESPACE"):
        namespaces = [os.environ["PDSERVE_WATCH_NAMESPACE"]]
    clusterwide = not namespaces
    kopf.configure(verbose=args.verbose)
    kopf.run(
        clusterwide=clusterwide,
        namespaces=namespaces or (),
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
        memo=handlers.new_memo(config, args.kubeconfig),
    )
    return 0
