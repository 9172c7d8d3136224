"""The infrastructure the tests and the benchmarks share: the server process, the fake API server, the
real control plane and node, the daemons, the Go tools. It imports nothing from tests/."""
