"""Pipeline schedules, partitions and timelines as data: no training here."""

import numpy as np
import pytest

from dist_loop.core.errors import UserError
from dist_loop.parallel.modes.pipeline import action as action_lib
from dist_loop.parallel.modes.pipeline import partition, simulator, timeline
from dist_loop.parallel.modes.pipeline import schedule as sl


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
  # Equal chunks, backward twice the forward: idle = (K-1)/(M+K-1).
  bars = simulator.simulate(sl.make(name, k, m)).bars
  span = max(end for _, _, _, end in bars)
  busy = sum(end - start for _, _, start, end in bars)
  assert 1 - busy / (k * span) == pytest.approx(sl.bubble_formula(k, m))


def test_bad_schedules_are_rejected():
  with pytest.raises(UserError, match="chunk 1 .* exactly once.*: F$"):
    sl.validate([[sl.F(0), sl.B(0)], [sl.F(0)]], 2, 1)
  with pytest.raises(UserError, match="in that order.*: B F"):
    sl.validate([[sl.B(0), sl.F(0)]], 1, 1)
  with pytest.raises(UserError, match="in that order.*: F W I"):
    sl.validate([[sl.F(0), sl.W(0), sl.I(0)]], 1, 1)
  with pytest.raises(UserError, match="device 0 runs F0 of chunk 1, which "
                                      "is on device 1"):
    sl.validate(sl.Schedule.of([[sl.F(0, 1)], [sl.F(0, 0)]], [0, 1]), 2, 1)
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
  assert "device 1 (chunks 1): F0 F1 B0 B1" in sl.format_schedule(
      sl.make("test_all_f_then_b_in_order", 2, 2))
  with pytest.raises(UserError, match="one chunk of layers on each device"):
    sl.make("test_all_f_then_b_in_order", 2, 2, virtual_stages=2)


def test_balance_minimises_the_largest_chunk():
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
  with pytest.raises(UserError, match="gives 3 chunks but --num_stages=2 "
                                      "needs 2"):
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
  schedule = sl.make("1f1b", 2, 4)
  order = {(d, a): (s, e) for d, a, s, e in bars}
  starts = np.array([[order[(d, a)][0] for a in row]
                     for d, row in enumerate(schedule)]) + 100.0
  ends = np.array([[order[(d, a)][1] for a in row]
                   for d, row in enumerate(schedule)]) + 100.0
  measured = timeline.bars_from_timestamps(schedule, starts, ends)
  assert sorted(measured, key=str) == sorted(bars, key=str)


def test_choose_takes_the_declared_split_only_for_auto():
  from dist_loop import models  # pylint: disable=g-import-not-at-top
  layers = models.build("mlp", (10,), 10).layers  # flatten, dense_1, logits
  seconds = [0.0, 1.0, 5.0]
  spans, how = partition.choose("auto", layers, 2, "", (1,), seconds)
  assert how == "the model's own split"
  assert [s.layer_names for s in spans] == [("flatten",),
                                             ("dense_1", "logits")]
  spans, how = partition.choose("auto", layers, 2, "", None, seconds)
  assert how == "measured time" and [s.end for s in spans] == [2, 3]
  assert [s.seconds for s in spans] == [1.0, 5.0]
  # dense_1 has 1408 parameters, logits 1290: balanced, they part.
  spans, how = partition.choose("params", layers, 2, "", (1,), seconds)
  assert how == "params" and [s.end for s in spans] == [2, 3]
  spans, how = partition.choose("explicit", layers, 3, "1,2", None, seconds)
  assert [s.params for s in spans] == [0, 1408, 1290]
  with pytest.raises(UserError, match="gives 2 chunks but zbv needs 3"):
    partition.choose("explicit", layers, 3, "1", None, seconds, "zbv")
  with pytest.raises(UserError, match="needs 4 chunks of layers but the "
                                      "model has only 3"):
    partition.choose("params", layers, 4, "", None, seconds + [0.0])


# -- the v2 schedules, as data --

def _bubble(name, k, m, v=0):
  schedule = sl.make(name, k, m, v)
  vs = schedule.virtual_stages  # A chunk is 1/V of a device's layers.
  costs = simulator.ChunkCosts.unit(schedule.num_chunks, 1.0 / vs, 2.0 / vs)
  return simulator.simulate(schedule, costs)


@pytest.mark.parametrize("k,m", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 6)])
def test_interleaving_divides_the_bubble_by_v(k, m):
  for v in (2, 3):
    assert _bubble("interleaved_1f1b", k, m, v).bubble == pytest.approx(
        (k - 1) / (v * m + k - 1))


@pytest.mark.parametrize("k,m", [(2, 2), (2, 4), (3, 5), (4, 8), (4, 16)])
def test_zb_h1_bubble_is_a_third_at_1f1b_peak_memory(k, m):
  prediction = _bubble("zb_h1", k, m)
  # With F = I = W: (K-1)/(3M+K-1), against 1F1B's (K-1)/(M+K-1).
  assert prediction.bubble == pytest.approx((k - 1) / (3 * m + k - 1))
  assert max(prediction.peak_live) == max(_bubble("1f1b", k, m).peak_live)


@pytest.mark.parametrize("k,m", [(2, 4), (3, 6), (4, 4), (4, 16)])
def test_zbv_leaves_only_the_first_forwards_idle(k, m):
  prediction = _bubble("zbv", k, m)
  schedule = sl.make("zbv", k, m)
  assert schedule.placement == tuple(range(k)) + tuple(reversed(range(k)))
  # Device K-1 waits K-1 chunk forwards (1/6 of a stage's F+I+W each).
  assert prediction.bubble == pytest.approx((k - 1) / (6 * m + k - 1))
  # 2K half-stage activations: 1F1B's peak in bytes.
  assert max(prediction.peak_live) <= 2 * k


def test_zero_bubble_schedules_split_the_backward():
  zb = sl.make("zb_h1", 2, 4)
  assert [" ".join(map(str, row)) for row in zb] == [
      "F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3",
      "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3",
  ]
  assert sl.make("zbv", 2, 4).kinds() == {"F", "I", "W"}
  interleaved = sl.make("interleaved_1f1b", 2, 4)
  assert interleaved.placement == (0, 1, 0, 1)
  assert sl.format_schedule(interleaved).splitlines()[0] == (
      "device 0 (chunks 0,2): F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 "
      "B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0")


def test_the_simulator_follows_measured_costs_and_counts_memory():
  schedule = sl.make("1f1b", 2, 4)
  costs = simulator.ChunkCosts(
      forward=(1.0, 3.0), input_grad=(1.0, 1.0), weight_grad=(1.0, 1.0),
      backward=(2.0, 6.0), activation_bytes=(100.0, 10.0),
      weight_grad_bytes=(50.0, 5.0), input_bytes=(4.0, 4.0))
  prediction = simulator.simulate(schedule, costs)
  # The slow second stage paces the pipeline: stage 0's first F, then
  # 4 x (3 + 6), then stage 0's last B.
  assert prediction.step_time == pytest.approx(1 + 4 * 9 + 2)
  assert prediction.peak_live == [2, 1]
  assert prediction.peak_bytes == [200.0, 10.0]
  recompute = simulator.simulate(schedule, simulator.ChunkCosts(
      **{**costs.__dict__, "recomputes": (True, True)}))
  # Each F keeps its input; a backward holds the recomputed activations.
  assert recompute.peak_bytes == [2 * 4.0 + 100.0, 4.0 + 10.0]
  moved = simulator.simulate(schedule, simulator.ChunkCosts(
      **{**costs.__dict__, "transfer": 0.5}))
  assert moved.step_time > prediction.step_time


def _shared(schedule, cores, **overrides):
  costs = simulator.ChunkCosts.unit(schedule.num_chunks)
  return simulator.simulate(schedule, simulator.ChunkCosts(
      **{**costs.__dict__, "cores": cores, **overrides}))


@pytest.mark.parametrize("name,k,m", [("1f1b", 4, 8), ("zb_h1", 2, 4),
                                      ("zbv", 2, 4)])
def test_shared_cores_slow_only_what_runs_at_once(name, k, m):
  schedule = sl.make(name, k, m)
  alone = simulator.simulate(schedule)
  # One core per device: nothing is shared, to the last bit.
  assert _shared(schedule, float(k)).bars == alone.bars
  # One core for all: the devices take turns, so the step is the sum of
  # all the work, F = 1 and B = 2 per chunk and micro-batch.
  one = _shared(schedule, 1.0)
  assert one.step_time == pytest.approx(3.0 * m * schedule.num_chunks)
  # Fewer cores than devices: slower than alone, faster than one core.
  if k > 2:
    two = _shared(schedule, 2.0)
    assert alone.step_time < two.step_time < one.step_time
  for prediction in (one, alone):  # Every device still keeps its order.
    for d, row in enumerate(schedule.devices):
      assert [a for dev, a, _, _ in sorted(prediction.bars,
                                           key=lambda b: b[2])
              if dev == d] == list(row)


def _list_simulation(schedule, costs):
  """The plain list simulation: start = max(device free, inputs + transfer),
  end = start + seconds. The event loop must equal it to the last bit."""
  free, done, bars = [0.0] * schedule.num_devices, {}, []
  for d, action in sl.execution_order(schedule):
    start = free[d]
    for need in action_lib.needs(action, schedule.num_chunks):
      end, device = done[need]
      start = max(start, end + (costs.transfer if device != d else 0.0))
    end = start + costs.seconds(action)
    for key in action_lib.provides(action):
      done[key] = (end, d)
    free[d] = end
    bars.append((d, action, start, end))
  return bars


@pytest.mark.parametrize("transfer", [0.0, 0.37])
def test_the_event_loop_equals_the_list_simulation_without_sharing(transfer):
  rng = np.random.RandomState(0)
  for name in sl.SCHEDULES.names():
    for k in (2, 3, 4):
      for m in (1, 3, 4, 8):
        try:
          schedule = sl.make(name, k, m)
        except UserError:
          continue  # Not defined for (K, M).
        n = schedule.num_chunks
        f, i, w = (tuple(rng.uniform(0.1, 2.0, n)) for _ in range(3))
        costs = simulator.ChunkCosts(
            f, i, w, tuple(a + b for a, b in zip(i, w)), transfer=transfer)
        got = sorted(simulator.simulate(schedule, costs).bars,
                     key=lambda b: (b[0], b[2]))
        assert got == sorted(_list_simulation(schedule, costs),
                             key=lambda b: (b[0], b[2])), (name, k, m)


def test_zero_times_and_bad_cores():
  # A chunk without variables may time its W at 0 (below the clock's
  # resolution): it still ends, at once, beside other work.
  schedule = sl.make("zb_h1", 2, 4)
  costs = simulator.ChunkCosts.unit(2)
  zero_w = simulator.ChunkCosts(
      **{**costs.__dict__, "weight_grad": (0.0, 1.0), "cores": 2.0,
         "crowded": ((1.5, 1.5, 0.5, 3.0),) * 2})
  assert simulator.simulate(schedule, zero_w).step_time > 0
  with pytest.raises(ValueError, match="cores must be positive"):
    simulator.ChunkCosts(**{**costs.__dict__, "cores": 0.0})


def test_crowded_actions_take_their_crowded_time():
  # Two devices, GPipe, one micro-batch each way: F0 on device 0, then F0
  # on device 1, B0 on 1, B0 on 0: never two at once, so all alone.
  schedule = sl.make("gpipe", 2, 1)
  # (F, I, W, B): twice as slow while another action runs.
  crowded = ((2.0, 1.0, 1.0, 4.0),) * 2
  alone = _shared(schedule, 2.0, crowded=crowded)
  assert alone.step_time == pytest.approx(2 * (1 + 2))
  # Two micro-batches: F1 on device 0 runs beside F0 on device 1 (both at
  # half speed), then the backward overlaps likewise.
  both = _shared(sl.make("gpipe", 2, 2), 2.0, crowded=crowded)
  plain = simulator.simulate(sl.make("gpipe", 2, 2))
  assert both.step_time > plain.step_time
  # Device 0 runs F0 F1 B1 B0, device 1 F0' F1' B1' B0': F0 alone (1),
  # F1 | F0' crowded (2), F1' alone (1), B1' alone (2), B1 | B0' crowded
  # (4), B0 alone (2).
  assert both.step_time == pytest.approx(1 + 2 + 1 + 2 + 4 + 2)


def test_timeline_draws_input_and_weight_gradients_and_chunks():
  schedule = sl.make("zbv", 2, 4)
  bars = timeline.bars_from_simulation(schedule)
  image = timeline.render_many([(bars, "ZBV"), (bars[:4], "PART")], schedule,
                               width=300)
  colours = {tuple(c) for c in image.reshape(-1, 3)}
  for kind in ("F", "I", "W"):
    assert timeline.COLORS[kind] in colours  # First chunks.
  assert tuple(int(c * 0.6) for c in timeline.COLORS["W"]) in colours
