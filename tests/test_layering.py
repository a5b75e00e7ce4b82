"""The direction of dependency between the packages (docs/architecture.md), read from every import statement
in the source, function-level and TYPE_CHECKING imports included: a new import against the direction, or one
that closes a circle of files, fails here."""
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


# The layers, top first: a module may import its own layer and those below it, never one above. loadgen is a
# client of the server (over HTTP, test_loadgen_reaches_the_server_over_http) that nothing else imports; the
# bare `reuse_server` is the package's __init__ alone (it only sets an environment variable before torch loads).
LAYERS = ("loadgen", "reuse_server.server", "reuse_server.api", "reuse_server.engine", "reuse_server.kv",
          "reuse_server.model", "reuse_server", "blend", "radix")


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the layer a module (or a name imported from one) is in; None: not ours."""
    for depth, layer in enumerate(LAYERS):
        if module == layer or (layer != "reuse_server" and module.startswith(layer + ".")):
            return depth
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(path): path for package in OURS for path in sources(package)}


def upward_imports() -> list[str]:
    found = []
    for module, path in our_modules().items():
        own = layer_of(module)
        for name in imports_of(path):
            depth = layer_of(name)
            if depth is not None and depth < own:
                found.append(f"{path.relative_to(REPO)} ({LAYERS[own]}) imports {name} ({LAYERS[depth]}, above it)")
    return sorted(set(found))


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it names in an import. A name is resolved to the longest module it starts
    with (`from reuse_server.kv.pins import Pin` -> reuse_server.kv.pins; a name a package's __init__ exports
    -> that __init__). The package __init__ Python runs before a submodule is not counted: it is no import
    the submodule's file makes."""
    modules = our_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {module: {target for name in imports_of(path) if (target := resolve(name)) not in (None, module)}
            for module, path in modules.items()}


def a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules in order, the first repeated at the end), or None."""
    done, path, on_path = set(), [], set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph[module]):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return None


def test_every_module_of_ours_is_in_a_layer():
    assert [m for m in our_modules() if layer_of(m) is None] == []


def test_each_layer_imports_only_itself_and_those_below():
    assert upward_imports() == []


def test_no_file_imports_itself_through_others():
    cycle = a_cycle(import_graph())
    modules = our_modules()
    assert cycle is None, "import circle: " + " -> ".join(str(modules[m].relative_to(REPO)) for m in cycle)


def test_radix_is_pure_python():
    assert offenders("radix", ("torch", "blend", "reuse_server", "loadgen")) == []


def test_loadgen_reaches_the_server_over_http():
    # the offline trace replay uses the radix tree, and reclaim runs the model for its attention probe
    exempt = ("loadgen/simulate.py", "loadgen/reclaim.py", "loadgen/attention_probe.py")
    assert offenders("loadgen", ("reuse_server", "blend"), exempt=exempt) == []
    assert offenders("loadgen", ("reuse_server.api", "reuse_server.engine", "reuse_server.kv")) == []


def plant(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """A source tree of our packages holding only `files`, which the checks then read instead of the repo's."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for package in OURS:
        (tmp_path / package).mkdir(exist_ok=True)
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The rule reads function-level and relative imports too, so a real violation cannot hide there."""
    plant(tmp_path, monkeypatch, {"reuse_server/kv/bad.py": "def f():\n    from ..server import metrics\n"})
    assert offenders("reuse_server/kv", ("reuse_server.server",)) == [
        "reuse_server/kv/bad.py imports reuse_server.server",
        "reuse_server/kv/bad.py imports reuse_server.server.metrics",
    ]


def test_the_order_check_sees_an_upward_import(tmp_path, monkeypatch):
    plant(tmp_path, monkeypatch, {
        "reuse_server/model/geometry.py": "from reuse_server.kv.layout import KVGeometry\n",
        "reuse_server/kv/layout.py": "KVGeometry = object\n",
        "reuse_server/engine/engine.py": "from reuse_server.kv.layout import KVGeometry\n",  # downward: fine
        "blend/chunks.py": "import typing\nif typing.TYPE_CHECKING:\n    import reuse_server\n",
    })
    assert upward_imports() == [
        "blend/chunks.py (blend) imports reuse_server (reuse_server, above it)",
        "reuse_server/model/geometry.py (reuse_server.model) imports reuse_server.kv.layout (reuse_server.kv, above it)",
        "reuse_server/model/geometry.py (reuse_server.model) imports reuse_server.kv.layout.KVGeometry "
        "(reuse_server.kv, above it)",
    ]


def test_the_cycle_check_sees_a_circle_through_a_function_level_import(tmp_path, monkeypatch):
    plant(tmp_path, monkeypatch, {
        "reuse_server/server/cli.py": "from reuse_server.server.cluster import add_parser\n",
        "reuse_server/server/cluster.py": "from reuse_server.server import sizing\n",
        "reuse_server/server/sizing.py": "def flags():\n    from .cli import build_parser\n",
        "reuse_server/server/args.py": "import reuse_server.server.cluster\n",  # into the circle, not on it
    })
    # found from args.py, the first module in name order: the circle from where that path entered it
    assert a_cycle(import_graph()) == ["reuse_server.server.cluster", "reuse_server.server.sizing",
                                       "reuse_server.server.cli", "reuse_server.server.cluster"]
    with pytest.raises(AssertionError, match="reuse_server/server/cluster.py -> reuse_server/server/sizing.py -> "
                                             "reuse_server/server/cli.py -> reuse_server/server/cluster.py"):
        test_no_file_imports_itself_through_others()
