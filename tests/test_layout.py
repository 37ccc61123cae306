"""docs/internals.md's layout table matches the tree: every public module of grpo/ is named in it (a
top-level module by its path, a package's modules by their file names in the package's row), and every
path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_rows() -> dict[str, str]:
    """{first column: the whole row} of the table under '## Layout'."""
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {row.split(" | ")[0].lstrip("| "): row for row in rows}


def public_modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if not p.name.startswith("_"))


def test_the_layout_table_names_every_public_module_of_grpo():
    rows = layout_rows()
    paths = {path for first in rows for path in re.findall(r"`([^`]+)`", first)}
    missing = []
    for module in public_modules(ROOT / "grpo"):
        relative = module.relative_to(ROOT)
        if len(relative.parts) == 2:  # grpo/x.py: named by its path
            if str(relative) not in paths:
                missing.append(str(relative))
            continue
        package_row = next((row for first, row in rows.items() if f"`grpo/{relative.parts[1]}/`" in first), "")
        if f"`{module.name}`" not in package_row:
            missing.append(str(relative))
    assert not missing, f"docs/internals.md's layout table does not name {missing}"


def test_every_path_in_the_layout_table_exists():
    rows = layout_rows()
    named = {path for first in rows for path in re.findall(r"`([^`]+)`", first)}
    assert named and all((ROOT / path).exists() for path in named), [p for p in named if not (ROOT / p).exists()]
