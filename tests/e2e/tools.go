//go:build tools

// Package e2e records the Kubernetes commands that build.sh compiles, so that
// `go mod tidy` keeps their dependencies in go.mod/go.sum.
package e2e

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
