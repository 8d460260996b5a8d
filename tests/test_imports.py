"""The project's import map: no cycles, no module reaching into another's
``_private`` names, and imports inside functions only where ``--help`` speed
or a lazy re-export needs them. Parsed with ``ast``: nothing is imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the installed package maps these folders to mlx_mtp.cli and mlx_mtp.convert
FOLDERS = {"mlx_mtp": "mlx_mtp", "cli": "mlx_mtp.cli", "convert": "mlx_mtp.convert"}
# where an import inside a function is wanted: the CLI (``--help`` loads no
# MLX), and the default model, which loads the converter only to build it
LAZY = ("mlx_mtp.cli", "mlx_mtp.convert.default_model")


def modules():
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package] + parts[: -1 if is_package else None])
            out[name] = (ast.parse(path.read_text()), is_package)
    return out


MODULES = modules()


def owner(name):
    """The project module ``name`` is in (None: not the project's)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(name):
    """(module imported, name taken from it or None, inside a function) for
    every import in ``name`` of a project module."""
    tree, is_package = MODULES[name]
    package = name if is_package else name.rpartition(".")[0]
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef)
            )
            if isinstance(child, ast.Import):
                out.extend((owner(a.name), None, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    if full in MODULES:
                        out.append((full, None, in_function))
                    else:
                        out.append((owner(base), a.name, in_function))
            visit(child, nested)

    visit(tree, False)
    return [(m, n, f) for m, n, f in out if m is not None and m != name]


def test_the_map_sees_the_package():
    assert {"mlx_mtp.generate", "mlx_mtp.cli.options", "mlx_mtp.convert.model"} <= set(
        MODULES
    )
    assert ("mlx_mtp.config", "read_head_config", False) in imports("mlx_mtp.loader")


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in imports(m)} for m in MODULES}
    cycles = []
    state = {}  # 1: on the path, 2: done

    def walk(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t) :] + [t])
            elif t not in state:
                walk(t, path + [t])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            walk(m, [m])
    assert cycles == []


def test_no_imports_of_private_names():
    private = [
        (m, t, n)
        for m in MODULES
        for t, n, _ in imports(m)
        if n is not None and n.startswith("_") and not n.startswith("__")
    ]
    assert private == []


def test_the_library_imports_neither_the_cli_nor_the_converter():
    """mlx_mtp's own modules sit below cli/ and convert/ (which use them)."""
    upward = sorted(
        (m, t)
        for m in MODULES
        if not m.startswith(("mlx_mtp.cli", "mlx_mtp.convert"))
        and m not in ("mlx_mtp", "mlx_mtp.__main__")  # the entry points
        for t, _, _ in imports(m)
        if t.startswith(("mlx_mtp.cli", "mlx_mtp.convert"))
    )
    assert upward == []


def test_imports_inside_functions_only_where_laziness_pays():
    lazy = sorted(
        {
            (m, t)
            for m in MODULES
            for t, _, in_function in imports(m)
            if in_function and not m.startswith(LAZY)
        }
    )
    assert lazy == []


def test_only_the_server_and_the_cli_import_the_server():
    """The library (the scheduler, the prompt cache, ``copy``) sits below
    ``serve/``, which uses it; only the command line starts a server."""
    upward = sorted(
        (m, t)
        for m in MODULES
        if not m.startswith(("mlx_mtp.serve", "mlx_mtp.cli"))
        and m not in ("mlx_mtp", "mlx_mtp.__main__")
        for t, _, _ in imports(m)
        if t.startswith("mlx_mtp.serve")
    )
    assert upward == []


def test_one_module_drives_the_round_and_one_builds_streams():
    """The decoding loop (``decoder.Decoder``) is the one module that runs a
    round's steps (``rounds``: draft, verify, settle), for one stream and a
    batch, ``tune``'s timings included; ``stream.open_stream`` is the one
    place a stream is made."""
    users = {m for m in MODULES for t, _, _ in imports(m) if t == "mlx_mtp.rounds"}
    assert users == {"mlx_mtp.decoder"}
    built = set()
    for m, (tree, _) in MODULES.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Stream"
            ):
                built.add(m)
    assert built == {"mlx_mtp.stream"}
