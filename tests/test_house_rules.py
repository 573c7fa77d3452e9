"""Rules of the house (issue 42), read from the syntax trees of the project's files.

No module reaches into another's private names: a name that starts with ``_`` is used only in the module
that defines it. Read from the syntax trees of every Python file of the project (library,
benchmarks, tests, the two scripts): attribute reads ``module._name`` through an imported project module,
``from module import _name``, and ``monkeypatch.setattr(module, "_name", ...)``."""

import ast
import os

from tests.helpers import ROOT

SOURCES = ("loco_jax", "benchmarks", "tests", "train.py", "prepare_data.py")


def project_files():
    for top in SOURCES:
        path = os.path.join(ROOT, top)
        if path.endswith(".py"):
            yield path
            continue
        for folder, _, names in os.walk(path):
            yield from (os.path.join(folder, n) for n in sorted(names) if n.endswith(".py"))


def module_name(path):
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path, modules):
    """``(line, "module._name")`` for every use in ``path`` of another project module's private name."""
    tree = ast.parse(open(path).read(), path)
    me, alias, found = module_name(path), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    alias[a.asname or a.name] = full
                elif node.module in modules and node.module != me and private(a.name):
                    found.append((node.lineno, f"{node.module}.{a.name}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in alias
                and private(node.attr) and alias[node.value.id] != me):
            found.append((node.lineno, f"{alias[node.value.id]}.{node.attr}"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in alias
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and private(node.args[1].value)):
            found.append((node.lineno, f"{alias[node.args[0].id]}.{node.args[1].value} (setattr)"))
    return sorted(found)


def test_no_module_uses_another_modules_private_names():
    files = list(project_files())
    modules = {module_name(p) for p in files} | {"loco_jax", "tests", "benchmarks"}
    found = [f"{os.path.relpath(p, ROOT)}:{line}: {name}" for p in files for line, name in private_uses(p, modules)]
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_use(tmp_path):
    """The three forms the check reads are each reported (so an empty report above means none is there)."""
    path = tmp_path / "probe.py"
    path.write_text("from loco_jax import quant\nfrom loco_jax.hlo import _dims\nimport loco_jax.sparse\n"
                    "quant._hadamard(1, 2)\nmonkeypatch.setattr(quant, '_lloyd_max', None)\nquant.__name__\n")
    modules = {"loco_jax", "loco_jax.quant", "loco_jax.hlo", "loco_jax.sparse"}
    assert [name for _, name in private_uses(str(path), modules)] == [
        "loco_jax.hlo._dims", "loco_jax.quant._hadamard", "loco_jax.quant._lloyd_max (setattr)"]


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers.py (and fixtures in conftest.py), not in a test module that
    another imports (which would also run its tests' module-level set-up there)."""
    found = []
    for path in project_files():
        if not os.path.basename(path).startswith("test_"):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names] + [node.module]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{os.path.relpath(path, ROOT)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] == "tests" and len(n.split(".")) > 1 and n.split(".")[1].startswith("test_")]
    assert not found, "test modules imported by tests:\n" + "\n".join(sorted(set(found)))


MAX_FUNCTION_LINES = 60  # of code: a function's lines after its docstring


def long_functions(path, limit=MAX_FUNCTION_LINES):
    """``(name, lines)`` of every function in ``path`` whose code (its lines after the docstring) exceeds
    ``limit``."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        documented = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str)
        first = body[1] if documented and len(body) > 1 else body[0]
        lines = node.end_lineno - first.lineno + 1
        if lines > limit:
            out.append((node.name, lines))
    return out


def test_no_library_function_is_over_sixty_lines_of_code():
    """Every function of ``loco_jax`` (the library and the training application) fits in 60 lines after its
    docstring; a longer one is split into named parts."""
    found = {os.path.relpath(p, ROOT): long_functions(p) for p in project_files() if "loco_jax" in p}
    assert not {p: f for p, f in found.items() if f}, found


def test_the_length_check_counts_code_not_docstrings(tmp_path):
    doc = '    """' + "\n".join(["line"] * 80) + '"""\n'
    path = tmp_path / "m.py"
    path.write_text("def short():\n" + doc + "    return 1\n\n\ndef long():\n" + "    x = 1\n" * 61)
    assert long_functions(str(path)) == [("long", 61)]


def wide_functions(path, limit=11):
    """``(name, count)`` of every public function in ``path`` that takes more than ``limit`` public parameters
    (``self``/``cls`` and ``_``-prefixed ones not counted)."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or private(node.name):
            continue
        a = node.args
        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        count = len([n for n in names if n not in ("self", "cls") and not private(n)])
        if count > limit:
            out.append((node.name, count))
    return out


def test_no_library_factory_takes_more_than_eleven_parameters():
    """The library's public functions (``loco_jax/*.py``: ``compress``, ``diloco``, the codec builders, the
    collectives) take at most 11 parameters each: what is sent is one value (``loco.codec``, ``diloco.codec``,
    ``exchange.Sparse.of``), not a dozen loose settings beside the transformation's own."""
    library = [p for p in project_files() if os.path.dirname(p) == os.path.join(ROOT, "loco_jax")]
    found = {os.path.relpath(p, ROOT): wide_functions(p) for p in library}
    assert len(library) >= 10 and not {p: f for p, f in found.items() if f}, found


def test_the_width_check_counts_public_parameters(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def narrow(a, b, *, c=1, _salt=0):\n    pass\n\n\n"
                    "def wide(" + ", ".join(f"a{i}" for i in range(12)) + "):\n    pass\n\n\n"
                    "class K:\n    def method(self, " + ", ".join(f"b{i}" for i in range(11)) + "):\n        pass\n")
    assert wide_functions(str(path)) == [("wide", 12)]
