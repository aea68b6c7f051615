"""The design notes of the code: ``[Note: Title]`` blocks that explain a decision where its code lives.

A note is defined where ``[Note: Title]`` opens a docstring or a comment and the explanation follows it; elsewhere
``[Note: Title]`` (``see [Note: ...]``) refers to one. ``python -m tierstore.tools.notes`` prints the index that
docs/design-notes.md holds (a test keeps the two equal).
"""

from __future__ import annotations

import os
import re

# opening a line, a docstring or a comment, and followed by its text (a reference there goes on "in file.py" or
# closes a parenthesis)
_DEFINITION = re.compile(r'(?m)^[ \t]*(?:r?"""|# )?[ \t]*\[Note: ([^\]]+)\](?=\s+(?!in\s)[\w(`])')
_ANY = re.compile(r"\[Note: ([A-Z][^\]]*)\]")


def _title(raw: str) -> str:
    """A title as written across lines of a comment or docstring, in one line."""
    return " ".join(raw.replace("#", " ").split())


def _sources(root: str) -> list[str]:
    out = []
    for top in ("tierstore", "integrations"):
        for d, _, files in os.walk(os.path.join(root, top)):
            out += [os.path.join(d, f) for f in files if f.endswith(".py") and f != "notes.py"]
    return sorted(os.path.relpath(p, root) for p in out)


def definitions(root: str) -> list[tuple[str, str]]:
    """(title, file) of every note defined in the code, by title."""
    found = set()
    for path in _sources(root):
        with open(os.path.join(root, path)) as f:
            found |= {(_title(m.group(1)), path) for m in _DEFINITION.finditer(f.read())}
    return sorted(found)


def references(root: str) -> set[str]:
    """Every note title named anywhere in the code."""
    out: set[str] = set()
    for path in _sources(root):
        with open(os.path.join(root, path)) as f:
            out |= {_title(t) for t in _ANY.findall(f.read())}
    return out


def index(root: str) -> str:
    lines = ["# Design notes", "",
             "Decisions are explained where their code lives, in blocks that open with `[Note: Title]`; the code "
             "refers to them as `see [Note: Title]`. This index lists each with the file that holds it (made by "
             "`python -m tierstore.tools.notes`).", ""]
    lines += [f"- **{title}**: `{path}`" for title, path in definitions(root)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(index(os.path.join(os.path.dirname(__file__), "..", "..")), end="")
