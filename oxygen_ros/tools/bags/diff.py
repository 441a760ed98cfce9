"""``oxygen bag-diff A B``: compare two output bags (``oxygen bag-eval`` or ``oxygen replay --record``) topic by topic;
exit status 0 when they agree within tolerance, 1 when they do not.

This file owns what "the same run" means. Messages are read back with rosbags (no ROS needed) and matched per topic,
by message type: ``ActionChunk`` by ``frame_index`` (``--match stamp``: by ``header.stamp``, the capture time of the
observation, for online vs offline runs whose frame numbering differs), ``LanguageToken`` streams by ``request_id``
(stamp mode: by task and order), ``MemoryEntry`` by ``entry_id`` (stamp mode: by order), other types
(``conversation/response`` strings, anything else) by order. In stamp mode a chunk whose first message came one
control tick later (fewer rows: the remainder) is compared on the rows both have. Actions agree when ``|a - b| <=
atol + rtol * |b|`` element-wise, and a NaN or inf only with the same value (a NaN against a number is beyond any
tolerance; its ``|a - b|`` counts as inf); any missing or extra message is a difference; everything else must be
equal: texts and token ids exactly, and in index mode the deterministic fields too (``chunk_id``, stamps,
``blended``, ``observation_age_s``...; ``inference_latency_ms`` is wall-clock and never compared). The report gives,
per topic, matched / missing / extra messages; for actions the max and p95 ``|a - b|`` per joint and the first frame
beyond tolerance (row, joint and both values); for language the missing token indices and the first differing token
of each answer with both texts. ``diff_bags`` returns ``TopicDiff`` records (also as JSON with ``--json``);
``plot_actions`` draws the per-frame max action difference.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Record", "read_bag", "Tolerance", "TopicDiff", "diff_bags", "format_report", "plot_actions", "main"]

_SHOW = 6           # items listed per kind of difference in the text report


@dataclass
class Record:
    t_ns: int           # log time
    raw: bytes          # CDR bytes as stored
    msg: object         # deserialised (rosbags), or None for a type the typestore does not know


def read_bag(path) -> dict[str, tuple[str, list[Record]]]:
    """topic -> (msgtype, records in log-time order) of a rosbag2 directory."""
    from rosbags.rosbag2 import Reader  # noqa: PLC0415

    from oxygen_ros.bags.types import typestore  # noqa: PLC0415

    ts = typestore()
    out: dict[str, tuple[str, list[Record]]] = {}
    with Reader(Path(path)) as r:
        for c in r.connections:
            out.setdefault(c.topic, (c.msgtype, []))
        for c, t_ns, raw in r.messages():
            try:
                msg = ts.deserialize_cdr(raw, c.msgtype)
            except Exception:  # noqa: BLE001 - unknown type: compared as bytes
                msg = None
            out[c.topic][1].append(Record(int(t_ns), bytes(raw), msg))
    return out


@dataclass(frozen=True)
class Tolerance:
    atol: float = 1e-4
    rtol: float = 0.0

    def exceeded(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Element-wise True where ``a`` and ``b`` disagree: finite values when ``|a - b| > atol + rtol * |b|``; a
        non-finite value agrees only with the same one (NaN with NaN, +inf with +inf), so a NaN or inf against a
        number is beyond any tolerance (what a broken checkpoint produces)."""
        finite = np.isfinite(a) & np.isfinite(b)
        bound = self.atol + self.rtol * np.abs(np.where(finite, b, 0.0))
        return np.where(finite, distance(a, b) > bound, ~_same(a, b))


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


def distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise ``|a - b|`` for finite values; 0 where both hold the same non-finite value, inf where one is
    non-finite and the other is not the same (never NaN, so maxima and percentiles stay meaningful)."""
    finite = np.isfinite(a) & np.isfinite(b)
    d = np.abs(np.where(finite, a, 0.0) - np.where(finite, b, 0.0))
    return np.where(finite, d, np.where(_same(a, b), 0.0, np.inf))


def _p95(x: np.ndarray) -> float:
    v = float(np.percentile(x, 95)) if x.size else 0.0
    return np.inf if np.isnan(v) else v          # linear interpolation between two infs gives NaN


@dataclass
class TopicDiff:
    topic: str
    kind: str                                           # actions | tokens | memory | ordered
    count_a: int
    count_b: int
    unit: str = "messages"                              # what matched/missing/extra count
    matched: int = 0
    missing: list = field(default_factory=list)         # keys in A, not in B
    extra: list = field(default_factory=list)           # keys in B, not in A
    differences: list = field(default_factory=list)     # one readable line each
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.differences)

    def to_json(self) -> dict:
        return {"topic": self.topic, "kind": self.kind, "ok": self.ok, "count_a": self.count_a,
                "count_b": self.count_b, "unit": self.unit, "matched": self.matched, "missing": self.missing,
                "extra": self.extra, "differences": self.differences, "stats": self.stats}


def _stamp(t) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


def _stamp_text(ns: int) -> str:
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def _keyed(records: list[Record], key) -> dict:
    """key -> first record with that key (an online recording may hold repeats)."""
    out: dict = {}
    for r in records:
        out.setdefault(key(r.msg), r)
    return out


def _first_field_differences(pairs, fields: dict, what: str) -> list[str]:
    """For each named field (name -> getter): the first matched key where A and B differ."""
    lines = []
    for name, get in fields.items():
        for k, ma, mb in pairs:
            va, vb = get(ma), get(mb)
            if va != vb:
                n = sum(1 for _, x, y in pairs if get(x) != get(y))
                lines.append(f"{name} differs in {n} of {len(pairs)} {what}, first at {k}: A {va!r}, B {vb!r}")
                break
    return lines


# ---------------------------------------------------------------------------------------------------- actions
def _actions(m) -> np.ndarray:
    a = np.asarray(m.actions, dtype=np.float32)
    h, d = int(m.horizon), int(m.action_dim)
    return a.reshape(h, d) if a.size == h * d else a.reshape(1, -1)


def diff_actions(topic: str, a: list[Record], b: list[Record], tol: Tolerance, match: str) -> TopicDiff:
    key = (lambda m: int(m.frame_index)) if match == "index" else (lambda m: _stamp(m.header.stamp))
    ka, kb = _keyed(a, key), _keyed(b, key)
    common = sorted(set(ka) & set(kb))
    show = str if match == "index" else _stamp_text
    d = TopicDiff(topic, "actions", len(a), len(b), "chunks", len(common), [show(k) for k in sorted(set(ka) - set(kb))],
                  [show(k) for k in sorted(set(kb) - set(ka))])
    per_frame, cols, first_bad, n_bad, shifted = [], [], None, 0, 0
    names: list[str] = []
    for k in common:
        ma, mb = ka[k].msg, kb[k].msg
        xa, xb = _actions(ma), _actions(mb)
        names = names or list(ma.joint_names)
        if match == "stamp" and xa.shape[1] == xb.shape[1] and xa.shape[0] != xb.shape[0]:
            n = min(len(xa), len(xb))          # a later first tick drops leading rows: compare the common tail
            xa, xb = xa[-n:], xb[-n:]
            shifted += 1
        if xa.shape != xb.shape:
            d.differences.append(f"frame {show(k)}: chunk shape A {xa.shape}, B {xb.shape}")
            per_frame.append((k, float("inf")))
            continue
        fa, fb = xa.astype(np.float64), xb.astype(np.float64)
        diff = distance(fa, fb)
        bad = tol.exceeded(fa, fb)
        worst = float(diff.max()) if diff.size else 0.0
        per_frame.append((k, worst))
        cols.append(diff)
        if bad.any():
            n_bad += 1
            if first_bad is None:
                r, j = np.unravel_index(int(np.argmax(np.where(bad, diff, -1.0))), diff.shape)
                first_bad = (k, float(diff[r, j]), int(r), int(j), float(fa[r, j]), float(fb[r, j]))
    if n_bad:
        k, v, r, j, va, vb = first_bad
        joint = names[j] if j < len(names) else f"column {j}"
        d.differences.append(f"actions beyond tolerance in {n_bad} of {len(common)} chunks; first at frame {show(k)}: "
                             f"|a - b| {v:.3g} at row {r}, {joint} (A {va:.6g}, B {vb:.6g})")
    widths = {c.shape[1] for c in cols}
    if cols and len(widths) == 1:
        rows = np.concatenate(cols, axis=0)                 # [sum of H, A]
        joints = [names[j] if j < len(names) else f"column {j}" for j in range(rows.shape[1])]
        d.stats["per_joint"] = {n: {"max": float(rows[:, j].max()), "p95": _p95(rows[:, j])}
                                for j, n in enumerate(joints)}
        d.stats["max"] = float(rows.max())
        d.stats["p95"] = _p95(rows)
    d.stats["per_frame_max"] = [[k, v] for k, v in per_frame]
    d.stats["first_frame_beyond_tolerance"] = None if first_bad is None else show(first_bad[0])
    d.stats["chunks_beyond_tolerance"] = n_bad
    d.stats["chunks_compared_on_common_tail"] = shifted
    pairs = [(show(k), ka[k].msg, kb[k].msg) for k in common]
    fields = {"joint_names": lambda m: list(m.joint_names), "header.frame_id": lambda m: m.header.frame_id,
              "step_dt": lambda m: float(m.step_dt)}
    if match == "index":
        fields.update({"chunk_id": lambda m: int(m.chunk_id), "header.stamp": lambda m: _stamp(m.header.stamp),
                       "start_time": lambda m: _stamp(m.start_time), "blended": lambda m: bool(m.blended),
                       "observation_age_s": lambda m: float(m.observation_age_s)})
    d.differences += _first_field_differences(pairs, fields, "chunks")
    return d


# ---------------------------------------------------------------------------------------------------- language
def _streams(records: list[Record], match: str) -> dict:
    """request key -> that request's token messages in index order."""
    by_id: dict[int, list] = {}
    for r in records:
        by_id.setdefault(int(r.msg.request_id), []).append(r.msg)
    if match == "index":
        keyed = by_id
    else:                         # (task, n-th request of that task, in order of first appearance)
        keyed, seen = {}, {}
        for msgs in by_id.values():
            task = msgs[0].task
            keyed[(task, seen.get(task, 0))] = msgs
            seen[task] = seen.get(task, 0) + 1
    return {k: sorted(v, key=lambda m: int(m.index)) for k, v in keyed.items()}


def _text(msgs) -> str:
    return "".join(m.text for m in msgs)


def _clip(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[:n] + "..."


def diff_tokens(topic: str, a: list[Record], b: list[Record], match: str) -> TopicDiff:
    sa, sb = _streams(a, match), _streams(b, match)
    common = sorted(set(sa) & set(sb), key=str)
    d = TopicDiff(topic, "tokens", len(a), len(b), "requests", len(common), sorted(set(sa) - set(sb), key=str),
                  sorted(set(sb) - set(sa), key=str))
    same = 0
    answers = {}
    for k in common:
        ma, mb = sa[k], sb[k]
        ids_a, ids_b = [int(m.token_id) for m in ma], [int(m.token_id) for m in mb]
        ta, tb = _text(ma), _text(mb)
        task = ma[0].task
        lines = []
        idx_a, idx_b = [int(m.index) for m in ma], [int(m.index) for m in mb]
        for side, x, y in (("missing in B", idx_a, idx_b), ("extra in B", idx_b, idx_a)):
            gone = sorted(set(x) - set(y))
            if gone:
                lines.append(f"request {k} ({task}): token message(s) {side}: index {_keys(gone)}")
        if ids_a != ids_b or ta != tb:
            i = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            pa = repr(ma[i].text) if i < len(ma) else "(end)"
            pb = repr(mb[i].text) if i < len(mb) else "(end)"
            lines.append(f"request {k} ({task}): first differing token at index {i}: A {pa}, B {pb}; "
                         f"A {_clip(ta)!r} | B {_clip(tb)!r}")
        fa, fb = ma[-1].finish_reason if ma[-1].is_final else "(unfinished)", \
            mb[-1].finish_reason if mb[-1].is_final else "(unfinished)"
        if fa != fb:
            lines.append(f"request {k} ({task}): finish_reason A {fa!r}, B {fb!r}")
        if task != mb[0].task:
            lines.append(f"request {k}: task A {task!r}, B {mb[0].task!r}")
        if match == "index" and int(ma[0].frame_index) != int(mb[0].frame_index):
            lines.append(f"request {k} ({task}): frame_index A {ma[0].frame_index}, B {mb[0].frame_index}")
        if match == "index" and [_stamp(m.header.stamp) for m in ma] != [_stamp(m.header.stamp) for m in mb]:
            lines.append(f"request {k} ({task}): token stamps differ")
        d.differences += lines
        same += not lines
        answers[str(k)] = {"task": task, "same": not lines, "a": ta, "b": tb}
    d.stats = {"requests_identical": same, "tokens_a": len(a), "tokens_b": len(b), "answers": answers}
    return d


def diff_memory(topic: str, a: list[Record], b: list[Record], match: str) -> TopicDiff:
    if match == "index":
        ka, kb = _keyed(a, lambda m: int(m.entry_id)), _keyed(b, lambda m: int(m.entry_id))
    else:
        ka, kb = dict(enumerate(a)), dict(enumerate(b))
    common = sorted(set(ka) & set(kb))
    d = TopicDiff(topic, "memory", len(a), len(b), "entries", len(common), sorted(set(ka) - set(kb)),
                  sorted(set(kb) - set(ka)))
    pairs = [(k, ka[k].msg, kb[k].msg) for k in common]
    fields = {"text": lambda m: m.text, "source_prompt": lambda m: m.source_prompt,
              "num_tokens": lambda m: int(m.num_tokens)}
    if match == "index":
        fields.update({"frame_index": lambda m: int(m.frame_index), "request_id": lambda m: int(m.request_id),
                       "header.stamp": lambda m: _stamp(m.header.stamp)})
    d.differences = _first_field_differences(pairs, fields, "entries")
    return d


def diff_ordered(topic: str, a: list[Record], b: list[Record]) -> TopicDiff:
    """Any other topic: the n-th message of A against the n-th of B (strings by text, others by bytes)."""
    n = min(len(a), len(b))
    d = TopicDiff(topic, "ordered", len(a), len(b), "messages", n, list(range(n, len(a))), list(range(n, len(b))))
    text = lambda r: r.msg.data if r.msg is not None and hasattr(r.msg, "data") and isinstance(r.msg.data, str) \
        else r.raw  # noqa: E731
    bad = [i for i in range(n) if text(a[i]) != text(b[i])]
    if bad:
        i = bad[0]
        va, vb = text(a[i]), text(b[i])
        show = (lambda v: repr(_clip(v))) if isinstance(va, str) else (lambda v: f"{len(v)} bytes")
        d.differences.append(f"{len(bad)} of {n} messages differ, first #{i}: A {show(va)}, B {show(vb)}")
    return d


# ---------------------------------------------------------------------------------------------------- bags
def diff_bags(path_a, path_b, tol: Tolerance = Tolerance(), match: str = "index") -> list[TopicDiff]:
    if match not in ("index", "stamp"):
        raise ValueError("match must be 'index' or 'stamp'")
    A, B = read_bag(path_a), read_bag(path_b)
    out = []
    for topic in sorted(set(A) | set(B)):
        if topic not in B or topic not in A:
            typ, recs = A.get(topic) or B.get(topic)
            d = TopicDiff(topic, "ordered", len(A[topic][1]) if topic in A else 0,
                          len(B[topic][1]) if topic in B else 0)
            d.differences.append(f"topic only in {'A' if topic in A else 'B'} ({typ}, {len(recs)} messages)")
            out.append(d)
            continue
        (ta, ra), (tb, rb) = A[topic], B[topic]
        if ta != tb:
            d = TopicDiff(topic, "ordered", len(ra), len(rb))
            d.differences.append(f"type A {ta}, B {tb}")
        elif any(r.msg is None for r in ra + rb):
            d = diff_ordered(topic, ra, rb)
        elif ta == "oxygen_ros/msg/ActionChunk":
            d = diff_actions(topic, ra, rb, tol, match)
        elif ta == "oxygen_ros/msg/LanguageToken":
            d = diff_tokens(topic, ra, rb, match)
        elif ta == "oxygen_ros/msg/MemoryEntry":
            d = diff_memory(topic, ra, rb, match)
        else:
            d = diff_ordered(topic, ra, rb)
        out.append(d)
    return out


def _keys(ks: list) -> str:
    return ", ".join(map(str, ks[:_SHOW])) + (f", ... ({len(ks)})" if len(ks) > _SHOW else "")


def format_report(diffs: list[TopicDiff], path_a, path_b, tol: Tolerance, match: str) -> str:
    by = "frame_index / request_id / entry_id" if match == "index" else "capture stamp / order"
    lines = [f"A: {path_a}", f"B: {path_b}",
             f"actions agree when |a - b| <= {tol.atol:g} + {tol.rtol:g} * |b|; texts and other fields exactly; "
             f"matched by {by}"]
    for d in diffs:
        lines.append(f"{d.topic}: {'same' if d.ok else 'DIFFERENT'} ({d.count_a} vs {d.count_b} messages, "
                     f"{d.matched} {d.unit} matched)")
        if d.missing:
            lines.append(f"  missing in B: {_keys(d.missing)}")
        if d.extra:
            lines.append(f"  extra in B: {_keys(d.extra)}")
        if d.kind == "actions" and "max" in d.stats:
            lines.append(f"  max |a - b| {d.stats['max']:.3g}, p95 {d.stats['p95']:.3g}; first frame beyond "
                         f"tolerance: {d.stats['first_frame_beyond_tolerance']}")
            pj = d.stats["per_joint"]
            cells = [f"{n} {v['max']:.2g}/{v['p95']:.2g}" for n, v in pj.items()]
            for i in range(0, len(cells), 4):
                lead = "  per joint max/p95: " if i == 0 else " " * 21
                lines.append(lead + ", ".join(cells[i:i + 4]))
        if d.kind == "tokens":
            lines.append(f"  {d.stats['requests_identical']} of {d.matched} requests identical")
        for x in d.differences[:_SHOW * 2]:
            lines.append(f"  {x}")
        if len(d.differences) > _SHOW * 2:
            lines.append(f"  ... {len(d.differences) - _SHOW * 2} more differences (see --json)")
    bad = [d.topic for d in diffs if not d.ok]
    lines.append(f"result: {'SAME' if not bad else 'DIFFERENT'} ({len(diffs) - len(bad)} of {len(diffs)} topics "
                 "agree)")
    return "\n".join(lines)


def plot_actions(diffs: list[TopicDiff], path, tol: Tolerance, match: str) -> Path | None:
    """Per-frame max |a - b| of every action topic, with the tolerance line; None when there is none."""
    series = [d for d in diffs if d.kind == "actions" and d.stats.get("per_frame_max")]
    if not series:
        return None
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for d in series:
        k = np.array([p[0] for p in d.stats["per_frame_max"]], dtype=np.float64)
        v = np.array([p[1] for p in d.stats["per_frame_max"]], dtype=np.float64)
        if match == "stamp":
            k = (k - k[0]) / 1e9
        ax.plot(k, np.where(np.isfinite(v), v, np.nan), ".-", label=d.topic)
    ax.axhline(tol.atol, color="red", ls="--", lw=1, label=f"atol {tol.atol:g}")
    ax.set_yscale("symlog", linthresh=max(tol.atol / 100, 1e-12))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("frame index" if match == "index" else "capture time since the first chunk (s)")
    ax.set_ylabel("max |a - b| over the chunk")
    ax.set_title("per-frame action difference")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="oxygen bag-diff", description=(
        "Compare two output bags of `oxygen bag-eval` / `oxygen replay --record`. Exit status 0 when they agree "
        "within tolerance, 1 when they differ, 2 on bad input."))
    p.add_argument("a", help="reference output bag (e.g. the golden one)")
    p.add_argument("b", help="output bag to check")
    p.add_argument("--atol", type=float, default=Tolerance.atol,
                   help="absolute action tolerance (default: %(default)g)")
    p.add_argument("--rtol", type=float, default=Tolerance.rtol,
                   help="relative action tolerance (default: %(default)g)")
    p.add_argument("--match", choices=("index", "stamp"), default="index",
                   help="index: chunks by frame_index, requests by request_id (two offline runs); stamp: chunks by "
                        "capture stamp, requests by task and order (online vs offline)")
    p.add_argument("--plot", default="out/bag_diff.png", help="per-frame action difference plot ('' = none; "
                                                              "default: %(default)s)")
    p.add_argument("--json", default="", help="also write the full report as JSON here")
    p.add_argument("--quiet", action="store_true", help="print only the result line")
    a = p.parse_args(argv)
    for path in (a.a, a.b):
        if not (Path(path) / "metadata.yaml").is_file():
            print(f"oxygen bag-diff: {path} is not a rosbag2 directory (no metadata.yaml)", file=sys.stderr)
            return 2
    tol = Tolerance(a.atol, a.rtol)
    diffs = diff_bags(a.a, a.b, tol, a.match)
    report = format_report(diffs, a.a, a.b, tol, a.match)
    print(report.splitlines()[-1] if a.quiet else report)
    if a.plot:
        out = plot_actions(diffs, a.plot, tol, a.match)
        if out is not None and not a.quiet:
            print(f"plot: {out}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"a": str(a.a), "b": str(a.b), "atol": tol.atol, "rtol": tol.rtol,
                                            "match": a.match, "same": all(d.ok for d in diffs),
                                            "topics": [d.to_json() for d in diffs]}, indent=2) + "\n")
    return 0 if all(d.ok for d in diffs) else 1


if __name__ == "__main__":
    sys.exit(main())
