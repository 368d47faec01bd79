"""Pipeline schedules, partitions and timelines as data: no training here."""

import numpy as np
import pytest

from dist_loop.errors import UserError
from dist_loop.modes.pipeline import partition, timeline
from dist_loop.modes.pipeline import schedule as sl


def text(schedule):
  return [" ".join(map(str, actions)) for actions in schedule]


def test_gpipe_order_k2_m4():
  assert text(sl.make("gpipe", 2, 4)) == [
      "F0 F1 F2 F3 B3 B2 B1 B0",
      "F0 F1 F2 F3 B3 B2 B1 B0",
  ]


def test_1f1b_order_k2_m4():
  assert text(sl.make("1f1b", 2, 4)) == [
      "F0 F1 B0 F2 B1 F3 B2 B3",
      "F0 B0 F1 B1 F2 B2 F3 B3",
  ]


def test_1f1b_order_k4_m6():
  assert text(sl.make("1f1b", 4, 6)) == [
      "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
      "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
      "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
      "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
  ]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_1f1b_holds_at_most_k_microbatches(k, m):
  one_f_one_b = sl.make("1f1b", k, m)
  assert sl.peak_activations(one_f_one_b[0]) == min(k, m)
  for stage, actions in enumerate(one_f_one_b):
    assert sl.peak_activations(actions) <= k - stage
  assert sl.peak_activations(sl.make("gpipe", k, m)[0]) == m


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k,m", [(2, 1), (2, 4), (3, 5), (4, 16)])
def test_simulated_bubble_is_the_formula(name, k, m):
  # Equal stages, backward twice the forward: idle = (K-1)/(M+K-1).
  runs = sl.simulate(sl.make(name, k, m), 1.0, 2.0)
  span = max(end for row in runs for _, _, end in row)
  busy = sum(end - start for row in runs for _, start, end in row)
  assert 1 - busy / (k * span) == pytest.approx(sl.bubble_formula(k, m))


def test_bad_schedules_are_rejected():
  with pytest.raises(UserError, match="exactly once"):
    sl.validate([[sl.F(0), sl.B(0)], [sl.F(0)]], 2, 1)
  with pytest.raises(UserError, match="B0 before F0"):
    sl.validate([[sl.B(0), sl.F(0)]], 1, 1)
  # Stage 0 waits for B0 before F1, but stage 1 runs F1 (needs stage 0's F1)
  # before B0: neither can go on.
  with pytest.raises(UserError, match="deadlocks"):
    sl.validate([[sl.F(0), sl.B(0), sl.F(1), sl.B(1)],
                 [sl.F(1), sl.F(0), sl.B(0), sl.B(1)]], 2, 2)
  with pytest.raises(UserError, match="unknown --pipeline_schedule"):
    sl.make("zigzag", 2, 4)


@sl.SCHEDULES.register("test_all_f_then_b_in_order")
def _in_order(num_stages, num_microbatches):
  return [[sl.F(i) for i in range(num_microbatches)]
          + [sl.B(i) for i in range(num_microbatches)]
          for _ in range(num_stages)]


def test_a_registered_schedule_is_usable():
  assert text(sl.make("test_all_f_then_b_in_order", 2, 2)) == [
      "F0 F1 B0 B1", "F0 F1 B0 B1"]
  assert "stage 1: F0 F1 B0 B1" in sl.format_schedule(
      sl.make("test_all_f_then_b_in_order", 2, 2))


def test_balance_minimises_the_largest_stage():
  assert partition.balance([1, 1, 1, 1], 2) == [2]
  assert partition.balance([5, 1, 1, 1, 1, 1], 2) == [1]
  assert partition.balance([1, 2, 3, 4, 5, 6], 3) == [3, 5]
  # Every stage gets a layer even if costs say otherwise.
  assert partition.balance([0, 0, 9], 3) == [1, 2]


def test_split_points_are_checked():
  assert partition.parse_split_points("2, 4") == [2, 4]
  with pytest.raises(UserError, match="comma-separated"):
    partition.parse_split_points("2;4")
  with pytest.raises(UserError, match=r"out of range.*1\.\.4"):
    partition.check_split_points([5], 2, 5)
  with pytest.raises(UserError, match="gives 3 stages"):
    partition.check_split_points([1, 2], 2, 5)
  with pytest.raises(UserError, match="strictly increasing"):
    partition.check_split_points([3, 2], 3, 5)


def test_timeline_draws_forwards_and_backwards():
  bars = timeline.bars_from_simulation(sl.make("1f1b", 2, 4))
  image = timeline.render(bars, 2, width=400)
  assert image.dtype == np.uint8 and image.shape[1:] == (400, 3)
  colours = {tuple(c) for c in image.reshape(-1, 3)}
  assert (66, 133, 244) in colours and (52, 168, 83) in colours
  # Measured timestamps in schedule order give the same bars.
  starts = np.array([[s for _, s, _ in row] for row in sl.simulate(
      sl.make("1f1b", 2, 4))]) + 100.0
  ends = np.array([[e for _, _, e in row] for row in sl.simulate(
      sl.make("1f1b", 2, 4))]) + 100.0
  measured = timeline.bars_from_timestamps(sl.make("1f1b", 2, 4), starts,
                                           ends)
  assert sorted(measured, key=str) == sorted(bars, key=str)


def test_choose_takes_the_declared_split_only_for_auto():
  from dist_loop import models  # pylint: disable=g-import-not-at-top
  layers = models.build("mlp", (10,), 10).layers  # flatten, dense_1, logits
  stages, how = partition.choose("auto", layers, 2, "", (1,), (10,), 4)
  assert how == "the model's own split"
  assert [s.layer_names for s in stages] == [("flatten",),
                                             ("dense_1", "logits")]
  # dense_1 has 1408 parameters, logits 1290: balanced, they part.
  stages, how = partition.choose("params", layers, 2, "", (1,), (10,), 4)
  assert how == "params" and [s.end for s in stages] == [2, 3]
  stages, how = partition.choose("explicit", layers, 3, "1,2", None, (10,), 4)
  assert [s.params for s in stages] == [0, 1408, 1290]
  with pytest.raises(UserError, match="gives 2 stages"):
    partition.choose("explicit", layers, 3, "1", None, (10,), 4)
