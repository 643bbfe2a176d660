"""Which committed tree a GPU check measured (issue 51 item 5), also where the GPU machine has no .git.

Here, before the device call:

    python tools/gpu/tree_stamp.py      # refuses a tree with uncommitted changes to the checked sources

writes ``tools/gpu/.tree-stamp.json`` (kept out of git by .git/info/exclude; pass it in ``carry`` beside
``.whl``): the commit and the sha256 of the sources the check runs (``source_hash``). On the GPU machine
``identity()`` hashes the sources again: equal to the stamp's, the run measured that commit ("clean");
different, it measured a tree that is in no commit, and check.json says so ("differs from the stamped
commit ..."), as it does when there is no stamp. Where git is there (a run on this machine) the commit and
whether the checked sources have uncommitted changes come from git itself.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP = Path(__file__).resolve().parent / ".tree-stamp.json"
FOLDERS = ("pdserve", "engine", "cachestore", "protos", "prefill_server", "decode_server", "tools")


def source_hash(root: Path = ROOT) -> str:
    """sha256 over the Python sources the check runs (paths and contents)."""
    digest = hashlib.sha256()
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.rstrip("\n") if proc.returncode == 0 else None


def changed_sources() -> list[str] | None:
    """Uncommitted changes (tracked or untracked) under the checked folders; None without git."""
    out = _git("status", "--porcelain", "--", *FOLDERS)
    return None if out is None else [line[3:] for line in out.splitlines() if line.endswith(".py")]


def identity() -> dict:
    """The check's record of its tree: commit, source hash, and whether that commit is what ran."""
    digest = source_hash()
    commit = _git("rev-parse", "HEAD")
    if commit is not None:
        changed = changed_sources() or []
        return {"commit": commit, "source_sha256": digest, "tree": "clean" if not changed else
                f"uncommitted changes to {len(changed)} file(s): {', '.join(changed[:5])}"}
    stamp = json.loads(STAMP.read_text()) if STAMP.exists() else None
    if stamp is None:
        return {"commit": None, "source_sha256": digest, "tree": "no git and no stamp (tools/gpu/tree_stamp.py)"}
    if stamp["source_sha256"] == digest:
        return {"commit": stamp["commit"], "source_sha256": digest, "tree": "clean (sources equal the stamp's)"}
    return {"commit": None, "source_sha256": digest,
            "tree": f"differs from the stamped commit {stamp['commit'][:12]} (sources hash differently)"}


def main() -> int:
    changed = changed_sources()
    if changed is None:
        print("tree_stamp: no git here; run it in the checkout you send to the GPU machine", file=sys.stderr)
        return 2
    if changed:
        print(f"tree_stamp: refused: commit these first (the check must measure a commit): {' '.join(changed)}",
              file=sys.stderr)
        return 1
    commit = _git("rev-parse", "HEAD")
    STAMP.write_text(json.dumps({"commit": commit, "source_sha256": source_hash()}) + "\n")
    exclude, line = ROOT / ".git" / "info" / "exclude", "/tools/gpu/.tree-stamp.json"
    if line not in (exclude.read_text().splitlines() if exclude.exists() else []):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write(line + "\n")
    print(f"tree_stamp: {STAMP.relative_to(ROOT)} = commit {commit[:12] if commit else '?'}; carry it with .whl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
