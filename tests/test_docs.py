"""Every plugin hook is documented (as datasette's tests/test_docs.py checks)."""

from pathlib import Path

import pytest

from headrace.plugins import hookspecs
from headrace.plugins.manager import HOOKS

DOCS = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()


def test_hooks_are_the_registration_hooks():
    assert set(HOOKS) == {"register_engines", "register_passes", "register_batch_policies", "register_llm_policies",
                          "register_workflows"}


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_signature(hook):
    assert f"### {hook}(register)" in DOCS


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_one_line_docstring(hook):
    doc = getattr(hookspecs, hook).__doc__
    assert doc and "\n" not in doc.strip()


# README.md and docs/*.md name routes, metrics, CLI flags and config keys: each must exist in the code,
# and every route and metric must be named somewhere in them, so the next drift between the two fails
# here rather than in a user's hands. ------------------------------------------------------------

import argparse
import dataclasses
import re

from conftest import ROOT

TEXTS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


def spans(names=None) -> list[tuple[str, str]]:
    """Every inline code span of the docs (or of the files in ``names``), with the file it is in."""
    return [(name, m.group(1)) for name, text in TEXTS.items() if names is None or name in names
            for m in re.finditer(r"`([^`\n]+)`", text)]


def _route_key(method: str, path: str) -> tuple[str, str]:
    return method, re.sub(r"\{[^}]*\}", "{}", path)


def app_routes() -> set[tuple[str, str]]:
    from headrace.daemon.app import create_app
    from headrace.daemon.config import Config

    out = set()
    for route in create_app(Config()).routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                out.add(_route_key(method, route.path))
    return out


def documented_routes(names=None) -> set[tuple[str, str]]:
    found = set()
    for _, span in spans(names):
        m = re.fullmatch(r"(GET|POST|PUT|PATCH|DELETE) (/[^\s`?]*)", span)
        if m:
            found.add(_route_key(m.group(1), m.group(2)))
    return found


def test_every_documented_route_is_served():
    missing = documented_routes() - app_routes()
    assert not missing, f"the docs name routes the app does not serve: {sorted(missing)}"


def test_every_route_is_documented():
    undocumented = app_routes() - documented_routes()
    assert not undocumented, f"routes neither README.md nor docs/ names: {sorted(undocumented)}"


def test_the_api_reference_names_every_route():
    undocumented = app_routes() - documented_routes({"docs/api.md"})
    assert not undocumented, f"routes docs/api.md (the full route reference) does not name: {sorted(undocumented)}"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from headrace.bench import subcommand as bench_cli
    from headrace.daemon import commands as daemon_cli

    parser, sub = daemon_cli.build_parser()
    bench_cli.add_parser(sub)
    return {"": parser, **sub.choices}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def test_every_documented_cli_flag_exists():
    parsers = _parsers()
    every = set().union(*map(_flags, parsers.values()))
    # Not __pycache__: scripts/test turns bytecode caches on, so a run that imported scripts/bench/ leaves .pyc files.
    scripts = "\n".join(p.read_text() for p in (ROOT / "scripts").rglob("*")
                         if p.is_file() and "__pycache__" not in p.parts)
    bad = []
    for name, span in spans():
        words = span.split()
        flags = [w.strip("[]") for w in words if re.fullmatch(r"\[?--[a-z][-a-z]*\]?", w)]
        flags = [f.split("=")[0] for f in flags]
        if not flags:
            continue
        if words[0] == "headrace" and len(words) > 1 and words[1] in parsers:
            known = _flags(parsers[words[1]])  # `headrace run ... --x`: a flag of that subcommand
        elif words[0].startswith("--"):
            known = every | set(re.findall(r"--[a-z][-a-z]*", scripts))  # a bare flag: headrace's or a script's
        else:
            continue  # another program's command line (pip, systemctl, a script with its own flags)
        bad += [f"{name}: {f} in `{span}`" for f in flags if f not in known]
    assert not bad, "flags the CLI does not have:\n" + "\n".join(bad)


def _config_fields() -> dict[str, set[str]]:
    from headrace.daemon import config

    sections = {f.name: f.type for f in dataclasses.fields(config.Config)}
    out = {name: {f.name for f in dataclasses.fields(getattr(config, cls))}
           for name, cls in [("server", "ServerConfig"), ("data", "DataConfig"), ("batching", "BatchingConfig"),
                             ("collections", "CollectionsConfig"), ("sessions", "SessionsConfig"),
                             ("workflows", "WorkflowsConfig"), ("responses", "ResponsesConfig"),
                             ("residency", "ResidencyConfig"), ("memory", "MemoryConfig")]}
    assert set(out) | {"engines"} == set(sections)
    out["engines"] = {f.name for f in dataclasses.fields(config.EngineConfig)}
    out["engines.batching"] = {f.name for f in dataclasses.fields(config.BatchingOverride)}
    return out


def test_every_documented_config_key_exists():
    fields = _config_fields()
    bad = []
    for name, span in spans():
        for section, key in [*re.findall(r"^\[([a-z.]+)\](?: ([a-z_]+))?", span),
                             *re.findall(r"^(server|data|batching|collections|sessions|workflows|responses|residency|memory)\.([a-z_]+)$", span)]:
            if section == "engines.options":
                continue  # an engine plugin's own options
            if section not in fields or (key and key not in fields[section]):
                bad.append(f"{name}: `{span}`")
    assert not bad, "config keys the config does not have:\n" + "\n".join(bad)


def _exposed_metrics(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, 1)[0])
    return names


def named_metrics(names=None) -> set[str]:
    return {m for _, span in spans(names) for m in re.findall(r"^(headrace_[a-z0-9_]+)(?:\{[^}]*\})?$", span)}


def test_the_api_reference_lists_every_named_metric():
    """docs/api.md's metrics list holds every metric the other pages name (the slow test below checks
    that those are all the daemon exposes)."""
    missing = named_metrics() - named_metrics({"docs/api.md"})
    assert not missing, f"metrics named elsewhere but missing from docs/api.md: {sorted(missing)}"


@pytest.mark.slow
def test_every_documented_metric_is_exposed(server):
    exposed = _exposed_metrics(server.metrics())
    named = named_metrics()
    assert named, "README.md and docs/ name no metric"
    assert not named - exposed, f"metrics the daemon does not expose: {sorted(named - exposed)}"
    families = {re.sub(r"_(bucket|sum|count|created|total)$", "", m) for m in exposed if m.startswith("headrace_")}
    unnamed = {f for f in families if not any(n == f or n.startswith(f + "_") for n in named)}
    assert not unnamed, f"metrics neither README.md nor docs/ names: {sorted(unnamed)}"


# The docs stay readable: a README a user reads in a minute, no table cell nobody can read, and no
# link that leads nowhere (in the repository: files outside it are not there for a user). ----------

README_MAX_BYTES = 15_000
CELL_MAX_CHARS = 200


def test_the_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size < README_MAX_BYTES, f"README.md is {size} bytes: move detail into docs/ (under {README_MAX_BYTES})"


def _prose_lines(text: str):
    """(line number, line) of a markdown text outside its fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def test_no_table_cell_is_too_long():
    long = [f"{name}:{number}: a cell of {len(cell.strip())} characters"
            for name, text in TEXTS.items() for number, line in _prose_lines(text) if line.startswith("|")
            for cell in line.strip().strip("|").split("|") if len(cell.strip()) > CELL_MAX_CHARS]
    assert not long, f"table cells over {CELL_MAX_CHARS} characters (use a list or a section):\n" + "\n".join(long)


def _anchors(text: str) -> set[str]:
    """The fragments a markdown page answers to: GitHub's heading slugs and explicit <a id>s."""
    found = set(re.findall(r'<a id="([^"]+)"', text))
    for _, line in _prose_lines(text):
        m = re.match(r"#+ (.+)", line)
        if m:
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_every_link_resolves_inside_the_repository():
    bad = []
    for name, text in TEXTS.items():
        page = ROOT / name
        for _, line in _prose_lines(text):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: not checked offline
                path, _, fragment = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if ROOT.resolve() not in dest.parents and dest != ROOT.resolve():
                    bad.append(f"{name}: {target} leads outside the repository")
                elif not dest.exists():
                    bad.append(f"{name}: {target} does not exist")
                elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest.read_text()):
                    bad.append(f"{name}: {target}: no such heading")
        bad += [f"{name}: names `{m}`, outside the repository" for m in re.findall(r"`(\.\./[^`]*)`", text)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_readme_links_every_docs_page():
    readme = TEXTS["README.md"]
    unlinked = [name for name in TEXTS if name.startswith("docs/") and f"]({name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
