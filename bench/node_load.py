"""Pings at a fixed rate to a manager inside the real node (tests/node): run in the node's
network namespace, `python -m bench.node_load HOST:PORT SECRET RATE SECONDS WORKLOADS`.
Prints the phase's summary as JSON (bench/loadgen.py's open loop)."""

from __future__ import annotations

import json
import sys

from app.domain.tokens import ping_token
from bench.loadgen import LoadGenerator, encode_request, run_async

BODY = b'{"status":"healthy","version":"1.0.0"}'


def main() -> None:
    address, secret, rate, seconds, count = sys.argv[1:6]
    host, port = address.rsplit(":", 1)
    names = [f"load-{i}" for i in range(int(count))]
    requests = [
        encode_request(
            method="POST",
            path=f"/v1/workloads/{name}/health",
            host=address,
            body=BODY,
            headers=[
                ("Authorization", f"Bearer {ping_token(secret, name)}"),
                ("Content-Type", "application/json"),
            ],
        )
        for name in names
    ]
    gen = LoadGenerator(host, int(port), requests)
    result = run_async(gen.open_loop(connections=4, rate=float(rate), duration=float(seconds)))
    print(json.dumps(result.summary()))


if __name__ == "__main__":
    main()
