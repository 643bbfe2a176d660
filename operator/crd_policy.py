"""The policy layer's part of the InferenceService schema: SLO classes (``spec.slo``), the
router (``spec.router``) and the planner (``spec.autoscaling``). Pure data, assembled by
``crds.py``; the limits of SLO classes come from ``pdserve.slo.classes`` (one place)."""

from __future__ import annotations

from pdserve.slo import classes as slo_classes
from pdserve.slo.policies import POLICIES

from pdserve.operator import crd_pod
from pdserve.operator.crd_schema import (DEFAULT_REPLICAS, DEFAULT_TBT_MS, DEFAULT_TTFT_MS, MAX_LOAD_WEIGHT,
                                         MAX_REPLICAS, NODE_SELECTOR, RESOURCES, TOLERATIONS, _int, _obj, _rule, _str)


def _slo_targets(default_ttft: int | None = None, default_tbt: int | None = None) -> dict:
    return {
        "ttftMs": _int("Time-to-first-token target in milliseconds.", 1, 600_000, default_ttft),
        "tbtMs": _int("Target of a request's mean time between tokens, in milliseconds.", 1, 60_000, default_tbt),
        "e2eMs": _int("End-to-end target (arrival to last token) in milliseconds.", 1, slo_classes.MAX_TARGET_MS),
        "earlyReject": {"type": "boolean", "default": False,
                        "description": "Refuse a request at once (429 with Retry-After and the estimate) when the "
                                       "estimate says its targets cannot be met even if it were served next; batch "
                                       "classes usually queue instead."},
    }


SLO_CLASS = _obj(
    {"name": _str("Class name: the X-SLO-Class header's value and the slo_class metric label.",
                  pattern=slo_classes.NAME_PATTERN, maxLength=63),
     **_slo_targets(),
     "priority": _int("The vLLM request field 'priority' value that selects this class (0, when no class "
                      "declares it, selects defaultClass).", -1_000_000, 1_000_000)},
    required=["name"],
)

SLO = _obj(
    {
        **_slo_targets(DEFAULT_TTFT_MS, DEFAULT_TBT_MS),
        "defaultClass": _str("The class of requests that name none: 'default' (this object's own targets) or "
                             "one of classes.", pattern=slo_classes.NAME_PATTERN, maxLength=63,
                             default=slo_classes.DEFAULT_CLASS),
        "classes": {
            "type": "array",
            "description": "Named SLO classes besides 'default' (e.g. interactive, batch); a request picks one with "
                           "the header X-SLO-Class or the body field priority.",
            "maxItems": slo_classes.MAX_CLASSES,
            "items": SLO_CLASS,
            "x-kubernetes-validations": [
                _rule("self.all(c, self.exists_one(d, d.name == c.name))", "spec.slo.classes names must be unique"),
                _rule("self.all(c, c.name != 'default')",
                      "spec.slo.classes must not declare 'default': it is the class of spec.slo's own targets"),
                _rule("self.all(c, !has(c.priority) || self.exists_one(d, has(d.priority) && "
                      "d.priority == c.priority))", "spec.slo.classes priorities must be unique"),
            ],
        },
        "queuePolicy": {"type": "string", "enum": list(POLICIES),
                        "description": "The order in which requests that must wait (every decode full, or with edf "
                                       "and qlm a step's budget of prompts queued in the prefill's engine) are "
                                       "served (`--queue-policy` of the "
                                       "prefills, and of the router with named classes): fifo (arrival), edf (earliest "
                                       "deadline first) or qlm (QLM's scheduler: the most requests meeting their "
                                       "targets). Unset: fifo."},
    },
    description="Latency targets (SLOs): the class 'default' from ttftMs/tbtMs/e2eMs, plus named classes. Passed "
                "to prefill pods as PDSERVE_SLO_CLASSES; their queue orders, rejects and reports by class.",
    default={},
    **{"x-kubernetes-validations": [
        _rule("!has(self.defaultClass) || self.defaultClass == 'default' || "
              "(has(self.classes) && self.classes.exists(c, c.name == self.defaultClass))",
              "spec.slo.defaultClass must be 'default' or the name of one of spec.slo.classes",
              fieldPath=".defaultClass"),
    ]},
)

ROUTER = _obj(
    {
        "replicas": _int("Router pods: the front door, each request to the prefill holding most of its prompt's KV "
                         "(0: no router, the prefill Service is the front door). Replicas decide alike from the same "
                         "KV events, so any number may run.", 0, MAX_REPLICAS, DEFAULT_REPLICAS),
        "resources": RESOURCES,
        "nodeSelector": NODE_SELECTOR,
        "tolerations": TOLERATIONS,
        "loadWeight": {"type": "number", "minimum": 0, "maximum": MAX_LOAD_WEIGHT,
                       "description": "Prompt tokens one request in flight on a prefill is worth when weighing load "
                                      "against its cached prefix (`pdserve router --load-weight`; default: the "
                                      "router's)."},
        **crd_pod.POD_SETTINGS,
        "disruptionBudget": crd_pod.DISRUPTION_BUDGET,
        "rollout": crd_pod.ROLLOUT,
    },
    description="The KV-aware router in front of the prefill pool (pdserve router).",
    default={},
)

def _autoscaling_bounds(pool: str, default_max: int) -> dict:
    return _obj(
        {"minReplicas": _int(f"Fewest {pool} pods the planner keeps.", 1, MAX_REPLICAS, 1),
         "maxReplicas": _int(f"Most {pool} pods the planner runs.", 1, MAX_REPLICAS, default_max)},
        description=f"Bounds of the {pool} pool{' (each decode pool)' if pool == 'decode' else ''}.",
        default={"minReplicas": 1, "maxReplicas": default_max},
        **{"x-kubernetes-validations": [_rule("self.minReplicas <= self.maxReplicas",
                                              f"spec.autoscaling.{pool}.minReplicas must be <= maxReplicas")]},
    )


AUTOSCALING = _obj(
    {
        "enabled": {"type": "boolean", "default": False,
                    "description": "Let the operator's planner set the pools' replicas (through their scale "
                                   "subresource) to meet spec.slo. Off: replicas are yours (kubectl scale, the spec)."},
        "prefill": _autoscaling_bounds("prefill", 4),
        "decode": _autoscaling_bounds("decode", 4),
        "intervalSeconds": _int("Seconds between two decisions.", 1, 3600, 15),
        "windowSeconds": _int("Seconds of metrics one decision looks at.", 5, 3600, 60),
        "scaleDownStabilizationSeconds": _int("A pool shrinks only to the highest need of this many seconds.",
                                              0, 86400, 300),
        "cooldownSeconds": _int("Seconds after a change of a pool before it may shrink.", 0, 86400, 60),
    },
    description="The SLO planner (pdserve.planner): scale up fast on bursts, down slowly, one drained pod at a time.",
    default={},
)
