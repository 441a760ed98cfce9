"""Unit tests of ``ros/action_space.py`` (delta -> absolute with openpi's mask semantics, the inverse used by RTC,
joint-limit clipping with its row counter, the per-step change limit) and of the new parameters' validation in
``ros/parameters.py`` (types, lengths, combinations: every bad value is a ``ConfigureError`` naming the parameter).
No DDS, no model."""
from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.ros.action_space import ActionSpace, ActionSpaceError
from oxygen_ros.ros.parameters import ConfigureError, Settings, check_value, load_params_file


def _openpi_bool_mask(*dims):
    """openpi's transforms.make_bool_mask (re-derived: n > 0 -> n True, n < 0 -> -n False)."""
    out = []
    for d in dims:
        out.extend([d > 0] * abs(d))
    return out


# -- delta -> absolute ---------------------------------------------------------------------------------------------
def test_default_is_identity():
    sp = ActionSpace.build(4)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(sp.to_absolute(a, None), a)
    np.testing.assert_array_equal(sp.clip(a)[0], a)
    assert sp.clip(a)[1] == 0 and sp.limit_steps(a, a[0] + 100)[1] == 0
    assert not sp.has_delta and not sp.has_limits


def test_aloha_mask_adds_state_to_joints_only():
    mask = _openpi_bool_mask(6, -1, 6, -1)
    assert mask == [True] * 6 + [False] + [True] * 6 + [False]
    sp = ActionSpace.build(14, delta_action_mask=mask, state_dim=14)
    rng = np.random.default_rng(0)
    delta = rng.normal(size=(5, 14)).astype(np.float32)
    state = rng.normal(size=14).astype(np.float32)
    out = sp.to_absolute(delta, state)
    m = np.array(mask)
    np.testing.assert_allclose(out[:, m], delta[:, m] + state[m], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out[:, ~m], delta[:, ~m])        # grippers: absolute, untouched
    # openpi AbsoluteActions, written out: actions[..., :dims] += where(mask, state[..., :dims], 0)
    ref = delta.copy()
    ref[..., :14] += np.where(m, state[:14], 0)[None, :]
    np.testing.assert_allclose(out, ref, atol=1e-6)
    np.testing.assert_allclose(sp.to_delta(out, state), delta, atol=1e-6)   # the inverse (RTC's prev_actions)


def test_short_mask_leaves_remaining_columns_absolute_and_ints_accepted():
    sp = ActionSpace.build(8, delta_action_mask=[1, 1, 0], state_dim=8)
    a = np.zeros((2, 8), np.float32)
    state = np.arange(1, 9, dtype=np.float32)
    out = sp.to_absolute(a, state)
    np.testing.assert_array_equal(out[0], [1, 2, 0, 0, 0, 0, 0, 0])


def test_delta_uses_the_given_state_not_another():
    sp = ActionSpace.build(2, delta_action_mask=[True, False])
    a = np.ones((1, 2), np.float32)
    assert sp.to_absolute(a, [10.0, 20.0])[0].tolist() == [11.0, 1.0]
    assert sp.to_absolute(a, [-3.0, 20.0])[0].tolist() == [-2.0, 1.0]


def test_delta_without_state_is_an_error():
    sp = ActionSpace.build(2, delta_action_mask=[True])
    with pytest.raises(ValueError, match="joint state"):
        sp.to_absolute(np.zeros((1, 2)), None)
    with pytest.raises(ValueError, match="state entries"):
        ActionSpace.build(3, delta_action_mask=[0, 0, 1]).to_absolute(np.zeros((1, 3)), [1.0, 2.0])


@pytest.mark.parametrize("kw,match", [
    (dict(delta_action_mask=[1, 0, 1, 1]), "delta_action_mask has 4"),
    (dict(delta_action_mask=[2]), "0/1"),
    (dict(delta_action_mask=[0, 0, 1], state_dim=2), "only 2"),
    (dict(limits_min=[0, 0]), "action_limits_min has 2"),
    (dict(limits_min=[1, 1, 1], limits_max=[0, 2, 2]), r"action_limits_min\[0\]"),
    (dict(max_step_change=[0.1, 0.1]), "1 entry for all"),
    (dict(max_step_change=[-1.0]), ">= 0"),
])
def test_build_rejects(kw, match):
    with pytest.raises(ActionSpaceError, match=match):
        ActionSpace.build(3, **kw)


# -- limits --------------------------------------------------------------------------------------------------------
def test_clip_counts_rows():
    sp = ActionSpace.build(2, limits_min=[-1.0, -np.inf], limits_max=[1.0, 0.5])
    a = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 0.7], [-5.0, 9.0], [1.0, 0.5]], np.float32)
    out, n = sp.clip(a)
    assert n == 3                                    # rows 1, 2, 3; row 4 sits exactly on the bounds
    np.testing.assert_array_equal(out, [[0, 0], [1, 0], [0, 0.5], [-1, 0.5], [1, 0.5]])
    assert np.all(out >= [-1, -np.inf]) and np.all(out <= [1, 0.5])


def test_only_one_side():
    out, n = ActionSpace.build(1, limits_max=[0.0]).clip(np.array([[-3.0], [3.0]], np.float32))
    assert out[:, 0].tolist() == [-3.0, 0.0] and n == 1


# -- step limit ----------------------------------------------------------------------------------------------------
def test_step_limit_bounds_every_step_from_prev():
    sp = ActionSpace.build(2, max_step_change=[0.1, 0.0])        # column 1 unlimited
    rows = np.array([[1.0, 5.0], [1.0, -5.0], [0.95, 0.0], [0.0, 0.0]], np.float32)
    out, n = sp.limit_steps(rows, prev=[0.0, 0.0])
    np.testing.assert_allclose(out[:, 0], [0.1, 0.2, 0.3, 0.2], atol=1e-6)
    np.testing.assert_array_equal(out[:, 1], rows[:, 1])
    assert n == 4
    steps = np.abs(np.diff(np.vstack([[0.0, 0.0], out]), axis=0))[:, 0]
    assert np.all(steps <= 0.1 + 1e-6)


def test_step_limit_untouched_when_within_and_first_row_free_without_prev():
    sp = ActionSpace.build(1, max_step_change=[0.5])
    rows = np.array([[3.0], [3.2], [3.6]], np.float32)
    out, n = sp.limit_steps(rows)
    np.testing.assert_array_equal(out, rows)
    assert n == 0
    out, n = sp.limit_steps(rows, prev=[0.0])
    np.testing.assert_allclose(out[:, 0], [0.5, 1.0, 1.5])
    assert n == 3


def test_step_limit_leaves_a_column_with_an_unknown_position_free():
    """A NaN in prev or an anchor (a column no joint state names) binds nothing; the other columns still are."""
    sp = ActionSpace.build(2, max_step_change=[0.1])
    rows = np.array([[1.0, 5.0], [1.0, 5.0]], np.float32)
    out, _ = sp.limit_steps(rows, prev=[0.0, np.nan], anchors=((1, np.array([0.0, np.nan])),))
    np.testing.assert_allclose(out, [[0.1, 5.0], [0.1, 5.0]], atol=1e-6)      # row 1 anchored to 0 in column 0


def test_step_limit_all_zero_is_off():
    assert ActionSpace.build(3, max_step_change=[0.0]).max_step is None


# -- parameters ----------------------------------------------------------------------------------------------------
def test_defaults_change_nothing():
    s = Settings.from_values({})
    assert s.chunking == "blend" and s.blend_steps == 0
    assert s.delta_action_mask == [] and s.action_limits_min == [] and s.action_max_step_change == []
    assert s.outputs == ["action_chunk"] and s.publish_action_chunk and not s.publish_joint_trajectory
    assert s.rtc_delay_steps == 0 and s.rtc_execution_horizon == 0 and s.rtc_max_guidance_weight == 10.0


def test_array_values_normalised():
    s = Settings.from_values({"delta_action_mask": [1, 0, True], "action_limits_min": [0, -1.5],
                              "action_limits_max": (1, 2.0)})
    assert s.delta_action_mask == [True, False, True]
    assert s.action_limits_min == [0.0, -1.5] and s.action_limits_max == [1.0, 2.0]


def test_shipped_config_is_valid():
    import pathlib

    cfg = pathlib.Path(__file__).resolve().parents[1] / "config" / "oxygen.yaml"
    s = Settings.from_values(load_params_file(cfg))
    assert s.chunking == "blend" and s.outputs == ["action_chunk"]


@pytest.mark.parametrize("values,match", [
    ({"chunking": "smooth"}, "chunking must be one of"),
    ({"chunking": "rtc", "blend_steps": 3}, "needs chunking: blend"),
    ({"chunking": "none", "blend_steps": 3}, "needs chunking: blend"),
    ({"outputs": []}, "outputs must be"),
    ({"outputs": ["action_chunk", "trajectory"]}, "outputs must be"),
    ({"outputs": ["joint_trajectory", "joint_trajectory"]}, "outputs must be"),
    ({"outputs": ["joint_trajectory"]}, "needs action_joint_names"),
    ({"delta_action_mask": [2]}, "0/1"),
    ({"delta_action_mask": [0.5]}, "0/1"),
    ({"action_limits_min": ["a"]}, "numbers"),
    ({"action_limits_min": [float("nan")]}, "NaN"),
    ({"action_joint_names": ["a", "b"], "action_limits_min": [0.0]}, "action_limits_min has 1"),
    ({"action_joint_names": ["a", "b"], "action_limits_max": [0.0, 1, 2]}, "action_limits_max has 3"),
    ({"action_joint_names": ["a", "b"], "action_limits_min": [1, 0], "action_limits_max": [0, 1]},
     r"action_limits_min\[0\]"),
    ({"action_joint_names": ["a", "b", "c"], "action_max_step_change": [0.1, 0.1]}, "give 1"),
    ({"action_max_step_change": [-0.1]}, ">= 0"),
    ({"action_joint_names": ["a"], "delta_action_mask": [1, 1]}, "delta_action_mask has 2"),
    ({"rtc_max_guidance_weight": -1.0}, "rtc_max_guidance_weight must be in"),
    ({"rtc_delay_steps": -1}, "rtc_delay_steps must be in"),
])
def test_bad_values_are_configure_errors(values, match):
    with pytest.raises(ConfigureError, match=match):
        Settings.from_values(values)


def test_check_value_for_runtime_set_and_array_types():
    import array

    assert check_value("action_limits_min", array.array("d", [0.5, 1.0])) is None
    assert check_value("delta_action_mask", [True, False]) is None
    assert "0/1" in check_value("delta_action_mask", [3])
    assert "outputs" in check_value("outputs", ["nope"])


# -- diagnostics ---------------------------------------------------------------------------------------------------
def test_limited_rows_in_diagnostics():
    from oxygen_ros.ros.diagnostics import OK, WARN, build_statuses

    base = dict(state="active", control_rate_hz=70.0, control_rate_measured_hz=69.0, observation_age_s=0.1,
                max_observation_age_s=1.0, chunking="rtc", rtc_delay_steps=3, rtc_chunks=7,
                counters={"actions_clipped_rows": 12, "actions_step_limited_rows": 4})
    st = {s.name: s for s in build_statuses({**base, "counters_delta": {}})}["oxygen_node: control"]
    assert st.level == OK and st.values["actions_clipped_rows"] == 12 and st.values["actions_step_limited_rows"] == 4
    assert st.values["chunking"] == "rtc" and st.values["rtc_delay_steps"] == 3 and st.values["rtc_chunks"] == 7
    st = {s.name: s for s in build_statuses({**base, "counters_delta": {"actions_clipped_rows": 5}})}
    c = st["oxygen_node: control"]
    assert c.level == WARN and "actions_clipped_rows +5" in c.message
