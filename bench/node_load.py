"""Pings at a fixed rate to a manager inside the real node (tests/node): run in the node's
network namespace, `python -m bench.node_load HOST:PORT SECRET RATE SECONDS WORKLOADS`.

Load for a memory reading, not a latency measurement: httpx over four keep-alive
connections, a ping due every 1/RATE s whatever the earlier ones are doing. Prints the
counts as JSON (requests_per_second, completed, transport_errors, statuses)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

import httpx

from app.domain.tokens import ping_token

BODY = {"status": "healthy", "version": "1.0.0"}
CONNECTIONS = 4


async def load(
    address: str, secret: str, rate: float, seconds: float, count: int
) -> dict[str, object]:
    names = [f"load-{i}" for i in range(count)]
    tokens = {name: f"Bearer {ping_token(secret, name)}" for name in names}
    statuses: Counter[int] = Counter()
    failed = 0
    limits = httpx.Limits(max_connections=CONNECTIONS)
    async with httpx.AsyncClient(
        base_url=f"http://{address}", limits=limits, timeout=5.0
    ) as client:

        async def ping(name: str) -> None:
            nonlocal failed
            try:
                response = await client.post(
                    f"/v1/workloads/{name}/health",
                    json=BODY,
                    headers={"authorization": tokens[name]},
                )
            except httpx.HTTPError:
                failed += 1
            else:
                statuses[response.status_code] += 1

        started = time.monotonic()
        pending = []
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            pending.append(asyncio.create_task(ping(names[i % count])))
        await asyncio.gather(*pending)
        wall = time.monotonic() - started
    completed = sum(statuses.values())
    return {
        "requests_per_second": round(completed / wall, 1),
        "completed": completed,
        "transport_errors": failed,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def main() -> None:
    address, secret, rate, seconds, count = sys.argv[1:6]
    print(json.dumps(asyncio.run(load(address, secret, float(rate), float(seconds), int(count)))))


if __name__ == "__main__":
    main()
