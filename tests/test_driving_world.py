"""The driving world (runtime/model/driving.py, issue 55): seeded scenes, the expert's plans held to
physics (positions the integral of speed, bounded accelerations) and to the judge, aggressiveness
moving peak acceleration, the judge against hand-made bad plans, prompts in VOCAB, the picture.
The rank correlation and the integral are computed here, not taken from the module."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.model.driving import (ACCEL_MAX, BEHAVIOURS, DECEL_MAX, DT, LANE_WIDTH, LATERAL_ACCEL_MAX, LENGTH,
                                          STEPS, VOCAB, Scene, draw, expert, judge, prompt, random_scene)  # fmt: skip

N_SCENES = 200
LEVELS = np.linspace(0.0, 1.0, 5)


@pytest.fixture(scope="module")
def scenes() -> list[Scene]:
    rng = np.random.default_rng(0)
    return [random_scene(rng) for _ in range(N_SCENES)]


@pytest.fixture(scope="module")
def plans(scenes) -> dict[tuple[int, str, float], np.ndarray | None]:
    """Every scene's expert plan for every behaviour at the five aggressiveness levels."""
    return {(i, b, float(g)): expert(s, b, float(g)).trajectory for i, s in enumerate(scenes) for b in BEHAVIOURS for g in LEVELS}


@pytest.fixture(scope="module")
def judged(scenes, plans) -> dict[tuple[int, str, float], dict]:
    """The judge's scores of every feasible plan, by the same keys."""
    return {key: judge(scenes[key[0]], traj, key[1]) for key, traj in plans.items() if traj is not None}


def _ranks(a: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their places)."""
    a = np.asarray(a, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(len(a), dtype=np.float64)
    for value in np.unique(a):
        r[a == value] = r[a == value].mean()
    return r


def _spearman(a, b) -> float:
    ra, rb = _ranks(a), _ranks(b)
    if np.ptp(ra) == 0 or np.ptp(rb) == 0:
        return float("nan")  # a constant peak: aggressiveness moved nothing, which fails the check
    return float(np.corrcoef(ra, rb)[0, 1])


def test_scenes_are_reproducible_from_the_seed():
    first = [random_scene(np.random.default_rng(7)) for _ in range(3)]
    again = [random_scene(np.random.default_rng(7)) for _ in range(3)]
    assert first == again
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(4)
    assert [random_scene(rng_a) for _ in range(5)] != [random_scene(rng_b) for _ in range(5)]


def test_expert_plans_are_physically_consistent(scenes, plans):
    keys = [key for key, traj in plans.items() if traj is not None]
    assert len(keys) > 0.7 * len(plans)
    traj = np.stack([plans[key] for key in keys])  # [n, STEPS, 3]
    assert traj.shape[1:] == (STEPS, 3)
    present = np.array([[0.0, scenes[i].ego_y, scenes[i].ego_speed] for i, _, _ in keys])
    np.testing.assert_array_equal(traj[:, 0], present)  # row 0 is the present state
    v = traj[..., 2]
    integral = np.concatenate([np.zeros((len(keys), 1)), np.cumsum(DT * (v[:, 1:] + v[:, :-1]) / 2, axis=1)], axis=1)
    np.testing.assert_allclose(traj[..., 0], integral, rtol=0, atol=1e-6)  # speed piecewise linear
    assert (v >= 0).all()
    along = np.diff(v, axis=1) / DT
    assert along.min() >= -DECEL_MAX - 1e-9 and along.max() <= ACCEL_MAX + 1e-9, (along.min(), along.max())
    across = np.diff(traj[..., 1], n=2, axis=1) / DT**2
    assert np.abs(across).max() <= LATERAL_ACCEL_MAX


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
def test_each_behaviour_done_as_asked_where_the_expert_finds_it_feasible(judged, behaviour):
    for g in (0.0, 0.5, 1.0):
        scored = [judged[(i, behaviour, g)] for i in range(N_SCENES) if (i, behaviour, g) in judged]
        # the world holds every behaviour often enough to learn it (overtake the rarest, ~0.3-0.5)
        assert len(scored) >= 0.25 * N_SCENES, (behaviour, g, len(scored))
        done = np.mean([j["behaviour_ok"] for j in scored])
        clear = np.mean([not j["collision"] and j["on_road"] for j in scored])
        assert done >= 0.97 and clear >= 0.97, (behaviour, g, done, clear)


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
def test_aggressiveness_moves_peak_acceleration_monotonically(judged, behaviour):
    rhos = []
    for i in range(N_SCENES):
        keys = [(i, behaviour, float(g)) for g in LEVELS]
        if all(key in judged for key in keys):  # feasible at every level
            rhos.append(_spearman(LEVELS, [judged[key]["peak_accel"] for key in keys]))
    assert len(rhos) >= 40, len(rhos)
    share = np.mean(np.nan_to_num(rhos, nan=-1.0) >= 0.9)
    assert share >= 0.9, (behaviour, share, len(rhos))


def _straight(scene: Scene, speed: float, y: float = 0.0) -> np.ndarray:
    t = np.arange(STEPS) * DT
    return np.stack([speed * t, np.full(STEPS, y), np.full(STEPS, speed)], axis=1)


def test_judge_catches_bad_plans():
    scene = Scene(ego_speed=15.0, ego_y=0.0, lead_gap=20.0, lead_speed=5.0)
    through = judge(scene, _straight(scene, 15.0), "keep lane")  # drives through the lead
    assert through["collision"] and not through["success"] and through["min_clearance"] < 0
    off = _straight(scene, 3.0)
    off[:, 1] = np.linspace(0.0, -6.0, STEPS)  # leaves the road to the right
    left_road = judge(scene, off, "keep lane")
    assert not left_road["on_road"] and not left_road["in_own_lane"] and left_road["final_lane"] is None
    assert not left_road["behaviour_ok"]
    stays = expert(scene, "keep lane", 0.5).trajectory
    assert judge(scene, stays, "keep lane")["success"]
    assert not judge(scene, stays, "change lane")["behaviour_ok"]  # in lane is no lane change
    assert not judge(scene, stays, "overtake left")["behaviour_ok"]  # never went left nor passed
    assert not judge(scene, _straight(scene, 4.0), "brake to stop")["behaviour_ok"]  # still moving
    other = _straight(scene, 4.0, y=LANE_WIDTH)
    assert judge(scene, other, "change lane")["behaviour_ok"]
    # an oncoming vehicle in the other lane is a box too
    head_on = Scene(ego_speed=15.0, ego_y=0.0, lead_gap=50.0, lead_speed=10.0, oncoming_distance=60.0, oncoming_speed=15.0)
    assert judge(head_on, other, "change lane")["collision"]
    # a brake that stops after the obstacle's rear: stopped, but not before it
    obstacle = Scene(ego_speed=10.0, ego_y=0.0, lead_gap=10.0, lead_speed=0.0, obstacle=True)
    late = np.zeros((STEPS, 3))
    late[:, 0] = np.minimum(np.arange(STEPS) * DT * 10.0, 10.0 + LENGTH + 1.0)
    scored = judge(obstacle, late, "brake to stop")
    assert scored["collision"] and not scored["behaviour_ok"]


def test_infeasible_behaviours_say_why():
    scene = Scene(ego_speed=15.0, ego_y=0.0, lead_gap=15.0, lead_speed=8.0, oncoming_distance=60.0, oncoming_speed=15.0)
    plan = expert(scene, "overtake left", 0.5)
    assert plan.trajectory is None and not plan.feasible and "oncoming" in plan.reason
    assert expert(scene, "change lane", 0.5).trajectory is None
    assert expert(scene, "follow", 0.5).feasible
    wall = Scene(ego_speed=20.0, ego_y=0.0, lead_gap=10.0, lead_speed=0.0, obstacle=True)
    assert not expert(wall, "brake to stop", 0.5).feasible  # 20 m/s to 0 in 7 m: past DECEL_MAX
    with pytest.raises(ValueError, match="aggressiveness"):
        expert(scene, "follow", 1.5)
    with pytest.raises(ValueError, match="behaviour"):
        expert(scene, "fly", 0.5)


def test_prompts_use_only_vocab_words(scenes):
    assert all(w.isalpha() and w.islower() for w in VOCAB)  # one token each for a word-level tokenizer
    used = set()
    for s in scenes:
        for b in BEHAVIOURS:
            for g in LEVELS:
                words = prompt(s, b, float(g)).split()
                assert set(words) <= set(VOCAB), prompt(s, b, float(g))
                used.update(words)
    assert used == set(VOCAB)  # no word the world never says
    s = Scene(ego_speed=12.0, ego_y=0.2, lead_gap=10.0, lead_speed=6.0, oncoming_distance=200.0, oncoming_speed=16.0)
    assert prompt(s, "overtake left", 0.75) == "ego medium lead near slow oncoming far fast behaviour overtake left aggressive high"


def test_draw_shows_the_road_and_every_labelled_plan(scenes):
    scene = next(s for s in scenes if s.oncoming and expert(s, "overtake left").feasible)
    trajs = {b: expert(scene, b).trajectory for b in ("follow", "overtake left", "brake to stop")}
    image = draw(scene, trajs)
    assert isinstance(image, Image.Image) and image.mode == "RGB"
    assert image.width > 200 and image.height > 100
    pixels = np.asarray(image).reshape(-1, 3)
    for colour in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):  # the first three trace colours
        assert (pixels == colour).all(axis=1).any(), colour
