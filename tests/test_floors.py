"""The import floors (DESIGN.md principle 7): nothing under refimpl/ imports a module of a higher floor, and no private
name (`_x`) of one refimpl module is used by another."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent / "refimpl"

# floor of each module (the longest matching prefix decides), lowest first: errors < kernels < models < formats /
# conventions < bundle / golden < diff < cli, with the helpers each floor stands on
FLOORS = {
    "refimpl.errors": 0, "refimpl.version": 0, "refimpl.files": 0, "refimpl.progress": 0, "refimpl.trace": 0,
    "refimpl.graph": 0,
    "refimpl.kernels": 1,
    "refimpl.encodings": 2, "refimpl.precision": 2, "refimpl.metrics": 2,
    "refimpl.models": 3,
    "refimpl.formats": 4, "refimpl.conventions": 4,
    "refimpl.presets": 5, "refimpl.sources": 5,   # models and tokenizers from files: above formats
    "refimpl.bundle": 6, "refimpl.bundle_schema": 6, "refimpl.bundle_exports": 6, "refimpl.golden": 6,
    "refimpl.generate": 6, "refimpl.arguments": 6,
    "refimpl.diff": 7, "refimpl.testing": 7,
    "refimpl.dataset": 8,
    "refimpl.cli": 9, "refimpl.__main__": 9, "refimpl": 9,   # the package itself: the public API over everything
}


def floor(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        yield name, package, ast.parse(path.read_text(), str(path))


def imported(package: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def refimpl_imports(name: str, package: str, tree) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) of every refimpl import, at any depth (inside functions too)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = imported(package, node)
            for alias in node.names:
                full = f"{target}.{alias.name}"
                is_module = (ROOT.parent / (full.replace(".", "/") + ".py")).exists() or \
                    (ROOT.parent / full.replace(".", "/")).is_dir()
                out.append((full, "", node.lineno) if is_module else (target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
    return [(t, n, line) for t, n, line in out if t == "refimpl" or t.startswith("refimpl.")]


def test_nothing_imports_upward():
    upward = sorted({f"{name}:{line} imports {target} (floor {floor(name)} -> {floor(target)})"
                     for name, package, tree in modules() for target, _, line in refimpl_imports(name, package, tree)
                     if floor(target) > floor(name)})
    assert not upward, "\n".join(upward)


def test_no_private_name_is_used_outside_its_module():
    private = []
    for name, package, tree in modules():
        modules_bound = set()
        for target, what, line in refimpl_imports(name, package, tree):
            if what.startswith("_") and not what.startswith("__"):
                private.append(f"{name}:{line} imports {target}.{what}")
            if not what:
                modules_bound.add(target.rpartition(".")[2])
        for node in ast.walk(tree):   # a private attribute of another module, or of another module's object
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                private.append(f"{name}:{node.lineno} reads .{node.attr}")
    assert not private, "\n".join(private)


def test_no_two_parts_import_each_other():
    """Between the top-level modules and packages (formats, presets, diff, ...) the imports form no cycle of two."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])
    edges = {(part(name), part(target)) for name, package, tree in modules()
             for target, _, _ in refimpl_imports(name, package, tree) if part(name) != part(target)}
    both = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b and "refimpl" not in (a, b))
    assert not both, both
