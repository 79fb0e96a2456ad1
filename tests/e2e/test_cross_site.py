"""A browser that has the page's Basic credentials cached sends them with any request to
the manager's origin, a cross-site form's POST included. Against the real process: such a
POST /v1/sync is refused (401) at the door, where before it passed the token check (and
got as far as the sync, here off for want of a cluster: 503), while the same credentials
still read the status, and the operator token as a bearer token still passes."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest

from tests.support.process import manager

pytestmark = pytest.mark.e2e

TOKEN = "operator-token-cross-site"
BASIC = "Basic " + base64.b64encode(f"operator:{TOKEN}".encode()).decode()
# what a browser adds to a form posted from another site
CROSS_SITE = {
    "origin": "https://attacker.example",
    "sec-fetch-site": "cross-site",
    "sec-fetch-mode": "navigate",
    "content-type": "application/x-www-form-urlencoded",
}


def test_a_cross_site_form_with_the_cached_basic_password_cannot_sync(tmp_path: Path) -> None:
    desired = tmp_path / "desired"
    desired.mkdir()
    (desired / "workloads.yaml").write_text("workloads: {}\n")
    env = {"API_TOKEN": TOKEN, "DESIRED_STATE_DIR": str(desired), "SYNC_INTERVAL_SECONDS": "3600"}
    with manager(env=env, workdir=tmp_path) as m:
        forged = httpx.post(
            f"{m.url}/v1/sync", headers={"authorization": BASIC, **CROSS_SITE}, content=b"x=1",
            timeout=10,
        )  # fmt: skip
        assert forged.status_code == 401, forged.text
        assert "reading only" in forged.json()["detail"]
        status = httpx.get(f"{m.url}/v1/status", headers={"authorization": BASIC}, timeout=10)
        assert status.status_code == 200
        acted = httpx.post(
            f"{m.url}/v1/sync", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
        )
        assert acted.status_code != 401, acted.text
