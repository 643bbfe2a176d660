"""The status sections of the CRD schema (pure data): the conditions every object carries, the
InferenceService's status (its pools, the planner's last decisions, an hf:// model's download) and a
pool's status (with the scale subresource's fields). ``status.py`` writes what these describe.
"""

from __future__ import annotations

from pdserve.operator.crd_schema import _obj, _str

CONDITIONS = {
    "type": "array",
    "description": "Ready, Progressing and Degraded, each with a reason.",
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
    "items": _obj(
        {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
        required=["type", "status"],
    ),
}

POOL_STATUS_ITEM = _obj({
    "name": {"type": "string"},
    "replicas": {"type": "integer"},
    "readyReplicas": {"type": "integer"},
    "ready": {"type": "boolean"},
})

AUTOSCALING_STATUS = _obj(
    {
        "source": _str("Where the planner read its metrics: prometheus or pods."),
        "lastDecisionTime": {"type": "string", "format": "date-time"},
        "pools": {
            "type": "array",
            "description": "The last decision for each pool: desired vs current replicas, and why.",
            "items": _obj({
                "name": _str("The pool object (PrefillPool or DecodePool)."),
                "role": _str("prefill or decode."),
                "current": {"type": "integer"},
                "desired": {"type": "integer"},
                "ready": {"type": "integer"},
                "signal": _str("What drove the decision: kv, busy, queue, ttft, tbt, idle, steady, hold, bounds, ..."),
                "reason": _str("The planner's reason, in words."),
                "lastScaleTime": {"type": "string", "format": "date-time"},
                "lastScaleReason": {"type": "string"},
            }),
        },
    },
    description="What the planner decided last (spec.autoscaling.enabled).",
)

MODEL_STATUS = _obj(
    {
        "source": _str("spec.model.source being downloaded."),
        "claim": _str("The claim it is downloaded into."),
        "job": _str("The download Job."),
        "phase": _str("Pending, Downloading, Downloaded or Failed."),
        "reason": _str("Why (TokenRefused, RepoNotFound, ... when Failed)."),
        "message": _str("What the download says, in words."),
        "progress": _str("Share, bytes and files done."),
        "bytesDone": {"type": "integer", "format": "int64"},
        "bytesTotal": {"type": "integer", "format": "int64"},
        "filesDone": {"type": "integer"},
        "filesTotal": {"type": "integer"},
    },
    description="The download of an hf:// model into a claim (spec.model.cache pvcName or size).",
)

ISVC_STATUS = _obj(
    {
        "observedGeneration": {"type": "integer", "format": "int64"},
        "conditions": CONDITIONS,
        "endpoint": _str("The OpenAI-compatible HTTP endpoint: the router Service, or the prefill Service "
                         "when spec.router.replicas is 0."),
        "prefillReady": _str("Ready/desired prefill pods."),
        "routerReady": _str("Ready/desired router pods (absent without a router)."),
        "router": POOL_STATUS_ITEM,
        "decodeReady": _str("Ready/desired decode pods over all pools."),
        "protocolVersion": {"type": "string"},
        "prefill": POOL_STATUS_ITEM,
        "decode": {"type": "array", "items": POOL_STATUS_ITEM},
        "autoscaling": AUTOSCALING_STATUS,
        "model": MODEL_STATUS,
    },
    **{"x-kubernetes-preserve-unknown-fields": True},
)

POOL_STATUS = _obj(
    {
        "observedGeneration": {"type": "integer", "format": "int64"},
        "conditions": CONDITIONS,
        "replicas": {"type": "integer", "description": "Pods the Deployment has (scale subresource)."},
        "readyReplicas": {"type": "integer"},
        "updatedReplicas": {"type": "integer"},
        "selector": _str("Label selector of the pool's pods (scale subresource)."),
    },
    **{"x-kubernetes-preserve-unknown-fields": True},
)
