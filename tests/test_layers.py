"""The package's layers, enforced: a module imports only from its own layer and those below (DESIGN.md's package
map), anywhere in the file, function-local imports included; and what is on disk or pure policy imports no Paddle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fdcore")

# Bottom first. A group may import itself and any group of a lower layer; groups of one layer are independent.
LAYERS = [
    [
        "fdcore.envs",
        "fdcore.logs",
        "fdcore.protocol",
        "fdcore.supervision",
    ],  # leaves: environment, logging, messages, OTP policy
    ["fdcore.ipc"],  # shared-memory transport
    ["fdcore.checkpoint"],  # what is on disk (no Paddle)
    ["fdcore.core"],  # pure serving policy (no Paddle)
    ["fdcore.models"],  # what computes (Paddle, the kernels)
    ["fdcore.config"],  # the configuration, checked against the CPU and the model
    ["fdcore.actors"],  # the actor processes and their runtime
    ["fdcore.client"],  # AsyncLLM, LLM
    ["fdcore.server"],  # the OpenAI-compatible HTTP server and its actor
    ["fdcore.janitor"],  # what a killed tree left behind
    ["fdcore.supervisor"],  # the supervisor process
    ["fdcore.generate"],  # one-shot generation (the README's first command)
    ["fdcore.cli", "fdcore"],  # the command line; fdcore: the package's own __init__
]
GROUPS = {group: layer for layer, groups in enumerate(LAYERS) for group in groups}


def group_of(module: str) -> str:
    """The layer group a module belongs to: its package under fdcore (fdcore.core.scheduler -> fdcore.core)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def modules() -> dict[str, str]:
    """Every module of the package, by dotted name: its path."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports_of(path: str, module: str) -> list[tuple[int, str]]:
    """(line, imported fdcore module) for every import statement of the file, wherever it stands."""
    found = []
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found += [(node.lineno, _submodule(base, alias.name)) for alias in node.names]
    return [(line, name) for line, name in found if name == "fdcore" or name.startswith("fdcore.")]


def _submodule(base: str, name: str) -> str:
    """What ``from base import name`` imports: the submodule base.name where there is one, else base."""
    relative = os.path.join(os.path.dirname(PACKAGE), *base.split("."), name)
    return f"{base}.{name}" if os.path.isdir(relative) or os.path.isfile(relative + ".py") else base


def violations(found: dict[str, str]) -> list[str]:
    bad = []
    for module, path in sorted(found.items()):
        mine = group_of(module)
        for line, target in imports_of(path, module):
            theirs = group_of(target)
            if theirs == mine or (mine == "fdcore" and theirs != "fdcore"):
                continue  # (a package imports itself; fdcore/__init__ is the top)
            if theirs not in GROUPS or mine not in GROUPS:
                bad.append(f"{path}:{line}: {target} or {module} is in no layer (tests/test_layers.py)")
            elif GROUPS[theirs] >= GROUPS[mine]:
                bad.append(
                    f"{os.path.relpath(path, PACKAGE)}:{line}: {module} ({mine}, layer {GROUPS[mine]}) imports "
                    f"{target} ({theirs}, layer {GROUPS[theirs]})"
                )
    return bad


def test_every_import_points_down():
    bad = violations(modules())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import_even_inside_a_function(tmp_path):
    """A planted violation: a core module reaching into models from a function body."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from fdcore.models.llama import LlamaModel\n")
    assert violations({"fdcore.core.planted": str(planted)}) == [
        f"{os.path.relpath(str(planted), PACKAGE)}:2: fdcore.core.planted (fdcore.core, layer 3) imports "
        "fdcore.models.llama (fdcore.models, layer 4)"
    ]
    assert not violations({"fdcore.models.planted": str(planted)})


@pytest.mark.parametrize("package", ["fdcore.checkpoint", "fdcore.core"])
def test_reading_checkpoints_and_serving_policy_import_no_paddle(package):
    names = [m for m in modules() if m == package or m.startswith(package + ".")]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'paddle' or m.startswith('paddle.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"{package} imports Paddle"
