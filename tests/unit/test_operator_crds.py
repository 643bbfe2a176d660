"""The CRD schema: one source (operator/crds.py), committed YAML equal to it, structural and sensible."""

from pathlib import Path

import yaml

from pdserve import defaults
from pdserve.operator import crds

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdserve"
REGENERATE = "run: .venv/bin/python -m pdserve.operator.crds charts/pdserve"


def committed_crd_files() -> list[Path]:
    return sorted(p for folder in (crds.TEMPLATED_DIR, crds.PLAIN_DIR) for p in (CHART / folder).glob("*.yaml"))


def test_committed_crds_equal_the_generated_ones():
    generated = crds.chart_files()
    committed = {p.relative_to(CHART).as_posix() for p in committed_crd_files()}
    assert committed == set(generated), REGENERATE
    for relative, text in generated.items():
        assert (CHART / relative).read_text() == text, f"{relative} is stale: {REGENERATE}"


def test_pdserve_crds_are_templates_kept_on_uninstall_and_kopfs_stay_in_crds_folder():
    """charts/pdserve/README.md: `helm upgrade` updates the pdserve.io CRDs; kopf's peering CRDs are
    in Helm's crds/ folder, installed before the peering object the chart makes of them."""
    for name, crd in crds.all_crds().items():
        folder, held = crds.chart_crd(crd)
        if crd["spec"]["group"] == "pdserve.io":
            assert folder == "files/crds" and held["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            assert held["spec"] == crd["spec"]  # the schema is the generated one, untouched
            assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})  # all_crds() unchanged
        else:
            assert folder == "crds" and held is crd, name


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schemas_are_structural():
    """Every node has a type (or is int-or-string / preserves unknown fields): the API server requires it."""
    for crd in crds.all_crds().values():
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in _walk(schema):
            assert "type" in node or node.get("x-kubernetes-int-or-string"), \
                f"{crd['metadata']['name']}{path} has no type"


def test_defaults_come_from_the_shared_facts():
    spec = crds.inferenceservice_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["transfer"]["properties"]["blockSize"]["default"] == defaults.BLOCK_SIZE
    assert spec["required"] == ["model", "decode"]


def test_names_subresources_and_columns():
    short = set()
    for crd in [crds.inferenceservice_crd(), crds.prefillpool_crd(), crds.decodepool_crd()]:
        names = crd["spec"]["names"]
        short.update(names["shortNames"])
        version = crd["spec"]["versions"][0]
        assert "status" in version["subresources"]
        columns = {c["name"] for c in version["additionalPrinterColumns"]}
        assert {"Ready", "Age"} <= columns
    assert short == {"pdis", "pdpp", "pddp"}
    isvc_columns = {c["name"] for c in crds.inferenceservice_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert {"Prefill", "Decode", "Endpoint"} <= isvc_columns
    for crd in [crds.prefillpool_crd(), crds.decodepool_crd()]:
        assert crd["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def test_committed_yaml_has_no_aliases():
    for path in committed_crd_files():
        text = path.read_text()
        assert "&id" not in text and "*id" not in text
        assert yaml.safe_load(text)["kind"] == "CustomResourceDefinition"


def test_crd_backends_are_the_cachestore_transports():
    # The operator may not import the cachestore (it runs no transport); its schema's enum is
    # checked against the one list instead.
    from pdserve.cachestore import TRANSPORTS
    from pdserve.operator.crds import BACKENDS

    assert tuple(BACKENDS) == tuple(TRANSPORTS)
