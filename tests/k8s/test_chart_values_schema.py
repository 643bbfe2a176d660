"""charts/pdserve/values.schema.json: every value of values.yaml has a type; helm accepts the defaults
and refuses a wrong type, a bad enum or an unknown key, naming the value's path (in `helm lint`,
`helm template`, and so in install and upgrade). Needs only helm."""

import json

import pytest
import yaml

from harness.chart import CHART, helm, lint_error, render, render_error

pytestmark = pytest.mark.k8s
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def resolve(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].removeprefix("#/definitions/")]
    return node


def leaves(values: dict, path: tuple = ()):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*path, key))
        else:
            yield (*path, key), value


def schema_at(path: tuple) -> dict:
    node = SCHEMA
    for key in path:
        node = resolve(node)
        node = node.get("properties", {}).get(key) or node.get("additionalProperties")
        assert isinstance(node, dict), f"values.schema.json has nothing for {'.'.join(path)}"
    return resolve(node)


def test_every_value_in_values_yaml_has_a_type():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    json_types = {bool: {"boolean"}, int: {"integer", "number"}, str: {"string"}, list: {"array"}, dict: {"object"}}
    for path, value in leaves(values):
        types = schema_at(path).get("type")
        assert types, f"{'.'.join(path)} has no type in values.schema.json"
        assert json_types[type(value)] & ({types} if isinstance(types, str) else set(types)), (path, value, types)


def test_the_defaults_pass_lint_and_render():
    assert "0 chart(s) failed" in helm("lint", "--strict", str(CHART))
    assert render()


@pytest.mark.parametrize("value,path,complaint", [
    ("operator.replicas=two", "/operator/replicas", "want integer"),
    ("networkPolicy.enabled=yes", "/networkPolicy/enabled", "want boolean"),
    ("operator.livenessPort=70000", "/operator/livenessPort", "maximum"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy", "IfNotPresent"),
    ("dashboards.labels.grafana_dashboard=1", "/dashboards/labels/grafana_dashboard", "want string"),
    ("operator.watchNamespaces={Team_A}", "/operator/watchNamespaces/0", "does not match pattern"),
    ("serviceMonitor.interval=often", "/serviceMonitor/interval", "does not match pattern"),
    ("operator.replica=2", "/operator", "'replica' not allowed"),  # a misspelt key is not silently ignored
    ("crds.install=no", "/crds/install", "want boolean"),
    ("test.timeoutSeconds=0", "/test/timeoutSeconds", "exclusiveMinimum"),
])
def test_a_bad_value_is_refused_naming_it(value, path, complaint):
    for refused in (render_error(value), lint_error(value)):
        line = next((ln for ln in refused.splitlines() if f"'{path}'" in ln), None)
        assert line is not None and complaint in line, refused
