"""Per-workload ping tokens: hex HMAC-SHA256(secret, workload name).

The manager hands each managed workload its token (as an environment variable) and
checks pings against it, without storing any token.
"""

from __future__ import annotations

import hashlib
import hmac


def ping_token(secret: str, name: str) -> str:
    return hmac.new(secret.encode(), name.encode(), hashlib.sha256).hexdigest()
