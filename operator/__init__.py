"""pdserve.operator: the kopf operator that turns an InferenceService into pools, a router, Deployments and Services.

Importable only as ``pdserve.operator`` (the bare name ``operator`` is the standard library's).

Reading path:

1. ``crds.py``: the schema of InferenceService / PrefillPool / DecodePool, the one source
   of the chart's CRD files (``python -m pdserve.operator.crds charts/pdserve``);
   built from ``crd_schema.py`` (building blocks, limits, defaults), ``crd_pod.py`` (each pool's
   ``engine``, pod settings, disruption budget; GPU pools) and ``crd_policy.py`` (``spec.slo``,
   ``spec.router``, ``spec.autoscaling``).
2. ``naming.py``: names, labels and selectors of every child; how prefill finds decodes.
3. ``pools.py`` then ``workloads.py``: pure builders (InferenceService -> pools ->
   Deployments, Services, RBAC, NetworkPolicies), unit-tested without a cluster;
   ``pod_settings.py``: engine flags, pod settings and PodDisruptionBudgets of every pool;
   ``model_pods.py``: how a pod gets ``spec.model`` (a claim; hf://: an init container downloads it);
   ``router_workloads.py``: the router (``spec.router``), owned by the InferenceService itself.
4. ``status.py``: pure status computation (Ready / Progressing / Degraded); ``pod_problems.py``:
   why a pool's pods do not run (image pull, scheduling, crashes), its Degraded reason.
5. ``handlers.py``: the kopf handlers wiring builders and status to the API, pods watched
   (``kubeapi.py``: server-side apply over one ApiClient; ``problem_events.py``: a Warning
   Event once per problem). docs/troubleshooting.md: each reason and its fix.
6. ``autoscaling.py``: ``spec.autoscaling``, the planner's loop per InferenceService
   (``autoscaling_metrics.py``: Prometheus or the pods' /metrics as its source).
7. ``cli.py``: ``pdserve operator`` (``config.py``: what it is told at start-up).
"""
