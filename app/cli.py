"""`workload-manager` / `python -m app`: serve the manager, sync once, or make a key.

Configuration errors end the process with one line on stderr naming the setting and
exit code 2, before anything starts.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from app import __version__
from app.settings import SettingsError, load_settings

if TYPE_CHECKING:
    from types import FrameType

    from app.services.syncing import SyncOutcome
    from app.settings import Settings


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app import logs, server
    from app.adapters.signing import InvalidKeyError
    from app.main import create_app

    overrides = {}
    if args.port is not None:
        overrides["port"] = args.port
    try:
        settings = load_settings(**overrides)
        logs.configure(level=settings.log_level, json_lines=settings.json_logs)
        app = create_app(settings)
    except (SettingsError, InvalidKeyError) as exc:
        print(f"workload-manager: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.reload:
        if settings.probe_port is not None:
            print("workload-manager: PROBE_PORT is not served under --reload", file=sys.stderr)
        # The reloading child builds its own app from the environment.
        uvicorn.run(
            "app.main:app_from_environment",
            factory=True,
            reload=True,
            reload_dirs=["app"],
            host=args.host or settings.host,
            port=settings.port,
            log_config=None,
            access_log=False,
            # the child imports the protocol by name and reads its bounds from the
            # environment, as it does the app
            http=server.RELOAD_PROTOCOL,
        )
        return 0
    deadline = app.state.runtime.shutdown

    received: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # the shutdown deadline starts at the signal, not once HTTP has drained
            deadline.begin()
            received.append(sig)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host or settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        server_header=False,
        # bounded request heads, head and keep-alive timeouts, the connection caps; the
        # refusals counted on /metrics; valid pings answered by the protocol
        http=server.bounded_protocol(
            server.HttpLimits.from_settings(settings),
            app.state.runtime.metrics.http_refusals,
            app.state.ping_answers,
        ),
        # open HTTP requests get a short share of the grace period; the rest is the
        # lifespan's (loops, jobs, the last report)
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_seconds * 0.1)),
    )
    # The port first, before anything starts or registers: a second manager started
    # beside a running one (`make run` twice) ends here, having touched nothing.
    try:
        listening = _listen(config.host, config.port)
    except OSError as exc:
        print(
            f"workload-manager: cannot listen on {config.host}:{config.port}: "
            f"{exc.strerror or exc} (is another manager running? PORT sets the port)",
            file=sys.stderr,
        )
        return 1
    sockets = [listening]
    if settings.probe_port is not None:
        try:
            sockets.append(_listen(config.host, settings.probe_port))
        except OSError as exc:
            listening.close()
            print(
                f"workload-manager: cannot listen on {config.host}:{settings.probe_port} "
                f"(PROBE_PORT): {exc.strerror or exc}",
                file=sys.stderr,
            )
            return 1
    try:
        Server(config).run(sockets=sockets)
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn has shut down as for SIGTERM, then raises the interrupt again;
        # exit as a shell reports an interrupted command, without a traceback
        return 128 + signal.SIGINT
    if signal.SIGINT in received:
        # the same when the interrupt raised again was ignored: the manager was started
        # with SIGINT ignored, as a script's background job is
        return 128 + signal.SIGINT
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, bound as uvicorn binds its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _sync(args: argparse.Namespace) -> int:
    import asyncio
    from contextlib import AsyncExitStack

    from app import logs
    from app.adapters.signing import InvalidKeyError
    from app.services.features.sync import SYNC
    from app.services.runtime import build_runtime, open_sync_only

    try:
        settings = load_settings()
        logs.configure(level="DEBUG" if args.verbose else "WARNING", json_lines=False)
        rt = build_runtime(settings)
    except (SettingsError, InvalidKeyError) as exc:
        print(f"workload-manager: configuration error: {exc}", file=sys.stderr)
        return 2

    async def once() -> int:
        async with AsyncExitStack() as stack:
            syncer = await open_sync_only(rt, stack)
            if syncer is None:
                print(f"workload-manager: sync is off: {rt.components[SYNC.name].reason}",
                      file=sys.stderr)  # fmt: skip
                return 2
            outcome = await syncer.sync(dry_run=args.dry_run)
        print(render_outcome(outcome))
        return 0 if outcome.ok else 1

    return asyncio.run(once())


def render_outcome(outcome: SyncOutcome) -> str:
    """The sync plan or result as a table a person reads at a glance."""
    title = "Sync plan (dry run: nothing was changed)" if outcome.dry_run else "Sync result"
    lines = [f"{title} - revision {outcome.revision or '-'}"]
    if outcome.aborted:
        lines.append(f"ABORTED: {outcome.aborted}")
        return "\n".join(lines)
    header = ("WORKLOAD", "ACTION", "FROM", "TO", "OUTCOME", "REASON")
    rows = [
        (r.name, r.action, r.from_version or "-", r.version or "-", r.outcome,
         r.error or r.reason or "")
        for r in outcome.results
    ]  # fmt: skip
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    counts = ", ".join(f"{k}={v}" for k, v in sorted(outcome.counts().items())) or "nothing"
    lines.append(f"{len(rows)} workload(s): {counts}; {outcome.duration_seconds:.2f} s")
    return "\n".join(lines)


def _migrate(args: argparse.Namespace) -> int:
    import asyncio

    from app.adapters.registry import AsyncpgRegistry, RegistryUnavailable
    from app.domain.migrations import ContractHeldBack, MigrationError
    from app.services import migrating

    try:
        settings = load_settings(_check_production=False)
    except SettingsError as exc:
        print(f"workload-manager: configuration error: {exc}", file=sys.stderr)
        return 2
    url = settings.migrate_url
    if url is None:
        print(
            "workload-manager: DATABASE_URL (or CAPABILITY_REGISTRY), or DATABASE_MIGRATE_URL, "
            "is not set",
            file=sys.stderr,
        )
        return 2
    if settings.migrate_through_pooler:
        print(
            f"workload-manager: DATABASE_URL goes through DATABASE_POOLER="
            f"{settings.database_pooler}: set DATABASE_MIGRATE_URL straight to PostgreSQL (a "
            "migration is one long transaction that waits on the other migrators' lock: the "
            "pooler's wait timeout and the pool the fleet's heartbeats share are in its way)",
            file=sys.stderr,
        )
        return 2
    directory = migrating.migrations_dir(settings.migrations_dir)

    async def run() -> int:
        registry = AsyncpgRegistry(
            url.get_secret_value(), timeout=settings.database_timeout_seconds
        )
        await registry.open()
        try:
            applied = await migrating.migrate(registry, directory)
        finally:
            await registry.close()
        for migration in applied:
            print(f"applied {migration.filename}")
        print(f"schema up to date ({len(applied)} applied now) from {directory}")
        return 0

    try:
        return asyncio.run(run())
    except ContractHeldBack as exc:
        for migration in exc.applied:
            print(f"applied {migration.filename}")
        print(f"workload-manager: migrations held back: {exc}", file=sys.stderr)
        return 1
    except MigrationError as exc:
        print(f"workload-manager: migrations refused: {exc}", file=sys.stderr)
        return 1
    except RegistryUnavailable as exc:
        print(f"workload-manager: database unreachable: {exc}", file=sys.stderr)
        return 1


def _lint_migrations(args: argparse.Namespace) -> int:
    from app.services import migrating

    directory = migrating.migrations_dir(args.directory)
    problems = migrating.lint(directory)
    for problem in problems:
        print(f"workload-manager: {directory}: {problem}", file=sys.stderr)
    if problems:
        return 1
    count = len(list(directory.glob("*.sql")))
    print(f"{count} migrations in {directory}: each declares its kind, and holds what it may")
    return 0


def _nats_settings() -> Settings | None:
    try:
        settings = load_settings(_check_production=False)
    except SettingsError as exc:
        print(f"workload-manager: configuration error: {exc}", file=sys.stderr)
        return None
    if settings.nats_url is None:
        print("workload-manager: NATS_URL is not set", file=sys.stderr)
        return None
    return settings


def _init_streams(args: argparse.Namespace) -> int:
    import asyncio

    from app.adapters.bus import BusError, JetStreamBus, NatsRefused
    from app.services.features.deps import nats_auth_of
    from app.services.streams import TIERS, init_streams

    settings = _nats_settings()
    if settings is None:
        return 2
    assert settings.nats_url is not None
    bus = JetStreamBus(
        settings.nats_url,
        name="workload-manager/init-streams",
        timeout=10,
        auth=nats_auth_of(settings),
    )

    async def run() -> None:
        await asyncio.wait_for(bus.connect(), timeout=15)
        try:
            tiers = tuple(args.tier) if args.tier else TIERS
            for what, result in await init_streams(bus, settings, tiers=tiers):
                print(f"{result:9}  {what}")
        finally:
            await bus.drain()

    try:
        asyncio.run(run())
    except (*BusError, TimeoutError, NatsRefused) as exc:
        print(f"workload-manager: NATS: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _publish(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from datetime import datetime

    from pydantic import ValidationError

    from app.adapters.bus import BusError, JetStreamBus, NatsRefused, Published
    from app.services.features.deps import nats_auth_of
    from app.services.streams import new_job, publish_job

    settings = _nats_settings()
    if settings is None:
        return 2
    assert settings.nats_url is not None
    try:
        job = new_job(
            args.type,
            payload=json.loads(args.payload),
            requirements=json.loads(args.requirements),
            idempotency_key=args.key,
            deadline=datetime.fromisoformat(args.deadline) if args.deadline else None,
        )
    except (ValueError, ValidationError) as exc:
        print(f"workload-manager: invalid job: {exc}", file=sys.stderr)
        return 2
    bus = JetStreamBus(
        settings.nats_url,
        name="workload-manager/publish",
        timeout=10,
        auth=nats_auth_of(settings),
    )

    async def run() -> Published:
        await asyncio.wait_for(bus.connect(), timeout=15)
        try:
            return await publish_job(bus, job, kind=args.kind, tier=args.tier)
        finally:
            await bus.drain()

    try:
        published = asyncio.run(run())
    except (*BusError, TimeoutError, NatsRefused) as exc:
        print(f"workload-manager: NATS: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    job_and_key = f"job {job.job_id} (key {job.idempotency_key})"
    if published.duplicate:
        # not an error: publishing under a key is idempotent (exit 0 as for a stored job)
        print(
            f"{job_and_key} not published: JetStream already had a message with that "
            f"Nats-Msg-Id within its duplicate window (stream sequence {published.seq}) and "
            "stored nothing"
        )
    else:
        print(f"published {job_and_key} as stream sequence {published.seq}")
    return 0


def _self_update(args: argparse.Namespace) -> int:
    import asyncio
    from contextlib import AsyncExitStack

    from app.adapters.kube import KubeError
    from app.adapters.signing import InvalidKeyError
    from app.adapters.versions import VersionSourceError
    from app.domain.updates import VersionFileError
    from app.services.features.self_update import SELF_UPDATE
    from app.services.runtime import build_runtime, open_self_update_only

    try:
        rt = build_runtime(load_settings(_check_production=False))
    except (SettingsError, InvalidKeyError) as exc:
        print(f"workload-manager: configuration error: {exc}", file=sys.stderr)
        return 2

    async def check() -> int:
        async with AsyncExitStack() as stack:
            updater = await open_self_update_only(rt, stack)
            if updater is None:
                reason = rt.components[SELF_UPDATE.name].reason
                print(f"workload-manager: self-update is off: {reason}", file=sys.stderr)
                return 2
            try:
                decision = await updater.check()
            except (VersionSourceError, VersionFileError, KubeError) as exc:
                print(f"workload-manager: cannot decide: {exc}", file=sys.stderr)
                return 1
        last = updater.last or {}
        print(f"running:   {last.get('running')}")
        print(f"published: {last.get('published')}")
        print(f"decision:  {decision.choice.value} ({decision.reason})")
        if decision.image:
            print(f"image:     {decision.image}")
        return 0

    return asyncio.run(check())


def _openapi(args: argparse.Namespace) -> int:
    import json

    from app.main import create_app
    from app.settings import Settings

    document = create_app(Settings(_env_file=None)).openapi()
    print(json.dumps(document, indent=2, sort_keys=True))
    return 0


def _schema(args: argparse.Namespace) -> int:
    import json

    from app.domain.jobs import job_json_schema

    print(json.dumps(job_json_schema(), indent=2, sort_keys=True))
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from app.adapters.signing import generate_keypair

    pem, seed, public = generate_keypair()
    if args.format == "pem":
        print(pem, end="")
    else:
        print(f"NODE_PRIVATE_KEY={seed}")
    print(f"# public key (base64, raw 32 bytes): {public}", file=sys.stderr)
    return 0


def _sign_version_file(args: argparse.Namespace) -> int:
    """Write `<file>.sig`, the detached signature the manager checks when
    SELF_UPDATE_PUBLIC_KEY is set; print that setting for the key on stdout."""
    import base64
    from pathlib import Path

    from app.adapters.signing import InvalidKeyError, parse_private_key, public_key_bytes
    from app.adapters.versions import sign_version_file
    from app.domain.updates import MAX_VERSION_FILE_BYTES, SIGNATURE_SUFFIX

    key_file, version_file = Path(args.key_file), Path(args.file)
    try:
        text = key_file.read_text().strip()
        content = version_file.read_bytes()
    except OSError as exc:
        print(f"workload-manager: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        print(f"workload-manager: {key_file}: not a key (not text)", file=sys.stderr)
        return 2
    try:  # the key as `keygen` prints it (either format), or the bare seed
        key = parse_private_key(text.removeprefix("NODE_PRIVATE_KEY="), source=str(key_file))
    except InvalidKeyError as exc:
        print(f"workload-manager: {exc}", file=sys.stderr)
        return 2
    if len(content) > MAX_VERSION_FILE_BYTES:
        print(
            f"workload-manager: {version_file} is larger than {MAX_VERSION_FILE_BYTES} bytes: "
            "the manager would refuse it",
            file=sys.stderr,
        )
        return 2
    signature = version_file.with_name(version_file.name + SIGNATURE_SUFFIX)
    signature.write_bytes(sign_version_file(content, key))
    print(f"SELF_UPDATE_PUBLIC_KEY={base64.b64encode(public_key_bytes(key.public_key())).decode()}")
    print(f"# wrote {signature}: publish it beside the version file", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workload-manager", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the manager (HTTP API and loops)")
    serve.add_argument("--host", help="listen address (default: HOST, 0.0.0.0)")
    serve.add_argument("--port", type=int, help="listen port (default: PORT, 8080)")
    serve.add_argument("--reload", action="store_true", help="restart on code changes (dev)")
    serve.set_defaults(func=_serve)

    sync = sub.add_parser("sync", help="sync deployments with the desired state once")
    sync.add_argument("--once", action="store_true", required=True, help="one sync, then exit")
    sync.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    sync.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    sync.set_defaults(func=_sync)

    migrate = sub.add_parser("migrate", help="apply pending schema migrations, then exit")
    migrate.set_defaults(func=_migrate)

    lint_migrations = sub.add_parser(
        "lint-migrations",
        help="check each migration's kind (expand or contract) against what it holds",
    )
    lint_migrations.add_argument(
        "directory",
        nargs="?",
        type=Path,
        help="the migrations folder (default: MIGRATIONS_DIR's default, the source tree's)",
    )
    lint_migrations.set_defaults(func=_lint_migrations)

    streams = sub.add_parser("init-streams", help="create or update the JetStream topology")
    streams.add_argument(
        "--tier",
        action="append",
        choices=("A", "B", "C"),
        help="consumers and ledger buckets for these tiers only",
    )
    streams.set_defaults(func=_init_streams, tier=None)

    publish = sub.add_parser("publish", help="publish one job (schema job/v1)")
    publish.add_argument("--kind", choices=("online", "offline", "write"), required=True)
    publish.add_argument("--tier", choices=("A", "B", "C"), required=True)
    publish.add_argument("--type", required=True, help="job type, e.g. memory.write or noop")
    publish.add_argument("--payload", default="{}", help="JSON object")
    publish.add_argument("--requirements", default="{}", help="JSON object")
    publish.add_argument("--key", help="idempotency key (default: the job id)")
    publish.add_argument("--deadline", help="RFC 3339 time after which the job expires")
    publish.set_defaults(func=_publish)

    update = sub.add_parser("self-update", help="show what the self-update would do")
    update.add_argument(
        "--check", action="store_true", required=True, help="decide, change nothing"
    )
    update.set_defaults(func=_self_update)

    schema = sub.add_parser("job-schema", help="print the JSON Schema of job/v1")
    schema.set_defaults(func=_schema)

    openapi = sub.add_parser("openapi", help="print the HTTP API's OpenAPI document")
    openapi.set_defaults(func=_openapi)

    keygen = sub.add_parser("keygen", help="print a new Ed25519 node key pair")
    keygen.add_argument(
        "--format",
        choices=("seed", "pem"),
        default="seed",
        help="seed: NODE_PRIVATE_KEY=<base64 seed> (default); pem: PKCS#8 PEM",
    )
    keygen.set_defaults(func=_keygen)

    sign = sub.add_parser(
        "sign-version-file", help="write <file>.sig, the file's Ed25519 signature"
    )
    sign.add_argument("file", help="the version file, exactly as it will be published")
    sign.add_argument(
        "--key-file", required=True, help="the release key (`keygen` output: PEM or seed)"
    )
    sign.set_defaults(func=_sign_version_file)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code
