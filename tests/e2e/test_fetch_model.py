"""`pdserve fetch-model` against a local Hub (harness/hf_hub_server.py), as an init container runs it.

A good token downloads what the engine reads (no README) and `pdserve generate` loads the
folder; a wrong token, a missing repository and a missing revision end with one line naming
the repository and the endpoint, and exit status 1.
"""

from __future__ import annotations

import subprocess

import pytest
from harness.hf_hub_server import HubServer, write_tiny_checkpoint
from harness.procs import VENV_BIN

PDSERVE = str(VENV_BIN / "pdserve")
TOKEN = "hf_test_good_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "tiny")
    with HubServer({"acme/tiny": folder}, token=TOKEN) as server:
        yield server


def fetch(hub: HubServer, tmp_path, source: str, token: str | None, *extra: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf-home"),
           "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([PDSERVE, "fetch-model", source, "--dest", str(tmp_path / "model"), *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def last_line(out: subprocess.CompletedProcess) -> str:
    return out.stderr.strip().splitlines()[-1]


def test_good_token_fetches_what_the_engine_reads_and_generate_loads_it(hub, tmp_path):
    out = fetch(hub, tmp_path, "hf://acme/tiny", TOKEN)
    assert out.returncode == 0, out.stderr
    model = tmp_path / "model"
    assert out.stdout.strip() == str(model)
    assert f"fetching model acme/tiny@main from {hub.url}" in out.stderr and "fetched acme/tiny@main" in out.stderr
    files = sorted(p.name for p in model.iterdir() if p.is_file())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]  # README.md is not fetched
    gen = subprocess.run([PDSERVE, "generate", "hello world", "--model", str(model), "--max-tokens", "4",
                          "--ignore-eos", "--threads", "1"],
                         capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert gen.returncode == 0, gen.stderr
    assert "[4 tokens in" in gen.stderr
    # a second run (a cache on a claim) asks the Hub again but fetches no file again
    before = len(hub.requests)
    again = fetch(hub, tmp_path, "hf://acme/tiny@main", TOKEN)
    assert again.returncode == 0, again.stderr
    assert not any(m == "GET" and "/resolve/" in p for m, p in hub.requests[before:])


def test_tokenizer_only_leaves_out_the_weights(hub, tmp_path):
    out = fetch(hub, tmp_path, "hf://acme/tiny", TOKEN, "--tokenizer-only")
    assert out.returncode == 0, out.stderr
    files = sorted(p.name for p in (tmp_path / "model").iterdir() if p.is_file())
    assert files == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_wrong_token_is_one_line_naming_the_repository_and_endpoint(hub, tmp_path):
    out = fetch(hub, tmp_path, "hf://acme/tiny", "hf_wrong")
    assert out.returncode == 1
    assert last_line(out) == (f"pdserve fetch-model: token refused (401) for acme/tiny@main at {hub.url}: put a valid "
                              "token with read access in the Secret named by spec.model.tokenSecret (HF_TOKEN)")
    assert "Traceback" not in out.stderr and not (tmp_path / "model" / "model.safetensors").exists()


def test_no_token_for_a_private_repository_says_to_set_one(hub, tmp_path):
    out = fetch(hub, tmp_path, "hf://acme/tiny", None)
    assert out.returncode == 1
    assert f"repository not found (401) acme/tiny@main at {hub.url}" in last_line(out)
    assert "needs spec.model.tokenSecret" in last_line(out)


def test_missing_repository_and_revision(hub, tmp_path):
    out = fetch(hub, tmp_path, "hf://acme/nope", TOKEN)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert last_line(out).startswith(f"pdserve fetch-model: repository not found (404) acme/nope@main at {hub.url}: "
                                     "check spec.model.source")
    out = fetch(hub, tmp_path, "hf://acme/tiny@v9", TOKEN)
    assert out.returncode == 1
    assert last_line(out) == (f"pdserve fetch-model: revision 'v9' not found in acme/tiny@v9 at {hub.url}: check the "
                              "tag, branch or commit after '@' in spec.model.source")


def test_unreachable_endpoint_and_bad_source(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HUB_ETAG_TIMEOUT": "2"}
    out = subprocess.run([PDSERVE, "fetch-model", "hf://acme/tiny", "--dest", str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "cannot reach http://127.0.0.1:9 for acme/tiny@main" in last_line(out)
    out = subprocess.run([PDSERVE, "fetch-model", "s3://bucket/model", "--dest", str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "hf://org/name" in out.stderr
