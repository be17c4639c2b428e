"""GET /docs: Swagger UI over /openapi.json, with its assets served by the daemon itself.

The daemon runs offline, so the page cannot load Swagger UI from a CDN: its dist files (Swagger
UI 5, which reads OpenAPI 3.1) come from the ``swagger-ui-py`` package's ``static`` folder, under
/docs/assets/. Only the files the package ships are served, by name; the package's own code (its
framework adapters) is not used.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response

from headrace.daemon.errors import APIError

ASSETS = "/docs/assets"

PAGE = f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>headrace API</title>
  <link rel="stylesheet" href="{ASSETS}/swagger-ui.css">
  <link rel="icon" type="image/png" href="{ASSETS}/favicon-32x32.png">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="{ASSETS}/swagger-ui-bundle.js"></script>
  <script src="{ASSETS}/swagger-ui-standalone-preset.js"></script>
  <script>
    window.ui = SwaggerUIBundle({{
      url: "/openapi.json",
      dom_id: "#swagger-ui",
      presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
      layout: "StandaloneLayout",
      persistAuthorization: true
    }});
  </script>
</body>
</html>
"""


@functools.cache
def asset_files() -> dict[str, Path]:
    """The files swagger-ui-py ships, by name (nothing else under /docs/assets is served)."""
    spec = importlib.util.find_spec("swagger_ui")  # located, not imported: its adapters pull in jinja2 and yaml
    if spec is None or spec.origin is None:
        return {}
    root = Path(spec.origin).parent / "static"
    return {p.name: p for p in root.iterdir() if p.is_file()}


async def docs_page(request: Request) -> Response:
    return HTMLResponse(PAGE)


async def docs_asset(request: Request) -> Response:
    name = request.path_params["file"]
    path = asset_files().get(name)
    if path is None:
        raise APIError(404, f"no documentation asset {name!r}", param="file", code="not_found")
    return FileResponse(path, headers={"Cache-Control": "public, max-age=86400"})
