"""aamperf installed from a wheel (`pip install .`, not an editable checkout) finds its config groups
from any working directory: pyproject.toml ships conf/ inside the package, as aamperf/conf."""

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_subpackage_and_conf():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in ROOT.glob("aamperf/**/__init__.py")}
    assert set(setuptools["packages"]) == found | {"aamperf.conf"}  # a new subpackage goes in the list
    assert setuptools["package-dir"] == {"aamperf.conf": "conf"}


def test_a_wheel_holds_every_config_file_and_trains_outside_the_checkout(tmp_path):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ there
    shutil.copytree(ROOT / "aamperf", source / "aamperf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "conf", source / "conf")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("aamperf-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
        names = set(archive.namelist())
    configs = {f"aamperf/{path.relative_to(ROOT).as_posix()}" for path in ROOT.glob("conf/**/*.yaml")}
    assert len(configs) > 60 and configs <= names  # conf/hydra/launcher/slurm.yaml too

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}  # the wheel's aamperf, not the checkout's
    where = subprocess.run(
        [sys.executable, "-c", "import aamperf.config as c; print(c.CONF_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip() == str(tmp_path / "site" / "aamperf" / "conf")
    run = subprocess.run(
        [sys.executable, "-m", "aamperf.train", "optim=ultra", "model=aam_tiny", "--cfg", "job"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "optim: ultra" in run.stdout  # conf/optim/ultra.yaml, read from the wheel
