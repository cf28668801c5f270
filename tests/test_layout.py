"""The loader's rooms stay layered (no import cycles), and the README's layout matches the tree."""

import ast
import re
from pathlib import Path

from pallas_hub.hub.manifest import ROOT

PACKAGE = ROOT / "loader" / "pallas_hub"
# each room may import only the rooms listed (besides itself); cli.py and demo.py sit on top of all
ALLOWED = {"vendored": set(), "hub": {"vendored"}, "verify": {"hub", "vendored"}, "bench": {"hub", "verify", "vendored"}}


def _imported_rooms(path: Path) -> set[str]:
    """The pallas_hub rooms (or top-level modules) a module imports, relative or absolute."""
    rel = path.relative_to(PACKAGE).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # resolve against the module's own package
                base = list(rel[:-1])[: len(rel) - node.level]
                parts = base + (node.module.split(".") if node.module else [])
                names = [parts[0]] if parts else [a.name for a in node.names]
            elif node.module and node.module.split(".")[0] == "pallas_hub":
                parts = node.module.split(".")[1:]
                names = [parts[0]] if parts else [a.name for a in node.names]
            else:
                continue
            found.update(n.removesuffix(".py") for n in names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("pallas_hub."))
    return found


def test_rooms_import_only_the_rooms_below_them():
    for room, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / room).rglob("*.py")):
            imported = _imported_rooms(path) - {room, "_version"}  # _version: a leaf (no imports)
            assert imported <= allowed, f"{path.relative_to(ROOT)} imports {sorted(imported - allowed)}"


def test_vendored_modules_import_only_each_other_relatively():
    for path in sorted((PACKAGE / "vendored").glob("_*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and (node.module or "").startswith("_"), f"{path.name}: {ast.unparse(node)}"
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert not node.module.startswith("pallas_hub"), f"{path.name}: {ast.unparse(node)}"


def test_readme_layout_names_every_room_and_top_level_folder():
    text = (ROOT / "README.md").read_text()
    layout = text.split("## Layout", 1)[1].split("```", 2)[1]
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    named = set(re.findall(r"^\s{2}(\w+)/", layout, re.MULTILINE))
    assert rooms <= named, f"rooms missing from the README layout: {sorted(rooms - named)}"
    for folder in ("kernels", "loader", "tests", "benchmarks"):
        assert re.search(rf"^{folder}/", layout, re.MULTILINE)
    for name in ("_bridge.py", "_chips.py", "_attention_math.py"):
        assert (PACKAGE / "vendored" / name).is_file() and name in layout
