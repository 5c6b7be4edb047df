"""The shape of the tree, checked: the layers of ``docs/architecture.md`` in their order (each
imports only those below it), a stage package imports no other stage, ``methods/`` imports only
the author API and the core, the author API is pure, only ``reef_stream.topics`` imports the
Kafka client, and modules import one another without cycles. A change that breaks one fails
here, naming the modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import reef_stream

PACKAGE = Path(reef_stream.__file__).resolve().parent
METHODS = PACKAGE.parent / "methods"
#: The layers, bottom to top (docs/architecture.md draws them). A module imports modules of its
#: own layer and of the layers below it, never above. ``reef_stream/__init__.py``, the lazy
#: table of public names, stands outside: it imports nothing when it is imported.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("reef_stream.core",)),
    ("author API", ("reef_stream.api",)),
    ("engine", ("reef_stream.engine",)),
    ("Kafka layer", ("reef_stream.topics",)),
    ("publishing", ("reef_stream.publishing",)),
    ("intake", ("reef_stream.intake",)),
    ("stages", ("reef_stream.consumers",)),
    ("serving", ("reef_stream.serving",)),
    ("local servers", ("reef_stream.servers",)),
    ("operations", ("reef_stream.ops",)),
    ("applications", ("reef_stream.demo", "reef_stream.cli")),
]
#: The stage loop every stage runs on; the one module of reef_stream.consumers outside a stage.
STAGE_LOOP = "reef_stream.consumers.stage"
#: Imports from one stage package into another, each with its reason.
STAGE_TO_STAGE = {
    ("reef_stream.consumers.rescore", "reef_stream.consumers.reward"):
        "a rescore runs the reward workers' calls over the log",
}
#: The Kafka layer: the only package whose modules import confluent_kafka.
KAFKA_LAYER = "reef_stream.topics"
def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``__init__`` as the package's own name)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _is_script_block(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` or ``if TYPE_CHECKING:``: imports there are not part of
    the module's import graph (they run only as a script, or never)."""
    if not isinstance(node, ast.If):
        return False
    text = ast.unparse(node.test)
    return "__name__" in text or "TYPE_CHECKING" in text


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, at module level or inside functions."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_script_block(child):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1]
                                    + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {target for target in found if target in modules and target != name}


def test_the_author_api_imports_neither_kafka_nor_redis():
    """Every module of reef_stream.api, imported in a fresh interpreter, leaves confluent_kafka
    and redis out of sys.modules: a method author's code never drags the service layer in."""
    api = sorted(name for name in _modules() if name.startswith("reef_stream.api"))
    assert "reef_stream.api.recipe" in api and "reef_stream.api.processor" in api
    script = (f"import importlib, sys\nfor m in {api!r}: importlib.import_module(m)\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('confluent_kafka', 'redis')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", f"reef_stream.api pulled in: {result.stdout.strip()}"


def _kafka_imports(source: str) -> list[int]:
    """The lines of ``source`` that import confluent_kafka or a module of it: ``import`` and
    ``from ... import`` statements anywhere (module level, inside functions, under
    ``TYPE_CHECKING``), and ``import_module`` / ``__import__`` of a literal name."""
    def is_client(name: str | None) -> bool:
        return name is not None and (name == "confluent_kafka"
                                     or name.startswith("confluent_kafka."))

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found = any(is_client(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found = node.level == 0 and is_client(node.module)
        elif isinstance(node, ast.Call) and node.args:
            called = ast.unparse(node.func).rpartition(".")[2]
            first = node.args[0]
            found = (called in ("import_module", "__import__") and isinstance(first, ast.Constant)
                     and isinstance(first.value, str) and is_client(first.value))
        else:
            continue
        if found:
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_kafka_layer_imports_confluent_kafka():
    """No module outside reef_stream.topics imports the Kafka client: they take its names from
    reef_stream.topics.kafka and build their clients with reef_stream.topics.connect."""
    importing = {name: lines for name, path in _modules().items()
                 if name != KAFKA_LAYER and not name.startswith(KAFKA_LAYER + ".")
                 and (lines := _kafka_imports(path.read_text()))}
    assert not importing, (
        "modules outside reef_stream/topics/ import confluent_kafka (module: lines); take its "
        f"names from reef_stream.topics.kafka, clients from reef_stream.topics.connect: {importing}")


def test_the_kafka_import_check_finds_every_form():
    """The checker itself: each way of importing the client is found, by its line; names that
    only look like it (another package, a relative module, a mention in a docstring) are not."""
    lines = [
        "import confluent_kafka",                               # 1
        "import os, confluent_kafka.admin as admin",            # 2
        "from confluent_kafka import Consumer",                 # 3
        "from confluent_kafka.admin import AdminClient",        # 4
        "def lazy():",                                          # 5
        "    from confluent_kafka import Producer",             # 6
        "if TYPE_CHECKING:",                                    # 7
        "    from confluent_kafka import Message",              # 8
        "client = importlib.import_module('confluent_kafka')",  # 9
        "import confluent_kafka_tools",                         # 10
        "from reef_stream.topics.kafka import Consumer",        # 11
        "from .confluent_kafka import x",                       # 12
        '"""confluent_kafka, named in a docstring"""',          # 13
        "module = import_module(name)",                         # 14
    ]
    assert _kafka_imports("\n".join(lines)) == [1, 2, 3, 4, 6, 8, 9]


def test_the_kafka_module_holds_the_clients_own_objects():
    """reef_stream.topics.kafka re-exports the client's objects themselves (so ``except
    KafkaException`` anywhere catches what the client raises), and imports the client's admin
    module only when ``AdminClient`` is first asked for."""
    script = ("import sys, confluent_kafka, reef_stream.topics.kafka as kafka\n"
              "lazy = 'confluent_kafka.admin' not in sys.modules\n"
              "import confluent_kafka.admin as admin\n"
              "other = [n for n in kafka.__all__ if getattr(kafka, n) not in "
              "(getattr(confluent_kafka, n, None), getattr(admin, n, None))]\n"
              "print(lazy, other)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "True []", result.stdout


def test_no_import_cycles_between_modules():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # A package's __init__ is imported with each of its modules; an import of the package
    # itself from inside it is not a cycle between modules.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycles, state = [], {}

    def walk(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                walk(target, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _layer(name: str) -> int | None:
    for index, (_, packages) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in packages):
            return index
    return None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_every_module_is_in_a_layer():
    outside = sorted(name for name in _modules() if name != "reef_stream" and _layer(name) is None)
    assert not outside, f"modules in no layer of LAYERS (docs/architecture.md): {outside}"


def test_each_layer_imports_only_the_layers_below_it():
    upward = sorted(f"{name} ({LAYERS[_layer(name)][0]}) -> {target} ({LAYERS[_layer(target)][0]})"
                    for name, targets in _graph().items() if name != "reef_stream"
                    for target in targets
                    if target != "reef_stream" and _layer(target) > _layer(name))
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def _stage(name: str) -> str | None:
    parts = name.split(".")
    if name.startswith("reef_stream.consumers.") and name != STAGE_LOOP and len(parts) > 2:
        return ".".join(parts[:3])
    return None


def test_a_stage_imports_no_other_stage():
    """Each stage is a package (processor, reward, trainer, evaluator, rescore) that imports the
    stage loop and the layers below, not another stage, except where STAGE_TO_STAGE says why."""
    crossing = sorted(f"{name} -> {target}" for name, targets in _graph().items()
                      for target in targets
                      if (mine := _stage(name)) and (theirs := _stage(target))
                      and mine != theirs and (mine, theirs) not in STAGE_TO_STAGE)
    assert not crossing, "a stage imports another stage:\n" + "\n".join(crossing)


def test_methods_import_only_the_author_api_and_the_core():
    allowed = ("reef_stream.api", "reef_stream.core")
    assert (METHODS / "sao" / "recipe.py").is_file(), f"no methods/ beside {PACKAGE}"
    found = {}
    for path in sorted(METHODS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                if name.split(".")[0] == "reef_stream" and not name.startswith(allowed):
                    found.setdefault(str(path.relative_to(METHODS.parent)), []).append(name)
    assert not found, f"methods/ reaching past the author API and the core: {found}"


def test_the_layer_check_finds_an_upward_import():
    """The checker itself: the engine importing the Kafka layer is upward; the reverse is not."""
    assert _layer("reef_stream.engine.join") < _layer("reef_stream.topics.connect")
    assert _layer("reef_stream.core.events") == 0
    assert _layer("reef_stream.cli.main") == _layer("reef_stream.demo.run") == len(LAYERS) - 1
    assert _stage("reef_stream.consumers.trainer.trainer") == "reef_stream.consumers.trainer"
    assert _stage(STAGE_LOOP) is None


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The checker itself: two modules importing each other (one lazily) are a cycle."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert _imports(modules["a"], "a", modules) == {"b"}
    assert _imports(modules["b"], "b", modules) == {"a"}


def test_the_architecture_doc_draws_the_layers_of_this_test():
    """docs/architecture.md's drawing lists the same layers, top to bottom, with their folders:
    the page a newcomer reads cannot drift from the order this file enforces."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    drawing = doc.split("## The layers", 1)[1].split("```")[1]
    rows = [line.split() for line in drawing.splitlines() if line[:1] == " " and line[1:2] != " "]
    drawn = []
    for row in rows:
        folders = tuple(word for word in row if word.endswith("/"))
        name = " ".join(word for word in row[:row.index(folders[0])]) if folders else None
        if folders:
            drawn.append((name, tuple(f"reef_stream.{folder[:-1]}" for folder in folders)))
    assert drawn == list(reversed(LAYERS))
