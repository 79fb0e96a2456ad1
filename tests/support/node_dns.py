"""The real node's cluster DNS: what K3S's CoreDNS answers that the manager's install needs,
`<service>.<namespace>.svc[.cluster.local]` to the Service's cluster IP, read from the API
server (cached for a second). Other names get NXDOMAIN; the node has no way out to ask
anyone else. Standard library only (it runs inside the node's network namespace):

    python -m tests.support.node_dns --listen 10.250.0.1 --server https://10.250.0.1:6443 \
        --ca ca.crt --cert admin.crt --key admin.key
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import struct
import time
import urllib.request

TTL = 5
A, AAAA = 1, 28
NXDOMAIN = 3
MAX_QUERY = 512


class Services:
    def __init__(self, server: str, context: ssl.SSLContext) -> None:
        self.server, self.context = server, context
        self.read_at = 0.0
        self.ips: dict[tuple[str, str], str] = {}

    def lookup(self, name: str, namespace: str) -> str | None:
        if (name, namespace) not in self.ips or time.monotonic() - self.read_at > 1.0:
            self._read()
        return self.ips.get((name, namespace))

    def _read(self) -> None:
        url = f"{self.server}/api/v1/services"
        try:
            with urllib.request.urlopen(url, context=self.context, timeout=3) as response:
                items = json.loads(response.read(8 * 1024 * 1024))["items"]
        except (OSError, ValueError, KeyError):
            return
        self.ips = {
            (item["metadata"]["name"], item["metadata"]["namespace"]): item["spec"]["clusterIP"]
            for item in items
            if item.get("spec", {}).get("clusterIP") not in (None, "", "None")
        }
        self.read_at = time.monotonic()


def _question(packet: bytes) -> tuple[str, int, int]:
    """The query's name, type and the offset just past its question."""
    labels, at = [], 12
    while True:
        length = packet[at]
        if length == 0:
            at += 1
            break
        if length > 63:
            raise ValueError("compressed or oversized label in a question")
        labels.append(packet[at + 1 : at + 1 + length].decode("ascii").lower())
        at += 1 + length
    qtype, _qclass = struct.unpack("!HH", packet[at : at + 4])
    return ".".join(labels), qtype, at + 4


def answer(packet: bytes, services: Services) -> bytes | None:
    if len(packet) < 12 or len(packet) > MAX_QUERY:
        return None
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if flags & 0x8000 or qdcount != 1:
        return None
    try:
        name, qtype, end = _question(packet)
    except (IndexError, ValueError, UnicodeDecodeError, struct.error):
        return None
    parts = name.removesuffix(".cluster.local").split(".")
    ip = None
    if len(parts) == 3 and parts[2] == "svc":
        ip = services.lookup(parts[0], parts[1])
    rd = flags & 0x0100
    header_flags = 0x8400 | rd  # a response, authoritative
    records = b""
    if ip is None:
        header_flags |= NXDOMAIN
    elif qtype == A:
        records = struct.pack("!HHHIH", 0xC00C, A, 1, TTL, 4) + socket.inet_aton(ip)
    count = 1 if records else 0
    header = struct.pack("!HHHHHH", ident, header_flags, 1, count, 0, 0)
    return header + packet[12:end] + records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args()
    context = ssl.create_default_context(cafile=args.ca)
    context.load_cert_chain(args.cert, args.key)
    services = Services(args.server, context)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((args.listen, 53))
    while True:
        packet, peer = sock.recvfrom(MAX_QUERY + 1)
        reply = answer(packet, services)
        if reply is not None:
            sock.sendto(reply, peer)


if __name__ == "__main__":
    main()
