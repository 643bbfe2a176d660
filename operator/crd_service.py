"""The InferenceService's service-wide sections of the CRD schema (pure data): ``MODEL`` (where the
model comes from and its download cache), ``TRANSFER`` (how prefill pushes KV), ``ROUTING`` (how a
prefill picks a decode, and where each prompt is computed), ``AUTH`` (API keys), ``BATCH_STORAGE``
(where the Batch API's database lives), and the image fields. ``crds.py`` assembles them with the
pools' sections (``crd_pod.py``, ``crd_parallel.py``) and the policy layer's (``crd_policy.py``).
"""

from __future__ import annotations

from pdserve import defaults, model_source
from pdserve.operator import naming
from pdserve.operator.crd_schema import (
    BACKENDS, DEFAULT_BACKEND, DEFAULT_MOUNT_PATH, DEFAULT_POLICY, MAX_BLOCK_SIZE, POLICIES, RESOURCES, _int, _obj,
    _rule, _str)

_QUANTITY = RESOURCES["properties"]["limits"]["additionalProperties"]
_HF_ONLY = "self.source.startsWith('hf://')"

MODEL = _obj(
    {
        "source": _str("Where the model comes from: 'builtin:<name>' (e.g. builtin:tiny); an absolute path to a "
                       "Hugging Face safetensors checkpoint (on pvcName, or a volume of the pod settings); "
                       "'hf://org/name[@revision]': downloaded from the Hugging Face Hub into spec.model.cache (an "
                       "emptyDir: by each pod; a claim: once, by a Job); 'pvc://claim/path/inside': the claim "
                       "mounted read-only.",
                       minLength=1, maxLength=1024),
        "pvcName": _str("A PersistentVolumeClaim holding the model, mounted read-only at mountPath (with an "
                        "absolute-path source).", minLength=1, maxLength=253),
        "mountPath": _str("Where pvcName, or the claim of a pvc:// source, is mounted.", pattern="^/",
                          default=DEFAULT_MOUNT_PATH, maxLength=512),
        "servedModelName": _str("The name clients put in \"model\" (and /v1/models lists). Default: the "
                                "repository's name for hf:// (hf://Qwen/Qwen2.5-0.5B-Instruct "
                                "-> Qwen2.5-0.5B-Instruct), the last element of a path, the name of builtin:<name>.",
                                minLength=1, maxLength=256, pattern="^[^ ]+$"),
        "tokenSecret": _obj(
            {"name": _str("The Secret (in the service's namespace).", minLength=1, maxLength=253),
             "key": _str("The key holding the token.", minLength=1, maxLength=253, default="HF_TOKEN")},
            required=["name"],
            description="hf:// only: a Secret with a Hugging Face token, for gated or private repositories. Only the "
                        "init container that downloads sees it (as HF_TOKEN).",
        ),
        "endpoint": _str("hf:// only: the Hub to download from (HF_ENDPOINT), e.g. a mirror. Default "
                         "https://huggingface.co.", pattern="^https?://[^ ]+$", maxLength=512),
        "cache": _obj(
            {"sizeLimit": {**_QUANTITY, "description": "Size limit of the emptyDir each pod downloads the model "
                                                      "into (one download per pod)."},
             "pvcName": _str("A PersistentVolumeClaim of yours the model is downloaded into once, by the operator's "
                             "download Job; the pods mount it read-only and wait for the Job. ReadWriteMany when the "
                             "pods run on more than one node.", minLength=1, maxLength=253),
             "size": {**_QUANTITY, "description": "The operator makes a PersistentVolumeClaim <name>-model-cache of "
                                                 "this size (owned by the InferenceService: deleted with it), "
                                                 "downloads the model into it once with a Job, and the pods mount it "
                                                 "read-only. At least the model's size."},
             "storageClassName": _str("With size: the claim's StorageClass (default: the cluster's default "
                                      "class).", minLength=1, maxLength=253),
             "accessMode": _str("With size: the claim's access mode. ReadWriteOnce (one node at a time) serves "
                                "every pod when they all run on one node; across nodes use ReadWriteMany. Default "
                                "ReadWriteOnce.", enum=["ReadWriteOnce", "ReadWriteMany"])},
            description="hf:// only: where the model is downloaded. Default: an emptyDir per pod (one download per "
                        "pod). With pvcName or size: once per InferenceService, into a claim (status.model shows "
                        "the download).",
            **{"x-kubernetes-validations": [
                _rule("[has(self.sizeLimit), has(self.pvcName), has(self.size)].filter(x, x).size() <= 1",
                      "spec.model.cache: set one of sizeLimit (an emptyDir per pod), pvcName (your claim) or size "
                      "(a claim the operator makes)"),
                _rule("has(self.size) || !(has(self.storageClassName) || has(self.accessMode))",
                      "spec.model.cache: storageClassName and accessMode are only for a claim the operator makes "
                      "(size)")]},
        ),
    },
    required=["source"],
    description="The model both pools serve.",
    **{"x-kubernetes-validations": [
        _rule("self.source.startsWith('builtin:') || self.source.startsWith('/') || "
              f"self.source.matches('{model_source.HF_PATTERN}') || self.source.matches('{model_source.PVC_PATTERN}')",
              f"spec.model.source must be {model_source.FORMS}", fieldPath=".source"),
        _rule("!self.source.startsWith('pvc://') || !(self.source.endsWith('/..') || self.source.contains('/../'))",
              "spec.model.source: the path inside a pvc:// claim must not contain '..'", fieldPath=".source"),
        _rule("!has(self.pvcName) || self.source.startsWith(self.mountPath + '/')",
              "spec.model.source must be a path under spec.model.mountPath when spec.model.pvcName is set",
              fieldPath=".source"),
        _rule(f"!has(self.tokenSecret) || {_HF_ONLY}",
              "spec.model.tokenSecret is only for an hf:// spec.model.source", fieldPath=".tokenSecret"),
        _rule(f"!has(self.cache) || {_HF_ONLY}",
              "spec.model.cache is only for an hf:// spec.model.source", fieldPath=".cache"),
        _rule(f"!has(self.endpoint) || {_HF_ONLY}",
              "spec.model.endpoint is only for an hf:// spec.model.source", fieldPath=".endpoint"),
    ]},
)

TRANSFER = _obj(
    {
        "backend": _str("KV transfer backend: tcp (framed sockets) or nixl (UCX).", enum=BACKENDS,
                        default=DEFAULT_BACKEND),
        "blockSize": _int("KV cache block size in tokens.", 1, MAX_BLOCK_SIZE, defaults.BLOCK_SIZE),
    },
    description="How prefill pushes the KV cache to decode.",
    default={},
)

ROUTING = _obj(
    {"policy": _str("wrr: weighted round robin on free KV memory; rr: plain round robin.", enum=POLICIES,
                    default=DEFAULT_POLICY),
     "disaggregation": _str("Where each prompt is computed (`--disaggregation` of the prefills): always (on a "
                            "prefill, its KV moved to the decode), auto (per request, by a cost model of the "
                            "prefill's measured speed and queue, the link, and the decode's cached prefix and load: "
                            "e.g. a later turn whose history the decode holds may be computed there while the "
                            "prefill is busy) or never (on the decode). Unset: always.",
                            enum=list(defaults.DISAGGREGATION_MODES))},
    description="How prefill picks a decode, and where each prompt is computed.",
    default={},
)

AUTH = _obj(
    {"apiKeySecret": _str("A Secret in the service's namespace holding the API keys: one key a line, or name:key (the "
                          "name is what the metrics count requests under; blank lines and # comments ignored). "
                          "Clients send a key as 'Authorization: Bearer <key>' (the OpenAI client's api_key).",
                          minLength=1, maxLength=253, pattern=naming.DNS_SUBDOMAIN),
     "key": _str("The Secret's key that holds the key file.", minLength=1, maxLength=253,
                 pattern=r"^[-._a-zA-Z0-9]+$", default=defaults.API_KEYS_SECRET_KEY)},
    required=["apiKeySecret"],
    description="API keys at the OpenAI doors: the router and the prefills (with their Batch API) answer 401 to a "
                "request without one of the keys, on every route but /health, /ready and /metrics. The operator "
                "mounts the Secret read-only and passes it as --api-key-file; pods read it at start (restart them "
                "after changing the Secret). Unset: no keys, the doors are open. docs/security.md says what the keys "
                "stop and what they do not.",
)

IMAGE = _str("Container image with the pdserve command (default: the operator's own image).", minLength=1,
             maxLength=512)
PULL_POLICY = _str("Image pull policy of the pods.", enum=["Always", "IfNotPresent", "Never"])
PROTOCOL = _str("Protocol version the image speaks (default: the operator's). Pods are labelled with it "
                "and prefill only routes to decodes of the same version.",
                pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

BATCH_STORAGE = _obj(
    {
        "pvcName": _str(f"A PersistentVolumeClaim for the database, mounted read-write at {defaults.BATCH_DATA_MOUNT} "
                        "(jobs then survive the pod). One prefill per database: with a ReadWriteOnce claim run one "
                        "prefill replica.", minLength=1, maxLength=253),
    },
    description="Where prefill pods keep the OpenAI Batch API's jobs and files (a SQLite database, docs/batch.md). "
                "Without pvcName: in the pod's emptyDir, which survives container restarts but not the pod.",
)
