"""Why a pool's pods do not run: pod objects -> one problem (a reason and a message a user can act on).

Pure functions over pods as the API server returns them (``status.containerStatuses``,
``status.conditions``); ``status.pool_status`` turns a pool's worst problem into its Degraded
condition. The reasons, in the order a pool's problem is picked (docs/troubleshooting.md says
what each means and how to fix it):

1. ``ImagePullBackOff``: a container or init container cannot get its image (the kubelet's
   waiting reason is ErrImagePull, ImagePullBackOff, InvalidImageName or ErrImageNeverPull);
   the message is the kubelet's.
2. ``CreateContainerError``: the kubelet cannot create or start a container
   (CreateContainerConfigError: a missing Secret or ConfigMap; CreateContainerError;
   RunContainerError); the message is the kubelet's.
3. ``InitContainerFailed``: an init container exited non-zero (this run or the last one) and
   has not completed since; its exit code, termination reason and message.
4. ``CrashLoopBackOff``: a container is not ready and its run ended in failure (non-zero exit,
   or the kubelet backs off restarting it); its exit code, termination reason and the end of
   its termination message.
5. ``Unschedulable``: the scheduler found no node (PodScheduled=False, reason Unschedulable);
   its message, e.g. "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."

A ready container is never a problem, whatever its last run was, so a recovered pod clears
its pool's problem. Pods being deleted (a rollout's leftovers) are not looked at.

``PodProblem.subject`` is what stays the same while a problem lasts (the kubelet alternates
ErrImagePull and ImagePullBackOff, a back-off grows, the pod is replaced): Warning Events are
posted once per subject (``problem_events.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

IMAGE_PULL = "ImagePullBackOff"
CREATE_CONTAINER = "CreateContainerError"
INIT_FAILED = "InitContainerFailed"
CRASH_LOOP = "CrashLoopBackOff"
UNSCHEDULABLE = "Unschedulable"
REASONS = (IMAGE_PULL, CREATE_CONTAINER, INIT_FAILED, CRASH_LOOP, UNSCHEDULABLE)  # worst first

_PULL_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
_CREATE_WAITING = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
# A termination message can be the last 80 lines of a log (FallbackToLogsOnError): keep its end,
# where a Python traceback names the error.
TAIL_LINES = 3
TAIL_CHARS = 400


@dataclass(frozen=True, slots=True)
class PodProblem:
    reason: str              # one of REASONS
    pod: str                 # the pod it was seen on (the first by name among those with the worst reason)
    detail: str              # the kubelet's or scheduler's words, the exit code
    subject: tuple           # what identifies the problem while it lasts (see the module docstring)
    others: int = 0          # how many more of the pool's pods have a problem

    @property
    def message(self) -> str:
        more = f" (and {self.others} more pod{'s' if self.others > 1 else ''})" if self.others else ""
        return f"pod {self.pod}: {self.detail}{more}"


def _tail(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    tail = " | ".join(lines[-TAIL_LINES:])
    return tail if len(tail) <= TAIL_CHARS else "..." + tail[-TAIL_CHARS:]


def _container_problem(cstatus: dict, init: bool) -> tuple[str, str, tuple] | None:
    """(reason, detail, subject) of one container status, or None when it is fine (or just starting)."""
    name = cstatus.get("name", "")
    what = f'{"init container" if init else "container"} "{name}"'
    state = cstatus.get("state") or {}
    waiting = state.get("waiting") or {}
    why, words = waiting.get("reason", ""), (waiting.get("message") or "").strip()
    if why in _PULL_WAITING:
        image = cstatus.get("image", "")
        return IMAGE_PULL, f'{what} cannot pull image "{image}": {words or why}', (name, image)
    if why in _CREATE_WAITING:
        return CREATE_CONTAINER, f"{what}: {why}: {words}", (name, why, words)
    if cstatus.get("ready"):
        return None
    ended = state.get("terminated") or (cstatus.get("lastState") or {}).get("terminated")
    if ended is None and why != "CrashLoopBackOff":
        return None
    if ended is None:  # backing off without a recorded end (the kubelet lost it): say so
        return (INIT_FAILED if init else CRASH_LOOP), f"{what} keeps failing; restarting with back-off", (name,)
    code = ended.get("exitCode", 0)
    if code == 0 and why != "CrashLoopBackOff":
        return None  # an init container that completed, or a clean exit the kubelet is restarting
    how = ended.get("reason") or ("Completed" if code == 0 else "Error")
    last = _tail(ended.get("message", ""))
    detail = f"{what} exited with code {code} ({how})" + (f": {last}" if last else "")
    return (INIT_FAILED if init else CRASH_LOOP), detail, (name, code, how)


def pod_problem(pod: dict) -> PodProblem | None:
    """The worst problem of one pod, or None (running fine, starting, or being deleted)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    found = [p for c in status.get("initContainerStatuses") or [] if (p := _container_problem(c, init=True))]
    found += [p for c in status.get("containerStatuses") or [] if (p := _container_problem(c, init=False))]
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == UNSCHEDULABLE:
            words = (cond.get("message") or "no node fits the pod").strip()
            found.append((UNSCHEDULABLE, words, (words,)))
    if not found:
        return None
    reason, detail, subject = min(found, key=lambda p: REASONS.index(p[0]))
    return PodProblem(reason, meta.get("name", ""), detail, subject)


def pool_problem(pods: list[dict]) -> PodProblem | None:
    """The worst problem among a pool's pods (ties: the first pod by name), counting the others."""
    problems = [p for pod in pods if (p := pod_problem(pod))]
    if not problems:
        return None
    worst = min(problems, key=lambda p: (REASONS.index(p.reason), p.pod))
    return dataclasses.replace(worst, others=len(problems) - 1)


def matches(pod: dict, labels: dict[str, str]) -> bool:
    """Whether a pod carries all of these labels (a pool's selector)."""
    have = (pod.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())
