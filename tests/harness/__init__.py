"""Test harness: processes (procs), P/D clusters (pd_cluster), the real control plane (kube,
kube_control_plane, kube_kubelet), the operator (operator_harness), a CacheStore peer process
(cachestore_peer), a threaded aiohttp app (threaded_app), multi-turn conversations for the
decode-reuse tests (conversations) and a toy closed loop for the planner (planner_sim).
Synchronisation by events: waits on conditions with named hang guards (conditions), gates the
test opens on the prefill (gates) and on the decode (decode_gate). How `make test` splits the
suite over pytest-xdist workers: suite_plan. No tests here."""
