"""How far a download of ``pdserve fetch-model`` is, and where it says so: the operator's download Job.

When the operator fetches an hf:// model once for an InferenceService (``spec.model.cache`` on a
claim: operator/model_cache.py), its Job runs ``pdserve fetch-model ... --progress-job NAME``. Then:

- ``planned_files``: the files the download will write, with their sizes (the Hub's tree listing of
  the resolved commit, filtered by the same patterns ``snapshot_download`` is given);
- ``measure``: bytes and files done so far, from what is on disk: finished files of the right size,
  plus the ``*.incomplete`` files huggingface_hub writes under ``DEST/.cache/huggingface/download``;
- ``JobReporter``: every ``INTERVAL_S`` (and once at the end) writes that progress as JSON into the
  annotation ``ANNOTATION`` of the Job (merge patch; the pod's ServiceAccount may get and patch that
  one Job only), which the operator copies into the InferenceService's ``status.model``; a failure
  writes its reason (``FetchError.reason``) and its one line. A reporter that cannot reach the API
  server says so once on stderr and the download goes on;
- ``MARKER``: written into DEST when the download is complete (commit, bytes, files); the pools' pods
  wait for it (``pdserve fetch-model --wait``) before their servers start.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import threading
import time
from pathlib import Path

ANNOTATION = "pdserve.io/model-download"  # the operator reads it (operator/model_cache.py)
MARKER = ".pdserve-download-complete"
INTERVAL_S = 2.0
WAIT_POLL_S = 2.0
WAIT_SAY_S = 30.0  # how often a waiting pod says what it waits for


def planned_files(api, repo: str, commit: str, patterns: list[str]) -> dict[str, int]:
    """{path: size} of the files at ``commit`` that match ``patterns`` (fnmatch, as snapshot_download)."""
    files = {}
    for entry in api.list_repo_tree(repo, revision=commit, recursive=True):
        path, size = getattr(entry, "path", None), getattr(entry, "size", None)
        if size is None or path is None:  # a folder
            continue
        if any(fnmatch.fnmatch(path, p) for p in patterns):
            files[path] = int(size)
    return files


def measure(dest: Path, planned: dict[str, int]) -> dict[str, int]:
    """Bytes and files done in ``dest`` against ``planned``: {bytesDone, bytesTotal, filesDone, filesTotal}."""
    done_bytes = done_files = 0
    for path, size in planned.items():
        final = dest / path
        if final.is_file() and final.stat().st_size == size:
            done_bytes += size
            done_files += 1
    partial = dest / ".cache" / "huggingface" / "download"
    if partial.is_dir():
        done_bytes += sum(p.stat().st_size for p in partial.rglob("*.incomplete") if p.is_file())
    total = sum(planned.values())
    return {"bytesDone": min(done_bytes, total), "bytesTotal": total, "filesDone": done_files,
            "filesTotal": len(planned)}


def write_marker(dest: Path, commit: str, progress: dict[str, int]) -> None:
    """The completion marker (written last, atomically: a pod that sees it sees every file)."""
    tmp = dest / f"{MARKER}.tmp"
    tmp.write_text(json.dumps({"commit": commit, **progress}))
    tmp.replace(dest / MARKER)


def wait_for_marker(dest: Path, what: str, clock=time.monotonic, sleep=time.sleep) -> Path:
    """Block until ``dest/MARKER`` exists, saying every WAIT_SAY_S seconds on stderr what it waits for."""
    said = None
    while not (dest / MARKER).is_file():
        if said is None or clock() - said >= WAIT_SAY_S:
            print(f"waiting for {what} to finish downloading into {dest} (kubectl get pdis: status.model)",
                  file=sys.stderr, flush=True)
            said = clock()
        sleep(WAIT_POLL_S)
    return dest


class JobReporter:
    """Writes progress into the annotation of Job ``name`` in ``namespace`` (see the module docstring)."""

    def __init__(self, name: str, namespace: str | None = None):
        self.name = name
        self.namespace = namespace or os.environ.get("POD_NAMESPACE") or "default"
        self._api = None
        self._broken = False
        self._last: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _client(self):
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()  # outside a pod ($KUBECONFIG): tests and manual runs
            self._api = client.BatchV1Api()
        return self._api

    def report(self, state: dict) -> None:
        """Write ``state`` (unchanged states are not written again); never raises."""
        if self._broken or state == self._last:
            return
        body = {"metadata": {"annotations": {ANNOTATION: json.dumps(state, sort_keys=True)}}}
        try:
            self._client().patch_namespaced_job(self.name, self.namespace, body,
                                                _content_type="application/merge-patch+json")
            self._last = state
        except Exception as exc:  # noqa: BLE001 - progress is a courtesy; the download goes on
            self._broken = True
            print(f"pdserve fetch-model: cannot write progress to Job {self.namespace}/{self.name} "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); downloading on",
                  file=sys.stderr, flush=True)

    def start(self, dest: Path, planned: dict[str, int]) -> None:
        """Report ``measure(dest, planned)`` every INTERVAL_S in a thread until ``finish`` or ``failed``."""
        self.report({"phase": "Downloading", **measure(dest, planned)})

        def loop() -> None:
            while not self._stop.wait(INTERVAL_S):
                self.report({"phase": "Downloading", **measure(dest, planned)})

        self._thread = threading.Thread(target=loop, name="fetch-progress", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(INTERVAL_S + 30)

    def finish(self, progress: dict[str, int]) -> None:
        self._halt()
        self.report({"phase": "Downloaded", **progress})

    def failed(self, reason: str, message: str) -> None:
        self._halt()
        counts = {k: v for k, v in (self._last or {}).items() if k not in ("phase", "reason", "message")}
        self.report({**counts, "phase": "Failed", "reason": reason, "message": message})
