"""`coli doctor`: every check answers pass / warn / fail / skip with what it found (and a fix when it is not a
pass), a damaged container and impossible budgets are failures, a taken port is a warning, and the command's
exit code says whether anything failed."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from coli.doctor import CHECKS, FAIL, PASS, SKIP, WARN, Context, check_container, check_ports, run_checks


def coli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    from coli.container.writer import ConvertOptions, convert
    from coli.model_store import DEMO_DIR

    if not (DEMO_DIR / "config.json").is_file():
        pytest.skip("demo model not built")
    dst = tmp_path_factory.mktemp("doctor") / "demo-int8"
    convert(DEMO_DIR, dst, ConvertOptions(experts="int8", dense="int8"), report=lambda m: None)
    return dst


@pytest.mark.timeout(120)
def test_every_check_reports_a_status_and_a_fix(container):
    checks = run_checks(Context(model=container, ram_gb=0.5))
    assert [c.name for c in checks] == ["python", "packages", "cuda driver", "pycuda", "gpu memory", "locked memory",
                                        "/dev/shm", "free ram", "disk read speed", "container", "free port", "run dir"]
    assert len(checks) == len(CHECKS)
    for c in checks:
        assert c.status in (PASS, WARN, FAIL, SKIP) and c.message, c
        if c.status in (WARN, FAIL) and c.name not in ("disk read speed",):
            assert c.fix, f"{c.name} is {c.status} without a fix: {c.message}"
    by = {c.name: c for c in checks}
    assert by["python"].status == PASS and by["packages"].status == PASS
    assert by["container"].status == PASS and "16 sampled expert records" in by["container"].message
    assert "GB/s" in by["disk read speed"].message
    assert by["/dev/shm"].status == PASS and by["free ram"].status in (PASS, WARN)


@pytest.mark.timeout(120)
def test_damaged_container_fails_with_the_extent_named(container, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(container, bad)
    from coli.container.reader import ContainerReader
    r = ContainerReader(bad, cache_dense=False)
    row = r.index[5]
    path, off = r.expert_paths[int(row["file"])], int(row["offset"]) + 100
    r.close()
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    c = check_container(Context(model=bad, sample=10_000))
    assert c.status == FAIL and f"layer {int(row['layer'])} expert {int(row['expert'])}" in c.message
    assert "coli verify" in c.fix
    (bad / "coli-manifest.json").write_text("{}")
    c = check_container(Context(model=bad))
    assert c.status == FAIL and "manifest" in c.message


def test_taken_port_warns_and_impossible_budgets_fail():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        c = check_ports(Context(port=s.getsockname()[1]))
        assert c.status == WARN and "--http" in c.fix
    finally:
        s.close()
    by = {c.name: c for c in run_checks(Context(ram_gb=1_000_000))}
    assert by["/dev/shm"].status == FAIL and "shm" in by["/dev/shm"].fix
    assert by["free ram"].status == FAIL and "--ram-gb" in by["free ram"].fix


@pytest.mark.timeout(120)
def test_cli_exit_code_and_json():
    r = coli("doctor", "--json")
    checks = json.loads(r.stdout)
    assert r.returncode == (1 if any(c["status"] == FAIL for c in checks) else 0)
    r = coli("doctor", "--json", "--ram-gb", "1000000")
    assert r.returncode == 1 and any(c["name"] == "/dev/shm" and c["status"] == FAIL for c in json.loads(r.stdout))
    r = coli("doctor")
    assert "pass" in r.stdout and "check" in r.stdout
