"""
``.. results:: ../benchmarks/results/NAME.md``: a benchmark's results file, rendered in the page.

The benchmarks write their results as markdown (``benchmarks/results/*.md``); the manual shows
those very files, so a number in the docs is the number a benchmark wrote, never a copy. The
subset of markdown the benchmarks write is turned into docutils nodes directly (no reST parsing,
so nothing in a file needs escaping): ``#`` headings become rubrics, pipe tables tables, ``- ``
lines bullet lists, ``<!-- ... -->`` comments (where a file keeps its command) and other lines
paragraphs, with ```code``` and ``**bold**`` inline.
"""

import re
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

_INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*")


def _inline(text):
    """Text with ``code`` and **bold** spans as docutils inline nodes."""
    result, last = [], 0
    for match in _INLINE.finditer(text):
        if match.start() > last:
            result.append(nodes.Text(text[last:match.start()]))
        if match.group(1) is not None:
            result.append(nodes.literal(match.group(1), match.group(1)))
        else:
            result.append(nodes.strong("", "", *_inline(match.group(2))))
        last = match.end()
    if last < len(text):
        result.append(nodes.Text(text[last:]))
    return result


def _paragraph(text):
    return nodes.paragraph("", "", *_inline(text))


def _cells(line):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(lines):
    header, rows = _cells(lines[0]), [_cells(line) for line in lines[2:]]
    width = len(header)
    rows = [row + [""] * (width - len(row)) for row in rows]
    group = nodes.tgroup(cols=width)
    group += [nodes.colspec(colwidth=1) for _ in range(width)]

    def row_node(cells):
        row = nodes.row()
        for cell in cells[:width]:
            entry = nodes.entry()
            entry += _paragraph(cell)
            row += entry
        return row

    head = nodes.thead()
    head += row_node(header)
    body = nodes.tbody()
    body += [row_node(cells) for cells in rows]
    group += [head, body]
    table = nodes.table(classes=["results-table"])
    table += group
    return table


def _blocks(text):
    """The file's blocks, in order, as docutils nodes."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i].rstrip()
        if not line.strip():
            i += 1
        elif line.lstrip().startswith("<!--"):
            comment = []
            while True:
                comment.append(lines[i].replace("<!--", "").replace("-->", "").strip())
                if "-->" in lines[i] or i + 1 == len(lines):
                    break
                i += 1
            i += 1
            out.append(_paragraph("How it was made: " + " ".join(part for part in comment if part)))
        elif line.startswith("#"):
            title = line.lstrip("#").strip()
            out.append(nodes.rubric(title, "", *_inline(title)))
            i += 1
        elif line.startswith("|"):
            table = []
            while i < len(lines) and lines[i].startswith("|"):
                table.append(lines[i])
                i += 1
            out.append(_table(table))
        elif line.startswith("- "):
            items = nodes.bullet_list()
            while i < len(lines) and lines[i].startswith("- "):
                item = nodes.list_item()
                item += _paragraph(lines[i][2:].strip())
                items += item
                i += 1
            out.append(items)
        else:
            paragraph = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("|", "#", "- ", "<!--")):
                paragraph.append(lines[i].strip())
                i += 1
            out.append(_paragraph(" ".join(paragraph)))
    return out


class Results(SphinxDirective):
    """Render a results file (path relative to the page, as for ``literalinclude``)."""

    required_arguments = 1
    option_spec = {"class": directives.class_option}

    def run(self):
        relative, path = self.env.relfn2path(self.arguments[0])
        path = Path(path)
        if not path.is_file():
            raise self.error(f"results file not found: {self.arguments[0]}")
        self.env.note_dependency(relative)
        container = nodes.container(classes=["results"] + self.options.get("class", []))
        container += _blocks(path.read_text(encoding="utf-8"))
        return [container]


def setup(app):
    app.add_directive("results", Results)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
