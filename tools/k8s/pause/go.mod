// The pause program of the one-node test cluster (tests/harness/kube_node.py); no dependencies.
module pdserve.local/pause

go 1.24.0
