"""Local stand-ins for the manager's peers, shared by the tests and the benchmarks: the
backend (tests' contract checks included), a real Kubernetes control plane from the pinned
binaries, threaded servers on loopback ports and the sync's desired-state fixtures.

Nothing here imports the tests or the benchmarks.
"""
