//go:build tools

// Package tools pins the commands this module builds, so that `go mod tidy` keeps them.
// It is never compiled (the build tag is never set); tools/k8s/build.sh runs
// `go build k8s.io/kubernetes/cmd/<name>` for each.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
