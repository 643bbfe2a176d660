"""Test harness: processes (procs), P/D clusters (pd_cluster), the real control plane (kube,
kube_control_plane, kube_kubelet), the operator (operator_harness), a CacheStore peer process
(cachestore_peer) and a threaded aiohttp app (threaded_app). No tests here."""
