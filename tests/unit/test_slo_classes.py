"""SLO classes (pdserve.slo.classes): spec.slo in its old and new form, selection of a request's
class by header and by vLLM's priority, and the errors that name the known classes."""

import json

import pytest

from pdserve.defaults import ENV_SLO_CLASSES
from pdserve.slo import classes as sc

NEW = {"ttftMs": 1000, "tbtMs": 100, "defaultClass": "interactive",
       "classes": [{"name": "interactive", "ttftMs": 2000, "e2eMs": 20000, "earlyReject": True, "priority": -1},
                   {"name": "batch", "e2eMs": 3600000, "priority": 5}]}


def test_the_old_two_fields_are_the_default_class():
    c = sc.parse({"ttftMs": 1000, "tbtMs": 100})
    assert c.names() == ["default"]
    d = c.select()
    assert (d.name, d.ttft_ms, d.tbt_ms, d.e2e_ms, d.early_reject) == ("default", 1000, 100, None, False)
    assert d.targets == ("ttft", "tbt")


def test_no_configuration_is_one_best_effort_class():
    c = sc.parse(None)
    assert c.select().name == "default" and c.select().targets == ()
    assert c.select().deadline(5.0) == float("inf")


def test_named_classes_and_the_default_class():
    c = sc.parse(NEW)
    assert c.names() == ["default", "interactive", "batch"]
    assert c.select().name == "interactive"  # defaultClass
    assert c.select(header="batch").name == "batch"
    assert c.select(header=" default ").name == "default"
    assert c.select(priority=5).name == "batch"
    assert c.select(priority=-1).name == "interactive"
    assert c.select(priority=0).name == "interactive"  # 0 (vLLM's default priority) = the default class
    assert c.select(header="batch", priority=5).name == "batch"
    assert c.by_name["interactive"].early_reject and not c.by_name["batch"].early_reject


def test_a_class_may_claim_priority_zero():
    c = sc.parse({"classes": [{"name": "low", "e2eMs": 10, "priority": 0}]})
    assert c.select(priority=0).name == "low" and c.select().name == "default"


@pytest.mark.parametrize("header, priority, words", [
    ("gold", None, ["unknown SLO class 'gold'", "X-SLO-Class", "default", "interactive (priority -1, 0)",
                    "batch (priority 5)"]),
    (None, 3, ["no SLO class answers priority 3", "interactive", "batch"]),
    (None, "high", ["priority must be an integer"]),
    (None, True, ["priority must be an integer"]),
    ("batch", -1, ["says 'batch' but priority -1 selects 'interactive'"]),
])
def test_an_unknown_class_names_the_known_ones(header, priority, words):
    c = sc.parse(NEW)
    with pytest.raises(ValueError) as err:
        c.select(header=header, priority=priority)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("obj, words", [
    ({"ttftMs": 0}, "slo.ttftMs must be an integer number of milliseconds"),
    ({"ttftMs": "fast"}, "slo.ttftMs"),
    ({"tbtMS": 5}, "unknown field(s) ['tbtMS']"),
    ({"earlyReject": "yes"}, "slo.earlyReject must be true or false"),
    ({"classes": {"name": "x"}}, "slo.classes must be a list"),
    ({"classes": [{"name": "a b"}]}, "slo.classes[0].name"),
    ({"classes": [{"name": "default"}]}, "'default' is the class of slo's own"),
    ({"classes": [{"name": "a"}, {"name": "a"}]}, "'a' is declared twice"),
    ({"classes": [{"name": "a", "e2eMs": -5}]}, "slo.classes[0].e2eMs"),
    ({"classes": [{"name": "a", "priority": 1}, {"name": "b", "priority": 1}]}, "both declare priority 1"),
    ({"defaultClass": "gold"}, "defaultClass 'gold' is not a declared class"),
    ([{"name": "a"}], "must be a JSON object like spec.slo"),
])
def test_bad_configurations_name_the_field(obj, words):
    with pytest.raises(ValueError) as err:
        sc.parse(obj)
    assert words in str(err.value)


def test_load_from_the_flag_a_file_or_the_operators_variable(tmp_path):
    env = {ENV_SLO_CLASSES: json.dumps({"ttftMs": 300})}
    assert sc.load(None, env).select().ttft_ms == 300
    assert sc.load(json.dumps(NEW), env).select().name == "interactive"  # the flag wins
    path = tmp_path / "slo.json"
    path.write_text(json.dumps(NEW))
    assert sc.load(str(path), {}).names() == ["default", "interactive", "batch"]
    assert sc.load(None, {}).select().targets == ()
    with pytest.raises(ValueError, match="not JSON and not a readable file"):
        sc.load(str(tmp_path / "missing.json"), {})
    with pytest.raises(ValueError, match=f"{ENV_SLO_CLASSES}: invalid JSON"):
        sc.load(None, {ENV_SLO_CLASSES: "{nope"})
    with pytest.raises(ValueError, match="--slo-classes: slo.ttftMs"):
        sc.load('{"ttftMs": -1}', {})


def test_the_verdict_of_a_finished_request():
    c = sc.SloClass("x", ttft_ms=500, tbt_ms=50, e2e_ms=2000)
    assert c.verdict(0.4, 1.9, 31) == {"ttft": True, "tbt": True, "e2e": True}  # (1.9-0.4)/30 = 50 ms
    assert c.verdict(0.6, 2.1, 2) == {"ttft": False, "tbt": False, "e2e": False}
    assert c.verdict(0.1, 0.1, 1) == {"ttft": True, "tbt": True, "e2e": True}  # one token: no gap
    assert sc.SloClass("y", e2e_ms=1000).verdict(None, 0.5, 0) == {"e2e": True}
    assert c.deadline(10.0) == pytest.approx(10.5) and sc.SloClass("b", e2e_ms=3000).deadline(1.0) == 4.0
