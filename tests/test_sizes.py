"""One job per file, checked: no Python module over 500 lines, no C++ file over 800, and no Python function over 60
lines without a comment inside it that says why it is one piece (``# (long: ...)``)."""

from __future__ import annotations

import ast
import os
import re

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fdcore")
MODULE_LINES, CXX_LINES, FUNCTION_LINES = 500, 800, 60


def _files(suffixes: tuple[str, ...]) -> list[str]:
    return sorted(
        os.path.join(root, name) for root, _, names in os.walk(PACKAGE) for name in names if name.endswith(suffixes)
    )


def long_functions(path: str) -> list[str]:
    """The functions of a module over FUNCTION_LINES lines that do not say why."""
    text = open(path).read()
    lines = text.split("\n")
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LINES and not any(
                "# (long:" in line for line in lines[node.lineno - 1 : node.end_lineno]
            ):
                found.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno} {node.name} ({length} lines)")
    return found


def long_cxx_functions(path: str) -> list[str]:
    """The C++ functions over FUNCTION_LINES lines whose body does not say why (``// (long: ...)``): a function
    is a signature at column 0 (on one line or several) whose body closes with a ``}`` at column 0."""
    lines = open(path).read().split("\n")
    found, i = [], 0
    while i < len(lines):
        line = lines[i]
        starts = line[:1].isalpha() and "(" in line and not line.rstrip().endswith(";")
        if starts and not re.match(r"(namespace|struct|class|enum|union|template|extern \"C\" \{|PD_BUILD)", line):
            brace = i
            while (
                brace < len(lines)
                and not lines[brace].rstrip().endswith("{")
                and not lines[brace].rstrip().endswith(";")
            ):
                brace += 1
            if brace < len(lines) and lines[brace].rstrip().endswith("{"):
                end = brace
                while end < len(lines) and not lines[end].startswith("}"):
                    end += 1
                if end - i + 1 > FUNCTION_LINES and not any("// (long:" in text for text in lines[brace:end]):
                    found.append(f"{os.path.relpath(path, PACKAGE)}:{i + 1} ({end - i + 1} lines)")
                i = end
        i += 1
    return found


def test_no_module_is_over_its_size():
    big = [
        f"{os.path.relpath(p, PACKAGE)} ({n} lines)"
        for p in _files((".py",))
        if (n := len(open(p).read().splitlines())) > MODULE_LINES
    ]
    big += [
        f"{os.path.relpath(p, PACKAGE)} ({n} lines)"
        for p in _files((".cc", ".h"))
        if (n := len(open(p).read().splitlines())) > CXX_LINES
    ]
    assert not big, f"files past {MODULE_LINES} lines (Python) or {CXX_LINES} (C++): {big}"


def test_no_long_function_goes_unexplained(tmp_path):
    assert [f for p in _files((".py",)) for f in long_functions(p)] == []
    assert [f for p in _files((".cc", ".h")) for f in long_cxx_functions(p)] == []
    planted_cc = tmp_path / "planted.cc"
    planted_cc.write_text("void F(int x,\n       int y) {\n" + "  x += y;\n" * FUNCTION_LINES + "}\n")
    assert len(long_cxx_functions(str(planted_cc))) == 1
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n" + "    x = 1\n" * FUNCTION_LINES)
    assert len(long_functions(str(planted))) == 1
    planted.write_text("def f():\n    # (long: a planted reason)\n" + "    x = 1\n" * FUNCTION_LINES)
    assert long_functions(str(planted)) == []
