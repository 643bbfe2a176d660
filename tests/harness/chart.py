"""charts/pdserve rendered with `helm template` (no cluster needed, only helm from `make k8s-tools`).

    docs = render("gateway.inferencePool.enabled=true", ...)   # --set values -> the rendered objects
    (pool,) = by_kind(docs, "InferencePool")
    err = render_error("gateway.inferencePool.enabled=true")   # helm's message when it must refuse
    err = lint_error("operator.replicas=two")                  # the same from `helm lint --strict`
"""

from __future__ import annotations

import subprocess

import yaml

from harness.kube import require_tools, tools_bin_dir
from harness.procs import REPO

CHART = REPO / "charts" / "pdserve"


def _helm(*args: str) -> subprocess.CompletedProcess:
    bin_dir = tools_bin_dir()
    require_tools(bin_dir, ("helm",))
    return subprocess.run([str(bin_dir / "helm"), *args], capture_output=True, text=True, timeout=120)


def helm(*args: str) -> str:
    proc = _helm(*args)
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _template_args(sets: tuple[str, ...]) -> list[str]:
    args = ["template", "rel", str(CHART), "-n", "pdserve-system"]
    for s in sets:
        args += ["--set", s]
    return args


def render(*sets: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(helm(*_template_args(sets))) if d]


def render_error(*sets: str) -> str:
    """helm's stderr for values it must refuse (fails the test if it renders them)."""
    proc = _helm(*_template_args(sets))
    assert proc.returncode != 0, f"helm rendered {sets}:\n{proc.stdout}"
    return proc.stderr


def lint_error(*sets: str) -> str:
    """`helm lint --strict`'s output for values it must refuse (fails the test if it passes them)."""
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = _helm(*args)
    assert proc.returncode != 0, f"helm lint passed {sets}:\n{proc.stdout}"
    return proc.stdout + proc.stderr


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]
