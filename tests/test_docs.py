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
