"""The chart's tls values (mutual TLS between each InferenceService's pods, on by default): what the operator
is told (PDSERVE_TLS, which `pdserve operator --tls` reads) and the RBAC it gets for it, with and without
cert-manager's API in the cluster (helm's --api-versions stands for it). Needs only helm."""

import pytest
import yaml

from harness.chart import CHART, by_kind, helm

pytestmark = pytest.mark.k8s
CERT_MANAGER_API = "cert-manager.io/v1/Certificate"


def render(*sets: str, api_versions: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "rel", str(CHART), "-n", "pdserve-system"]
    for s in sets:
        args += ["--set", s]
    for v in api_versions:
        args += ["--api-versions", v]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


def tls_mode(docs: list[dict]) -> str:
    (deployment,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    return env["PDSERVE_TLS"]


def operator_rules(docs: list[dict]) -> list[dict]:
    (role,) = [r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "rel-pdserve-operator"]
    return role["rules"]


def granted(docs: list[dict], resource: str) -> set[str]:
    return {v for r in operator_rules(docs) if resource in r["resources"] for v in r["verbs"]}


def test_on_by_default_with_the_operators_own_cas_when_cert_manager_is_absent():
    docs = render()
    assert tls_mode(docs) == "self-signed"
    assert granted(docs, "secrets") == {"get", "create", "patch"}  # no list or watch: it reads its own by name
    assert granted(docs, "certificates") == set()


def test_cert_manager_when_its_api_is_installed_or_asked_for():
    for docs in (render(api_versions=(CERT_MANAGER_API,)), render("tls.issuer=cert-manager")):
        assert tls_mode(docs) == "cert-manager"
        assert granted(docs, "certificates") == granted(docs, "issuers") == {"get", "create", "patch"}
    docs = render("tls.issuer=operator", api_versions=(CERT_MANAGER_API,))
    assert tls_mode(docs) == "self-signed" and granted(docs, "certificates") == set()


def test_off_takes_the_secrets_away():
    docs = render("tls.enabled=false", api_versions=(CERT_MANAGER_API,))
    assert tls_mode(docs) == "off"
    assert granted(docs, "secrets") == granted(docs, "certificates") == set()


def test_the_cli_takes_every_mode_the_chart_renders():
    from pdserve.operator.config import TLS_MODES

    modes = {tls_mode(render(*sets, api_versions=apis)) for sets, apis in (
        ((), ()), (("tls.enabled=false",), ()), ((), (CERT_MANAGER_API,)))}
    assert modes == set(TLS_MODES)
