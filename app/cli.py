"""`workload-manager` / `python -m app`: serve the manager, or manage its keys.

Configuration errors end the process with one line on stderr naming the setting and
exit code 2, before anything starts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app import __version__
from app.settings import SettingsError, load_settings


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app import logs
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
        )
        return 0
    uvicorn.run(
        app,
        host=args.host or settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) or None,
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workload-manager", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the manager (HTTP API and loops)")
    serve.add_argument("--host", help="listen address (default: HOST, 0.0.0.0)")
    serve.add_argument("--port", type=int, help="listen port (default: PORT, 8080)")
    serve.add_argument("--reload", action="store_true", help="restart on code changes (dev)")
    serve.set_defaults(func=_serve)

    keygen = sub.add_parser("keygen", help="print a new Ed25519 node key pair")
    keygen.add_argument(
        "--format",
        choices=("seed", "pem"),
        default="seed",
        help="seed: NODE_PRIVATE_KEY=<base64 seed> (default); pem: PKCS#8 PEM",
    )
    keygen.set_defaults(func=_keygen)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code
