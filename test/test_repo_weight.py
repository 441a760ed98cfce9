"""The repository stays light: no tracked file over 5 MB outside ``checkpoints/`` (the shipped demo policy).

Every clone and every copy to a device machine carries the tracked files, so large run artefacts (bags, per-episode
JSON, long videos) stay local under ``bench/results/`` (``.gitignore``; the README's "What bench/results/ keeps" says
how to regenerate them).  The list comes from ``git ls-files`` (staged files included); outside a git checkout (an
exported tree, an installed package) the test is skipped.  The checker is also tried on a planted heavy file.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 5 * 1024 * 1024
ALLOWED = ("checkpoints/",)


def heavy_tracked_files(root: Path, limit: int = LIMIT, allowed=ALLOWED) -> list[tuple[str, int]] | None:
    """(path, bytes) of every tracked file over ``limit`` outside the ``allowed`` prefixes; None when ``root`` is not
    a git checkout (or git is missing)."""
    if shutil.which("git") is None:
        return None
    r = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=60)
    if r.returncode != 0:
        return None
    out = []
    for rel in filter(None, r.stdout.decode("utf-8", "surrogateescape").split("\0")):
        p = root / rel
        if rel.startswith(allowed) or not p.is_file() or p.is_symlink():
            continue
        size = p.stat().st_size
        if size > limit:
            out.append((rel, size))
    return sorted(out)


def test_no_tracked_file_over_5_mb_outside_checkpoints():
    heavy = heavy_tracked_files(ROOT)
    if heavy is None:
        pytest.skip("not a git checkout")
    assert heavy == [], "tracked files over 5 MB (keep them local: .gitignore, README 'What bench/results/ keeps'): " \
        + ", ".join(f"{p} ({s / 2**20:.1f} MB)" for p, s in heavy)


def test_the_checker_finds_a_planted_heavy_file(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is missing")
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_SYSTEM=os.devnull)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, env=env)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "checkpoints" / "demo").mkdir(parents=True)
    for rel, size in (("bench/results/bag.mcap", LIMIT + 1), ("checkpoints/demo/model.safetensors", LIMIT + 1),
                      ("bench/results/ok.json", LIMIT), ("untracked.bin", LIMIT + 1)):
        with open(tmp_path / rel, "wb") as f:
            f.truncate(size)
    subprocess.run(["git", "-C", str(tmp_path), "add", "bench", "checkpoints"], check=True, env=env)
    assert heavy_tracked_files(tmp_path) == [("bench/results/bag.mcap", LIMIT + 1)]
    assert heavy_tracked_files(tmp_path / "nowhere") is None
