"""The direction of dependency between the packages (docs/architecture.md), read from every import statement
in the source, function-level imports included: a new import against the direction fails here."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("radix", "blend", "reuse_server", "loadgen")


def imports_of(path: Path) -> set[str]:
    """Every module named by an import in the file (absolute names; relative ones resolved to the package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            # `from reuse_server import server` names the subpackage, not just the parent
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def offenders(folder: str, forbidden, exempt=()) -> list[str]:
    found = []
    for path in sources(folder):
        if path.relative_to(REPO).as_posix() in exempt:
            continue
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(REPO)} imports {name}")
    return sorted(set(found))


def test_radix_is_pure_python():
    assert offenders("radix", ("torch", "blend", "reuse_server", "loadgen")) == []


def test_blend_never_imports_the_server():
    assert offenders("blend", ("reuse_server", "loadgen")) == []


@pytest.mark.parametrize("room", ["reuse_server/engine", "reuse_server/kv", "reuse_server/model"])
def test_engine_kv_and_model_never_import_the_service(room):
    assert offenders(room, ("reuse_server.api", "reuse_server.server", "loadgen")) == []


def test_loadgen_reaches_the_server_over_http():
    # the offline trace replay uses the radix tree, and reclaim runs the model for its attention probe
    exempt = ("loadgen/simulate.py", "loadgen/reclaim.py", "loadgen/attention_probe.py")
    assert offenders("loadgen", ("reuse_server", "blend"), exempt=exempt) == []
    assert offenders("loadgen", ("reuse_server.api", "reuse_server.engine", "reuse_server.kv")) == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The rule reads function-level and relative imports too, so a real violation cannot hide there."""
    room = tmp_path / "reuse_server" / "kv"
    room.mkdir(parents=True)
    (room / "bad.py").write_text("def f():\n    from ..server import metrics\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert offenders("reuse_server/kv", ("reuse_server.server",)) == [
        "reuse_server/kv/bad.py imports reuse_server.server",
        "reuse_server/kv/bad.py imports reuse_server.server.metrics",
    ]
