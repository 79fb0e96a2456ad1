"""The job data plane on a three-server JetStream cluster whose stream leader dies.

Three nats-server processes clustered over loopback routes; the job, event and ledger
streams with three replicas; two manager processes (two node ids, one tier) sharing the
tier's durable consumer, their idempotency ledger in the replicated key-value bucket (no
database). 1,000 jobs are published, and while they run the server leading the job
stream is killed, then started again. The servers have the fleet's accounts as shipped
(k8s/nats/auth.conf.example, or `NATS_AUTH_FILE`): the operator makes the topology in the
account JOBS, the producers publish the jobs, and the managers run on tier A's nkey alone,
through the services JOBS exports to tier A. Each job's effect is counted by the workload
it calls, outside the managers: every one happens exactly once, each job has its one
`job.completed` event, and the restarted server catches up with the others.
"""

from __future__ import annotations

import functools
from pathlib import Path

import nats.errors

from app.adapters.bus import JetStreamBus, NatsAuth
from app.adapters.kv_ledger import bucket as ledger_bucket
from app.domain.jobs import STREAMS
from app.domain.nats_servers import NatsServers
from app.services.streams import init_streams, new_job, publish_job
from app.settings import Settings
from standins.servers import serve
from tests.support.jobs_world import (
    EFFECT_URL,
    EffectCounter,
    consumer_bound,
    consumer_settled,
    publisher,
    stored_events,
    through_proxy,
)
from tests.support.nats_auth import OPERATOR, PRODUCERS, auth_file, filled, new_nkey_user
from tests.support.nats_cluster import has_meta_leader, running_cluster, stream_cluster
from tests.support.polling import eventually
from tests.support.process import ManagerProcess

JOBS = 1000
KILL_AFTER = 300  # effects seen before the leader is killed
RESTART_AFTER = 700  # ... and before it is started again
STREAM = STREAMS["write"]


async def _effects(counter: EffectCounter, at_least: int) -> bool:
    return len(counter.calls) >= at_least


async def _caught_up(urls: list[str], stream: str, name: str) -> bool:
    try:
        group = await stream_cluster(urls, stream)
    except (nats.errors.Error, TimeoutError):  # electing a leader: ask again
        return False
    replica = group["replicas"].get(name)
    if group["leader"] == name:
        return all(r["current"] and r["lag"] == 0 for r in group["replicas"].values())
    return bool(replica and replica["current"] and replica["lag"] == 0)


async def test_no_job_is_lost_or_run_twice_when_the_stream_leader_dies(tmp_path: Path) -> None:
    # paused while the jobs are published, so that the leader dies with most of them to run
    counter = EffectCounter(hold=0.02, paused=True)
    keys = [f"clustered-{i:04d}" for i in range(JOBS)]
    users = {name: new_nkey_user(tmp_path, name) for name in ("A", PRODUCERS)}
    accounts = filled(auth_file().read_text(), users)
    with (
        running_cluster(tmp_path / "nats", auth=accounts) as cluster,
        serve(counter.app()) as workload,
    ):
        operator = cluster.as_user(*OPERATOR)
        await eventually(functools.partial(has_meta_leader, operator), within=60)
        topology = JetStreamBus(NatsServers.parse(",".join(operator)), name="operator", timeout=10)
        await topology.connect()
        try:
            await init_streams(topology, Settings(_env_file=None, nats_stream_replicas=3))
        finally:
            await topology.drain()
        managers = []
        for node in ("node-c1", "node-c2"):
            (tmp_path / node).mkdir()
            env = {
                "NATS_URL": cluster.url,
                "NATS_NKEY_SEED_FILE": str(users["A"].seed_file),
                "NATS_AUTO_INIT_STREAMS": "false",
                "NATS_STREAM_REPLICAS": "3",
                "NODE_ID": node,
                "NODE_TIER": "A",
                "REPORT_ENABLED": "false",
                "WORKER_CONCURRENCY": "8",
                # the production default: a job's lease (from the ack wait) must outlast
                # the leader's failover, which took over 10 s on a busy two-core machine;
                # a lease that runs out mid-failover lets the other node run the job too
                "JOB_ACK_WAIT_SECONDS": "30",
                "JOB_HELD_DELAY_SECONDS": "0.5",
                "SHUTDOWN_GRACE_SECONDS": "10",
                **through_proxy(workload.url),
            }
            managers.append(ManagerProcess(env=env, workdir=tmp_path / node))
        try:
            for proc in managers:
                proc.start(timeout=60)
            await eventually(lambda: consumer_bound(operator, STREAM, 2), within=60, step=0.2)
            producer = NatsAuth(nkey_seed_file=users[PRODUCERS].seed_file)
            async with publisher(cluster.url, auth=producer) as bus:
                effect = {"url": EFFECT_URL, "body": {}}
                for key in keys:
                    job = new_job("http", idempotency_key=key, payload=effect)
                    await publish_job(bus, job, kind="write", tier="A")
            counter.resume()
            await eventually(lambda: _effects(counter, KILL_AFTER), within=120, step=0.05)
            leader = (await stream_cluster(operator, STREAM))["leader"]
            cluster.kill(leader)
            at_kill = len(counter.calls)
            survivors = [
                u for u, m in zip(operator, cluster.members, strict=True) if m.name != leader
            ]
            await eventually(lambda: _effects(counter, RESTART_AFTER), within=180, step=0.1)
            at_restart = len(counter.calls)
            cluster.restart(leader)
            await eventually(lambda: consumer_settled(survivors, STREAM), within=180, step=0.5)
            for stream in (STREAM, "MM_EVENTS", f"KV_{ledger_bucket('A')}"):
                await eventually(
                    functools.partial(_caught_up, operator, stream, leader),
                    within=120, step=0.5,
                )  # fmt: skip
            events = await stored_events(operator)
        finally:
            logs = "".join(proc.log()[-20000:] for proc in managers)
            for proc in managers:
                proc.stop()
    when = f"leader {leader} killed at {at_kill} effects, restarted at {at_restart}"
    assert at_kill < JOBS, f"{when}: the leader died after the run; make the workload slower"
    assert len(counter.calls) == JOBS, f"{when}\n{logs}"
    twice = {k: n for k, n in counter.calls.items() if n != 1}
    assert twice == {}, f"{when}: {twice}\n{logs}"
    completed = [
        body["idempotency_key"] for subject, body in events if subject.endswith(".completed")
    ]
    assert sorted(completed) == keys, logs
