"""The public plugin API: contrib plugins use only it, and importing it stays within the plugins layer."""

import ast
import re
import subprocess
import sys

from conftest import ROOT

from headrace.plugins import api

ALLOWED = {"headrace.plugins.api", "headrace.plugins.hookspecs"}
CONTRIB = sorted(p for p in (ROOT / "plugins-contrib").glob("headrace-*/headrace_*/**/*.py") if "build" not in p.parts)


def _headrace_imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "headrace" or m.startswith("headrace.")}


def test_contrib_plugins_import_only_the_public_api():
    assert len({p.parts[-3] for p in CONTRIB}) >= 4  # vllm, sglang, hashembed, ray
    bad = {str(p.relative_to(ROOT)): sorted(_headrace_imports(p) - ALLOWED) for p in CONTRIB}
    assert not {k: v for k, v in bad.items() if v}


def test_importing_the_api_loads_no_daemon_code():
    code = ("import sys, headrace.plugins.api; "
            "print(sorted(m for m in sys.modules if m.startswith(('headrace.daemon', 'headrace.graph'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_hosting_names_resolve_to_the_daemons_own():
    from headrace.daemon.app import create_app
    from headrace.daemon.errors import APIError

    assert api.create_app is create_app and api.APIError is APIError


def test_every_public_name_resolves_and_is_documented():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    documented = set(re.findall(r"`([A-Za-z_]+)`", docs))
    for name in api.__all__:
        getattr(api, name)
    assert not set(api.__all__) - documented
