"""The package's import graph follows the layers of docs/design.md#package-layers: every module
of ``jax_flash_metal/`` is in the table (by itself or by its folder), and imports (at module
level or inside functions) go only to strictly lower layers or within one folder; there is no
import circle. Test files import helper modules, never each other.

The table is read from the documentation and the imports from the source (``ast``), so the page
and the code cannot drift apart.
"""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "jax_flash_metal"
DESIGN = os.path.join(ROOT, "docs", "design.md")


def layers():
    """{entry: layer} from the table under the "Package layers" heading; an entry is a module
    named relative to the package ("__init__" for the package itself) or a folder ("core/")."""
    with open(DESIGN, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Package layers", 1)[1].split("\n## ", 1)[0]
    result = {}
    for layer, entries in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.M):
        for name in re.findall(r"`([\w./]+)`", entries):
            assert name not in result, f"{name} is in two layers"
            result[name] = int(layer)
    assert result, "no layer table under 'Package layers' in docs/design.md"
    return result


def folder_of(module):
    """The folder entry ("core/") a module belongs to, or None for a top-level module."""
    path = MODULES.get(module, "")
    top = module.split(".")[0]
    if "." in module or os.path.basename(path) == "__init__.py" and module != "__init__":
        return top + "/"
    return None


def layer_of(module):
    return LAYERS.get(module, LAYERS.get(folder_of(module) or ""))


def source_modules():
    """{module: path} of every Python module of the package."""
    found = {}
    base = os.path.join(ROOT, PACKAGE)
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f[:-3]), base).split(os.sep)
                if parts[-1] == "__init__" and len(parts) > 1:
                    parts = parts[:-1]  # a subpackage is named by its folder
                found[".".join(parts)] = os.path.join(folder, f)
    return found


def _package_of(module):
    """The package that relative imports in ``module`` start from ("" = the top package)."""
    path = MODULES[module]
    if os.path.basename(path) == "__init__.py":
        return "" if module == "__init__" else module
    return module.rpartition(".")[0]


def _known(name, known):
    """``name`` (relative to the package) as a module of the table or the source: the longest
    dotted prefix that is one; the package itself ("__init__") when none is."""
    parts = name.split(".") if name else []
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return "__init__"


def imports_of(module, known):
    """The package modules ``module`` imports, anywhere in its source, as (line, target)."""
    with open(MODULES[module], encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.append((node.lineno, _known(alias.name[len(PACKAGE) + 1:], known)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module).split(".") if _package_of(module) else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                parent = ".".join(base + ([node.module] if node.module else []))
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                parent = node.module[len(PACKAGE) + 1:]
            else:
                continue
            for alias in node.names:  # `from . import x` may name a module
                full = f"{parent}.{alias.name}" if parent else alias.name
                found.append((node.lineno, _known(full if full in known else parent, known)))
    return sorted(set(found))


MODULES = source_modules()
LAYERS = layers()
BUILT = {"_ext", "_build_info"}  # written by the build, not in the source tree


def test_every_module_has_a_layer():
    assert sorted(m for m in MODULES if layer_of(m) is None) == []
    folders = {folder_of(m) for m in MODULES}
    modules_and_folders = set(MODULES) | folders | BUILT
    assert sorted(set(LAYERS) - modules_and_folders) == []
    # A folder's modules are named by the folder's row, not one by one.
    assert sorted(m for m in MODULES if folder_of(m) and m in LAYERS) == []


def test_imports_go_only_to_lower_layers():
    known = set(MODULES) | BUILT
    upward = []
    for module in sorted(MODULES):
        for line, target in imports_of(module, known):
            same_folder = folder_of(module) is not None and folder_of(target) == folder_of(module)
            if target != module and not same_folder and layer_of(target) >= layer_of(module):
                upward.append(f"{PACKAGE}/{module}: line {line} imports {target} "
                              f"(layer {layer_of(module)} -> {layer_of(target)})")
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    known = set(MODULES) | BUILT
    graph = {m: {t for _, t in imports_of(m, known) if t != m and t in MODULES} for m in MODULES}
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_test_files_import_no_test_file():
    tests = os.path.join(ROOT, "tests")
    paths = sorted(os.path.relpath(os.path.join(d, n), tests) for d, _, names in os.walk(tests)
                   for n in names if n.endswith(".py"))
    names = [os.path.basename(p)[:-3] for p in paths]
    test_files = {n for n in names if n.startswith("test_")}
    found = []
    for name in paths:
        with open(os.path.join(tests, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"tests/{name}: line {node.lineno} imports {m}" for m in modules
                      if m in test_files]
    assert not found, "\n".join(found)


def test_the_walker_sees_imports_inside_functions():
    """The lazy import of the FFI lowering sits in a function body."""
    known = set(MODULES) | BUILT
    assert "fused.ffi_lowering" in {t for _, t in imports_of("fused.loader", known)}
    assert "_ext" in {t for _, t in imports_of("tools.profile_model", known)}
