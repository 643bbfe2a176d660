"""Where a model comes from: ``spec.model.source`` (and ``pdserve fetch-model``'s argument), parsed.

Four forms, each with the name clients put in "model" when ``servedModelName`` is not set:

============================  ==================================  =========================
source                        what the pods do                    default served name
============================  ==================================  =========================
``builtin:tiny``              nothing: the engine builds it       ``tiny``
``/models/qwen``              read it (a volume the user mounts)  ``qwen``
``hf://Qwen/Qwen2.5-0.5B``    an init container downloads it      ``Qwen2.5-0.5B``
``hf://org/name@v1.0``        ... at a branch, tag or commit      ``name``
``pvc://weights/qwen/v1``     mount claim ``weights`` read-only   ``v1``
============================  ==================================  =========================

Pure parsing, no I/O: the operator builds pods from it and ``pdserve.model_fetch`` downloads
with it. ``HF_PATTERN`` and ``PVC_PATTERN`` are the same rules the CRD's schema checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BUILTIN_PREFIX = "builtin:"
HF_PREFIX = "hf://"
PVC_PREFIX = "pvc://"
DEFAULT_REVISION = "main"

# org/name as the Hub spells them; a revision is a branch, tag or commit (no '/', '@' or spaces).
# No backslashes: the CRD's CEL rules use these patterns as they are.
_HUB_NAME = "[A-Za-z0-9][-A-Za-z0-9_.]{0,95}"
HF_PATTERN = f"^hf://{_HUB_NAME}/{_HUB_NAME}(@[^/@ ]{{1,255}})?$"
# a claim name is a DNS subdomain; the path inside it is relative, without '..' segments
_CLAIM = "[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
PVC_PATTERN = f"^pvc://{_CLAIM}/[^ ]+$"
FORMS = "'builtin:<name>', an absolute path, 'hf://org/name[@revision]' or 'pvc://claim/path'"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """One parsed source. ``kind``: builtin, path, hf or pvc; the other fields as the kind has them."""

    kind: str
    text: str
    repo: str = ""  # hf: org/name
    revision: str = ""  # hf: a branch, tag or commit (default main)
    claim: str = ""  # pvc: the PersistentVolumeClaim
    path: str = ""  # path: the absolute path; pvc: the path inside the claim

    @property
    def default_served_name(self) -> str:
        if self.kind == "builtin":
            return self.text.removeprefix(BUILTIN_PREFIX)
        if self.kind == "hf":
            return self.repo.rsplit("/", 1)[1]
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def parse(text: str) -> ModelSource:
    """``text`` -> ModelSource; ValueError (naming the accepted forms) when it is none of them."""
    if text.startswith(BUILTIN_PREFIX) and len(text) > len(BUILTIN_PREFIX):
        return ModelSource("builtin", text)
    if text.startswith("/"):
        return ModelSource("path", text, path=text)
    if re.fullmatch(HF_PATTERN, text):
        repo, _, revision = text.removeprefix(HF_PREFIX).partition("@")
        return ModelSource("hf", text, repo=repo, revision=revision or DEFAULT_REVISION)
    if re.fullmatch(PVC_PATTERN, text):
        claim, _, path = text.removeprefix(PVC_PREFIX).partition("/")
        path = path.strip("/")
        if not path or ".." in path.split("/"):
            raise ValueError(f"model source {text!r}: the path inside the claim must be relative, without '..'")
        return ModelSource("pvc", text, claim=claim, path=path)
    raise ValueError(f"model source {text!r} is not {FORMS}")
