"""Sphinx configuration of the pyro_ngvi manual.

Build from the repository root (what tests/test_docs.py does, with warnings as errors):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Nothing is fetched at build time: no intersphinx; MathJax is loaded by the reader's browser.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the package from this checkout, not an installed copy
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "pyro_ngvi"
author = "the pyro_ngvi authors"
copyright = "the pyro_ngvi authors"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "results",  # docs/_ext/results.py: benchmarks/results/*.md rendered as tables
]

autodoc_member_order = "bysource"

# Every cross-reference to this package must resolve (a broken :func: renders as plain text,
# silently); the ones to torch, Pyro, BackPACK and the builtins cannot, without intersphinx.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(torch|pyro|backpack|builtins)(\..*)?"),
                        (r"py:.*", r"(callable|Tensor|Module|Distribution|optional)")]
autodoc_typehints = "none"  # the docstrings' :param: lines say the types
autodoc_inherit_docstrings = False  # Pyro's ELBO / PyroOptim docstrings are theirs, not ours
autodoc_default_options = {"members": True}  # (no "show-inheritance": a False there turns it on)

# Only blocks marked ``.. code-block:: python`` are Python (and run by tests/test_docs.py);
# a bare ``::`` block is plain text.
highlight_language = "none"
pygments_style = "sphinx"

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = []
html_theme = "alabaster"
html_static_path = []
html_theme_options = {
    "description": "Natural-gradient variational inference for Pyro",
    "fixed_sidebar": False,
    "page_width": "1100px",
    "sidebar_width": "230px",
}
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}
