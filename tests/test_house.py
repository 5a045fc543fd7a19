"""The house sizes of issue 25 (DESIGN section 3), kept by the tests: a module of at most 600
lines, a class of at most 400, NGVI's docstring under 60 lines (the maths lives in the docs)."""

import ast
from pathlib import Path

import pyro_ngvi

PACKAGE = Path(pyro_ngvi.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_at_most_600_lines():
    lines = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in MODULES}
    assert len(lines) > 30
    assert {name: n for name, n in lines.items() if n > 600} == {}


def test_every_class_is_at_most_400_lines():
    sizes = {f"{path.relative_to(PACKAGE)}:{node.name}": node.end_lineno - node.lineno + 1
             for path in MODULES for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    assert "optim.py:NGVI" in sizes
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_ngvi_docstring_is_under_60_lines():
    assert 20 < len(pyro_ngvi.NGVI.__doc__.strip().splitlines()) < 60
