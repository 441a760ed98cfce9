"""pip build of oxygen_ros on top of PyPI's ROS 2 wheels (the robot uses `colcon build`, which ignores this file).

`pip install --no-build-isolation .` runs the package's own CMakeLists.txt (the same one colcon uses) against the ROS
build tools installed in the current environment (requirements-build.txt), installs it into a staging prefix, and
packs that install tree into a platform wheel:

  staging/lib/python3.X/site-packages/oxygen_ros/**  -> the `oxygen_ros` package (hand-written code + generated
                                                        msg, srv, action)
  staging/lib/*.so                                   -> <env>/lib   (found by the ROS wheels' bootstrapper)
  staging/lib/oxygen_ros/*                           -> <env>/lib/oxygen_ros   (`ros2 run` executables)
  staging/share/**                                   -> <env>/share (package share dir, launch/, config/, ament index)

CMake runs on a copy of the sources under build/, because the environment usually lives inside the source tree
(.venv) and CMake refuses exported include paths that point into the source directory.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CMAKE_INPUTS = ["CMakeLists.txt", "package.xml", "msg", "srv", "action", "scripts", "launch", "config", "oxygen_ros"]


class BinaryDistribution(Distribution):
    """The wheel carries compiled message libraries, so it must be a platform wheel."""

    def has_ext_modules(self):
        return True


def _copy_sources(dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CMAKE_INPUTS:
        src = ROOT / name
        if not src.exists():
            continue
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            shutil.copy2(src, dst / name)


def _cmake_build(work: Path) -> Path:
    """Configure, build and install the CMake package; return the install prefix."""
    src, bld, inst = work / "src", work / "build", work / "install"
    _copy_sources(src)
    if inst.exists():
        shutil.rmtree(inst)
    prefix = sys.prefix  # the ROS wheels put share/ and lib/ at the environment prefix
    env = dict(os.environ)
    env["AMENT_PREFIX_PATH"] = os.pathsep.join(p for p in [prefix, env.get("AMENT_PREFIX_PATH", "")] if p)
    env["CMAKE_PREFIX_PATH"] = os.pathsep.join(p for p in [prefix, env.get("CMAKE_PREFIX_PATH", "")] if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cmake = shutil.which("cmake", path=env["PATH"])
    if cmake is None:
        raise RuntimeError("cmake not found: install requirements-build.txt (pip install -r requirements-build.txt)")
    jobs = str(max(1, os.cpu_count() or 1))
    run = lambda *args: subprocess.run([cmake, *args], check=True, env=env)  # noqa: E731
    run("-S", str(src), "-B", str(bld), f"-DCMAKE_INSTALL_PREFIX={inst}", "-DBUILD_TESTING=OFF",
        "-DCMAKE_BUILD_TYPE=Release", f"-DPython3_EXECUTABLE={sys.executable}",
        f"-DPYTHON_INSTALL_DIR={Path(sysconfig.get_path('purelib')).relative_to(prefix)}")
    run("--build", str(bld), "-j", jobs)
    run("--install", str(bld))
    return inst


class BuildWithMessages(build_py):
    """build_py + the CMake message build; registers the install tree's lib/ and share/ as data files."""

    def run(self):
        super().run()
        inst = _cmake_build(ROOT / "build" / "oxygen_ros_cmake")
        purelib = Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
        generated = inst / purelib / "oxygen_ros"
        target = Path(self.build_lib) / "oxygen_ros"
        for path in generated.rglob("*"):
            rel = path.relative_to(generated)
            if path.is_dir() or "__pycache__" in rel.parts:
                continue
            if rel.parts[0] not in ("msg", "srv", "action") and rel.suffix == ".py":
                continue  # hand-written sources come from build_py itself
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / rel)
        data = {}
        for path in sorted(inst.rglob("*")):
            rel = path.relative_to(inst)
            if path.is_dir() or rel.parts[0] == "include" or rel.is_relative_to(purelib):
                continue
            data.setdefault(str(rel.parent), []).append(str(path))
        self.distribution.data_files = sorted(data.items())


setup(
    name="oxygen_ros",
    version="0.1.0",
    description="ROS 2 node for a pi0.5-style VLA with unified KV cache management (OxyGen)",
    packages=find_packages(include=["oxygen_ros", "oxygen_ros.*"]),     # every hand-written (sub)package
    python_requires=">=3.10",
    install_requires=["numpy", "torch", "transformers", "safetensors", "sentencepiece", "opencv-python-headless",
                      "rosbags", "matplotlib"],
    entry_points={"console_scripts": ["oxygen=oxygen_ros.tools.cli:main", "oxygen_node=oxygen_ros.ros.node:main"]},
    cmdclass={"build_py": BuildWithMessages},
    distclass=BinaryDistribution,
    zip_safe=False,
)
