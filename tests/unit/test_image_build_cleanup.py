"""tools/image/build.sh's clean-up after a build, run in a cache that never built the other kind of image
(a fresh machine: `make image` first, or `make image-cuda` first). Under the script's `set -euo pipefail`
the lines that read the other kind's files must not fail the build: a CUDA build from a clean cache
exited 1 there after a passing check and a written archive (2026-12-06)."""

from __future__ import annotations

import subprocess
from pathlib import Path

BUILD_SH = Path(__file__).resolve().parents[2] / "tools" / "image" / "build.sh"


def _assignment(name: str) -> str:
    """The script's `name="$(...)"` assignment, as written (it may span lines)."""
    text = BUILD_SH.read_text()
    start = text.index(f'\n{name}="$(') + 1
    end = text.index(')"\n', start) + 2
    return text[start:end]


def test_the_clean_up_reads_no_other_kind_without_failing(tmp_path):
    other, log = tmp_path / "cuda", tmp_path / "build.log"
    other.mkdir()  # exists, but holds no image of its kind yet
    log.write_text("--> 0123456789abcdef\n")
    script = "\n".join([
        "set -euo pipefail",
        f"OTHER_DIR={other} OTHER_PREFIX=pdserve-cuda log={log} NAME=n BASE_NAME=b",
        "bah() { :; }",  # an image store with nothing to say
        _assignment("other_names"),
        _assignment("keep"),
        'echo "names=[$other_names] keep=[$keep]"',
    ])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "names=[] keep=[0123456789a]"
