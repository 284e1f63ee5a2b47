"""fdcore.envs owns every FDCORE_* environment variable: no other module names one."""

from __future__ import annotations

import ast
import os
import re

import pytest

from fdcore import envs

PACKAGE = os.path.dirname(envs.__file__)
NAME = re.compile(r"^FDCORE_[A-Z0-9_]+$")


def _named_variables(path: str) -> list[str]:
    """The FDCORE_* names a module's code spells out (string constants; docstrings aside)."""
    tree = ast.parse(open(path).read())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and NAME.match(node.value)
        and id(node) not in docstrings
    ]


def test_only_envs_names_an_fdcore_variable():
    strays = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and path != envs.__file__:
                found = _named_variables(path)
                if found:
                    strays[os.path.relpath(path, PACKAGE)] = found
    assert not strays, f"FDCORE_* variables named outside fdcore/envs.py: {strays}"


def test_every_variable_is_listed_and_read_through_get(monkeypatch):
    assert all(NAME.match(name) for name in envs.VARIABLES) and len(set(envs.VARIABLES)) == len(envs.VARIABLES)
    monkeypatch.setenv(envs.HOME, "/somewhere")
    assert envs.fdcore_home() == "/somewhere"
    monkeypatch.delenv(envs.HOME)
    assert envs.fdcore_home() == os.path.join(os.path.expanduser("~"), ".cache", "fdcore")
    with pytest.raises(KeyError, match="FDCORE_UNKNOWN"):
        envs.get("FDCORE_UNKNOWN")
