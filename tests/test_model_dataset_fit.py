"""Every registered model with every registered dataset: each pair either
builds and runs a forward pass, or is refused while the flags are parsed in
one line naming both and a pair that fits (configure.check_fit, from the
components' declarations: models/base.py, data/base.py)."""

import numpy as np
import pytest

from dist_loop import configure, data, models
from dist_loop.core.errors import UserError
from dist_loop.data import shard_writer
from experiments.extensions import residual_cnn  # noqa: F401  (registers it)
from tests.conftest import run_main

SEQ_LEN = 8


def _flags(dataset, tmp_path):
  """The flags that make `dataset` load from tmp_path, small."""
  if dataset == "mnist":
    rng = np.random.RandomState(0)
    np.savez(tmp_path / "mnist.npz",
             x_train=rng.randint(0, 255, (4, 28, 28), dtype=np.uint8),
             y_train=rng.randint(0, 10, 4),
             x_test=rng.randint(0, 255, (2, 28, 28), dtype=np.uint8),
             y_test=rng.randint(0, 10, 2))
    return {"data_dir": str(tmp_path)}
  if dataset == "text":
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 4)
    return {"data_file": str(path), "seq_len": SEQ_LEN}
  if dataset == "pysource":
    return {"seq_len": SEQ_LEN}
  if dataset == "shards":  # Digits' first images, as shards.
    digits = data.DATASETS.get("digits")(None, 0, None)
    small = data.Dataset(digits.train_x[:8], digits.train_y[:8],
                         digits.eval_x[:4], digits.eval_y[:4],
                         digits.num_classes)
    shard_writer.write(small, "tfrecord", 1, str(tmp_path / "shards"), 0,
                       {"dataset": "digits"})
    return {"data_dir": str(tmp_path / "shards")}
  return {}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  """{(model's image size, dataset): Dataset}, each loaded once."""
  cache = {}

  def load(model, dataset):
    key = (models.image_size_for(model), dataset)
    if key not in cache:
      config = configure.make_config(
          workdir="/unused", model=model, dataset=dataset,
          **_flags(dataset, tmp_path_factory.mktemp(dataset)))
      cache[key] = data.load(config, key[0]), config
    return cache[key]

  return load



def _project(registry):
  """The names registered by the project (dist_loop, its worked examples),
  not by other test modules or benchmarks sharing this process."""
  return [n for n in registry.names() if registry.get(n).__module__.startswith(
      ("dist_loop.", "experiments."))]


PAIRS = [(m, d) for m in _project(models.MODELS)
         for d in _project(data.DATASETS)]


@pytest.mark.parametrize("model,dataset", PAIRS)
def test_each_pair_builds_or_is_refused_in_one_line(model, dataset, loaded):
  if not configure.fits(model, dataset):
    with pytest.raises(UserError) as refused:
      configure.check_fit(model, dataset)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"--model={model} takes ")
    assert f"--dataset={dataset}" in message
    assert " with this " in message  # A pair that fits, named.
    return
  configure.check_fit(model, dataset)
  split, config = loaded(model, dataset)
  try:  # What the loader does not declare (shards: their manifest) is
    # checked once loaded, as `train.run` does.
    configure.check_fit(model, dataset, data.given(split))
  except UserError as refused:
    assert "\n" not in str(refused) and f"--model={model}" in str(refused)
    return
  config = config.replace(model=model, model_options=None)
  config = configure.validate(config, configure.cluster_lib.parse(None))
  net = models.build_for(config, split)
  logits = np.asarray(net(split.train_x[:2]))
  want = ((2, split.num_classes) if split.train_y.ndim == 1
          else (2, SEQ_LEN, split.num_classes))
  assert logits.shape == want
  assert np.isfinite(logits).all()


def test_the_matrix_has_both_kinds():
  # The walk above tests the check only if some pairs fit and some do not.
  verdicts = {configure.fits(m, d) for m, d in PAIRS}
  assert verdicts == {True, False}


@pytest.mark.parametrize("model,dataset", [("transformer", "digits"),
                                           ("cnn", "text")])
def test_a_misfit_is_refused_at_parse_time_and_makes_no_workdir(
    model, dataset, tmp_path):
  workdir = tmp_path / "run"
  extra = ["--data_file=/etc/hostname"] if dataset == "text" else []
  code, out, err = run_main(f"--model={model}", f"--dataset={dataset}",
                            f"--workdir={workdir}", *extra)
  assert code != 0
  assert f"--model={model} takes" in err
  assert "Traceback" not in err + out
  assert not workdir.exists()


def test_a_loader_that_breaks_its_declaration_is_named(tmp_path, monkeypatch):
  loader = data.DATASETS.get("synthetic")
  monkeypatch.setattr(loader, "input_rank", 2, raising=False)
  config = configure.make_config(workdir=str(tmp_path), model="mlp",
                                 dataset="synthetic")
  with pytest.raises(UserError, match=r"--dataset=synthetic declares .* but "
                     r"gave .*fix its declaration"):
    data.load(config, models.image_size_for("mlp"))


@data.DATASETS.register("test_undeclared_bytes")
def _undeclared_bytes(data_dir, seed, image_size=None):
  """Token windows whose loader declares nothing."""
  del data_dir, seed, image_size
  x = np.arange(64 * SEQ_LEN, dtype=np.int32).reshape(64, SEQ_LEN) % 256
  return data.Dataset(x, x, x[:8], x[:8], 256, task="language_model")


def test_what_a_loader_does_not_declare_is_checked_once_loaded(tmp_path):
  """Not at parse time (nothing to go by), but before the model is built:
  one line, and the refused run leaves no workdir."""
  assert configure.fits("mlp", "test_undeclared_bytes")
  workdir = tmp_path / "run"
  code, out, err = run_main("--model=mlp", "--dataset=test_undeclared_bytes",
                            f"--workdir={workdir}")
  assert code == 1 and out == ""
  # One line; the datasets it names are those registered in this process
  # (other test files register their own).
  assert err.count("\n") == 1 and err.startswith(
      "error: --model=mlp takes the classification task, but "
      "--dataset=test_undeclared_bytes poses language_model; use "
      "--model=transformer with this dataset or "), err
  assert " or --dataset=digits with this model" in err
  assert not workdir.exists()
