"""Pods -> the problem a user can act on (pod_problems), the pool's and the InferenceService's
Degraded condition from it (status), and Warning Events once per problem (problem_events).

The pods are real status shapes, as `kubectl get pod -o yaml` shows them (trimmed to status).
"""

import yaml

from pdserve.operator import pod_problems, pools, problem_events, status
from pdserve.operator.config import OperatorConfig
from pdserve.operator.pod_problems import PodProblem

CONFIG = OperatorConfig(default_image="img:1", protocol_version="1")
NOT_READY = """
  - {type: PodReadyToStartContainers, status: "True", lastTransitionTime: "2026-11-30T10:00:03Z"}
  - {type: Initialized, status: "True", lastTransitionTime: "2026-11-30T10:00:01Z"}
  - {type: Ready, status: "False", reason: ContainersNotReady, message: "containers with unready status: [prefill]",
     lastTransitionTime: "2026-11-30T10:00:01Z"}
  - {type: ContainersReady, status: "False", reason: ContainersNotReady,
     message: "containers with unready status: [prefill]", lastTransitionTime: "2026-11-30T10:00:01Z"}
  - {type: PodScheduled, status: "True", lastTransitionTime: "2026-11-30T10:00:00Z"}
"""


def pod(name: str, status_yaml: str, **meta) -> dict:
    return {"metadata": {"name": name, "namespace": "ns", **meta}, "status": yaml.safe_load(status_yaml)}


IMAGE_PULL_BACKOFF = pod("chat-prefill-7c9d4-abcde", f"""
phase: Pending
conditions: {NOT_READY}
containerStatuses:
- name: prefill
  image: registry.example/pdserve:nope
  imageID: ""
  ready: false
  restartCount: 0
  started: false
  state:
    waiting:
      reason: ImagePullBackOff
      message: 'Back-off pulling image "registry.example/pdserve:nope": ErrImagePull: failed to pull and unpack
        image "registry.example/pdserve:nope": failed to resolve reference "registry.example/pdserve:nope":
        registry.example/pdserve:nope: not found'
""")

ERR_IMAGE_PULL = pod("chat-prefill-7c9d4-abcde", f"""
phase: Pending
conditions: {NOT_READY}
containerStatuses:
- name: prefill
  image: registry.example/pdserve:nope
  imageID: ""
  ready: false
  restartCount: 0
  started: false
  state:
    waiting:
      reason: ErrImagePull
      message: 'failed to pull and unpack image "registry.example/pdserve:nope": failed to resolve reference
        "registry.example/pdserve:nope": pull access denied, repository does not exist or may require authorization'
""")

UNSCHEDULABLE = pod("chat-decode-main-5f6b7-xyz12", """
phase: Pending
qosClass: Burstable
conditions:
- type: PodScheduled
  status: "False"
  reason: Unschedulable
  message: '0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available:
    1 No preemption victims found for incoming pod.'
  lastProbeTime: null
  lastTransitionTime: "2026-11-30T10:00:00Z"
""")

CRASH_LOOP = pod("chat-decode-main-5f6b7-qrs34", """
phase: Running
conditions:
- {type: Ready, status: "False", reason: ContainersNotReady, message: "containers with unready status: [decode]"}
- {type: ContainersReady, status: "False", reason: ContainersNotReady}
- {type: PodScheduled, status: "True"}
containerStatuses:
- name: decode
  image: registry.example/pdserve:1
  imageID: registry.example/pdserve@sha256:0a1b
  containerID: containerd://4f2e
  ready: false
  restartCount: 4
  started: false
  state:
    waiting:
      reason: CrashLoopBackOff
      message: back-off 1m20s restarting failed container=decode pod=chat-decode-main-5f6b7-qrs34_ns(6c1f0f3e)
  lastState:
    terminated:
      exitCode: 1
      reason: Error
      message: |
        Traceback (most recent call last):
          File "/app/pdserve/engine/model_runner.py", line 41, in __init__
            torch.cuda.set_device(0)
        RuntimeError: CUDA unavailable: no NVIDIA driver found (--device cuda)
      startedAt: "2026-11-30T10:03:00Z"
      finishedAt: "2026-11-30T10:03:04Z"
      containerID: containerd://4f2e
""")

# Between two back-offs the kubelet runs the container again: running, not ready, the last run failed.
RESTARTED_AFTER_OOM = pod("chat-decode-big-1a2b3-tuv56", """
phase: Running
containerStatuses:
- name: decode
  image: registry.example/pdserve:1
  ready: false
  restartCount: 1
  started: true
  state: {running: {startedAt: "2026-11-30T10:05:00Z"}}
  lastState: {terminated: {exitCode: 137, reason: OOMKilled, startedAt: "2026-11-30T10:04:00Z",
                           finishedAt: "2026-11-30T10:04:50Z"}}
""")

INIT_FAILED = pod("chat-prefill-7c9d4-fghij", """
phase: Pending
conditions:
- {type: Initialized, status: "False", reason: ContainersNotInitialized,
   message: "containers with incomplete status: [fetch-model]"}
- {type: Ready, status: "False", reason: ContainersNotReady}
- {type: PodScheduled, status: "True"}
initContainerStatuses:
- name: fetch-model
  image: busybox:1.36
  ready: false
  restartCount: 2
  started: false
  state:
    waiting: {reason: CrashLoopBackOff, message: "back-off 20s restarting failed container=fetch-model"}
  lastState:
    terminated: {exitCode: 2, reason: Error, message: "cp: can't stat '/models/tiny': No such file or directory\\n"}
containerStatuses:
- name: prefill
  image: registry.example/pdserve:1
  ready: false
  restartCount: 0
  state: {waiting: {reason: PodInitializing}}
""")

CONFIG_ERROR = pod("chat-prefill-7c9d4-klmno", """
phase: Pending
containerStatuses:
- name: prefill
  image: registry.example/pdserve:1
  ready: false
  restartCount: 0
  state: {waiting: {reason: CreateContainerConfigError, message: 'secret "hf-token" not found'}}
""")

STARTING = pod("chat-prefill-7c9d4-pqrst", """
phase: Pending
initContainerStatuses:
- {name: fetch-model, image: busybox:1.36, ready: true, restartCount: 0,
   state: {terminated: {exitCode: 0, reason: Completed}}}
containerStatuses:
- {name: prefill, image: "registry.example/pdserve:1", ready: false, restartCount: 0,
   state: {waiting: {reason: ContainerCreating}}}
""")

# Crashed once, now ready again: recovered, whatever the last run was.
RECOVERED = pod("chat-decode-main-5f6b7-qrs34", """
phase: Running
conditions:
- {type: Ready, status: "True"}
containerStatuses:
- name: decode
  image: registry.example/pdserve:1
  ready: true
  restartCount: 5
  started: true
  state: {running: {startedAt: "2026-11-30T10:09:00Z"}}
  lastState: {terminated: {exitCode: 1, reason: Error}}
""")


def test_image_pull_backoff_and_err_image_pull_are_one_problem_with_the_kubelets_words():
    backoff, err = pod_problems.pod_problem(IMAGE_PULL_BACKOFF), pod_problems.pod_problem(ERR_IMAGE_PULL)
    assert backoff.reason == err.reason == "ImagePullBackOff"
    assert backoff.message.startswith('pod chat-prefill-7c9d4-abcde: container "prefill" cannot pull image '
                                      '"registry.example/pdserve:nope": Back-off pulling image')
    assert "not found" in backoff.message and "pull access denied" in err.message
    assert backoff.subject == err.subject  # the kubelet alternates the two: one problem for Events


def test_unschedulable_carries_the_schedulers_message():
    problem = pod_problems.pod_problem(UNSCHEDULABLE)
    assert problem.reason == "Unschedulable"
    assert "0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in problem.message


def test_crash_loop_names_container_exit_code_and_the_end_of_its_message():
    problem = pod_problems.pod_problem(CRASH_LOOP)
    assert problem.reason == "CrashLoopBackOff"
    assert 'container "decode" exited with code 1 (Error)' in problem.message
    assert "RuntimeError: CUDA unavailable: no NVIDIA driver found" in problem.message
    assert "Traceback" not in problem.message  # only the last lines of a long message
    assert "1m20s" not in problem.message      # the growing back-off is not part of it


def test_a_container_running_again_after_a_crash_is_still_a_problem_until_ready():
    problem = pod_problems.pod_problem(RESTARTED_AFTER_OOM)
    assert problem.reason == "CrashLoopBackOff" and "exited with code 137 (OOMKilled)" in problem.message
    assert pod_problems.pod_problem(RECOVERED) is None


def test_init_container_failure_and_create_container_errors():
    init = pod_problems.pod_problem(INIT_FAILED)
    assert init.reason == "InitContainerFailed"
    assert 'init container "fetch-model" exited with code 2 (Error)' in init.message and "No such file" in init.message
    config = pod_problems.pod_problem(CONFIG_ERROR)
    assert config.reason == "CreateContainerError"
    assert 'CreateContainerConfigError: secret "hf-token" not found' in config.message


def test_starting_or_deleted_pods_have_no_problem():
    assert pod_problems.pod_problem(STARTING) is None
    assert pod_problems.pod_problem(pod("gone", "phase: Pending")) is None
    leaving = {**CRASH_LOOP, "metadata": {**CRASH_LOOP["metadata"], "deletionTimestamp": "2026-11-30T10:10:00Z"}}
    assert pod_problems.pod_problem(leaving) is None


def test_a_pool_reports_its_worst_problem_and_how_many_more_pods_have_one():
    assert pod_problems.pool_problem([STARTING, RECOVERED]) is None
    worst = pod_problems.pool_problem([UNSCHEDULABLE, CRASH_LOOP, STARTING, IMAGE_PULL_BACKOFF])
    assert worst.reason == "ImagePullBackOff" and worst.others == 2 and worst.message.endswith("(and 2 more pods)")
    one = pod_problems.pool_problem([UNSCHEDULABLE, STARTING])
    assert one.reason == "Unschedulable" and one.others == 0 and "more" not in one.message


def isvc() -> dict:
    from pathlib import Path

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"].update(namespace="ns", generation=1)
    doc["spec"]["router"] = {"replicas": 0}
    return doc


def deployment(replicas: int, ready: int, conditions=()) -> dict:
    return {"metadata": {"generation": 1}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas, "conditions": list(conditions)}}


def degraded(st: dict) -> dict:
    return next(c for c in st["conditions"] if c["type"] == "Degraded")


def test_pool_and_service_degraded_carry_the_pod_problem():
    svc = isvc()
    prefill = pools.build_prefill_pool(svc, CONFIG)
    decodes = pools.build_decode_pools(svc, CONFIG)
    problem = pod_problems.pool_problem([UNSCHEDULABLE])
    pst = status.pool_status(prefill, deployment(1, 0), "s", problem)
    assert (degraded(pst)["status"], degraded(pst)["reason"]) == ("True", "Unschedulable")
    assert degraded(pst)["message"] == problem.message
    ok = [(d, status.pool_status(d, deployment(d["spec"]["replicas"], 1), "s")) for d in decodes]
    st = status.isvc_status(svc, (prefill, pst), ok)
    assert (degraded(st)["status"], degraded(st)["reason"]) == ("True", "Unschedulable")
    assert degraded(st)["message"] == f"prefill: {problem.message}"
    # the pods recover: the conditions clear
    healthy = status.isvc_status(svc, (prefill, status.pool_status(prefill, deployment(1, 1), "s")), ok)
    assert degraded(healthy)["status"] == "False"


def test_deployment_failure_wins_and_a_pod_problem_beats_the_progress_deadline():
    pool = pools.build_decode_pools(isvc(), CONFIG)[0]
    problem = pod_problems.pool_problem([CRASH_LOOP])
    quota = {"type": "ReplicaFailure", "status": "True", "message": "exceeded quota"}
    assert degraded(status.pool_status(pool, deployment(2, 0, [quota]), "s", problem))["reason"] == "ReplicaFailure"
    late = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "timed out"}
    assert degraded(status.pool_status(pool, deployment(2, 0, [late]), "s", problem))["reason"] == "CrashLoopBackOff"
    assert degraded(status.pool_status(pool, deployment(2, 0, [late]), "s"))["reason"] == "ProgressDeadlineExceeded"


def health(problem: PodProblem | None, stored: dict | None = None, key: str = "uid-1") -> problem_events.PoolHealth:
    cond = (status.condition("Degraded", True, problem.reason, problem.message, 1) if problem
            else status.condition("Degraded", False, "AsExpected", "", 1))
    return problem_events.PoolHealth(key, "prefill", {}, {}, cond, problem.subject if problem else (), stored)


def test_events_once_per_problem_again_after_recovery_and_not_after_a_restart():
    ledger = problem_events.ProblemLedger(started="2026-11-30T10:00:00Z")
    backoff, err = pod_problems.pool_problem([IMAGE_PULL_BACKOFF]), pod_problems.pool_problem([ERR_IMAGE_PULL])
    assert ledger.is_new(health(backoff))
    assert not ledger.is_new(health(err)) and not ledger.is_new(health(backoff))  # the kubelet's flip-flop
    crash = pod_problems.pool_problem([CRASH_LOOP])
    assert ledger.is_new(health(crash))                       # a different problem
    assert ledger.is_new(health(backoff, key="uid-2"))        # another pool
    assert not ledger.is_new(health(None))                    # recovered: forgotten
    assert ledger.is_new(health(crash))                       # so a recurrence is announced

    # A new operator process: a problem stored before it started was announced by the last one...
    stored = {**health(crash).degraded, "lastTransitionTime": "2026-11-30T09:00:00Z"}
    restarted = problem_events.ProblemLedger(started="2026-11-30T10:00:00Z")
    assert not restarted.is_new(health(crash, stored))
    # ...but one stored while this process ran (its refresh failed before posting) is announced.
    later = {**stored, "lastTransitionTime": "2026-11-30T10:00:05Z"}
    assert problem_events.ProblemLedger(started="2026-11-30T10:00:00Z").is_new(health(crash, later))
