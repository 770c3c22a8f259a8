"""tests/e2e/forms.py, the table of the end-to-end tests that run again in each body-holding
deployment form, holds to the tests themselves: a test whose body reads the deployment form
(`deployment()`, `.deployment_form`, BODY_HOLD_FORMS) asserts something that differs by form, so
it is named there, in PER_FORM (run in every form) or in ONCE (with the reason it runs in one);
and every name there is a test that exists.

Reads files only: no network, no build.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.e2e.forms import ONCE, PER_FORM

E2E = Path(__file__).resolve().parents[1] / "e2e"


def functions_of(path: Path) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def reads_the_form(function: ast.AST) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "deployment":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "deployment_form":
            return True
        if isinstance(node, ast.Name) and node.id == "BODY_HOLD_FORMS":
            return True
    return False


def form_readers(source: str) -> set[tuple[str, str]]:
    """(file, test) of every test in `source` (a directory of test files) that reads the form."""
    found = set()
    for path in sorted(Path(source).glob("test_*.py")):
        for name, function in functions_of(path).items():
            if reads_the_form(function):
                found.add((path.name, name))
    return found


def named(*tables: dict[str, dict[str, str]]) -> set[tuple[str, str]]:
    return {(file, test) for table in tables for file, tests in table.items() for test in tests}


def test_every_test_that_reads_the_form_is_in_the_table():
    unnamed = form_readers(str(E2E)) - named(PER_FORM, ONCE)
    assert not unnamed, ("these tests read the deployment form but tests/e2e/forms.py names them nowhere: "
                         + ", ".join(f"{f}::{t}" for f, t in sorted(unnamed)))


def test_every_test_the_table_names_exists():
    missing = [(file, test) for file, test in sorted(named(PER_FORM, ONCE))
               if not (E2E / file).is_file() or test not in functions_of(E2E / file)]
    assert not missing, f"tests/e2e/forms.py names tests that do not exist: {missing}"


def test_a_test_runs_in_every_form_or_once_not_both():
    assert not named(PER_FORM) & named(ONCE)


def test_every_entry_says_why():
    for table in (PER_FORM, ONCE):
        for file, tests in table.items():
            for test, reason in tests.items():
                assert isinstance(reason, str) and len(reason) > 40, (file, test)


@pytest.mark.parametrize("reader", [
    "def test_x(gateway):\n    if gateway.deployment_form in ('a',):\n        pass\n",
    "def test_x():\n    assert deployment() == 'envoyfilter'\n",
    "def test_x():\n    assert 'wasmplugin' in BODY_HOLD_FORMS\n",
])
def test_a_new_test_that_reads_the_form_is_found(tmp_path, reader):
    (tmp_path / "test_new.py").write_text(reader + "\n\ndef test_y():\n    assert True\n")
    assert form_readers(str(tmp_path)) == {("test_new.py", "test_x")}
