"""The rooms' layers hold (pyproject.toml's [tool.importlinter] contracts, checked by import-linter's `lint-imports`:
each room imports only the rooms below it, no import cycle between sibling packages or modules), and no module
imports a private name of another (checked here with ast: import-linter does not look at names). Each check is
shown to fail on a planted violation, in a copy of the package."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from disco_clip_ds.testing.launch import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGE = "disco_clip_ds"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package under ROOT, with ROOT's pyproject.toml (no cache: a copy is new each time)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def private_imports(package: Path) -> list[str]:
    """'module:line name' for each private name (a leading underscore, dunders aside) that a module of PACKAGE takes
    from another module of it: `from x import _name`, `import x._module`, or `x._name` on a module imported as x."""
    found = []
    for path in sorted(package.rglob("*.py")):
        here = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        modules = {}  # local name -> the package module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package.name:
                for alias in node.names:
                    if node.module != here and _private(alias.name):
                        found.append(f"{here}:{node.lineno} {node.module}.{alias.name}")
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package.name:
                        if any(_private(part) for part in alias.name.split(".")):
                            found.append(f"{here}:{node.lineno} {alias.name}")
                        modules[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                module = modules.get(node.value.id)
                if module and module != here:
                    found.append(f"{here}:{node.lineno} {module}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_every_room_imports_only_the_rooms_below_it_and_no_cycle():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_a_planted_upward_import_breaks_the_contract(tmp_path):
    """losses/ (below train/) importing train.run: the layers contract names it, and the cycle contract the way
    round."""
    shutil.copytree(REPO / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    comm = tmp_path / PACKAGE / "losses" / "comm.py"
    comm.write_text(comm.read_text() + "\nimport disco_clip_ds.train.run  # planted\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout
    assert "disco_clip_ds.losses is not allowed to import disco_clip_ds.train:" in result.stdout
    assert "- disco_clip_ds.losses.comm -> disco_clip_ds.train.run" in result.stdout


def test_no_module_imports_a_private_name_of_another():
    assert private_imports(REPO / PACKAGE) == []


def test_a_planted_private_import_is_found(tmp_path):
    package = tmp_path / PACKAGE
    (package / "room").mkdir(parents=True)
    (package / "room" / "a.py").write_text("def _helper():\n    pass\n\n_LIMIT = 3\n")
    (package / "room" / "b.py").write_text(
        "from disco_clip_ds.room.a import _helper\n"
        "from disco_clip_ds.room import a\n"
        "import disco_clip_ds.room._hidden\n\n"
        "def f():\n    from disco_clip_ds.room.a import _LIMIT\n\n    return a._helper(), a.__name__, _LIMIT\n"
    )
    assert private_imports(package) == [
        "disco_clip_ds.room.b:1 disco_clip_ds.room.a._helper",
        "disco_clip_ds.room.b:3 disco_clip_ds.room._hidden",
        "disco_clip_ds.room.b:6 disco_clip_ds.room.a._LIMIT",
        "disco_clip_ds.room.b:8 disco_clip_ds.room.a._helper",
    ]
