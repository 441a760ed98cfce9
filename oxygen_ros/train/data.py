"""Episode bags -> training samples: the topic mapping, decoding, episodes, splits, normalisation statistics.

This file owns how a rosbag2 becomes something to learn from.  ``TopicMap`` names the topics (cameras -> the model's
three slots, joint states, executed actions, instruction, episode status, text targets); ``TopicMap.from_layout``
takes cameras and joint names from the node's own parameters (a robot's ``oxygen.yaml`` already maps its topics) as a
``RobotLayout`` (the shell, ``tools/train.py``, reads the parameter file with ``ros/parameters.py``), the rest from
options.  ``load_episodes(bags, topics)`` reads each bag once with rosbags (no ROS needed) and cuts it
into ``Episode`` s at the ``EpisodeStatus`` boundaries (a bag without that topic is one episode): per base-camera
frame the three slots' images (uint8; a slot whose camera is missing or has no frame within ``FRAME_TOL`` is masked),
the joint state in force, the instruction in force, the text targets stamped at that frame and, when the bag has
them, the frame's *action label* (``trajectory_msgs/JointTrajectory`` stamped with the frame: the chunk an expert
commands from that state, as ``oxygen sim-record`` writes); per control step the executed actions.  A training
sample is a frame: its images, state, its action chunk - the label's first H rows when it has one, else the next H
executed actions from the frame's time on (rows past the label's or the episode's end are padding, masked out of the
loss) - and one of its text targets.  Failed episodes are skipped unless their frames are labelled (a DAgger
rollout's failures are what it learns from).
``norm_stats`` computes openpi's quantile statistics (q01 / q99, plus mean / std) of states and of actions in the
space the policy outputs (``delta_action_mask`` columns relative to the state at the frame, as ``ros/action_space.py``
converts back).  Bad input fails before training with the bag, topic and field named: a mapped topic missing, joint
names missing from a message, actions of different dimension across episodes, NaN/inf, no usable frame.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["DataError", "RobotLayout", "TopicMap", "Episode", "load_episodes", "split_episodes", "norm_stats", "to_policy_actions"]

FRAME_TOL_NS = 30_000_000          # another camera's frame counts as "the same instant" within 30 ms
STATE_TOL_NS = 100_000_000         # the joint state in force must be at most 100 ms old at a frame


class DataError(ValueError):
    """Unusable training data; the message names the bag, topic and field."""


@dataclass(frozen=True)
class RobotLayout:
    """What training takes from the node's parameter file: the robot's layout, without the node's code.  The caller
    reads the file (``tools/train.py``: ``ros/parameters.Settings``) and hands this in, so ``train/`` imports no ROS."""
    slot_topics: tuple             # 3 camera topics (slots base, left wrist, right wrist); "" = masked slot
    state_names: tuple             # joint names, in the state's order
    action_names: tuple            # joint names, in the action's order
    delta_action_mask: tuple = ()  # per action column: True = the policy outputs it relative to the state
    memory_prompt: str = "Describe the scene in one sentence."

    @staticmethod
    def of(settings) -> "RobotLayout":
        """The layout of anything with the node ``Settings``' fields of the same names."""
        return RobotLayout(tuple(settings.slot_topics), tuple(settings.state_names), tuple(settings.action_names),
                           tuple(bool(x) for x in settings.delta_action_mask), str(settings.memory_prompt))


@dataclass(frozen=True)
class TopicMap:
    cameras: tuple                 # 3 topics (slots base, left wrist, right wrist); "" = masked slot
    state_names: tuple             # joint names, in the state's order
    action_names: tuple            # joint names, in the action's order
    joint_states: str = "/joint_states"
    actions: str = "/executed_action"
    instruction: str = "/instruction"
    episode: str = "/episode"
    text_targets: str = "/text_targets"
    labels: str = "/action_label"

    @staticmethod
    def from_layout(layout: RobotLayout, **topics) -> "TopicMap":
        """Cameras and joint names from the robot's layout (relative names get a leading '/'); other topics from
        ``topics`` (None = default)."""
        rel = lambda t: (t if t.startswith("/") else "/" + t) if t else ""  # noqa: E731
        if not layout.state_names or not layout.action_names:
            raise DataError("the parameter file must name state_joint_names and action_joint_names (training needs "
                            "the joints' order)")
        kw = {k: rel(v) for k, v in topics.items() if v is not None}
        return TopicMap(tuple(rel(t) for t in layout.slot_topics), tuple(layout.state_names),
                        tuple(layout.action_names), **kw)


@dataclass
class Episode:
    source: str                    # "<bag>#<index>"
    images: np.ndarray             # [F, 3, h, w, 3] uint8 (masked slots: zeros)
    image_mask: np.ndarray         # [F, 3] bool
    frame_ns: np.ndarray           # [F] int64
    state: np.ndarray              # [F, D] float32: the joint state in force at each frame
    instruction: list              # [F] str
    texts: list                    # [F] list of (kind, prompt, text)
    action_ns: np.ndarray          # [T] int64
    actions: np.ndarray            # [T, A] float32: executed actions, one per control step
    meta: dict = field(default_factory=dict)     # task, seed, success from the episode status
    labels: np.ndarray | None = None             # [F, L, A] float32: each frame's action label (None: no labels)
    label_rows: np.ndarray | None = None         # [F] int: valid rows of each frame's label (0 = unlabelled frame)
    target: np.ndarray | None = None             # [F, 3] float32: the named cube's place + valid (target_aux.py)

    @property
    def num_frames(self) -> int:
        return len(self.frame_ns)

    def action_chunk(self, frame: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """The frame's action label, else the executed actions from frame ``frame``'s time on: ([H, A], valid [H])."""
        if self.labels is not None and self.label_rows[frame] > 0:
            rows = self.labels[frame, :min(horizon, int(self.label_rows[frame]))]
        else:
            start = int(np.searchsorted(self.action_ns, self.frame_ns[frame], side="left"))
            rows = self.actions[start:start + horizon]
        out = np.zeros((horizon, self.actions.shape[1]), np.float32)
        valid = np.zeros(horizon, bool)
        out[:len(rows)] = rows
        valid[:len(rows)] = True
        if 0 < len(rows) < horizon:
            out[len(rows):] = rows[-1]             # padding repeats the last action (masked out of the loss)
        return out, valid


def _decode_image(msg, where: str) -> np.ndarray:
    h, w, enc = int(msg.height), int(msg.width), str(msg.encoding)
    data = np.frombuffer(bytes(msg.data) if not isinstance(msg.data, np.ndarray) else msg.data.tobytes(), np.uint8)
    if enc not in ("rgb8", "bgr8") or int(msg.step) < w * 3 or data.size < h * int(msg.step):
        raise DataError(f"{where}: image encoding {enc!r} {w}x{h} step {msg.step} ({data.size} bytes) is not "
                        "usable (training reads rgb8 / bgr8)")
    img = data[:h * int(msg.step)].reshape(h, int(msg.step))[:, :w * 3].reshape(h, w, 3)
    return np.ascontiguousarray(img[..., ::-1] if enc == "bgr8" else img)


def _ns(stamp) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def _ordered(names: list, values, wanted: tuple, where: str) -> np.ndarray:
    idx = {n: i for i, n in enumerate(names)}
    missing = [n for n in wanted if n not in idx]
    if missing:
        raise DataError(f"{where}: joint name(s) {missing[:4]} missing from the message (names: {names[:6]}...)")
    v = np.asarray(values, dtype=np.float64)
    if len(v) != len(names):
        raise DataError(f"{where}: {len(names)} names but {len(v)} positions")
    out = v[[idx[n] for n in wanted]]
    if not np.all(np.isfinite(out)):
        raise DataError(f"{where}: position contains NaN or inf")
    return out.astype(np.float32)


def _read_bag(path: Path, tm: TopicMap):
    """All mapped messages of one bag, decoded, sorted by log time."""
    from rosbags.rosbag2 import Reader  # noqa: PLC0415

    from oxygen_ros.bags.types import typestore  # noqa: PLC0415 - pure rosbags + our msg definitions

    ts = typestore()
    try:
        reader = Reader(path)
        reader.open()
    except Exception as exc:  # noqa: BLE001 - rosbags raises several types for a bad bag
        raise DataError(f"{path}: not a readable rosbag2 ({type(exc).__name__}: {exc})") from exc
    try:
        topics = {c.topic: c for c in reader.connections if c.msgcount > 0}
        wanted = {t: k for k, t in (("joint_states", tm.joint_states), ("actions", tm.actions),
                                    ("instruction", tm.instruction), ("episode", tm.episode),
                                    ("text", tm.text_targets), ("label", tm.labels))}
        for slot, cam in enumerate(tm.cameras):
            if cam:
                wanted[cam] = f"camera{slot}"
        required = [tm.joint_states, tm.actions, tm.cameras[0] or next(c for c in tm.cameras if c)]
        missing = [t for t in required if t not in topics]
        if missing:
            raise DataError(f"{path}: mapped topic(s) {missing} not in the bag (it has messages on "
                            f"{sorted(topics)}); map them with --params (camera_topics, joint names) or the "
                            "--*-topic options")
        conns = [c for c in reader.connections if c.topic in wanted]
        out = []
        for con, t_ns, raw in reader.messages(connections=conns):
            kind = wanted[con.topic]
            where = f"{path} {con.topic}"
            try:
                msg = ts.deserialize_cdr(raw, con.msgtype)
            except Exception as exc:  # noqa: BLE001
                raise DataError(f"{where}: cannot decode a {con.msgtype} message ({exc})") from exc
            if kind.startswith("camera"):
                out.append((_ns(msg.header.stamp), kind, _decode_image(msg, where)))
            elif kind == "joint_states":
                out.append((_ns(msg.header.stamp), kind, _ordered(list(msg.name), msg.position, tm.state_names,
                                                                  where + " position")))
            elif kind == "actions":
                names = list(msg.name)
                vals = _ordered(names, msg.position, tm.action_names, where + " position") if names else \
                    np.asarray(msg.position, np.float32)
                if not np.all(np.isfinite(vals)):
                    raise DataError(f"{where} position: NaN or inf in an executed action")
                out.append((_ns(msg.header.stamp), kind, vals))
            elif kind == "label":
                rows = np.stack([_ordered(list(msg.joint_names), p.positions, tm.action_names,
                                          f"{where} point {i}") for i, p in enumerate(msg.points)]) if msg.points \
                    else None
                if rows is None:
                    raise DataError(f"{where}: an action label without points")
                out.append((_ns(msg.header.stamp), kind, rows))
            elif kind == "instruction":
                out.append((t_ns, kind, str(msg.data)))
            elif kind == "episode":
                out.append((_ns(msg.header.stamp), kind, msg))
            else:
                out.append((_ns(msg.header.stamp), kind, (str(msg.kind), str(msg.prompt), str(msg.text))))
        out.sort(key=lambda e: e[0])
        return out
    finally:
        reader.close()


def _episode_ranges(events, path) -> list[tuple[int, int, dict]]:
    """(start ns, end ns, meta) per episode from the status messages; the whole bag when there are none."""
    st = [(t, m) for t, k, m in events if k == "episode"]
    if not st:
        ts = [t for t, _, _ in events]
        return [(min(ts), max(ts), {})] if ts else []
    ranges, start, meta = [], None, {}
    for t, m in st:
        if start is None:
            start, meta = t - int(round(float(m.elapsed) * 1e9)), {}
        meta = {"task": str(m.task), "seed": int(m.seed), "success": bool(m.success), "episode_id": int(m.episode_id)}
        if m.done:
            ranges.append((start, t, meta))
            start = None
    if start is not None:                         # the bag ended inside an episode: keep what was recorded
        ranges.append((start, st[-1][0], meta))
    return ranges


def load_episodes(bags, tm: TopicMap, image_size: int | None = None, only_success: bool = True) -> list[Episode]:
    """Every episode of every bag (a directory holding bags is searched for them); images resized with pad to
    ``image_size`` when given (the model's input, as the node does)."""
    from oxygen_ros.model.processing import resize_with_pad  # noqa: PLC0415

    paths = []
    for b in bags:
        b = Path(b)
        if (b / "metadata.yaml").is_file():
            paths.append(b)
        elif b.is_dir():
            paths += sorted(p.parent for p in b.rglob("metadata.yaml"))
        else:
            raise DataError(f"{b}: no rosbag2 bag there (a bag is a directory with metadata.yaml)")
    if not paths:
        raise DataError(f"no bags found in {list(map(str, bags))}")
    episodes: list[Episode] = []
    dims = None
    for path in paths:
        events = _read_bag(path, tm)
        for ei, (t0, t1, meta) in enumerate(_episode_ranges(events, path)):
            ev = [e for e in events if t0 <= e[0] <= t1]
            labelled = any(k == "label" for _, k, _ in ev)
            if only_success and meta and not meta.get("success", True) and not labelled:
                continue
            ep = _build_episode(ev, tm, f"{path}#{ei}", meta, image_size, resize_with_pad)
            if ep is None:
                continue
            if dims is None:
                dims = (ep.state.shape[1], ep.actions.shape[1])
            elif (ep.state.shape[1], ep.actions.shape[1]) != dims:
                raise DataError(f"{ep.source}: state/action dimensions {ep.state.shape[1]}/{ep.actions.shape[1]} "
                                f"differ from earlier episodes' {dims[0]}/{dims[1]}")
            episodes.append(ep)
    if not episodes:
        raise DataError(f"no usable episode in {list(map(str, paths))} (every episode lacked frames, states or "
                        "actions, or none succeeded)")
    return episodes


def _build_episode(ev, tm: TopicMap, source: str, meta: dict, image_size, resize) -> Episode | None:
    cams = {int(k[6:]): [] for _, k, _ in ev if k.startswith("camera")}
    for t, k, img in ev:
        if k.startswith("camera"):
            cams[int(k[6:])].append((t, img))
    primary = next(i for i, c in enumerate(tm.cameras) if c)
    base = cams.get(primary, [])
    states = [(t, v) for t, k, v in ev if k == "joint_states"]
    acts = [(t, v) for t, k, v in ev if k == "actions"]
    if not base or not states or not acts:
        return None
    if len({len(v) for _, v in acts}) != 1:
        raise DataError(f"{source} {tm.actions}: executed actions of different lengths in one episode")
    st_ns = np.array([t for t, _ in states])
    instr = [(t, v) for t, k, v in ev if k == "instruction"]
    texts: dict[int, list] = {}
    labels: dict[int, np.ndarray] = {}
    for t, k, v in ev:
        if k == "text":
            texts.setdefault(t, []).append(v)
        elif k == "label":
            labels[t] = v
    frames, masks, f_ns, f_state, f_instr, f_text, f_label = [], [], [], [], [], [], []
    for t, img in base:
        j = int(np.searchsorted(st_ns, t, side="right")) - 1
        if j < 0 or t - st_ns[j] > STATE_TOL_NS:
            continue
        slots, mask = [], []
        for slot in range(3):
            im = img if slot == primary else _nearest(cams.get(slot, []), t)
            if im is not None and image_size is not None:
                im = resize(im, image_size, image_size)
            slots.append(im)
            mask.append(im is not None)
        ref = next(s for s in slots if s is not None)
        frames.append(np.stack([s if s is not None else np.zeros_like(ref) for s in slots]))
        masks.append(mask)
        f_ns.append(t)
        f_state.append(states[j][1])
        k = max((i for i, (ti, _) in enumerate(instr) if ti <= t), default=None)
        f_instr.append(instr[k][1] if k is not None else (instr[0][1] if instr else ""))
        f_text.append(texts.get(t, []))
        f_label.append(labels.get(t))
    if not frames:
        return None
    lab, rows = None, None
    if labels:
        L = max(len(v) for v in labels.values())
        A = acts[0][1].shape[0]
        if any(v.shape[1] != A for v in labels.values()):
            raise DataError(f"{source} {tm.labels}: action labels have {next(iter(labels.values())).shape[1]} "
                            f"columns, the executed actions {A}")
        lab = np.zeros((len(f_label), L, A), np.float32)
        rows = np.zeros(len(f_label), np.int64)
        for i, v in enumerate(f_label):
            if v is not None:
                lab[i, :len(v)], rows[i] = v, len(v)
    return Episode(source, np.stack(frames), np.array(masks), np.array(f_ns, np.int64), np.stack(f_state),
                   f_instr, f_text, np.array([t for t, _ in acts], np.int64), np.stack([v for _, v in acts]), meta,
                   lab, rows)


def _nearest(frames: list, t: int):
    if not frames:
        return None
    ts = np.array([f[0] for f in frames])
    i = int(np.argmin(np.abs(ts - t)))
    return frames[i][1] if abs(int(ts[i]) - t) <= FRAME_TOL_NS else None


def split_episodes(episodes: list[Episode], val_fraction: float, seed: int = 0):
    """(train, val): a seeded choice of whole episodes for validation (at least one when val_fraction > 0)."""
    n = len(episodes)
    k = int(round(n * val_fraction)) if val_fraction > 0 else 0
    k = min(max(k, 1 if val_fraction > 0 and n > 1 else 0), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    val_idx = set(order[:k].tolist())
    return ([e for i, e in enumerate(episodes) if i not in val_idx],
            [e for i, e in enumerate(episodes) if i in val_idx])


def to_policy_actions(actions: np.ndarray, state: np.ndarray, delta_mask) -> np.ndarray:
    """Absolute actions [H, A] -> the policy's output space: columns of ``delta_mask`` minus the state [D] at the
    frame (the inverse of ``ros/action_space.py`` ``to_absolute``)."""
    out = np.array(actions, dtype=np.float32, copy=True)
    m = np.zeros(out.shape[-1], bool)
    dm = np.asarray(delta_mask, bool)[:out.shape[-1]]
    m[:len(dm)] = dm
    out[:, m] -= np.asarray(state, np.float32)[m]
    return out


def norm_stats(episodes: list[Episode], horizon: int, delta_mask) -> dict:
    """openpi's norm_stats.json content: {"norm_stats": {"state": {...}, "actions": {...}}} with mean, std, q01, q99
    per dimension, actions over every valid row of every frame's chunk (in the policy's output space)."""
    dm = np.asarray(delta_mask, bool)
    S = np.concatenate([e.state for e in episodes])
    A = []
    for e in episodes:
        for f in range(e.num_frames):
            a, v = e.action_chunk(f, horizon)
            A.append(to_policy_actions(a[v], e.state[f], dm))
    A = np.concatenate(A)

    def stats(x):
        return {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(),
                "q01": np.quantile(x, 0.01, axis=0).tolist(), "q99": np.quantile(x, 0.99, axis=0).tolist()}
    return {"norm_stats": {"state": stats(S.astype(np.float64)), "actions": stats(A.astype(np.float64))}}


def describe(episodes: list[Episode]) -> str:
    n_f = sum(e.num_frames for e in episodes)
    tasks: dict = {}
    for e in episodes:
        tasks[e.meta.get("task", "?")] = tasks.get(e.meta.get("task", "?"), 0) + 1
    return (f"{len(episodes)} episodes ({', '.join(f'{k} {v}' for k, v in sorted(tasks.items()))}), {n_f} frames, "
            f"state dim {episodes[0].state.shape[1]}, action dim {episodes[0].actions.shape[1]}")


def locate_in_instructions(episodes: list) -> int:
    """The localisation-conditioning experiment (``oxygen train --locate-in-instruction``): every frame's instruction
    gets the named cube's cell appended (``sim.tasks.located_instruction``), taken from the frame's own "Where is the
    <colour> cube?" text target.  In place; returns the frames changed (frames without that target keep theirs)."""
    from oxygen_ros.sim.tasks import locate_question, located_instruction, named_colour  # noqa: PLC0415

    changed = 0
    for ep in episodes:
        for f, instr in enumerate(ep.instruction):
            colour = named_colour(instr or "")
            if colour is None:
                continue
            q = locate_question(colour)
            cell = next((text for _kind, prompt, text in ep.texts[f] if prompt == q), None)
            if cell is not None:
                ep.instruction[f] = located_instruction(instr, cell)
                changed += 1
    return changed

