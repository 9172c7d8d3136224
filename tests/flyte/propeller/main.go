// Command flytepropeller is Flyte's flytepropeller controller (flytepropeller/cmd/controller) with the
// pod plugin alone: Flyte's own main loads every plugin, Spark's among them, whose module the Go module
// proxy does not serve. The pod plugin registers the container and sidecar task types (raw-container tasks
// with copilot among them).
package main

import (
	"github.com/flyteorg/flyte/flytepropeller/cmd/controller/cmd"

	_ "github.com/flyteorg/flyte/flyteplugins/go/tasks/plugins/k8s/pod"
)

func main() {
	cmd.Execute()
}
