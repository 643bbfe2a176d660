"""A thin JSON client for the few kinds the operator touches, over one kubernetes ApiClient.

Objects go in and come out as plain dicts (the builders' output), not generated model
classes. Writes use server-side apply with field manager ``pdserve-operator`` and
``force``: one idempotent create-or-patch that also removes fields the builders stopped
setting, and that a restart mid-reconcile can simply repeat.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from pdserve.operator import naming


@dataclass(frozen=True, slots=True)
class Kind:
    prefix: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str


KINDS: dict[str, Kind] = {
    "InferenceService": Kind(f"/apis/{naming.API_VERSION}", "inferenceservices"),
    "PrefillPool": Kind(f"/apis/{naming.API_VERSION}", "prefillpools"),
    "DecodePool": Kind(f"/apis/{naming.API_VERSION}", "decodepools"),
    "Deployment": Kind("/apis/apps/v1", "deployments"),
    "Service": Kind("/api/v1", "services"),
    "ServiceAccount": Kind("/api/v1", "serviceaccounts"),
    "Role": Kind("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Kind("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": Kind("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": Kind("/apis/policy/v1", "poddisruptionbudgets"),
    "Pod": Kind("/api/v1", "pods"),
    "Secret": Kind("/api/v1", "secrets"),  # mutual TLS: each InferenceService's CA and certificate (tls_issuer.py)
    "Issuer": Kind("/apis/cert-manager.io/v1", "issuers"),  # the same, from cert-manager
    "Certificate": Kind("/apis/cert-manager.io/v1", "certificates"),
    "Job": Kind("/apis/batch/v1", "jobs"),  # spec.model.cache on a claim: the download (model_cache.py)
    "PersistentVolumeClaim": Kind("/api/v1", "persistentvolumeclaims"),
}

TIMEOUT_S = 30  # per request: a hung API server call turns into a retry, not a stuck handler


def make_api_client(kubeconfig: str | None = None, pool_size: int = 32) -> ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (or $KUBECONFIG).

    pool_size: HTTP connections kept open; match the handler thread count, or connections
    are opened and discarded under load.
    """
    from kubernetes import client, config

    cfg = client.Configuration()
    loaded = False
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            loaded = True
        except config.ConfigException:
            pass
    if not loaded:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = pool_size
    return ApiClient(cfg)


class KubeApi:
    """get / list / apply / patch / scale / delete / patch_status on the kinds in KINDS; errors are ApiException."""

    def __init__(self, client: ApiClient):
        self.client = client

    def _path(self, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        k = KINDS[kind]
        path = f"{k.prefix}/namespaces/{namespace}/{k.plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def _request(self, method: str, path: str, body: object = None, query: list[tuple[str, str]] | None = None,
                 content_type: str = "application/json") -> dict:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.client.param_serialize(method, path, query_params=query or [], header_params=headers, body=body,
                                              auth_settings=["BearerToken"])
        response = self.client.call_api(*request, _request_timeout=TIMEOUT_S)
        data = response.read()
        text = data.decode("utf-8") if data else ""
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=text, data=None)
        return json.loads(text) if text else {}

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return self._request("GET", self._path(kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: dict[str, str] | None = None) -> list[dict]:
        query = [("labelSelector", naming.label_selector(selector))] if selector else []
        return self._request("GET", self._path(kind, namespace), query=query).get("items", [])

    def apply(self, obj: dict) -> dict:
        """Server-side apply of a whole object (create or patch); returns the object as stored."""
        meta = obj["metadata"]
        return self._request("PATCH", self._path(obj["kind"], meta["namespace"], meta["name"]), body=obj,
                             query=[("fieldManager", naming.MANAGER), ("force", "true")],
                             content_type="application/apply-patch+yaml")

    def patch_status(self, kind: str, namespace: str, name: str, status: dict) -> dict:
        """Merge-patch the status subresource."""
        return self._request("PATCH", self._path(kind, namespace, name, "status"), body={"status": status},
                             content_type="application/merge-patch+json")

    def patch(self, kind: str, namespace: str, name: str, body: dict) -> dict:
        """Merge-patch an object (e.g. one annotation of a pod)."""
        return self._request("PATCH", self._path(kind, namespace, name), body=body,
                             content_type="application/merge-patch+json")

    def scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict:
        """Set replicas through the scale subresource (what `kubectl scale` and the HPA write)."""
        return self._request("PATCH", self._path(kind, namespace, name, "scale"), body={"spec": {"replicas": replicas}},
                             content_type="application/merge-patch+json")

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (the garbage collector removes what it owned); False if absent."""
        try:
            self._request("DELETE", self._path(kind, namespace, name),
                          body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise
