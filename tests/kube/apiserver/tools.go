//go:build tools

// Package tools pins the Kubernetes commands this module builds: `go build k8s.io/kubernetes/cmd/kube-apiserver`, `cmd/kube-controller-manager`, `cmd/kubelet` and `cmd/kube-proxy`.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
