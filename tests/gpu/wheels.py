"""Download the wheels the GPU check needs on the GPU machine, which has no network.

That machine has Python 3.12 and torch (with CUDA and nccl), numpy, matplotlib and their
dependencies, but none of IPython, ipyparallel, pyzmq, jupyter_client, ipykernel or anywidget.
This resolves shardviz's runtime dependencies with its ``cluster`` extra (torch left out: the
machine's own is used) for that Python and platform, drops what the machine already has, and
downloads the rest (binary wheels only) into one folder. shardviz itself runs from the working
tree, so the folder never holds a stale copy of it.

    python tests/gpu/wheels.py .gpu-wheels      (``make gpu-wheels``)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
# On the GPU machine's image already (see the device notes): carried, they would shadow its own.
ON_THE_MACHINE = {
    "torch",
    "numpy",
    "matplotlib",
    "contourpy",
    "cycler",
    "fonttools",
    "kiwisolver",
    "packaging",
    "pillow",
    "pyparsing",
    "python-dateutil",
    "six",
    "psutil",
    "tqdm",
    "typing-extensions",
    "pygments",
}
LIMIT_MB = 32  # what travels to the machine is at most 64 MiB with the working tree


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """shardviz's dependencies and its ``cluster`` extra, torch left out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["cluster"]]
    return [r for r in reqs if norm(re.split(r"[<>=!~; \[]", r)[0]) not in ON_THE_MACHINE]


def target_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def main(dest: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--report", str(report), "--target", str(Path(tmp) / "t"), *target_args(), *requirements()]
        print("resolving for Python", PYTHON_VERSION, ":", " ".join(requirements()), flush=True)
        subprocess.run(cmd, check=True)
        items = json.loads(report.read_text())["install"]
    pins = sorted(
        f"{i['metadata']['name']}=={i['metadata']['version']}"
        for i in items
        if norm(i["metadata"]["name"]) not in ON_THE_MACHINE
    )
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    print(f"downloading {len(pins)} wheels into {dest}", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *target_args()]
    subprocess.run([*cmd, *pins], check=True)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    (dest / "requirements.txt").write_text("\n".join(pins) + "\n")
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {dest}")
    if len(wheels) != len(pins):
        print(f"error: {len(pins)} pinned, {len(wheels)} downloaded", file=sys.stderr)
        return 1
    if size > LIMIT_MB:
        print(f"error: {size:.1f} MiB is over the {LIMIT_MB} MiB meant for the wheels", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / ".gpu-wheels")))
