"""Download a Hugging Face model repository into a folder a pdserve server can load with --model.

    pdserve fetch-model hf://Qwen/Qwen2.5-0.5B-Instruct --dest /model-cache/Qwen2.5-0.5B-Instruct
    pdserve fetch-model hf://org/private-model@v1.0 --dest DIR   # HF_TOKEN=hf_... in the environment

Only the files a pdserve engine reads are fetched: config.json, generation_config.json, the
tokenizer files and the *.safetensors weights (with their index); --tokenizer-only leaves out
the weights (a router only hashes prompts; a prefill serves the same files to a router that mounts
no model: pdserve.tokenizer_files). Files already in DEST at the same commit are not
fetched again, so a cache on a PersistentVolumeClaim survives restarts.

Environment: HF_ENDPOINT (default https://huggingface.co; a mirror or a test server) and
HF_TOKEN (gated or private repositories). Progress goes to stderr; on success the folder is
printed on stdout. A refused token (401/403), a missing repository or revision (404) or an
unreachable endpoint ends with one line naming the repository and the endpoint and saying what
to do, exit status 1. The operator runs this as the init container of every pod of an
InferenceService whose spec.model.source is hf://... and whose spec.model.cache is an emptyDir; with a
claim it runs it once, as a Job (``--progress-job``: progress into the Job's annotation, a completion
marker into DEST; pdserve.model_fetch_progress), and the pods wait for the marker (``--wait``).

The built-in model (``tiny`` / ``builtin:tiny``) has no repository: with --tokenizer-only its
byte-level tokenizer is written into DEST as Hugging Face files (``ByteTokenizer.hf_files``), for
clients that count tokens with ``transformers.AutoTokenizer`` (the benchmark tools of
docs/benchmarks.md: ``--tokenizer DEST``); no network.

    pdserve fetch-model builtin:tiny --tokenizer-only --dest /tmp/tiny-tokenizer
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pdserve import model_fetch_progress, model_source
from pdserve.defaults import BUILTIN_MODEL

# what engine/loader.py and engine/tokenizer.py read; nothing else is downloaded
CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
DEFAULT_ENDPOINT = "https://huggingface.co"


class FetchError(Exception):
    """A download that cannot succeed as asked; the message is the one line the user sees, ``reason`` a
    word for it (the InferenceService's condition reason when the operator's Job fetches: TokenRefused,
    GatedRepoRefused, RepoNotFound, RevisionNotFound, HubUnreachable, NoSafetensors, DownloadFailed)."""

    def __init__(self, message: str, reason: str = "DownloadFailed"):
        super().__init__(message)
        self.reason = reason


def allow_patterns(tokenizer_only: bool) -> list[str]:
    return CONFIG_FILES + TOKENIZER_FILES + ([] if tokenizer_only else WEIGHT_FILES)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="hf://org/name[@revision] (revision: a branch, tag or commit; default main), or "
                                       f"the built-in {BUILTIN_MODEL!r} with --tokenizer-only")
    parser.add_argument("--dest", required=True, type=Path, help="folder to download into (created if missing)")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="only config and tokenizer files, no weights (what `pdserve router --model` reads)")
    parser.add_argument("--progress-job", metavar="JOB",
                        help="the operator's download Job: write progress into its annotation "
                             f"{model_fetch_progress.ANNOTATION} (namespace: $POD_NAMESPACE) and, when done, "
                             f"the marker {model_fetch_progress.MARKER} into DEST")
    parser.add_argument("--wait", action="store_true",
                        help="download nothing: wait until DEST holds the marker the download Job writes when done "
                             "(the pools' pods do this)")


def fetch(source: model_source.ModelSource, dest: Path, tokenizer_only: bool = False,
          reporter: model_fetch_progress.JobReporter | None = None) -> Path:
    """Download ``source`` (kind hf) into ``dest``; FetchError with the user's one line when it cannot.
    With ``reporter`` the progress goes to the operator's Job and the completion marker into ``dest``."""
    import httpx2
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{source.repo}@{source.revision} at {endpoint()}"
    token = os.environ.get("HF_TOKEN") or None
    refused = (f"token refused ({{status}}) for {where}: put a valid token with read access in the Secret "
               "named by spec.model.tokenSecret (HF_TOKEN)")
    try:
        # Resolve the revision first: snapshot_download itself, when the Hub refuses, quietly returns whatever
        # an earlier run left in dest (a cache on a claim), which would hide a revoked token or a deleted repo.
        api = HfApi(endpoint=endpoint(), token=token)
        commit = api.model_info(source.repo, revision=source.revision).sha
        if reporter is not None:
            planned = model_fetch_progress.planned_files(api, source.repo, commit, allow_patterns(tokenizer_only))
            dest.mkdir(parents=True, exist_ok=True)
            reporter.start(dest, planned)
        folder = snapshot_download(repo_id=source.repo, revision=commit, local_dir=str(dest), endpoint=endpoint(),
                                   token=token, allow_patterns=allow_patterns(tokenizer_only))
    except RevisionNotFoundError:
        raise FetchError(f"revision {source.revision!r} not found in {where}: check the tag, branch or "
                         "commit after '@' in spec.model.source", "RevisionNotFound") from None
    except GatedRepoError:
        raise FetchError(f"access to gated repository {where} refused: accept its terms on the Hub with the "
                         "account of the token in spec.model.tokenSecret (HF_TOKEN)", "GatedRepoRefused") from None
    except RepositoryNotFoundError as exc:
        status = exc.response.status_code if exc.response is not None else 404
        if token and status in (401, 403):
            raise FetchError(refused.format(status=status), "TokenRefused") from None
        hint = ("check spec.model.source, and that the token in spec.model.tokenSecret can read it" if token else
                "check spec.model.source; a private or gated repository needs spec.model.tokenSecret (HF_TOKEN)")
        raise FetchError(f"repository not found ({status}) {where}: {hint}", "RepoNotFound") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        if status in (401, 403):
            raise FetchError(refused.format(status=status), "TokenRefused") from None
        raise FetchError(f"download of {where} failed (HTTP {status}): {str(exc).splitlines()[0]}") from None
    except (httpx2.TransportError, LocalEntryNotFoundError) as exc:
        raise FetchError(f"cannot reach {endpoint()} for {source.repo}@{source.revision}: check HF_ENDPOINT "
                         f"(spec.model.endpoint) and the pod's network ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})", "HubUnreachable") from None
    folder = Path(folder)
    if not tokenizer_only and not any(folder.glob("*.safetensors")):
        raise FetchError(f"{where} has no *.safetensors weights: pdserve loads safetensors checkpoints only",
                         "NoSafetensors")
    if reporter is not None:
        progress = model_fetch_progress.measure(folder, planned)
        model_fetch_progress.write_marker(folder, commit, progress)
        reporter.finish(progress)
    return folder


def write_builtin_tokenizer(name: str, dest: Path) -> Path:
    """The built-in model's tokenizer as Hugging Face files in ``dest`` (created if missing); files
    already there with the same content are left as they are."""
    from pdserve.engine.loader import tiny_config
    from pdserve.engine.tokenizer import ByteTokenizer

    if name.removeprefix(model_source.BUILTIN_PREFIX) != BUILTIN_MODEL:
        raise FetchError(f"{name!r} is not a built-in model (the built-in one is {BUILTIN_MODEL!r})")
    dest.mkdir(parents=True, exist_ok=True)
    for file, text in ByteTokenizer().hf_files(tiny_config().max_position_embeddings).items():
        path = dest / file
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    return dest


def run(args: argparse.Namespace) -> int:
    if args.source == BUILTIN_MODEL or args.source.startswith(model_source.BUILTIN_PREFIX):
        if not args.tokenizer_only:
            print(f"pdserve fetch-model: {args.source!r} is built in (its weights are made at start, nothing to "
                  "fetch); --tokenizer-only writes its tokenizer as Hugging Face files", file=sys.stderr)
            return 2
        try:
            folder = write_builtin_tokenizer(args.source, args.dest)
        except FetchError as exc:
            print(f"pdserve fetch-model: {exc}", file=sys.stderr)
            return 2
        print(f"wrote the byte-level tokenizer of the built-in model {args.source!r} into {folder}", file=sys.stderr)
        print(folder)
        return 0
    try:
        source = model_source.parse(args.source)
    except ValueError as exc:
        print(f"pdserve fetch-model: {exc}", file=sys.stderr)
        return 2
    if source.kind != "hf":
        print(f"pdserve fetch-model: {args.source!r} is not hf://org/name[@revision]", file=sys.stderr)
        return 2
    if args.wait:
        model_fetch_progress.wait_for_marker(args.dest, f"the download Job of {source.text}")
        print(args.dest)
        return 0
    reporter = model_fetch_progress.JobReporter(args.progress_job) if args.progress_job else None
    what = "config and tokenizer" if args.tokenizer_only else "model"
    print(f"fetching {what} {source.repo}@{source.revision} from {endpoint()} into {args.dest}", file=sys.stderr)
    started = time.monotonic()
    try:
        folder = fetch(source, args.dest, args.tokenizer_only, reporter)
    except FetchError as exc:
        print(f"pdserve fetch-model: {exc}", file=sys.stderr, flush=True)
        if reporter is not None:
            reporter.failed(exc.reason, str(exc))
        return 1
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    print(f"fetched {source.repo}@{source.revision}: {size / 2**20:.1f} MiB in {time.monotonic() - started:.1f}s",
          file=sys.stderr)
    print(folder)
    return 0
