//go:build tools

// Package tools pins etcd's server module: `go build go.etcd.io/etcd/server/v3` builds the etcd binary.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
)
