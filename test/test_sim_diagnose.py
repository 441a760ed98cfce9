"""``oxygen sim-diagnose`` and the localisation experiment (issue 26's diagnosis): the grounding statistic against
hand-made cases (a policy that knows only the arm scores 0, one that follows the cube scores r = 1 with its slope);
the cell distance of "row R column C" answers; the named colour of every task's instruction; the training option that
writes the cell into each frame's instruction from the frame's own text target; the oracle wrapper (the cell follows a
cube the expert carries across the table, and the wrapped expert still succeeds); the self wrapper (asks every frame,
prompts the next frame's action with its own answer); and the locate probe on the shipped checkpoint (its VLM places the named cube within one cell - measured: 50 / 50 scenes)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from oxygen_ros.sim.tasks import TASKS, draw_task, locate_question, located_instruction, named_colour
from oxygen_ros.tools.sim.diagnose import cell_distance, within_group_stats

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_policy_that_knows_only_the_arm_has_no_within_arm_grounding():
    rng = np.random.default_rng(0)
    true = rng.normal(size=(40, 2))
    arms = ["left"] * 20 + ["right"] * 20
    only_arm = np.array([[0.3, 0.1] if a == "left" else [-0.3, 0.2] for a in arms])   # moves by arm, not by cube
    s = within_group_stats(only_arm, true + only_arm, arms)
    assert s["x"]["r"] == 0 and s["y"]["r"] == 0
    follows = 0.5 * true + only_arm                                                   # half-way to the cube
    s = within_group_stats(follows, true + only_arm, arms)
    assert s["x"]["r"] == pytest.approx(1) and s["y"]["slope"] == pytest.approx(0.5)


@pytest.mark.parametrize("answer,truth,cells", [
    ("row 3 column 5", "row 3 column 5", 0), ("row 4 column 6", "row 3 column 5", 1),
    ("row 1 column 5", "row 3 column 5", 2), (" row 8 column 1 ", "row 1 column 1", 7),
    ("row 3", "row 3 column 5", None), ("not in view", "row 3 column 5", None), ("row 3 column 5", "not in view", None),
    ("", "row 3 column 5", None)])
def test_cell_distance_is_chebyshev_over_well_formed_answers_only(answer, truth, cells):
    assert cell_distance(answer, truth) == cells


@pytest.mark.parametrize("task", TASKS)
def test_every_tasks_instruction_names_its_target_colour(task):
    for seed in range(5):
        spec = draw_task(task, seed)
        assert named_colour(spec.instruction) == spec.target
        assert named_colour(located_instruction(spec.instruction, "row 2 column 7")) == spec.target
    assert named_colour("wave at the camera") is None


def test_locate_in_instructions_takes_each_frames_own_cell():
    from oxygen_ros.train.data import locate_in_instructions
    base = "pick up the red cube"
    ep = SimpleNamespace(instruction=[base, base, base, "wave"], texts=[
        [("conversation", locate_question("red"), "row 2 column 3"), ("memory", "Describe", "a red cube")],
        [("conversation", locate_question("blue"), "row 5 column 5"), ("conversation", locate_question("red"),
                                                                         "row 3 column 3")],
        [("conversation", "How many cubes are on the table?", "two")],       # no target for red: unchanged
        [("conversation", locate_question("red"), "row 1 column 1")]])      # names no cube: unchanged
    assert locate_in_instructions([ep]) == 2
    assert ep.instruction == [located_instruction(base, "row 2 column 3"), located_instruction(base, "row 3 column 3"),
                              base, "wave"]


def test_the_oracle_sends_the_cell_the_cube_is_in_and_follows_it():
    """The expert carries the cube from the right arm's side to the left's: the oracle's instruction changes with the
    cube's cell, each one sent to the node's pipeline is the cell of the cube at that step, and the expert (which
    ignores the text) still succeeds: the wrapper changes nothing but the instruction."""
    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings
    from oxygen_ros.sim.episode import EpisodeConfig, run_episode
    from oxygen_ros.sim.locate_prompt import LocateOracle
    from oxygen_ros.sim.scene import AlohaScene
    from oxygen_ros.sim.tasks import cube_locations

    sim = AlohaScene()
    pol = LocateOracle(PipelinePolicy(sim_settings(None, {"delta_action_mask": []}), expert=True, horizon=20))
    spec = draw_task("transfer", 0)
    sent, mismatched = [], []
    try:
        pol.reset(spec, sim)
        inputs = pol.policy.pipeline.inputs
        real = inputs.on_instruction

        def spy(text):
            sent.append(text)
            want = located_instruction(spec.instruction, cube_locations(sim)[locate_question(spec.target)])
            if text != want:
                mismatched.append((text, want))
            return real(text)
        inputs.on_instruction = spy
        pol.reset = lambda *_: None                      # run_episode resets; keep the spied pipeline
        res = run_episode(sim, spec, pol, EpisodeConfig())
    finally:
        pol.close()
        sim.close()
    assert res.success
    assert not mismatched, mismatched[:3]
    assert len(set(sent)) >= 3 and len(sent) == len(set(sent)), sent          # sent on change only
    assert all(s.startswith(spec.instruction + " (row ") for s in sent)


def test_the_shipped_policys_vlm_locates_the_named_cube(tmp_path):
    """The probe through the node's conversation path on the shipped checkpoint: each answer is a well-formed cell
    and at least 4 of 6 are within one cell (measured on scenes 0-49: 100 % within one cell, 74 % exact)."""
    from oxygen_ros.ros.engine_factory import resolve_checkpoint
    from oxygen_ros.tools.sim.diagnose import grounding
    pytest.importorskip("mujoco")
    res = grounding(str(resolve_checkpoint("demo")), "reach", range(6))
    locs = [r["locate"] for r in res["rows"]]
    assert len(locs) == 6 and all(loc["answer"] is not None for loc in locs), locs
    assert all(loc["cells_off"] is not None for loc in locs), locs
    assert res["locate"]["scored"] == 6 and res["locate"]["within_one_cell"] >= 4 / 6, locs


def test_self_locate_asks_every_frame_and_prompts_the_next_action_with_its_own_answer():
    """``LocateSelf`` on the shipped checkpoint (its VLM answers "Where is the X cube?"): one question per camera
    frame through the node's conversation path; from the second frame on, the instruction the pipeline holds ends with
    the newest well-formed answer before that frame (the first frame: the plain instruction)."""
    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings
    from oxygen_ros.sim.episode import EpisodeConfig, run_episode
    from oxygen_ros.sim.locate_prompt import LocateSelf, wrap
    from oxygen_ros.sim.scene import AlohaScene

    sim = AlohaScene()
    pol = wrap(PipelinePolicy(sim_settings(None, {"checkpoint": "demo", "device": "cpu"})), "self")
    assert isinstance(pol, LocateSelf)
    spec = draw_task("reach", 1)
    seen = []                                           # (instruction the pipeline holds, answers so far) per frame
    try:
        pol.reset(spec, sim)
        real_act = pol.policy.act

        def act(obs, ready_t):
            out = real_act(obs, ready_t)
            said = [e["text"] for e in pol.policy.language_log if e["prompt"] == locate_question(spec.target)]
            seen.append((obs.instruction, pol.policy.pipeline.inputs._instruction, said))
            return out
        pol.policy.act = act
        pol.reset = lambda *_: None
        run_episode(sim, spec, pol, EpisodeConfig(), on_step=None)
    finally:
        pol.close()
        sim.close()
    frames = len(seen)
    assert frames >= 5 and pol.asked == frames
    assert len(seen[-1][2]) == frames                   # every question answered, in its own frame
    assert seen[0][0] == spec.instruction               # no answer before the first frame
    import re
    for k in range(1, frames):
        good = [a.strip() for a in seen[k - 1][2] if re.fullmatch(r"row \d+ column \d+", a.strip())]
        want = located_instruction(spec.instruction, good[-1]) if good else spec.instruction
        assert seen[k][0] == seen[k][1] == want, k
    assert seen[-1][0] != spec.instruction              # the shipped VLM's answers are cells (50 / 50 measured)


def test_locate_prompt_modes():
    from oxygen_ros.sim.locate_prompt import LocateOracle, LocateSelf, wrap
    sentinel = object()
    assert wrap(sentinel, None) is sentinel and wrap(sentinel, "") is sentinel
    assert type(wrap(sentinel, "oracle")) is LocateOracle and type(wrap(sentinel, "self")) is LocateSelf
    with pytest.raises(ValueError, match="oracle or self"):
        wrap(sentinel, "psychic")


@pytest.mark.parametrize("mode", ["oracle", "self"])
def test_sim_eval_runs_a_locate_prompt_in_lockstep_only(mode, tmp_path, capsys):
    import json

    from oxygen_ros.tools.sim import eval as sim_eval
    pytest.importorskip("mujoco")
    out = tmp_path / "ev"
    assert sim_eval.main(["--policy", "demo", "--locate-prompt", mode, "--task", "reach", "--seeds", "0:1", "--no-video",
                          "--quiet", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["locate_prompt"] == mode
    assert len(res["episodes"]) == 1 and not res["episodes"][0].get("error")
    for bad in (["--policy", "expert"], ["--policy", "demo", "--clock", "realtime"]):
        with pytest.raises(SystemExit) as e:
            sim_eval.main([*bad, "--locate-prompt", mode, "--task", "reach", "--seeds", "0:1", "--out",
                           str(tmp_path / "x")])
        assert e.value.code == 2
    assert "--locate-prompt: lockstep and a model policy only" in capsys.readouterr().err


def test_sim_diagnose_puts_the_cell_in_the_instruction_and_checks_it(tmp_path, capsys):
    import json

    from oxygen_ros.tools.sim import diagnose
    pytest.importorskip("mujoco")
    out = tmp_path / "d"
    assert diagnose.main(["--policy", "demo", "--task", "reach", "--seeds", "0:3", "--instruction-cell", "none",
                          "--instruction-cell", "true", "--instruction-cell", "row 1 column 1", "--out", str(out)]) == 0
    res = json.loads((out / "grounding.json").read_text())["results"]
    assert [r["instruction_cell"] for r in res] == [None, "true", "row 1 column 1"]
    assert res[0]["locate"]["asked"] == 3                    # the plain instruction: the locate probe too
    assert all(r["locate"] is None and r["usable"] == 3 for r in res[1:])
    table = capsys.readouterr().out
    assert "demo + true" in table and "demo + row 1 column 1" in table
    for bad in (["--policy", "demo", "--instruction-cell", "row one"],
                ["--policy", "expert", "--instruction-cell", "true"]):
        with pytest.raises(SystemExit) as e:
            diagnose.main([*bad, "--seeds", "0:1", "--out", str(tmp_path / "x")])
        assert e.value.code == 2


def test_copycat_plans_from_the_experts_mid_episode_state_with_its_own_and_another_scenes_image(tmp_path):
    """``--copycat T``: per seed, the expert's frame at T s (task unfinished); the policy plans from that state with
    the frame's own images and with another same-arm seed's images; both plans are scored against the named cube of
    the frame's own scene, and the JSON says whose image each plan saw."""
    import json

    from oxygen_ros.tools.sim import diagnose
    pytest.importorskip("mujoco")
    out = tmp_path / "cc"
    assert diagnose.main(["--policy", "expert", "--policy", "demo", "--task", "reach", "--seeds", "0:6", "--no-locate",
                          "--copycat", "0.4", "--out", str(out)]) == 0
    res = json.loads((out / "grounding.json").read_text())["results"]
    assert [r.get("image") for r in res] == [None, None, "own", "other"]          # the expert: no copycat pair
    own, other = res[2], res[3]
    assert own["usable"] == other["usable"] >= 4 and own["copycat_t"] == 0.4
    for a, b in zip(own["rows"], other["rows"]):
        assert a["seed"] == b["seed"] == a["image_of"] != b["image_of"] and a["arm"] == b["arm"]
        assert a["true"] == b["true"]                                             # the same state, the same target
    assert len(other["mean_abs_change"]) == 2
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit) as e:
            diagnose.main(["--policy", "demo", "--copycat", bad, "--seeds", "0:1", "--out", str(tmp_path / "x")])
        assert e.value.code == 2


def test_row_reads_the_planned_endpoint_that_many_rows_ahead(tmp_path):
    """``--row N``: the endpoint is the chunk's row N, so policies of different horizons compare at one time ahead;
    the expert then plans at least N rows.  The expert's reach moves at bounded speed toward the cube: its endpoint
    10 rows ahead is short of its 20-row one, which is short of its 40-row one; row 20 equals the default (H = 20)."""
    from oxygen_ros.tools.sim import diagnose
    pytest.importorskip("mujoco")
    seeds = range(3)
    res = {r: diagnose.grounding("expert", "reach", seeds, camera_size=16, row=r) for r in (None, 10, 20, 40)}
    plan = {r: np.array([x["planned"] for x in v["rows"]]) for r, v in res.items()}
    assert np.allclose(plan[20], plan[None])
    n = {r: np.linalg.norm(p, axis=1) for r, p in plan.items()}
    assert (n[10] < n[20]).all() and (n[20] < n[40]).all(), n
    assert res[40]["row"] == 40
    with pytest.raises(SystemExit) as e:
        diagnose.main(["--policy", "expert", "--row", "0", "--seeds", "0:1", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
