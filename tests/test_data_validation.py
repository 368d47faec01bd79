"""Bad data: every file either loads into a dataset a model can train on, or
is refused before training in one line naming the file and the fix.

`data.load` checks what any loader returns (`data/base.py: check`); mnist
and text check what their own formats need first. The fuzz writes seeded
variants of an mnist.npz (truncated, wrong shapes, wrong types, labels out
of range, empty, ...) and of a text file, and loads each: anything but a
clean dataset or one `UserError` line fails the test. A few go through the
entry point, for the exit code, the one `error:` line, and a workdir that a
refused run did not create.
"""

import io
import os
import random
import re

import numpy as np
import pytest

from conftest import run_main
from helpers import load_data
from dist_loop import data, make_config
from dist_loop.core.errors import UserError
from dist_loop.data import base
from dist_loop.data.base import Dataset

SEED = 20260117


# -- the rules every dataset shares --


def _good(**changes):
  rng = np.random.RandomState(0)
  fields = dict(train_x=rng.randn(8, 3).astype(np.float32),
                train_y=np.arange(8, dtype=np.int32) % 4,
                eval_x=rng.randn(2, 3).astype(np.float32),
                eval_y=np.array([0, 3], np.int32), num_classes=4,
                source="/data/set.npz")
  fields.update(changes)
  return Dataset(**fields)


BAD = {
    "no_train_examples": (
        dict(train_x=np.zeros((0, 3), np.float32),
             train_y=np.zeros(0, np.int32)),
        "there are no train examples"),
    "no_eval_examples": (
        dict(eval_x=np.zeros((0, 3), np.float32),
             eval_y=np.zeros(0, np.int32)),
        "there are no eval examples"),
    "inputs_of_rank_1": (
        dict(train_x=np.zeros(8, np.float32)),
        r"the train inputs have shape \(8,\), not \[examples, features...\]"),
    "an_empty_feature_axis": (
        dict(train_x=np.zeros((8, 0), np.float32)),
        r"the train inputs have shape \(8, 0\)"),
    "fewer_labels": (dict(train_y=np.zeros(7, np.int32)),
                     "8 train inputs but 7 labels"),
    "eval_of_another_shape": (
        dict(eval_x=np.zeros((2, 4), np.float32)),
        r"the eval inputs' examples have shape \(4,\), the train inputs' "
        r"\(3,\)"),
    "string_inputs": (dict(train_x=np.full((8, 3), "a")),
                      "the train inputs are of type <U1, not numbers"),
    "float_labels": (dict(eval_y=np.array([0.0, 1.5])),
                     "the eval labels are of type float64, not integers"),
    "labels_of_another_shape": (
        dict(train_y=np.zeros((8, 2), np.int32)),
        r"the train labels have shape \(8, 2\): one per example \(8,\) or "
        r"one per input position \(8, 3\)"),
    "a_label_too_large": (dict(train_y=np.full(8, 4, np.int32)),
                          "train label 4 is outside the 4 classes 0..3"),
    "a_negative_label": (dict(eval_y=np.array([0, -1], np.int32)),
                         "eval label -1 is outside the 4 classes"),
    "no_classes": (dict(num_classes=0),
                   "num_classes is 0, not a positive integer"),
    "a_list_not_an_array": (dict(eval_y=[0, 1]),
                            "eval_y is a list, not an array"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_dataset_no_model_can_train_on_is_refused_naming_its_file(case):
  changes, expected = BAD[case]
  with pytest.raises(UserError) as info:
    base.check(_good(**changes), "set")
  message = str(info.value)
  assert message.startswith("/data/set.npz: ") and "\n" not in message
  assert re.search(expected, message), message
  assert message.endswith("; replace the file with a valid one")


def test_a_loader_of_data_made_in_code_is_named_instead_of_a_file():
  with pytest.raises(UserError, match=r"^the loader of --dataset=set: there "
                     r"are no eval examples; fix that loader$"):
    base.check(_good(source="", eval_x=np.zeros((0, 3), np.float32),
                     eval_y=np.zeros(0, np.int32)), "set")


def test_what_every_dataset_needs_and_no_more_passes():
  base.check(_good(), "set")
  base.check(_good(train_x=np.full((8, 3), np.nan, np.float32)), "set")
  tokens = np.arange(20, dtype=np.int32).reshape(4, 5) % 7
  base.check(Dataset(tokens, tokens, tokens[:1], tokens[:1], 7,
                     task="language_model"), "text")  # A label per position.
  for name in ("synthetic", "digits"):
    base.check(data.DATASETS.get(name)(None, 0, 28), name)


def test_labels_become_int32_only_when_no_value_changes():
  assert base.int32_labels(np.array([3, 9], np.uint8)).dtype == np.int32
  huge = np.array([1, 2**32 + 3], np.int64)  # Cast, it would read 3.
  assert base.int32_labels(huge) is huge
  with pytest.raises(UserError, match=f"label {2**32 + 3} is outside"):
    base.check(_good(train_y=np.resize(huge, 8)), "set")


# -- mnist.npz, fuzzed --


def _mnist_arrays(rng, n_train=12, n_test=4):
  return dict(
      x_train=rng.randint(0, 256, (n_train, 28, 28)).astype(np.uint8),
      y_train=rng.randint(0, 10, n_train).astype(np.uint8),
      x_test=rng.randint(0, 256, (n_test, 28, 28)).astype(np.uint8),
      y_test=rng.randint(0, 10, n_test).astype(np.uint8))


def _npz(arrays) -> bytes:
  out = io.BytesIO()
  np.savez(out, **arrays)
  return out.getvalue()


def _spoil(rng, arrays, how):
  """(the file's bytes, the words its refusal must contain, or None if it
  must load)."""
  key = ["x_train", "y_train", "x_test", "y_test"][rng.randint(4)]
  x_key, y_key = [("x_train", "y_train"), ("x_test", "y_test")][
      rng.randint(2)]
  good = _npz(arrays)
  if how == "intact":
    return good, None
  if how == "truncated":
    return good[:rng.randint(1, len(good) - 1)], "cannot be read as mnist.npz"
  if how == "random_bytes":
    return bytes(rng.randint(0, 256, rng.randint(0, 3000)).astype(
        np.uint8)), "cannot be read as mnist.npz"
  if how == "a_single_array":
    out = io.BytesIO()
    np.save(out, arrays["x_train"])
    return out.getvalue(), "a single array, not an .npz archive"
  if how == "a_missing_key":
    return _npz({k: v for k, v in arrays.items() if k != key}), f"no {key}"
  if how == "flat_images":
    arrays[x_key] = arrays[x_key].reshape(len(arrays[x_key]), -1)[:, 0]
    return _npz(arrays), f"{x_key} is uint8 of shape"
  if how == "images_of_rank_4":
    arrays[x_key] = arrays[x_key][..., None]
    return _npz(arrays), "not images [n, height, width]"
  if how == "empty_images":
    arrays[x_key] = np.zeros((3, 0, 28), np.uint8)
    return _npz(arrays), "not images [n, height, width]"
  if how == "string_images":
    arrays[x_key] = np.full((3, 28, 28), "x")
    return _npz(arrays), "not images"
  if how == "object_arrays":
    arrays[key] = np.array([None, 1], dtype=object)
    return _npz(arrays), "cannot be read as mnist.npz"
  if how == "no_examples":
    arrays[x_key], arrays[y_key] = (np.zeros((0, 28, 28), np.uint8),
                                    np.zeros(0, np.uint8))
    return _npz(arrays), "there are no"
  if how == "label_10_or_more":
    arrays[y_key] = arrays[y_key].copy()
    arrays[y_key][rng.randint(len(arrays[y_key]))] = rng.randint(10, 256)
    return _npz(arrays), "outside the 10 classes 0..9"
  if how == "negative_labels":
    arrays[y_key] = arrays[y_key].astype(np.int64) - 20
    return _npz(arrays), "outside the 10 classes 0..9"
  if how == "float_labels":
    arrays[y_key] = arrays[y_key] + 0.5
    return _npz(arrays), "labels are of type float64, not integers"
  if how == "labels_of_rank_2":
    arrays[y_key] = arrays[y_key][:, None]
    return _npz(arrays), "labels have shape"
  if how == "fewer_labels":
    arrays[y_key] = arrays[y_key][:-1]
    return _npz(arrays), "labels"
  if how == "other_image_size":  # Resized to the model's 28x28 if it asks.
    arrays["x_train"] = arrays["x_train"][:, :20, :24]
    arrays["x_test"] = arrays["x_test"][:, :20, :24]
    return _npz(arrays), None
  raise AssertionError(how)


SPOILS = ("intact", "truncated", "random_bytes", "a_single_array",
          "a_missing_key", "flat_images", "images_of_rank_4", "empty_images",
          "string_images", "object_arrays", "no_examples", "label_10_or_more",
          "negative_labels", "float_labels", "labels_of_rank_2",
          "fewer_labels", "other_image_size")
NUM_FILES = 60


def _fuzzed_files():
  rng = np.random.RandomState(SEED)
  cases = [SPOILS[i % len(SPOILS)] for i in range(NUM_FILES)]
  random.Random(SEED).shuffle(cases)
  return [(i, how, *_spoil(rng, _mnist_arrays(rng), how))
          for i, how in enumerate(cases)]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_fuzzed_mnist_files_load_or_are_refused_in_one_line(tmp_path, model):
  outcomes = {}
  for i, how, content, refusal in _fuzzed_files():
    directory = tmp_path / f"file{i}"
    directory.mkdir()
    (directory / "mnist.npz").write_bytes(content)
    config = make_config(workdir=str(tmp_path / "run"), dataset="mnist",
                         model=model, data_dir=str(directory))
    try:
      split = load_data(config)
    except UserError as e:
      message = str(e)
      assert "\n" not in message, (how, message)
      assert message.startswith(str(directory / "mnist.npz")), (how, message)
      assert refusal is not None and refusal in message, (how, message)
      outcomes[how] = "refused"
      continue
    assert refusal is None, (how, "loaded")
    image = (28, 28, 1) if model == "cnn" else split.train_x.shape[1:]
    assert split.train_x.shape[1:] == split.eval_x.shape[1:] == image
    outcomes[how] = "loaded"
  assert set(outcomes) == set(SPOILS)  # Every kind of damage was tried.


@pytest.mark.parametrize("make, kind", [
    (os.mkfifo, "a FIFO, device or socket"),
    (lambda path: os.symlink("/dev/zero", path), "a FIFO, device or socket"),
    (os.mkdir, "a directory")])
def test_an_mnist_npz_that_is_no_regular_file_is_named_not_opened(
    tmp_path, monkeypatch, make, kind):
  """A FIFO (opening it would block), a link to /dev/zero (reading it
  would never end) or a directory is there, and no mnist.npz in Keras's
  own directory: it is named as what it is, not "not found"."""
  monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
  path = tmp_path / "mnist.npz"
  make(str(path))
  config = make_config(workdir=str(tmp_path / "run"), dataset="mnist",
                       model="mlp", data_dir=str(tmp_path))
  with pytest.raises(UserError) as raised:
    load_data(config)
  assert str(raised.value) == (
      f"{path} is not a regular file ({kind}); put the standard mnist.npz "
      "there, or pass --data_dir=DIR that holds it")
  assert not (tmp_path / "run").exists()


def test_a_bad_mnist_is_refused_at_the_door_and_a_good_one_trains(tmp_path):
  rng = np.random.RandomState(1)
  arrays = _mnist_arrays(rng, n_train=64, n_test=16)
  bad = dict(arrays, y_train=np.full(64, 12, np.uint8))
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "mnist.npz").write_bytes(_npz(bad))
  common = ["--dataset=mnist", "--model=mlp", "--global_batch_size=16",
            "--train_steps=2", "--steps_per_loop=2", "--log_every=2",
            "--eval_every=2", "--checkpoint_every=2"]
  code, out, err = run_main(*common, f"--data_dir={tmp_path / 'bad'}",
                            f"--workdir={tmp_path / 'refused'}")
  assert code == 1, (out, err)
  assert [l for l in err.splitlines() if l.strip()] == [
      f"error: {tmp_path}/bad/mnist.npz: train label 12 is outside the 10 "
      "classes 0..9; replace the file with a valid one"]
  assert not (tmp_path / "refused").exists()
  (tmp_path / "good").mkdir()
  (tmp_path / "good" / "mnist.npz").write_bytes(_npz(arrays))
  code, out, err = run_main(*common, f"--data_dir={tmp_path / 'good'}",
                            f"--workdir={tmp_path / 'trained'}")
  assert code == 0, err
  assert "done: step 2" in out


# -- --data_file, fuzzed --


def _text_cases(tmp_path):
  """(path, seq_len, the words of its refusal or None)."""
  rng = random.Random(SEED)
  cases = []
  for i in range(30):
    seq_len = rng.choice([1, 4, 16, 64])
    need = 20 * seq_len + 1
    size = rng.choice([0, 1, need - 1, need, need + rng.randrange(5000)])
    kind = rng.choice(["binary", "utf8", "nul"])
    content = {"binary": rng.randbytes(size),
               "utf8": ("é東" * size).encode("utf-8")[:size],
               "nul": b"\0" * size}[kind]
    path = tmp_path / f"text{i}.{kind}"
    path.write_bytes(content)
    refusal = ("is empty" if size == 0 else
               "too short" if size < need else None)
    cases.append((str(path), seq_len, refusal))
  os.mkfifo(tmp_path / "fifo")
  cases += [(str(tmp_path), 4, "is a directory"),
            (str(tmp_path / "fifo"), 4, "is not a regular file"),
            ("/dev/zero", 4, "is not a regular file"),
            (str(tmp_path / "absent"), 4, "no such file")]
  return cases


def test_fuzzed_text_files_load_or_are_refused_in_one_line(tmp_path):
  for path, seq_len, refusal in _text_cases(tmp_path):
    config = make_config(workdir=str(tmp_path / "run"), dataset="text",
                         data_file=path, seq_len=seq_len)
    try:
      split = load_data(config)
    except UserError as e:
      assert "\n" not in str(e) and str(e).startswith(f"--data_file={path}")
      assert refusal is not None and refusal in str(e), (path, str(e))
      continue
    assert refusal is None, (path, "loaded")
    assert split.input_shape == (seq_len,) and len(split.eval_x) >= 1
    inputs = np.asarray(split.train_x)
    assert inputs.min() >= 0 and inputs.max() < 256
