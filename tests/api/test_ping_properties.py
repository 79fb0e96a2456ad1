"""Property tests: whatever a workload sends, a ping gets 204 or a clean 4xx, never a 5xx,
and only a valid ping changes the book."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.main import create_app
from app.settings import Settings

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
BODIES = st.one_of(
    st.builds(
        lambda status, extra: {"status": status, **extra},
        st.sampled_from(["healthy", "degraded", "unhealthy", "fine", "", None]),
        st.dictionaries(
            st.sampled_from(["version", "message", "details", "other"]), JSON, max_size=3
        ),
    ),
    JSON,
)
VALID_NAMES = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
OTHER_NAMES = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="/?#%\\"),
    min_size=1,
    max_size=30,
)
NAMES = st.one_of(VALID_NAMES, OTHER_NAMES)


def app_for(fast: bool) -> Any:
    return create_app(Settings(_env_file=None, embedded_services=False, ping_fast_path=fast))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=NAMES, body=BODIES, fast=st.booleans())
async def test_any_ping_is_204_or_a_clean_4xx(name: str, body: Any, fast: bool) -> None:
    app = app_for(fast)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as client:
        response = await client.post(
            f"/v1/workloads/{name}/health",
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
    assert response.status_code in (204, 404, 405, 413, 422), response.text
    book = app.state.runtime.book
    if response.status_code == 204:
        assert book.view(name) is not None
    else:
        assert book.names() == []
        if response.status_code == 422:
            assert response.json()["detail"][0]["loc"][0] in ("path", "body")


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=200))
async def test_arbitrary_bytes_never_break_the_ping_route(raw: bytes) -> None:
    app = app_for(True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as client:
        response = await client.post("/v1/workloads/api/health", content=raw)
    assert response.status_code in (204, 422)
