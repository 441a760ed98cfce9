"""Every dependency ``package.xml`` declares can be resolved by ``rosdep install`` on a Jazzy robot: a ROS package
released in Jazzy or an existing rosdep key (``test/data/rosdep/``: a snapshot of ros/rosdistro).  A key that does not
exist makes ``rosdep install --from-paths src --ignore-src -y`` fail outright ("Cannot locate rosdep definition"), so
the class of bug is "a name rosdep cannot resolve", whatever the dependency type or condition."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "rosdep"
DEP_TAGS = ("depend", "build_depend", "build_export_depend", "buildtool_depend", "buildtool_export_depend",
            "exec_depend", "test_depend", "doc_depend")


def _lines(name: str) -> set[str]:
    return {ln.strip() for ln in (DATA / name).read_text().splitlines() if ln.strip() and not ln.startswith("#")}


def test_every_package_xml_dependency_is_a_jazzy_package_or_a_rosdep_key():
    known = _lines("jazzy_packages.txt") | _lines("rosdep_keys.txt")
    root = ET.parse(REPO / "package.xml").getroot()
    deps = [(el.tag, el.text.strip(), el.get("condition")) for tag in DEP_TAGS for el in root.iter(tag)]
    assert len(deps) > 10
    bad = [f"<{tag}>{name}</{tag}>" + (f" (condition {cond})" if cond else "") for tag, name, cond in deps
           if name not in known]
    assert not bad, f"not resolvable by rosdep on Jazzy: {bad}"


def test_the_snapshot_is_the_real_thing():
    """Guards the guard: the lists hold the keys the README relies on and lack the ones known not to exist."""
    keys, pkgs = _lines("rosdep_keys.txt"), _lines("jazzy_packages.txt")
    assert {"python3-torch", "python3-transformers-pip", "python3-rosbags-pip", "python3-mujoco-pip"} <= keys
    assert not {"python3-safetensors", "python3-sentencepiece"} & keys
    assert {"rclpy", "sensor_msgs", "trajectory_msgs", "launch_ros", "cv_bridge"} <= pkgs
    assert len(keys) > 1000 and len(pkgs) > 1000


def test_readme_robot_install_installs_what_rosdep_cannot():
    """The README's robot steps pip-install exactly the Python dependencies package.xml leaves to pip."""
    text = (REPO / "README.md").read_text()
    assert "rosdep install --from-paths" in text
    for name in ("safetensors", "sentencepiece"):
        assert f"{name}" in text.split("rosdep install --from-paths", 1)[1].split("colcon build", 1)[0], \
            f"README: {name} must be pip-installed between rosdep and colcon build"
