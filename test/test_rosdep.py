"""``package.xml``'s dependencies resolve on a Jazzy robot, and the README's robot install steps match them.

``rosdep install --from-paths src --ignore-src -y`` fails on the robot with "Cannot locate rosdep definition" for a
dependency that is neither a package of the ROS distribution nor a rosdep key (``python3-safetensors`` and
``python3-sentencepiece`` were declared and are neither).  The check runs against a snapshot of ros/rosdistro kept in
``test/data/rosdep/`` (its README names the commit and date), so it needs no network and no ``../shared``.

The README's robot steps (section "Building") must run rosdep first, then pip, then colcon; pip installs exactly
what has no rosdep key, pinned as in ``requirements.txt``; every Python package the robot needs (``requirements.txt``
minus the PyPI ROS wheels) is either a declared rosdep key or on that pip line; and the README names every non-ROS
key ``package.xml`` declares.  Generic: a new dependency (e.g. ``python3-mujoco-pip``) is checked the same way.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = REPO / "test" / "data" / "rosdep"
DEPENDENCY_TAGS = ("depend", "build_depend", "build_export_depend", "buildtool_depend", "buildtool_export_depend",
                   "exec_depend", "test_depend", "doc_depend")
# pip distribution names whose rosdep key is not python3-<name>[-pip]
KEY_NAME = {"opencv-python-headless": "opencv", "opencv-python": "opencv"}


def _lines(name: str) -> set[str]:
    return {x.strip() for x in (SNAPSHOT / name).read_text().splitlines() if x.strip()}


@pytest.fixture(scope="module")
def snapshot() -> tuple[set[str], set[str]]:
    """(Jazzy packages, rosdep keys)."""
    return _lines("jazzy_packages.txt"), _lines("rosdep_keys.txt")


def package_dependencies(path: Path = REPO / "package.xml") -> list[tuple[str, str]]:
    """(tag, name) of every dependency element of a package.xml (format 2/3)."""
    root = ET.parse(path).getroot()
    return [(el.tag, (el.text or "").strip()) for tag in DEPENDENCY_TAGS for el in root.findall(tag)]


def requirements(path: Path = REPO / "requirements.txt") -> dict[str, str]:
    """name -> version pin ('' if none) of requirements.txt, without the PyPI ROS wheels (ros-*), which stand in for
    what ROS packages give on a robot."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-") or line.startswith("ros-"):
            continue
        name = re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-")
        m = re.search(r"==\s*([^\s;]+)", line)
        out[name] = m.group(1) if m else ""
    return out


def simulation_only(path: Path = REPO / "requirements.txt") -> set[str]:
    """The packages of requirements.txt's simulation section (the comment block that says "not needed on the
    robot"): the development / CI environment needs them, the robot's runtime does not."""
    out, inside = set(), False
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#"):
            if "not needed on the robot" in line:
                inside = True
            elif inside and out:                  # the next section's comment ends it
                inside = False
            continue
        if inside and line:
            out.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return out


def key_candidates(dist: str) -> list[str]:
    n = KEY_NAME.get(dist, dist)
    return [f"python3-{n}", f"python3-{n}-pip"]


def robot_steps() -> tuple[str, list[str]]:
    """The README's robot paragraph (from "On the robot" to the next list item) and its shell block's lines."""
    text = (REPO / "README.md").read_text()
    start = text.index("- **On the robot")
    end = text.index("\n- **", start + 1)
    section = text[start:end]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the robot steps are a ```bash block"
    lines = [x.split("#", 1)[0].strip() for x in block.group(1).splitlines()]
    return section, [x for x in lines if x]


def test_every_dependency_is_a_jazzy_package_or_a_rosdep_key(snapshot):
    jazzy, keys = snapshot
    assert len(jazzy) > 1000 and len(keys) > 1000 and "rclpy" in jazzy and "python3-torch" in keys
    deps = package_dependencies()
    assert len(deps) > 20
    unknown = [f"<{tag}>{name}</{tag}>" for tag, name in deps if name not in jazzy and name not in keys]
    assert not unknown, (f"not a Jazzy package nor a rosdep key (rosdep install fails on the robot): {unknown}; "
                         "install it with pip after rosdep (README robot steps) or get a key into ros/rosdistro")


def test_the_check_finds_an_undefined_key(snapshot, tmp_path):
    """The names of the bug: neither is a key, so a package.xml declaring them fails the check above."""
    jazzy, keys = snapshot
    bad = tmp_path / "package.xml"
    bad.write_text('<package format="3"><name>x</name><depend>rclpy</depend>'
                   "<exec_depend>python3-safetensors</exec_depend><test_depend>python3-sentencepiece</test_depend>"
                   "</package>")
    deps = package_dependencies(bad)
    assert deps == [("depend", "rclpy"), ("exec_depend", "python3-safetensors"), ("test_depend", "python3-sentencepiece")]
    assert [n for _, n in deps if n not in jazzy and n not in keys] == ["python3-safetensors", "python3-sentencepiece"]


def test_readme_robot_steps_match_package_xml_and_requirements(snapshot):
    jazzy, keys = snapshot
    section, lines = robot_steps()
    order = [next((i for i, x in enumerate(lines) if x.startswith(cmd)), None)
             for cmd in ("rosdep install", "python3 -m pip install", "colcon build")]
    assert None not in order and order == sorted(order), f"rosdep, then pip, then colcon: {lines}"
    assert "--from-paths src" in lines[order[0]] and "--ignore-src" in lines[order[0]]
    pip = dict(re.match(r"([A-Za-z0-9_.-]+)(?:==(\S+))?$", tok).groups()
               for tok in lines[order[1]].split()[4:])
    pip = {k.lower().replace("_", "-"): v or "" for k, v in pip.items()}
    declared = {n for _, n in package_dependencies()}
    reqs = requirements()
    for dist, version in pip.items():
        has_key = [k for k in key_candidates(dist) if k in keys]
        assert not has_key, f"{dist} is on the README's pip line but has the rosdep key {has_key}: declare it instead"
        assert dist in reqs and version == reqs[dist], f"pip line {dist}=={version}, requirements.txt {reqs.get(dist)}"
    sim = simulation_only()
    uncovered = [d for d in reqs if d not in pip and d not in sim and not any(k in declared for k in key_candidates(d))]
    assert not uncovered, (f"requirements.txt packages neither declared in package.xml (a rosdep key) nor on the "
                           f"README's pip line: {uncovered}")
    # the simulation's packages: a (conditional) rosdep key, or pinned on the README's simulation pip line
    text = (REPO / "README.md").read_text()
    for d in sim:
        if any(k in declared for k in key_candidates(d)):
            continue
        assert re.search(rf"pip install [^`\n]*{re.escape(d)}=={re.escape(reqs[d])}", text), \
            f"README: the simulation's {d}=={reqs[d]} (no rosdep key) must be on its pip install line"
    named = [n for n in declared if n in keys and n not in jazzy and f"`{n}`" not in section]
    assert not named, f"the README's robot steps do not say that rosdep installs {named}"
