"""The "driving" world (issue 55): a two-lane road seen from above, an ego vehicle, the traffic
around it, an expert planner per behaviour, the prompt that states scene and behaviour in words,
a judge of any trajectory, and a picture. Numpy and Pillow only. The model that learns it is
export/world/plan_model.py (its latent: plan_grid.py), the plan-edit-evaluate loop
pipeline/plans.py (docs/plans.md).

**The road and the scene.** A straight two-way road of two lanes, ``LANE_WIDTH`` wide each: the
ego's lane (lane 0, centre y = 0, traffic in +x) and the other lane (lane 1, centre y =
``LANE_WIDTH``, the oncoming traffic's). x runs along the road, y across it, metres; the ego's
centre starts at x = 0, a little off its lane's centre (``ego_y``). Every vehicle is a
``LENGTH`` x ``WIDTH`` box. In the ego's lane ahead there is always a *lead*: a vehicle driving at
a constant ``lead_speed``, or (``obstacle``) a stopped one (a broken-down car, road works),
``lead_gap`` metres bumper to bumper ahead. Sometimes an *oncoming* vehicle drives toward the ego
in the other lane at a constant speed, ``oncoming_distance`` metres front to front. Every other
vehicle keeps its speed and lane over the horizon: ``STEPS`` = 64 steps of ``DT`` = 0.1 s, row 0
the present (t = 0), row 63 t = 6.3 s.

**A trajectory** is float64 [STEPS, 3]: the ego centre's x, y and speed along the road (m/s) at
t = k * DT; row 0 is the ego's present state. Positions are the integral of that speed: the expert
steps with a constant acceleration per step, so x[k+1] = x[k] + DT * (v[k] + v[k+1]) / 2 exactly.

**The expert** (``expert(scene, behaviour, aggressiveness) -> Plan``), simple and deterministic:

- *longitudinal*: the Intelligent Driver Model (Treiber, Hennecke & Helbing 2000),
  ``a = a_max [1 - (v / v0)^4 - (s* / s)^2]``, ``s* = s0 + v T + v dv / (2 sqrt(CLOSING_ACCEL b))``
  (the original has ``sqrt(a_max b)``), its braking capped at the larger of ``b`` and the constant
  deceleration that ends the closing ``CAP_GAP`` behind the lead (the ACC model's
  constant-acceleration heuristic in its simplest form): both so that a bolder style scales every
  acceleration up; with the original, the calm style anticipated less and braked harder later.
  Against the lead while the ego's box overlaps the lead's lane laterally (centres closer than
  ``WIDTH + LATERAL_MARGIN``), the free-road term alone once ``LATERAL_BLEND`` further across
  (blended linearly between, so that leaving the lane is no jerk spike); clipped to [-``DECEL_MAX``,
  a_max], speed never below 0. While an overtake pulls out it takes the largest constant
  acceleration (at most the free road's) that clears the lead's lane before it comes within
  ``CAP_GAP`` of the lead, and keeps no headway to it. ``follow`` drives toward ``SPEED_LIMIT``
  (so it closes up to the lead and settles at its speed and headway); ``keep lane`` and ``change lane`` toward the present speed
  (they hold it unless the lead makes them slow); ``overtake left`` toward a passing speed
  ``max(ego, lead) + pass margin`` (at most ``PASS_SPEED_MAX``);
- *brake to stop*: a minimum-jerk (quintic) speed profile from the present speed to 0 over a stop
  time chosen so that the ego stops before the lead (``s0`` bumper to bumper) within the horizon;
- *lateral*: a minimum-jerk (quintic) lane-change profile ``y0 + (y1 - y0)(10 u^3 - 15 u^4 + 6
  u^5)``, ``u = t / T_lc``: every behaviour first centres the ego in its target lane (its own,
  lane 1 for ``change lane`` and ``overtake left``); ``overtake left`` comes back to lane 0 once
  its rear is ``return gap`` metres past the lead's front (if the horizon leaves no time to come
  back the plan ends in lane 1, past the lead).

``aggressiveness`` in [0, 1] moves the parameters monotonically, linearly between the calm and the
aggressive value of ``CALM`` and ``AGGRESSIVE``: a_max, b, lane-change time T_lc, pass margin,
return gap (time headway T and gap s0 stay fixed: ``CALM``'s comment says why); ``brake to stop``
stops in ``T_hi - g (T_hi - T_lo)`` seconds, ``T_hi`` the longest stop the scene allows, ``T_lo``
the larger of ``T_hi / 2`` and the shortest one within ``DECEL_MAX``; it centres the ego in its
lane within 0.7 of the stop time. The bounds every expert plan keeps (the tests hold them):
longitudinal acceleration in [-``DECEL_MAX``, ``ACCEL_MAX``], lateral in [-``LATERAL_ACCEL_MAX``,
``LATERAL_ACCEL_MAX``], speed >= 0.

**Infeasible** (``Plan.trajectory`` None, ``Plan.reason`` says why), by the expert's own rules,
not the judge's: while the ego's box intrudes into lane 1 and the oncoming vehicle is still ahead,
their front-to-front distance must stay at least ``ONCOMING_MARGIN_M + ONCOMING_MARGIN_S x``
closing speed; ``overtake left`` must be past the lead (rear ``return gap`` beyond its front) within
the horizon; the IDM must keep 0.5 m from the lead; ``brake to stop`` must stop before the lead
within the horizon and ``DECEL_MAX``.

**The prompt** (``prompt(scene, behaviour, aggressiveness)``): words only, numbers binned into
words (``SPEED_BINS``, ``GAP_BINS``, ``ONCOMING_BINS``, ``AGGRESSIVENESS_WORDS``), e.g. ``ego
medium lead near slow oncoming far fast behaviour overtake left aggressive high``; ``VOCAB`` is
every word a prompt can hold (``write_tokenizer(out, VOCAB)`` makes each one token, as the shapes
world's ``world_words``). The ego's lateral offset is not said: it is state, which a planner keeps
by masking the trajectory's first rows.

**The judge** (``judge(scene, trajectory, behaviour) -> dict``) knows the world, not the expert:
it reads the positions (x, y) only, never the speed column, and scores collision (the ego's box,
grown to the axis-aligned box of its box turned by its heading, against every other vehicle's at
each step), lane keeping (body on the road, the lane its centre ends in), comfort (peak |acc| and
|jerk| of the positions by finite differences), progress, and whether the behaviour asked was done
(``behaviour_ok``; rules in ``judge``'s docstring).

**The picture** (``draw(scene, trajectories)``): the road from above, lateral scale stretched
(``PIXELS_PER_M_Y``) so that lanes are readable, vehicles at t = 0 (solid) and at the horizon's end
(outlined), each trajectory a labelled polyline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# The road and the clock
LANE_WIDTH = 3.5  # m, a common rural/urban lane
LANE_CENTRES = (0.0, LANE_WIDTH)  # lane 0: the ego's; lane 1: the oncoming traffic's
ROAD_Y = (-LANE_WIDTH / 2, 1.5 * LANE_WIDTH)  # the road's edges
LENGTH, WIDTH = 4.5, 1.8  # m, every vehicle's box (a mid-size car)
STEPS, DT = 64, 0.1  # the horizon: 64 rows at t = 0 .. 6.3 s
TIMES = np.arange(STEPS) * DT
SPEED_LIMIT = 22.0  # m/s (~80 km/h): follow's desired speed; scenes' ego speeds stay below it
PASS_SPEED_MAX = 25.0  # m/s: an overtake may briefly exceed the limit by this much at most

# The bounds every expert plan keeps (tests/test_driving_world.py holds them)
ACCEL_MAX = 4.0  # m/s^2, longitudinal; the aggressive a_max (3) stays under it
DECEL_MAX = 8.0  # m/s^2, an emergency stop on dry asphalt
LATERAL_ACCEL_MAX = 4.0  # m/s^2; the fastest lane change (2.5 s over 3.5 m) peaks at 3.2

# The expert's own safety rules (the judge does not use them)
LATERAL_MARGIN = 0.3  # m: centres closer than WIDTH + this across the road share a lane
ONCOMING_MARGIN_M, ONCOMING_MARGIN_S = 5.0, 1.0  # front-to-front room kept from oncoming traffic
LATERAL_BLEND = 1.0  # m beyond that over which the lead's pull on the ego fades to nothing
CLOSING_ACCEL = 2.0  # m/s^2 in the IDM's closing term: the same anticipation for every style
CAP_GAP = 2.5  # m: the IDM's braking cap still stops the closing this far behind the lead
LEAD_MIN_GAP = 0.5  # m: the IDM must keep at least this much bumper to bumper

BEHAVIOURS = ("follow", "overtake left", "brake to stop", "keep lane", "change lane")


@dataclass(frozen=True)
class Style:
    """The expert's parameters at one aggressiveness (``style(g)``)."""

    accel_max: float  # IDM a_max, m/s^2
    decel_comfort: float  # IDM b, m/s^2
    headway: float  # IDM T, s
    min_gap: float  # IDM s0 and the stop gap of brake to stop, m
    lane_change_time: float  # T_lc, s
    pass_margin: float  # m/s above max(ego, lead) an overtake aims at
    return_gap: float  # m between the ego's rear and the lead's front before coming back


# The headway and gap are the same for both: a shorter headway for the bold style made the calm one
# brake harder from a close start (it wants more room), so peak acceleration fell with
# aggressiveness in most close-start scenes (measured: rho >= 0.9 on 0.3-0.5 of scenes, not 0.9).
CALM = Style(accel_max=1.0, decel_comfort=1.5, headway=1.5, min_gap=3.0, lane_change_time=4.0, pass_margin=5.0, return_gap=6.0)
AGGRESSIVE = Style(accel_max=3.0, decel_comfort=5.0, headway=1.5, min_gap=3.0, lane_change_time=2.5, pass_margin=9.0, return_gap=3.0)


def style(aggressiveness: float) -> Style:
    """Every parameter linear from ``CALM`` (0) to ``AGGRESSIVE`` (1)."""
    g = float(aggressiveness)
    if not 0.0 <= g <= 1.0:
        raise ValueError(f"aggressiveness {g} is outside [0, 1]")
    return Style(*(c + g * (a - c) for c, a in zip(vars(CALM).values(), vars(AGGRESSIVE).values())))


@dataclass(frozen=True)
class Scene:
    ego_speed: float  # m/s
    ego_y: float  # m, the ego centre's offset from its lane's centre (left positive)
    lead_gap: float  # m, bumper to bumper
    lead_speed: float  # m/s, 0 when ``obstacle``
    obstacle: bool = False  # the lead is a stopped vehicle / road works
    oncoming_distance: Optional[float] = None  # m front to front; None: no oncoming vehicle
    oncoming_speed: float = 0.0  # m/s toward the ego

    @property
    def oncoming(self) -> bool:
        return self.oncoming_distance is not None


def random_scene(rng: np.random.Generator) -> Scene:
    """A scene with every quantity uniform over its range: ego 6-20 m/s, 0.1-0.5 m off centre; a
    stopped obstacle 30-100 m ahead (p = 0.2) or a lead 8-50 m ahead at 30% of the ego's speed to
    the ego's + 1 m/s (within the limit); an oncoming vehicle (p = 0.5) 40-400 m away at 8-20 m/s.
    Always draws the same numbers from ``rng``, whichever branches are taken."""
    u = rng.random(9)
    ego_speed = 6.0 + 14.0 * u[0]
    ego_y = (0.1 + 0.4 * u[1]) * (1 if u[2] < 0.5 else -1)
    obstacle = bool(u[3] < 0.2)
    if obstacle:
        gap, lead_speed = 30.0 + 70.0 * u[4], 0.0
    else:
        low, high = 0.3 * ego_speed, min(SPEED_LIMIT, ego_speed + 1.0)
        gap, lead_speed = 8.0 + 42.0 * u[4], low + (high - low) * u[5]
    oncoming = bool(u[6] < 0.5)
    return Scene(
        ego_speed=float(ego_speed), ego_y=float(ego_y), lead_gap=float(gap), lead_speed=float(lead_speed), obstacle=obstacle,
        oncoming_distance=float(40.0 + 360.0 * u[7]) if oncoming else None, oncoming_speed=float(8.0 + 12.0 * u[8]) if oncoming else 0.0,
    )  # fmt: skip


def agent_tracks(scene: Scene) -> dict[str, np.ndarray]:
    """Every other vehicle's centre over the horizon, [STEPS, 2] (x, y) by name ("lead" or
    "obstacle", "oncoming"): constant speed in its lane."""
    lead = np.stack([scene.lead_gap + LENGTH + scene.lead_speed * TIMES, np.full(STEPS, LANE_CENTRES[0])], axis=1)
    out = {"obstacle" if scene.obstacle else "lead": lead}
    if scene.oncoming:
        x = scene.oncoming_distance + LENGTH - scene.oncoming_speed * TIMES
        out["oncoming"] = np.stack([x, np.full(STEPS, LANE_CENTRES[1])], axis=1)
    return out


# 1. the expert


@dataclass(frozen=True)
class Plan:
    """The expert's plan: ``trajectory`` [STEPS, 3] (x, y, speed), or None with ``reason`` when the
    behaviour is unsafe or impossible in the scene."""

    trajectory: Optional[np.ndarray]
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.trajectory is not None


def _quintic(u: float) -> float:
    """The minimum-jerk blend 0 -> 1 over u in [0, 1] (zero speed and acceleration at both ends)."""
    u = min(1.0, max(0.0, u))
    return u * u * u * (10.0 + u * (-15.0 + 6.0 * u))


def _idm(v: float, v0: float, p: Style, gap: Optional[float], closing: float, headway: Optional[float] = None) -> float:
    """IDM acceleration (``gap`` None on a free road; ``headway`` replaces the style's), with two
    changes that make a bolder style move every acceleration up, never down (module docstring):
    the closing term of s* uses ``sqrt(CLOSING_ACCEL b)``, not ``sqrt(a_max b)``; the braking is
    capped at the larger of ``b`` and the constant deceleration that stops the closing
    ``CAP_GAP`` metres behind the lead (the ACC model's constant-acceleration heuristic, Kesting,
    Treiber & Helbing 2010, in its simplest form)."""
    a = p.accel_max * (1.0 - (v / v0) ** 4) if v0 > 0 else -p.decel_comfort
    if gap is not None:
        t = p.headway if headway is None else headway
        s_star = p.min_gap + max(0.0, v * t + v * closing / (2.0 * math.sqrt(CLOSING_ACCEL * p.decel_comfort)))
        a -= p.accel_max * (s_star / max(gap, 0.1)) ** 2
        need = closing**2 / (2.0 * max(gap - CAP_GAP, 0.1)) if closing > 0 else 0.0
        a = max(a, -max(p.decel_comfort, need))
    return min(p.accel_max, max(-DECEL_MAX, a))


def _oncoming_clear(scene: Scene, x: float, y: float, v: float, t: float) -> bool:
    """The expert's rule for the other lane: room enough ahead when the ego's box intrudes in it."""
    if not scene.oncoming or y + WIDTH / 2 <= LANE_WIDTH / 2:
        return True
    xo = scene.oncoming_distance + LENGTH - scene.oncoming_speed * t
    if xo + LENGTH / 2 < x - LENGTH / 2:  # already behind the ego
        return True
    front_to_front = (xo - LENGTH / 2) - (x + LENGTH / 2)
    return front_to_front >= ONCOMING_MARGIN_M + ONCOMING_MARGIN_S * (v + scene.oncoming_speed)


def _drive(scene: Scene, p: Style, desired: float, lane: int, overtake: bool) -> Plan:
    """IDM along the road, a quintic lane profile across it, stepped at DT (module docstring)."""
    x, y, v = [0.0] * STEPS, [0.0] * STEPS, [0.0] * STEPS
    v[0], y[0] = scene.ego_speed, scene.ego_y
    lead_x0, vl = scene.lead_gap + LENGTH, scene.lead_speed
    # lateral segments: (start time, from, to); the first centres the ego in its target lane
    seg = (0.0, scene.ego_y, LANE_CENTRES[lane])
    back = None  # the time the overtake's return starts
    # when the lane-change profile takes the ego's box clear of lane 0's (an overtake's pull-out)
    u = np.linspace(0.0, 1.0, 401)
    y_out = scene.ego_y + (LANE_CENTRES[1] - scene.ego_y) * u**3 * (10.0 + u * (-15.0 + 6.0 * u))
    t_clear = p.lane_change_time * float(u[np.argmax(y_out - LANE_CENTRES[0] >= WIDTH + LATERAL_MARGIN)])
    for k in range(STEPS - 1):
        t = k * DT
        lead_x = lead_x0 + vl * t
        # how much the lead counts: fully while the ego shares its lane, fading out over
        # LATERAL_BLEND beyond (a step would be a jerk spike when the ego leaves the lane)
        beside = abs(y[k] - LANE_CENTRES[0]) - (WIDTH + LATERAL_MARGIN)
        weight = min(1.0, max(0.0, 1.0 - beside / LATERAL_BLEND)) if lead_x > x[k] else 0.0
        if overtake and t >= t_clear:
            weight = 0.0  # past the pull-out the ego is in lane 1, clear of the lead by construction
        free = _idm(v[k], desired, p, None, 0.0)
        a = free
        if weight > 0:
            gap = lead_x - x[k] - LENGTH
            if gap < LEAD_MIN_GAP:
                return Plan(None, f"the lead cannot be kept {LEAD_MIN_GAP} m away (gap {gap:.2f} m at t = {t:.1f} s)")
            tau = t_clear - t
            if overtake and tau > 0:
                # pulling out: the largest constant acceleration (at most the free road's) with
                # which the ego clears the lead's lane before it comes within CAP_GAP of it
                room = gap - CAP_GAP - (v[k] - vl) * tau  # at the present speed
                a = max(-DECEL_MAX, min(free, 2.0 * room / tau**2))
            else:
                following = _idm(v[k], desired, p, gap, v[k] - vl, 0.0 if overtake else None)
                a = weight * following + (1.0 - weight) * free
        v[k + 1] = max(0.0, v[k] + a * DT)
        x[k + 1] = x[k] + DT * (v[k] + v[k + 1]) / 2
        t1 = t + DT
        if overtake and back is None and t1 >= p.lane_change_time:
            if x[k + 1] - LENGTH / 2 - (lead_x0 + vl * t1 + LENGTH / 2) >= p.return_gap:
                back = t1
                seg = (t1, LANE_CENTRES[1], LANE_CENTRES[0])
        y[k + 1] = seg[1] + (seg[2] - seg[1]) * _quintic((t1 - seg[0]) / p.lane_change_time)
        if not _oncoming_clear(scene, x[k + 1], y[k + 1], v[k + 1], t1):
            return Plan(None, f"oncoming vehicle too close at t = {t1:.1f} s")
    if overtake and back is None:
        return Plan(None, "the lead is not passed within the horizon")
    return Plan(np.array([x, y, v], dtype=np.float64).T)


def _brake(scene: Scene, p: Style, g: float) -> Plan:
    """A minimum-jerk stop: v(t) = v0 (1 - q(t / T)), peak deceleration 1.875 v0 / T, distance
    v0 T / 2; T_hi the longest stop that ends within the horizon (one step before its end) and
    keeps ``min_gap`` from the lead, T_lo the larger of T_hi / 2 and the shortest within DECEL_MAX."""
    v0 = scene.ego_speed
    candidates = np.arange(STEPS - 2, 4, -1) * DT  # stop times, longest first
    u = np.clip(TIMES[None, :] / candidates[:, None], 0.0, 1.0)
    q = u**3 * (10.0 + u * (-15.0 + 6.0 * u))
    speed = v0 * (1.0 - q)
    x = np.concatenate([np.zeros((len(candidates), 1)), np.cumsum(DT * (speed[:, 1:] + speed[:, :-1]) / 2, axis=1)], axis=1)
    lead_rear = scene.lead_gap + LENGTH / 2 + scene.lead_speed * TIMES
    clear = ((lead_rear[None, :] - (x + LENGTH / 2)) >= p.min_gap).all(axis=1)
    if not clear.any():
        return Plan(None, "cannot stop before the lead within the horizon")
    t_hi = float(candidates[np.argmax(clear)])
    t_min = 1.875 * v0 / DECEL_MAX
    if t_hi < t_min:
        return Plan(None, f"stopping before the lead needs more than {DECEL_MAX} m/s^2")
    t_lo = max(t_min, t_hi / 2)
    t_stop = t_hi - g * (t_hi - t_lo)
    # a shorter stop ends further back, so the gap the longest stop kept still holds
    u = np.clip(TIMES / t_stop, 0.0, 1.0)
    v = v0 * (1.0 - u**3 * (10.0 + u * (-15.0 + 6.0 * u)))
    v[TIMES >= t_stop] = 0.0
    x = np.concatenate([[0.0], np.cumsum(DT * (v[1:] + v[:-1]) / 2)])
    # centred while still rolling: a car does not move sideways standing still
    u = np.clip(TIMES / min(p.lane_change_time, 0.7 * t_stop), 0.0, 1.0)
    y = scene.ego_y + (LANE_CENTRES[0] - scene.ego_y) * u**3 * (10.0 + u * (-15.0 + 6.0 * u))
    return Plan(np.stack([x, y, v], axis=1))


def expert(scene: Scene, behaviour: str, aggressiveness: float = 0.5) -> Plan:
    """The expert's plan for ``behaviour`` (one of ``BEHAVIOURS``) at ``aggressiveness`` (module
    docstring: the rules, the bounds, when a plan is infeasible)."""
    p = style(aggressiveness)
    if behaviour == "follow":
        return _drive(scene, p, SPEED_LIMIT, lane=0, overtake=False)
    if behaviour == "keep lane":
        return _drive(scene, p, scene.ego_speed, lane=0, overtake=False)
    if behaviour == "change lane":
        return _drive(scene, p, scene.ego_speed, lane=1, overtake=False)
    if behaviour == "overtake left":
        desired = min(PASS_SPEED_MAX, max(scene.ego_speed, scene.lead_speed) + p.pass_margin)
        return _drive(scene, p, desired, lane=1, overtake=True)
    if behaviour == "brake to stop":
        return _brake(scene, p, float(aggressiveness))
    raise ValueError(f"unknown behaviour {behaviour!r}; one of {', '.join(BEHAVIOURS)}")


# 2. the prompt

SPEED_BINS = ((10.0, "slow"), (15.0, "medium"), (math.inf, "fast"))  # m/s, upper bounds
GAP_BINS = ((20.0, "near"), (40.0, "mid"), (math.inf, "far"))  # m bumper to bumper
ONCOMING_BINS = ((80.0, "near"), (160.0, "mid"), (math.inf, "far"))  # m front to front
AGGRESSIVENESS_WORDS = ("lowest", "low", "medium", "high", "highest")  # at 0, 0.25, 0.5, 0.75, 1


def _bin(value: float, bins) -> str:
    return next(word for bound, word in bins if value < bound)


def aggressiveness_word(aggressiveness: float) -> str:
    """The nearest of the five levels' words."""
    style(aggressiveness)  # validates the range
    return AGGRESSIVENESS_WORDS[int(round(aggressiveness * (len(AGGRESSIVENESS_WORDS) - 1)))]


def prompt(scene: Scene, behaviour: str, aggressiveness: float = 0.5) -> str:
    """``ego <speed> (lead <gap> <speed> | obstacle <gap>) oncoming (none | <distance> <speed>)
    behaviour <behaviour> aggressive <level>``."""
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; one of {', '.join(BEHAVIOURS)}")
    words = ["ego", _bin(scene.ego_speed, SPEED_BINS)]
    if scene.obstacle:
        words += ["obstacle", _bin(scene.lead_gap, GAP_BINS)]
    else:
        words += ["lead", _bin(scene.lead_gap, GAP_BINS), _bin(scene.lead_speed, SPEED_BINS)]
    if scene.oncoming:
        words += ["oncoming", _bin(scene.oncoming_distance, ONCOMING_BINS), _bin(scene.oncoming_speed, SPEED_BINS)]
    else:
        words += ["oncoming", "none"]
    words += ["behaviour", behaviour, "aggressive", aggressiveness_word(aggressiveness)]
    return " ".join(words)


def _vocab() -> tuple[str, ...]:
    words = {"ego", "lead", "obstacle", "oncoming", "none", "behaviour", "aggressive", *AGGRESSIVENESS_WORDS}
    for bins in (SPEED_BINS, GAP_BINS, ONCOMING_BINS):
        words.update(word for _, word in bins)
    for behaviour in BEHAVIOURS:
        words.update(behaviour.split())
    return tuple(sorted(words))


VOCAB = _vocab()  # every word a prompt holds; export/world/tiny_model.py write_tokenizer(out, VOCAB)


# 3. the judge

MIN_FOLLOW_GAP = 2.0  # m bumper to bumper a follow must keep
FOLLOW_HEADWAY = 3.0  # s: a follow ends at most this far behind the lead (or still closing up on it)
STOPPED_SPEED = 0.3  # m/s: "stopped" at the end of a brake
COMFORT_ACCEL, COMFORT_JERK = 4.0, 10.0  # m/s^2, m/s^3: above these a plan is not comfortable


def _lane_of(y: float) -> Optional[int]:
    """The lane a centre is in, None off the road."""
    if not ROAD_Y[0] <= y <= ROAD_Y[1]:
        return None
    return 0 if y < LANE_WIDTH / 2 else 1


def judge(scene: Scene, trajectory: np.ndarray, behaviour: str) -> dict:
    """Scores of a trajectory ([STEPS, >= 2]: x, y per row at t = k DT; other columns unread).

    - ``collision`` (and ``min_clearance``, m: the largest per-axis separation of the two boxes,
      negative when they overlap): the ego's box, grown to the axis-aligned box of itself turned
      by its heading (atan2 of the position differences), against every other vehicle's at each step;
    - ``on_road``: the ego's grown box within the road's edges at every step; ``final_lane``: the
      lane its centre ends in (None off the road); ``in_own_lane``: its box within lane 0 (10 cm
      of slack) at every step;
    - ``peak_accel`` / ``peak_jerk``: max |second / third difference| of (x, y) over DT^2 / DT^3;
      ``comfortable``: both under ``COMFORT_ACCEL`` / ``COMFORT_JERK``;
    - ``progress``: x travelled; ``end_speed``: the last step's distance over DT;
    - ``behaviour_ok``: *follow*: in its own lane throughout, never closer than ``MIN_FOLLOW_GAP``
      to the lead, and keeping up: ending at most ``FOLLOW_HEADWAY`` seconds (at its end speed)
      behind the lead, or at an end speed of at least the lead's (at most the limit) - 1 m/s; *overtake left*: its centre in lane 1 at some step,
      its rear past the lead's front at the end; *brake to stop*: ``end_speed`` <= ``STOPPED_SPEED``,
      ending in lane 0 behind the lead's rear; *keep lane*: in its own lane throughout;
      *change lane*: ending in lane 1, on the road;
    - ``success``: ``behaviour_ok`` and no collision and on the road.
    """
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; one of {', '.join(BEHAVIOURS)}")
    traj = np.asarray(trajectory, dtype=np.float64)
    if traj.ndim != 2 or traj.shape[0] != STEPS or traj.shape[1] < 2:
        raise ValueError(f"a trajectory is [{STEPS}, >= 2] (x, y, ...), got {traj.shape}")
    xy = traj[:, :2]
    d = np.gradient(xy, DT, axis=0)
    heading = np.arctan2(d[:, 1], d[:, 0])  # a stopped ego (0, 0) reads as heading 0
    c, s = np.abs(np.cos(heading)), np.abs(np.sin(heading))
    half_x, half_y = LENGTH / 2 * c + WIDTH / 2 * s, LENGTH / 2 * s + WIDTH / 2 * c
    clearance = np.inf
    for track in agent_tracks(scene).values():
        sep_x = np.abs(xy[:, 0] - track[:, 0]) - (half_x + LENGTH / 2)
        sep_y = np.abs(xy[:, 1] - track[:, 1]) - (half_y + WIDTH / 2)
        clearance = min(clearance, float(np.maximum(sep_x, sep_y).min()))
    on_road = bool(((xy[:, 1] - half_y >= ROAD_Y[0]) & (xy[:, 1] + half_y <= ROAD_Y[1])).all())
    lane0 = (LANE_CENTRES[0] - LANE_WIDTH / 2 - 0.1, LANE_CENTRES[0] + LANE_WIDTH / 2 + 0.1)
    in_own_lane = bool(((xy[:, 1] - half_y >= lane0[0]) & (xy[:, 1] + half_y <= lane0[1])).all())
    final_lane = _lane_of(float(xy[-1, 1]))
    acc = np.diff(xy, n=2, axis=0) / DT**2
    jerk = np.diff(xy, n=3, axis=0) / DT**3
    peak_accel, peak_jerk = float(np.linalg.norm(acc, axis=1).max()), float(np.linalg.norm(jerk, axis=1).max())
    end_speed = float(np.linalg.norm(xy[-1] - xy[-2]) / DT)

    lead = agent_tracks(scene)["obstacle" if scene.obstacle else "lead"]
    gaps = lead[:, 0] - xy[:, 0] - LENGTH  # bumper to bumper, along the road
    ego_rear, ego_front = xy[-1, 0] - LENGTH / 2, xy[-1, 0] + LENGTH / 2
    lead_front, lead_rear = lead[-1, 0] + LENGTH / 2, lead[-1, 0] - LENGTH / 2
    if behaviour == "follow":
        kept_up = gaps[-1] <= FOLLOW_HEADWAY * max(end_speed, 1.0) or end_speed >= min(scene.lead_speed, SPEED_LIMIT) - 1.0
        ok = in_own_lane and gaps.min() >= MIN_FOLLOW_GAP and kept_up
    elif behaviour == "overtake left":
        went_left = any(_lane_of(float(y)) == 1 for y in xy[:, 1])
        ok = went_left and ego_rear > lead_front
    elif behaviour == "brake to stop":
        ok = end_speed <= STOPPED_SPEED and final_lane == 0 and ego_front <= lead_rear
    elif behaviour == "keep lane":
        ok = in_own_lane
    else:  # change lane
        ok = final_lane == 1 and on_road
    collision = clearance < 0
    return {
        "collision": bool(collision), "min_clearance": clearance, "on_road": on_road, "in_own_lane": in_own_lane,
        "final_lane": final_lane, "peak_accel": peak_accel, "peak_jerk": peak_jerk,
        "comfortable": peak_accel <= COMFORT_ACCEL and peak_jerk <= COMFORT_JERK, "progress": float(xy[-1, 0] - xy[0, 0]),
        "end_speed": end_speed, "behaviour_ok": bool(ok), "success": bool(ok and not collision and on_road),
    }  # fmt: skip


# 4. the picture

PIXELS_PER_M_X, PIXELS_PER_M_Y = 8.0, 12.0  # across the road stretched: lanes stay readable
_TRACE_COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
                  (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))  # fmt: skip


def draw(scene: Scene, trajectories: dict[str, np.ndarray], x_range: Optional[tuple[float, float]] = None) -> Image.Image:
    """The road from above (x to the right, lane 1 at the top), the vehicles at t = 0 (filled)
    and at the horizon's end (outlined), and each trajectory a polyline in its own colour, labelled
    at its end and in the legend. ``x_range`` (m): the stretch of road shown (default: all of it
    that anything reaches)."""
    tracks = agent_tracks(scene)
    if x_range is None:
        xs = [-10.0] + [float(t[:, 0].max()) + LENGTH for t in tracks.values()]
        xs += [float(np.asarray(tr)[:, 0].max()) + LENGTH for tr in trajectories.values()]
        x_range = (-10.0, min(max(xs), 300.0))
    margin_top, legend_h = 10, 16 * max(1, len(trajectories)) + 10
    width = int((x_range[1] - x_range[0]) * PIXELS_PER_M_X) + 20
    road_h = (ROAD_Y[1] - ROAD_Y[0]) * PIXELS_PER_M_Y
    height = int(road_h) + 2 * margin_top + legend_h
    image = Image.new("RGB", (width, height), (245, 245, 240))
    d = ImageDraw.Draw(image)
    font = ImageFont.load_default()

    def px(x: float, y: float) -> tuple[float, float]:
        return 10 + (x - x_range[0]) * PIXELS_PER_M_X, margin_top + (ROAD_Y[1] - y) * PIXELS_PER_M_Y

    d.rectangle([px(x_range[0], ROAD_Y[1]), px(x_range[1], ROAD_Y[0])], fill=(90, 90, 90))
    for y in ROAD_Y:
        d.line([px(x_range[0], y), px(x_range[1], y)], fill=(250, 250, 250), width=2)
    mid = LANE_WIDTH / 2
    x = x_range[0]
    while x < x_range[1]:  # dashed centre line: 3 m dash, 6 m gap
        d.line([px(x, mid), px(min(x + 3.0, x_range[1]), mid)], fill=(250, 230, 60), width=2)
        x += 9.0

    def box(cx: float, cy: float, fill, outline) -> None:
        (x0, y0), (x1, y1) = px(cx - LENGTH / 2, cy + WIDTH / 2), px(cx + LENGTH / 2, cy - WIDTH / 2)
        d.rectangle([x0, y0, x1, y1], fill=fill, outline=outline, width=2)

    # vehicles in colours no trace takes: a pale lead, a black obstacle, a pale yellow oncoming car
    colours = {"lead": (225, 225, 225), "obstacle": (20, 20, 20), "oncoming": (250, 220, 120)}
    for name, track in tracks.items():
        box(*track[-1], None, colours[name])
        box(*track[0], colours[name], (255, 255, 255))
    box(0.0, scene.ego_y, (60, 120, 230), (255, 255, 255))
    for i, (label, traj) in enumerate(trajectories.items()):
        colour = _TRACE_COLOURS[i % len(_TRACE_COLOURS)]
        xy = np.asarray(traj, dtype=np.float64)[:, :2]
        d.line([px(float(a), float(b)) for a, b in xy], fill=colour, width=2)
        box(float(xy[-1, 0]), float(xy[-1, 1]), None, colour)
        end = px(float(xy[-1, 0]) + LENGTH / 2 + 1, float(xy[-1, 1]))
        d.text((end[0], end[1] - 6), label, fill=colour, font=font)
        ly = margin_top * 2 + road_h + 16 * i
        d.line([(12, ly + 6), (32, ly + 6)], fill=colour, width=3)
        d.text((38, ly), label, fill=(20, 20, 20), font=font)
    return image
