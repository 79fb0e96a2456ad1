"""The fault-injecting proxy in front of the real kube-apiserver (`proxy.FaultProxy`) and
its request records and one-shot fault rules (`faults`). docs/test-control-plane.md."""
