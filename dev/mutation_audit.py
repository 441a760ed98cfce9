#!/usr/bin/env python3
"""Mutation audit: plants one realistic bug at a time and checks that the tests written for it fail.

This file owns the audit's mechanics; the bugs live in a spec (default ``dev/mutants.toml``), one ``[[mutant]]`` table
each: ``id``, ``file`` (repository-relative), ``original`` (a snippet that must occur exactly once in that file),
``replacement``, ``tests`` (pytest arguments: the covering test files or node ids, kept small) and ``behaviour`` (one
line: what the planted bug does).  The script copies the repository's files (tracked + untracked, not ignored) into a
temporary directory once, first runs each distinct test selection unmutated (a selection that fails there makes the
audit meaningless: the script stops), then for each mutant writes the mutated file into the copy, runs
``python -m pytest -x -q -p no:cacheprovider -n 0 <tests>`` there (``PYTHONPATH`` = the copy, no bytecode files, in
its own process group, killed after ``--timeout`` s), restores the file and records the result: ``caught`` (tests
failed), ``survived`` (tests passed), ``timeout`` (counted as caught, shown apart) or ``error`` (the snippet is not in
the file exactly once: a stale spec).  The working tree is never written; the copy is removed on any exit (Ctrl-C
included).  It prints a line per mutant and the total, writes a JSON summary (``--out``) and exits 1 when the caught
fraction is below ``--threshold`` (default 0.95) or the spec has errors, 2 for bad arguments, 3 when a baseline
fails.

Run from the repository root (the audit takes a while: about 10 s per mutant on two shared cores; it runs niced):

    /work/main/.venv/bin/python dev/mutation_audit.py                         # every mutant, dev/mutants.toml
    /work/main/.venv/bin/python dev/mutation_audit.py --only exec-ramp-jump,rep-wilson-zero-width
    /work/main/.venv/bin/python dev/mutation_audit.py --list
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0"]


@dataclass
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    tests: list
    behaviour: str


@dataclass
class Result:
    id: str
    file: str
    behaviour: str
    status: str                          # caught | survived | timeout | error
    seconds: float = 0.0
    returncode: int | None = None
    detail: str = ""
    tests: list = field(default_factory=list)


def load_spec(path: Path) -> list[Mutant]:
    data = tomllib.loads(path.read_text())
    out, seen = [], set()
    for i, m in enumerate(data.get("mutant", [])):
        missing = [k for k in ("id", "file", "original", "replacement", "tests", "behaviour") if k not in m]
        if missing:
            raise ValueError(f"{path}: mutant #{i + 1} ({m.get('id', '?')}) lacks {missing}")
        if m["id"] in seen:
            raise ValueError(f"{path}: mutant id {m['id']!r} repeats")
        if m["original"] == m["replacement"]:
            raise ValueError(f"{path}: mutant {m['id']!r} replaces its snippet by itself")
        seen.add(m["id"])
        out.append(Mutant(m["id"], m["file"], m["original"], m["replacement"], list(m["tests"]), m["behaviour"]))
    return out


def copy_tree(dst: Path) -> None:
    """The repository's files as git sees them (tracked + untracked, not ignored) -> ``dst``."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


class Runner:
    """pytest in the copy, one process group at a time (so Ctrl-C and timeouts kill everything it started)."""

    def __init__(self, root: Path, timeout: float, python: str):
        self.root, self.timeout, self.python = root, timeout, python
        self.proc: subprocess.Popen | None = None
        self.env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")

    def run(self, tests: list, log: Path) -> tuple[str, int | None, float]:
        t0 = time.monotonic()
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([self.python, *PYTEST, *tests], cwd=self.root, env=self.env, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = self.proc.wait(self.timeout)
                status = "survived" if rc == 0 else "caught"
            except subprocess.TimeoutExpired:
                self.kill()
                rc, status = None, "timeout"
            except BaseException:                        # Ctrl-C / SIGTERM: nothing it started may outlive it
                self.kill()
                raise
            finally:
                self.proc = None
        return status, rc, time.monotonic() - t0

    def kill(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def tail(path: Path, n: int = 25) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(REPO / "dev" / "mutants.toml"), help="the mutants (TOML)")
    ap.add_argument("--only", default="", help="comma-separated mutant ids (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test run (default 300)")
    ap.add_argument("--threshold", type=float, default=0.95, help="minimum caught fraction (default 0.95)")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "oxygen-mutation-audit.json"),
                    help="JSON summary path (default: in the temp directory)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    ap.add_argument("--nice", type=int, default=10, help="niceness added to this process and its tests")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs of the selections")
    ap.add_argument("--keep-logs", default="", help="a directory to keep every run's pytest output in")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    try:
        mutants = load_spec(Path(args.spec))
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"mutation_audit: bad spec: {exc}", file=sys.stderr)
        return 2
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {m.id for m in mutants})
        if unknown:
            print(f"mutation_audit: unknown mutant id(s) {unknown}", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.id in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.id:32} {m.file:36} {m.behaviour}")
        return 0
    if args.nice:
        os.nice(args.nice)

    tmp = Path(tempfile.mkdtemp(prefix="oxygen-mutation-"))
    runner = Runner(tmp, args.timeout, args.python)
    logs = Path(args.keep_logs) if args.keep_logs else tmp / "_logs"

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    results: list[Result] = []
    try:
        copy_tree(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        if not args.no_baseline:
            selections = list(dict.fromkeys(tuple(m.tests) for m in mutants))
            for i, sel in enumerate(selections):
                status, rc, secs = runner.run(list(sel), logs / f"baseline-{i}.log")
                print(f"baseline {' '.join(sel)}: {'ok' if status == 'survived' else status} ({secs:.0f} s)",
                      flush=True)
                if status != "survived":
                    print(tail(logs / f"baseline-{i}.log"), file=sys.stderr)
                    print("mutation_audit: the unmutated tree fails this selection; fix it first", file=sys.stderr)
                    return 3
        for m in mutants:
            target = tmp / m.file
            text = target.read_text() if target.is_file() else None
            count = text.count(m.original) if text is not None else 0
            if count != 1:
                r = Result(m.id, m.file, m.behaviour, "error", tests=m.tests,
                           detail=f"snippet found {count} times (must be once): the spec is stale")
            else:
                target.write_text(text.replace(m.original, m.replacement))
                try:
                    status, rc, secs = runner.run(m.tests, logs / f"{m.id}.log")
                finally:
                    target.write_text(text)
                detail = tail(logs / f"{m.id}.log", 3) if status == "survived" else ""
                r = Result(m.id, m.file, m.behaviour, status, round(secs, 1), rc, detail, m.tests)
            results.append(r)
            print(f"{r.status:8} {r.seconds:6.1f}s  {m.id:32} {m.behaviour}" + (f"  [{r.detail}]"
                                                                                  if r.status == "error" else ""),
                  flush=True)
    except KeyboardInterrupt:
        runner.kill()
        print("\nmutation_audit: interrupted; the working tree was never modified", file=sys.stderr)
        return 130
    finally:
        runner.kill()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)

    caught = sum(r.status in ("caught", "timeout") for r in results)
    errors = [r for r in results if r.status == "error"]
    scored = len(results) - len(errors)
    frac = caught / scored if scored else 0.0
    survivors = [r.id for r in results if r.status == "survived"]
    summary = {"spec": str(args.spec), "mutants": len(results), "scored": scored, "caught": caught,
               "timeouts": sum(r.status == "timeout" for r in results), "survived": survivors,
               "errors": [r.id for r in errors], "caught_fraction": frac, "threshold": args.threshold,
               "results": [asdict(r) for r in results]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ncaught {caught} of {scored} ({100 * frac:.1f} %), threshold {100 * args.threshold:.0f} %"
          + (f"; survived: {', '.join(survivors)}" if survivors else "")
          + (f"; {len(errors)} stale spec entries" if errors else "") + f"\nsummary: {args.out}")
    return 0 if frac >= args.threshold and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
