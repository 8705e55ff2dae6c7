"""The pyproject's explicit package list must cover every package folder (a missed one would be
absent from a non-editable install), and kernel sources must be package data."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _declared():
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"packages = \[(.*?)\]", text, re.S).group(1)
    return set(re.findall(r'"([\w.]+)"', block))


def test_every_package_folder_is_declared():
    mapping = {"coli": "coli", "stages": "coli.stages", "protocol": "coli.protocol"}
    found = set()
    for top, name in mapping.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    missing = found - _declared()
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_cli_entry_point_imports():
    from coli.cli.main import app
    assert app.info.name == "coli"
