//go:build tools

// Package tools pins the kube-router command so that `go mod tidy` keeps it. It is never compiled;
// tools/k8s/build.sh runs `go build github.com/cloudnativelabs/kube-router/v2/cmd/kube-router`.
package tools

import _ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
