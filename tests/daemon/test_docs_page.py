"""/docs: Swagger UI over /openapi.json, every asset served by the daemon itself (no CDN; no models loaded)."""

from __future__ import annotations

import re

import anyio
import httpx
import pytest

from headrace.daemon.app import create_app
from headrace.daemon.config import Config


@pytest.fixture(scope="module")
def app():
    return create_app(Config())


def get_all(app, paths):
    async def fetch():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get(p) for p in paths]

    return anyio.run(fetch)


def test_docs_page_loads_its_assets_from_the_daemon(app):
    (page,) = get_all(app, ["/docs"])
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"} <= set(assets)
    assert all(a.startswith("/docs/assets/") for a in assets)  # nothing from another host
    assert 'url: "/openapi.json"' in page.text
    served = get_all(app, assets)
    for path, r in zip(assets, served):
        assert r.status_code == 200, path
        assert len(r.content) > 100, path
    kinds = {path.rsplit(".", 1)[1]: r.headers["content-type"] for path, r in zip(assets, served)}
    assert "javascript" in kinds["js"] and kinds["css"].startswith("text/css")
    # The bundle is Swagger UI itself, not a placeholder.
    assert b"SwaggerUIBundle" in served[assets.index("/docs/assets/swagger-ui-bundle.js")].content


@pytest.mark.parametrize("name", ["nope.js", "%2e%2e", "%2e%2e%2f__init__.py"])
def test_an_unknown_asset_is_a_404_envelope(app, name):
    (r,) = get_all(app, [f"/docs/assets/{name}"])
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_docs_routes_are_in_the_contract(app):
    (r,) = get_all(app, ["/openapi.json"])
    paths = r.json()["paths"]
    assert "text/html" in paths["/docs"]["get"]["responses"]["200"]["content"]
    assert "/docs/assets/{file}" in paths
