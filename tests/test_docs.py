"""The manual in docs/: it builds with warnings as errors, and every Python block in it runs.

Python blocks are ``.. code-block:: python`` (or ``code`` / ``sourcecode``, ``py``, ``python3``)
and ``.. testcode::``; each page's blocks run in order in one namespace, as a reader would paste
them. A block that is not meant to run (a shell command) is written as ``bash`` or ``console``.
"""

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pyro

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(path for path in DOCS.rglob("*.rst") if "_build" not in path.parts)

_DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. (?P<kind>code-block|code|sourcecode|testcode)::\s*(?P<lang>\S*)\s*$")
_PYTHON = {"python", "python3", "py"}


def python_blocks(text):
    """``(line number, source)`` of every Python block of a reST page, in order."""
    lines = text.splitlines()
    blocks = []
    for number, line in enumerate(lines):
        match = _DIRECTIVE.match(line)
        if not match:
            continue
        kind, lang = match["kind"], match["lang"]
        if not (kind == "testcode" or lang in _PYTHON):
            continue
        indent = len(match["indent"])
        body, i = [], number + 1
        while i < len(lines) and re.match(r"^\s+:[\w-]+:", lines[i]):  # the directive's options
            i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        source = textwrap.dedent("\n".join(body)).strip("\n")
        assert source, f"empty Python block at line {number + 1}"
        first = i - len(body) + next(k for k, text in enumerate(body) if text.strip())
        blocks.append((first + 1, source))
    return blocks


def test_docs_build_with_warnings_as_errors(tmp_path):
    """``python -m sphinx -W --keep-going -b html docs OUT``: the command the README names."""
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
               "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"sphinx failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    for page in PAGES:
        html = tmp_path / "html" / page.relative_to(DOCS).with_suffix(".html")
        assert html.is_file(), f"{page.relative_to(ROOT)} was not built: is it in a toctree?"


def test_the_block_finder_reads_what_sphinx_renders():
    """A self-check of :func:`python_blocks`: options skipped, bash left out, blocks kept apart."""
    page = textwrap.dedent("""
        Text.

        .. code-block:: python
           :caption: one

           a = 1

           b = a + 1

        .. code-block:: bash

           echo not python

        * a list item

          .. testcode::

             c = b * 2

        After.
        """)
    blocks = python_blocks(page)
    assert [source for _, source in blocks] == ["a = 1\n\nb = a + 1", "c = b * 2"]
    assert [page.splitlines()[number - 1].strip() for number, _ in blocks] == ["a = 1", "c = b * 2"]


def test_the_readme_is_a_front_page_whose_code_runs():
    """At most 8 KB; the two commands first (the test one is what .ci/run runs); the one command
    that builds this manual; its Python blocks run, in order, in one namespace."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) <= 8192
    first = readme.split("```bash\n", 1)[1].splitlines()[:2]
    assert first[0].startswith('python3 -m venv .venv && .venv/bin/pip install -e ".[examples]" && '
                               ".venv/bin/python examples/bnn_classification.py")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert first[1].split("#")[0].strip() == ci.replace("pip install -q ", "pip install ")  # pip's -q aside
    assert ('.venv/bin/pip install -e ".[docs]" && .venv/bin/python -m sphinx -W -b html docs docs/_build/html'
            in readme)
    namespace = {"__name__": "readme"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for number, source in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S)):
            exec(compile(source, f"README.md, Python block {number + 1}", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("page", [path for path in PAGES if python_blocks(path.read_text(encoding="utf-8"))],
                         ids=lambda path: str(path.relative_to(DOCS)))
def test_every_python_block_of_the_page_runs(page):
    namespace = {"__name__": f"docs.{page.stem}"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for number, source in python_blocks(page.read_text(encoding="utf-8")):
            # padded so that a traceback's line numbers are the page's
            code = compile("\n" * (number - 1) + source, str(page.relative_to(ROOT)), "exec")
            try:
                exec(code, namespace)
            except Exception as error:
                raise AssertionError(
                    f"the block at {page.relative_to(ROOT)}:{number} failed: {error!r}\n\n{source}") from error
    finally:
        torch.set_num_threads(threads)
        pyro.clear_param_store()


def _warning_openings():
    """``(file, line, opening)`` of every warning text in ``pyro_ngvi``: the literal start (at most five
    words, up to the first formatted value) of the message of each ``warnings.warn`` and ``warn_skip``
    call, and of each ``*message`` function whose result is warned (the watches'), read from the source."""
    found = []
    for path in sorted((ROOT / "pyro_ngvi").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            text = None
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                index = {"warn": 0, "warn_skip": 1}.get(name)
                if index is not None and len(node.args) > index:
                    text = node.args[index]
            elif isinstance(node, ast.FunctionDef) and node.name.endswith("message") and node.name != "stuck_message":
                returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return)
                           and not (n.value is None or isinstance(n.value, ast.Constant) and n.value.value is None)]
                text = returns[-1] if returns else None
            while isinstance(text, ast.BinOp):  # "..." + more: its start
                text = text.left
            if isinstance(text, ast.JoinedStr):
                head = text.values[0]
                text = head if isinstance(head, ast.Constant) else None
            if isinstance(text, ast.Constant) and isinstance(text.value, str):
                words = text.value.split()[:5]
                found.append((path.relative_to(ROOT), node.lineno, " ".join(words).rstrip(" ,.:;({")))
    return found


def test_every_warning_is_explained_with_a_remedy():
    """Each warning the package can raise is in the table of ``docs/guide/choices.rst`` ("Warnings, and
    what to do"), found by the opening words the user sees."""
    page = (DOCS / "guide" / "choices.rst").read_text(encoding="utf-8")
    table = " ".join(page.split("Warnings, and what to do", 1)[1].split("What is refused", 1)[0].split())
    openings = _warning_openings()
    assert len(openings) >= 20, openings  # the reader of the source found them
    missing = [f"{path}:{line}: {opening!r}" for path, line, opening in openings if opening not in table]
    assert not missing, "warnings not explained in docs/guide/choices.rst:\n" + "\n".join(missing)
