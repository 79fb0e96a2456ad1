"""In-process kube-apiserver emulator (apps/v1 Deployments, core/v1 Namespaces) over real HTTP.

Written directly on Starlette rather than kmock, to own label selectors, resourceVersion and
strategic-merge patching; served by `tests.support.servers` on a free loopback port so the
real `kubernetes_asyncio` client and the real `kubectl` can drive it. Behaviours honoured and
not honoured: docs/kube-emulator.md. Typical use::

    with KubeEmulator.serve(rollout_delay=0.05) as emu:
        emu.write_kubeconfig(tmp_path / "kubeconfig", namespace="apps")
        emu.add_deployment(deployment_dict, namespace="apps")
        emu.mark_bad_image("repo/x:2.0")            # rollout never ready -> deadline exceeded
        emu.fail_next("PATCH", "/deployments/api", status=500)
        emu.delay_next("GET", "/deployments", seconds=5)
        emu.edit_deployment("apps", "api", lambda d: d["spec"].update(replicas=3))
        assert emu.requests[-1].status == 200        # RecordedRequest(method, path, ...)
        emu.reset()      # empty state between tests sharing one (module-scoped) server
"""

from tests.support.kube import KubeEmulator, RecordedRequest

__all__ = ["KubeEmulator", "RecordedRequest"]
