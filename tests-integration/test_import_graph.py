"""The house rules on imports, checked from the source: no import circle anywhere, packages import only what
the design allows, and the app's modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "storage_io": ROOT / "packages/storage-io/src/storage_io",
    "named_tensors": ROOT / "packages/named-tensors/src/named_tensors",
    "lm_models": ROOT / "packages/lm-models/src/lm_models",
    "shard_cache": ROOT / "packages/shard-cache/src/shard_cache",
    "dist_ckpt": ROOT / "packages/dist-ckpt/src/dist_ckpt",
    "trackers": ROOT / "packages/trackers/src/trackers",
    "hf_bridge": ROOT / "packages/hf-bridge/src/hf_bridge",
    "lm_train": ROOT / "apps/train/src/lm_train",
}
# DESIGN.md, "Who may import whom": each workspace package and the others it may import.
ALLOWED = {
    "storage_io": set(),
    "named_tensors": set(),
    "lm_models": {"named_tensors"},
    "shard_cache": {"storage_io"},
    "dist_ckpt": {"storage_io"},
    "trackers": set(),
    "hf_bridge": {"lm_models", "named_tensors", "storage_io"},
    "lm_train": {"lm_models", "hf_bridge", "shard_cache", "dist_ckpt", "trackers", "named_tensors", "storage_io"},
}
# Packages whose public front (the package itself) is all that the app may import from them.
FRONT_ONLY = ("storage_io", "shard_cache", "dist_ckpt", "hf_bridge")
# shard-cache's read path, and the build and repair code that it must never reach.
READERS = ("shard_cache.reader", "shard_cache.chunk_reading")
WRITERS = ("shard_cache.build", "shard_cache.worker", "shard_cache.repair", "shard_cache.lock", "shard_cache.recovery")


def _module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(SOURCES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(pkg, p): p for pkg, root in SOURCES.items() for p in sorted(root.rglob("*.py"))}


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Workspace modules that `module` imports anywhere in its body: lazy and TYPE_CHECKING imports count too, since
    a circle hidden behind either is still a circle to a reader (and to a type checker)."""
    found: set[str] = set()
    package_parts = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package_parts[: len(package_parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            for alias in node.names:
                found.add(f"{target}.{alias.name}")  # `from pkg import submodule`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges = set()
    for name in found:
        while name and name not in known:  # `import a.b.c` names module a.b.c; an attribute import names its module
            name = name.rpartition(".")[0]
        if (
            name and name != module and not module.startswith(name + ".")
        ):  # a module's own parent package is not an edge
            edges.add(name)
    return edges


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imports(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def test_the_checker_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = "from . import sibling\nfrom .other import thing\nif TYPE_CHECKING:\n    import pkg.hidden\n"
    source += "def f():\n    from pkg.lazy import g\n"
    known = {"pkg", "pkg.mod", "pkg.sibling", "pkg.other", "pkg.hidden", "pkg.lazy"}
    assert _imports(ast.parse(source), "pkg.mod", False, known) == {
        "pkg.sibling",
        "pkg.other",
        "pkg.hidden",
        "pkg.lazy",
    }


def test_no_import_circle_among_or_inside_the_packages_and_the_app(graph):
    assert _cycles(graph) == []


def test_packages_import_only_what_the_design_allows(graph):
    wrong = sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if (src := module.split(".")[0]) != (dst := target.split(".")[0]) and dst not in ALLOWED[src]
    )
    assert wrong == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for other in graph.get(todo.pop(), ()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def test_the_app_imports_only_the_public_fronts_of_the_storage_packages(graph):
    private = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith("lm_train")
        for target in targets
        if target.split(".")[0] in FRONT_ONLY and target not in FRONT_ONLY
    )
    assert private == []


def test_shard_cache_readers_never_reach_its_build_or_repair_code(graph):
    for reader in READERS:
        assert _reachable(graph, reader) & set(WRITERS) == set(), reader


def test_source_files_stay_small():
    limits = {"lm_train": 300}
    too_long = []
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limits.get(package, 500):
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert too_long == []


# The training loop's core, which knows kinds of training only through lm_train.run.training_kind.TrainingKind.
KIND_FREE_CORE = ("lm_train.run.state", "lm_train.run.batch", "lm_train.run.step", "lm_train.planning")
# The kinds of training, each one module or package (the table of them, lm_train.kinds, loads them by name).
KIND_MODULES = ("lm_train.language_modeling", "lm_train.post.dpo", "lm_train.post.doremi")


def _within(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def _reached(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module that `start` imports directly or through others, each with the module that imports it."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for other in sorted(graph.get(node, ())):
            if other not in via and other != start:
                via[other] = node
                todo.append(other)
    return via


def _kind_imports(graph: dict[str, set[str]], starts: list[str], kinds: tuple[str, ...]) -> list[str]:
    """Each start module that reaches a kind module, as the chain of imports that leads there."""
    found = []
    for start in starts:
        via = _reached(graph, start)
        for target in sorted(t for t in via if _within(t, kinds)):
            chain = [target]
            while chain[-1] != start:
                chain.append(via[chain[-1]])
            found.append(" -> ".join(reversed(chain)))
    return found


def test_the_kind_checker_follows_chains():
    graph = {
        "lm_train.run.step": {"lm_train.helper"},
        "lm_train.helper": {"lm_train.post.dpo.loss"},
        "lm_train.run.batch": set(),
    }
    found = _kind_imports(graph, ["lm_train.run.step", "lm_train.run.batch"], ("lm_train.post.dpo",))
    assert found == ["lm_train.run.step -> lm_train.helper -> lm_train.post.dpo.loss"]


def test_state_batch_step_and_planning_import_no_kind_of_training(graph):
    core = sorted(m for m in graph if _within(m, KIND_FREE_CORE))
    assert "lm_train.planning.plan" in core and "lm_train.run.step" in core  # the names are today's
    assert [k for k in KIND_MODULES if k not in graph] == []
    assert _kind_imports(graph, core, KIND_MODULES) == []


def test_doremi_does_not_import_dpo(graph):
    doremi = sorted(m for m in graph if _within(m, ("lm_train.post.doremi",)))
    assert "lm_train.post.doremi.training" in doremi
    assert _kind_imports(graph, doremi, ("lm_train.post.dpo",)) == []


def test_the_app_is_grouped_by_job_with_few_entries_at_the_top():
    """lm_train's top level holds packages by job (run, data, post, tools, config, cli, ...) and a few modules."""
    root = SOURCES["lm_train"]
    entries = sorted(p.name for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    assert len(entries) <= 15, entries
    assert {"run", "data", "post", "tools", "config", "cli"} <= set(entries)
