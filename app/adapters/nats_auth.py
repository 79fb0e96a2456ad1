"""How the manager proves who it is to NATS: paths to credentials, and the options nats-py
takes from them. Apart from the bus so that deciding the worker's config (the settings'
paths, app/services/components.py) imports no NATS client.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class NatsAuth:
    """How the manager proves who it is to NATS, besides a user:password or token in the
    URL (nats-py reads those from it): a creds file (a user JWT and its nkey seed), an
    nkey seed file, and TLS. Paths only; the secrets stay in their files."""

    creds_file: Path | None = None
    nkey_seed_file: Path | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.creds_file is not None:
            options["user_credentials"] = str(self.creds_file)
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = str(self.nkey_seed_file)
        if self.tls_ca_file is not None or self.tls_cert_file is not None:
            context = ssl.create_default_context(
                cafile=str(self.tls_ca_file) if self.tls_ca_file is not None else None
            )
            if self.tls_cert_file is not None and self.tls_key_file is not None:
                context.load_cert_chain(str(self.tls_cert_file), str(self.tls_key_file))
            options["tls"] = context
        return options
