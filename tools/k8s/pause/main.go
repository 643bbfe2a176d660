// Command pause is the sandbox ("infra") container of every pod on the one-node test cluster:
// it holds the pod's namespaces open and does nothing else. containerd runs it from the image
// that tests/harness/kube_node_images.py writes around this binary (no registry is reachable,
// so the usual registry.k8s.io/pause cannot be pulled).
//
// It exits 0 on SIGINT or SIGTERM and reaps every exited child (as PID 1 of a pod that shares
// its process namespace it inherits orphans); otherwise it sleeps.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 16)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
