"""The chart's CRDs (charts/pdserve/README.md, "CRDs"): the pdserve.io ones are templates, so `helm upgrade`
changes their schemas on the API server; `helm.sh/resource-policy: keep` leaves them, and the users'
InferenceServices, in place when the release stops rendering them or is uninstalled; kopf's peering
CRDs are in Helm's crds/ folder. Rendering needs only helm; the rest runs on the real control plane."""

import json
import shutil

import pytest
import yaml

from harness.chart import CHART, by_kind, render
from harness.operator_harness import CRD_NAMES, RELEASE, RELEASE_NAMESPACE, get_json, install_chart
from harness.procs import REPO
from pdserve.operator import crds

pytestmark = pytest.mark.k8s
EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
PROBE = "upgradeProbe"  # the field the upgraded chart's InferenceService schema adds


def test_the_chart_renders_the_generated_pdserve_crds_unless_told_not_to():
    rendered = {c["metadata"]["name"]: c for c in by_kind(render(), "CustomResourceDefinition")}
    templated = {}
    for name, crd in crds.all_crds().items():
        folder, held = crds.chart_crd(crd)
        if folder == crds.TEMPLATED_DIR:
            templated[crd["metadata"]["name"]] = held
        else:  # kopf's: in Helm's crds/ folder, which `helm template` leaves out
            assert (CHART / folder / name).is_file()
    assert sorted(templated) == sorted(CRD_NAMES)
    assert rendered == templated
    assert all(c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for c in rendered.values())
    assert not by_kind(render("crds.install=false"), "CustomResourceDefinition")


def isvc_properties(kube) -> dict:
    crd = get_json(kube, "crd", "inferenceservices.pdserve.io")
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def dry_run_with_probe(kube, ns: str):
    """The example with spec.upgradeProbe through a server-side dry run with strict field validation: the
    API server refuses it while the schema it applies lacks the field, and takes it once that has it."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"][PROBE] = "x"
    return kube.kubectl("apply", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-", input=json.dumps(doc),
                        check=False)


def test_helm_upgrade_changes_a_crds_schema(kube, ns, tmp_path):
    install_chart(kube)
    assert PROBE not in isvc_properties(kube)
    refused = dry_run_with_probe(kube, ns)
    assert refused.returncode != 0 and f'unknown field "spec.{PROBE}"' in refused.stderr, refused.stderr

    # The next chart version: the same chart with one more field in the InferenceService schema.
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart)
    path = chart / crds.TEMPLATED_DIR / "inferenceservices.yaml"
    crd = yaml.safe_load(path.read_text())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][PROBE] = {
        "type": "string", "description": "Only in the upgraded chart of this test."}
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    try:
        kube.helm("upgrade", RELEASE, str(chart), "-n", RELEASE_NAMESPACE)
        assert isvc_properties(kube)[PROBE]["type"] == "string"

        def taken():
            proc = dry_run_with_probe(kube, ns)
            return proc if proc.returncode == 0 else None
        accepted = kube.wait_until(taken, timeout=30, what=f"the API server to take spec.{PROBE} (the new schema)")
        assert json.loads(accepted.stdout)["spec"][PROBE] == "x"
    finally:
        install_chart(kube)  # the repository's chart again: the field goes away the same way
    assert PROBE not in isvc_properties(kube)


def test_crds_and_inference_services_outlive_the_release(kube, ns):
    install_chart(kube)
    kube.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    try:
        # No longer rendered: Helm drops them from the release but deletes nothing (keep).
        kube.helm("upgrade", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--set", "crds.install=false")
        assert all(get_json(kube, "crd", name) is not None for name in CRD_NAMES)
        install_chart(kube)  # rendered again: the same release takes them back
        kube.helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE)
        for name in CRD_NAMES:
            crd = get_json(kube, "crd", name)
            assert crd is not None and crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", name
        assert get_json(kube, "inferenceservice", "chat", "-n", ns) is not None
    finally:
        install_chart(kube)  # a new install of the same release adopts the kept CRDs
    assert get_json(kube, "inferenceservice", "chat", "-n", ns) is not None
