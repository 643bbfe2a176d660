"""HubServer: a local stand-in for the Hugging Face Hub, for `pdserve fetch-model` (HF_ENDPOINT).

It serves model folders in the Hub's layout, for exactly the requests huggingface_hub 2.4.0's
``snapshot_download`` makes (read in .venv/.../huggingface_hub/_snapshot_download.py,
hf_api.py and file_download.py):

1. ``GET /api/models/{org}/{name}/revision/{rev}``: model info; ``sha`` is the commit the
   revision resolves to (``siblings`` lists the files, as the Hub answers);
2. ``GET /api/models/{org}/{name}/tree/{commit}?recursive=...``: the file list (type, path,
   size, oid), one page (no ``Link`` header);
3. ``HEAD`` then ``GET /{org}/{name}/resolve/{commit}/{file}``: the file's metadata in the
   headers the client checks (``X-Repo-Commit``, ``ETag``, ``Content-Length``), then its bytes.

Errors as the Hub signals them (``X-Error-Code``, which the client maps to its exceptions): an
unknown repository 404 ``RepoNotFound``, an unknown revision 404 ``RevisionNotFound``, an unknown
file 404 ``EntryNotFound``. With ``token`` set every request needs ``Authorization: Bearer
<token>``: none gets 401 ``RepoNotFound`` (a private repository looks missing), a wrong one 401
"Invalid credentials". ``requests`` records (method, path) of what was asked, ``bytes_served`` the
file bytes sent (the bodies of GET .../resolve/...: what a download costs the Hub).

    with HubServer({"acme/tiny": folder}, token="hf_good") as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_good"}
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

from aiohttp import web

from pdserve.net import free_port

REVISIONS = ("main",)  # the branch every served repository has (the commit is derived from its files)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


class HubServer:
    """Serve ``repos`` ({"org/name": folder}) on ``host`` while the ``with`` block runs; ``.url``."""

    def __init__(self, repos: dict[str, Path], token: str | None = None, host: str = "127.0.0.1",
                 advertise: str | None = None):
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.commits = {repo: self._commit(folder) for repo, folder in self.repos.items()}
        self.token, self.host, self.port = token, host, free_port()
        self.url = f"http://{advertise or host}:{self.port}"
        self.requests: list[tuple[str, str]] = []
        self.bytes_served = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @staticmethod
    def _commit(folder: Path) -> str:
        """A 40-hex commit id derived from the folder's files (same files, same commit)."""
        digest = hashlib.sha1()
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            digest.update(path.name.encode() + b"\0" + _sha1(path.read_bytes()).encode())
        return digest.hexdigest()

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._record_and_authorize])
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file:.+}", self._resolve)
        return app

    @web.middleware
    async def _record_and_authorize(self, request: web.Request, handler):
        self.requests.append((request.method, request.path))
        if self.token is not None:
            auth = request.headers.get("Authorization", "")
            if not auth:
                return self._error(401, "RepoNotFound", "Repository not found")
            if auth != f"Bearer {self.token}":
                return self._error(401, None, "Invalid credentials in Authorization header")
        return await handler(request)

    @staticmethod
    def _error(status: int, code: str | None, message: str) -> web.Response:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        return web.json_response({"error": message}, status=status, headers=headers)

    def _lookup(self, request: web.Request) -> tuple[str, Path, str] | web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in self.repos:
            return self._error(404, "RepoNotFound", f"Repository {repo} not found")
        rev, commit = request.match_info["rev"], self.commits[repo]
        if rev not in REVISIONS and rev != commit:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo, self.repos[repo], commit

    def _files(self, folder: Path) -> list[Path]:
        return sorted(p for p in folder.iterdir() if p.is_file())

    async def _info(self, request: web.Request) -> web.Response:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        repo, folder, commit = found
        return web.json_response({"id": repo, "modelId": repo, "sha": commit, "private": self.token is not None,
                                  "siblings": [{"rfilename": p.name} for p in self._files(folder)]})

    async def _tree(self, request: web.Request) -> web.Response:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        _, folder, _ = found
        return web.json_response([{"type": "file", "path": p.name, "size": p.stat().st_size,
                                   "oid": _sha1(p.read_bytes())} for p in self._files(folder)])

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        _, folder, commit = found
        path = folder / request.match_info["file"]
        if "/" in request.match_info["file"] or not path.is_file():
            return self._error(404, "EntryNotFound", f"{request.match_info['file']} not found")
        data = path.read_bytes()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{_sha1(data)}"', "Content-Length": str(len(data)),
                   "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return web.Response(status=200, headers=headers)
        self.bytes_served += len(data)
        return web.Response(body=data, headers=headers, content_type="application/octet-stream")

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self._app())
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, self.host, self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> HubServer:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError(f"hub server on port {self.port} did not start within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def write_tiny_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A small Llama checkpoint as the Hub holds one: config.json, model.safetensors, tokenizer.json
    (word-level over a few words) + tokenizer_config.json, generation_config.json, and a README.md
    that `pdserve fetch-model` must not fetch."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
    from pdserve.engine.config import ModelConfig

    words = ["<s>", "</s>", "[UNK]", "hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog"]
    vocab = {w: i for i, w in enumerate(words)}
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=256, bos_token_id=0, eos_token_ids=[1])
    save_hf_checkpoint(random_hf_weights(cfg, seed=seed, std=0.15), cfg, folder)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (folder / "README.md").write_text("# tiny\nA test checkpoint.\n")
    return folder
