"""Pure builders: ``spec.model`` -> how a server (or router) pod gets its model.

``model_plan(spec, image_settings, tokenizer_only)`` says, for each form of ``spec.model.source``
(``pdserve.model_source``):

- ``builtin:<name>`` / an absolute path: ``--model`` is the source; a path on ``pvcName`` mounts
  that claim read-only at ``mountPath``;
- ``pvc://claim/path``: the claim mounted read-only at ``mountPath``; ``--model`` is
  ``<mountPath>/path``;
- ``hf://org/name[@rev]`` with ``spec.model.cache`` an emptyDir (the default; ``sizeLimit``): an init
  container ``fetch-model`` (the pod's image, ``pdserve fetch-model``) downloads the repository into
  ``/model-cache/org/name/rev`` on the volume ``model-cache``: one download per pod. The server mounts
  it read-only and gets ``--model`` that folder. HF_TOKEN (from ``spec.model.tokenSecret``) and
  HF_ENDPOINT (``spec.model.endpoint``) are in the init container's environment only. A failed
  download ends the init container with one line, which ``terminationMessagePolicy:
  FallbackToLogsOnError`` makes its termination message, which ``pod_problems.py`` reports as
  InitContainerFailed.
- ``hf://`` with ``spec.model.cache`` a claim (``pvcName``: the user's; ``size``: one the operator
  makes, ``cache_claim``): the model is fetched once, by the operator's download Job
  (model_cache.py), into the same folder on the claim; every pod mounts the claim read-only and its
  init container ``wait-model`` (``pdserve fetch-model --wait``: no token, no network) waits for
  the Job's completion marker.

A router only hashes prompts, and mounts no claim, so that it may run on any node (a ReadWriteOnce
claim would pin it to the pools' node): its plan (``tokenizer_only``) is, for hf:// on an emptyDir,
an init container that fetches the config and tokenizer files alone (``fetch-model --tokenizer-only``)
into its own emptyDir; for a model on a claim (pvc://, a path on ``pvcName``, hf:// on a claim cache),
nothing at all:
``model_arg`` is None and the router takes the files from a prefill at start (``pdserve router
--tokenizer-from-prefill``, ``pdserve.tokenizer_files``); builtin: and a path without a claim are
as for a server.

``served_model_name(spec)``: ``spec.model.servedModelName``, else the source's default name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve import model_source
from pdserve.operator import naming

CACHE_VOLUME = "model-cache"
CACHE_MOUNT = "/model-cache"
INIT_CONTAINER = "fetch-model"
WAIT_CONTAINER = "wait-model"  # with a claim cache: waits for the download Job (model_cache.py)
DEFAULT_TOKEN_KEY = "HF_TOKEN"  # the schema's default of spec.model.tokenSecret.key


@dataclass
class ModelPlan:
    """What a pod needs for its model: the ``--model`` argument (None: a router that takes its tokenizer
    from a prefill), volumes, the server container's mounts, init containers (empty unless the model is
    downloaded)."""

    model_arg: str | None
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)


def served_model_name(spec: dict) -> str:
    model = spec["model"]
    return model.get("servedModelName") or model_source.parse(model["source"]).default_served_name


def download_dir(source: model_source.ModelSource) -> str:
    """Where an hf:// source lands on the cache volume (one folder per repository and revision)."""
    return f"{CACHE_MOUNT}/{source.repo}/{source.revision}"


def cache_claim(model: dict, isvc_name: str) -> str | None:
    """The claim an hf:// model is fetched once into: ``spec.model.cache.pvcName`` (the user's), or with
    ``spec.model.cache.size`` the operator's own (naming.model_cache_claim); None: an emptyDir per pod."""
    cache = model.get("cache") or {}
    if not model["source"].startswith(model_source.HF_PREFIX):
        return None
    if cache.get("pvcName"):
        return cache["pvcName"]
    return naming.model_cache_claim(isvc_name) if cache.get("size") else None


def fetch_env(model: dict) -> list[dict]:
    """The environment of a container that downloads ``spec.model``: HOME and HF_HOME under /tmp, HF_ENDPOINT
    (``spec.model.endpoint``), HF_TOKEN (from ``spec.model.tokenSecret``)."""
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/huggingface"},
           {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if model.get("endpoint"):
        env.append({"name": "HF_ENDPOINT", "value": model["endpoint"]})
    secret = model.get("tokenSecret")
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key", DEFAULT_TOKEN_KEY)}}})
    return env


def _wait_container(spec: dict, source: model_source.ModelSource, security: dict, message_policy: str) -> dict:
    """With a claim cache: wait (read-only, no token) for the download Job's completion marker."""
    container = {
        "name": WAIT_CONTAINER,
        "image": spec["image"],
        "command": ["pdserve"],
        "args": ["fetch-model", source.text, "--dest", download_dir(source), "--wait"],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": True}],
        "securityContext": security,
        "terminationMessagePolicy": message_policy,
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def _fetch_container(spec: dict, source: model_source.ModelSource, security: dict, message_policy: str,
                     tokenizer_only: bool) -> dict:
    env = fetch_env(spec["model"])
    container = {
        "name": INIT_CONTAINER,
        "image": spec["image"],
        "command": ["pdserve"],
        "args": ["fetch-model", source.text, "--dest", download_dir(source),
                 *(["--tokenizer-only"] if tokenizer_only else [])],
        "env": env,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT}],
        "securityContext": security,
        "terminationMessagePolicy": message_policy,
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def model_plan(spec: dict, security: dict, message_policy: str, tokenizer_only: bool = False) -> ModelPlan:
    """How a pod of ``spec`` (a pool spec, or the router's shared spec with ``tokenizer_only``) gets its
    model. ``security`` and ``message_policy``: the securityContext and terminationMessagePolicy of the
    pod's containers."""
    model = spec["model"]
    source = model_source.parse(model["source"])
    mount_path = model.get("mountPath", "/models")
    if source.kind == "hf" and cache_claim(model, spec["inferenceService"]):
        if tokenizer_only:
            return ModelPlan(None)  # the router: no claim; its tokenizer files come from a prefill
        volume = {"name": CACHE_VOLUME, "persistentVolumeClaim": {
            "claimName": cache_claim(model, spec["inferenceService"]), "readOnly": True}}
        return ModelPlan(download_dir(source), [volume],
                         [{"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": True}],
                         [_wait_container(spec, source, security, message_policy)])
    if source.kind == "hf":
        cache = {} if tokenizer_only else (model.get("cache") or {})
        empty_dir = {"sizeLimit": str(cache["sizeLimit"])} if "sizeLimit" in cache else {}
        volume = {"name": CACHE_VOLUME, "emptyDir": empty_dir}
        return ModelPlan(download_dir(source), [volume],
                         [{"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": True}],
                         [_fetch_container(spec, source, security, message_policy, tokenizer_only)])
    claim = source.claim if source.kind == "pvc" else model.get("pvcName")
    if claim and tokenizer_only:
        return ModelPlan(None)  # the router: no claim; its tokenizer files come from a prefill
    plan = ModelPlan(f"{mount_path.rstrip('/')}/{source.path}" if source.kind == "pvc" else source.text)
    if claim:
        plan.volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        plan.mounts.append({"name": "model", "mountPath": mount_path, "readOnly": True})
    return plan
