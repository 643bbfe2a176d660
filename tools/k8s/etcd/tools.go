//go:build tools

// Package tools pins the etcd server command (the main package at the root of
// go.etcd.io/etcd/server/v3) so that `go mod tidy` keeps it. It is never compiled;
// tools/k8s/build.sh runs `go build go.etcd.io/etcd/server/v3`.
package tools

import _ "go.etcd.io/etcd/server/v3"
