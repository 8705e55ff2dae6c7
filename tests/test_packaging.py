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


def test_matplotlib_is_the_bench_extra_not_a_base_dependency():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {re.split(r"[<>=;\[ ]", r, 1)[0].lower() for r in reqs}   # noqa: E731
    assert "matplotlib" not in names(project["dependencies"])
    assert "matplotlib" in names(project["optional-dependencies"]["bench"])
    assert "matplotlib" in names(project["optional-dependencies"]["dev"])   # the plot tests still draw


def test_the_runtime_imports_without_matplotlib():
    # A base install has no matplotlib: the CLI, the stages, the gateway and the bench must import without it
    # (sys.modules[name] = None makes `import name` raise ImportError, as on a machine without it).
    import subprocess
    import sys

    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import coli.cli.main, coli.serve.gateway, coli.bench.stream, coli.bench.plots\n"
            "import coli.stages.executor.process, coli.stages.supervisor.process, coli.stages.ramtier.process\n"
            "import coli.stages.reader.process\n"
            "from coli.cli.main import app\n"
            "assert \"'.[bench]'\" in coli.bench.plots.missing()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
