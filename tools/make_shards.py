r"""Make shards: any registered dataset, or your own file, as files on disk.

    python -m tools.make_shards --dataset=digits --format=arrayrecord \
        --num_shards=4 --out=/data/digits_shards
    python -m tools.make_shards --dataset=text --data_file=corpus.txt \
        --seq_len=128 --format=tfrecord --num_shards=16 --out=/data/corpus
    python -m tools.make_shards --dataset=npz --npz=mine.npz ...

then train with `--dataset=shards --data_dir=OUT`. The dataset is loaded as
a run would load it (its split, its normalisation; `--image_size` resizes
images, by default they are kept as they are and resized when read) and
checked by the same rules (`data.base.check`). `--dataset=npz` takes an
.npz with x_train, y_train, x_test, y_test. Formats, the manifest and the
guarantees: docs/data.md. Bad input is one line on stderr and exit 2.

    python -m tools.make_shards --verify=/data/digits_shards

checks a shards directory against its manifest, every shard's SHA-256
included (one full read of the shards), and writes nothing: what a run
does at every start with `--verify_checksums`, done once (after copying the
shards, say). A mismatch is one line naming the file, and exit 2.
"""

import dataclasses
import os
import stat
import sys

from absl import app, flags

from dist_loop.core.errors import UserError
from dist_loop.runtime import console, files, process_exit

FLAGS = flags.FLAGS
flags.DEFINE_string("dataset", None, "A registered dataset (digits, mnist, "
                    "pysource, text, ...) or npz (with --npz).")
flags.DEFINE_enum("format", "arrayrecord", ["tfrecord", "arrayrecord"],
                  "tfrecord: sequential; arrayrecord: random access.")
flags.DEFINE_integer("num_shards", 8, "Files of the train split.",
                     lower_bound=1)
flags.DEFINE_string("out", None, "The directory to create.")
flags.DEFINE_string("data_dir", None, "Where a file-based dataset is read "
                    "from (mnist.npz).")
flags.DEFINE_string("data_file", None, "--dataset=text: the file.")
flags.DEFINE_string("npz", None, "--dataset=npz: the .npz file.")
flags.DEFINE_integer("seq_len", 128, "Text datasets: bytes per example.",
                     lower_bound=1)
flags.DEFINE_integer("image_size", None, "Resize images to this side "
                     "(default: as the dataset has them).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "The dataset's split seed, and the order "
                     "of TFRecord train shards.", lower_bound=0)
flags.DEFINE_string("verify", None, "Instead of writing shards: check the "
                    "shards directory DIR against its manifest, every "
                    "shard's SHA-256 included, and exit.")


def load_named():
  """The dataset FLAGS name, loaded as a run loads it, and its record."""
  from dist_loop import data  # pylint: disable=g-import-not-at-top
  from dist_loop.data import shard_writer  # pylint: disable=g-import-not-at-top
  if FLAGS.dataset == "npz":
    if not FLAGS.npz:
      raise UserError("--dataset=npz needs --npz=PATH")
    if not_a_file(FLAGS.npz):
      raise UserError(f"--npz={FLAGS.npz} {not_a_file(FLAGS.npz)}; pass an "
                      ".npz file")
    dataset = shard_writer.from_npz(FLAGS.npz)
    data.base.check(dataset, "npz")
    return dataset, {"dataset": "npz", "npz": FLAGS.npz}
  if FLAGS.dataset == "shards" or FLAGS.dataset not in data.DATASETS.names():
    raise UserError(f"--dataset={FLAGS.dataset} is not a registered dataset "
                    f"({', '.join(data.DATASETS.names())}) or npz")
  loader = data.DATASETS.get(FLAGS.dataset)
  kwargs, record = {}, {"dataset": FLAGS.dataset, "seed": FLAGS.seed,
                        "image_size": FLAGS.image_size}
  if hasattr(loader, "Options"):
    given = {"data_file": FLAGS.data_file, "seq_len": FLAGS.seq_len}
    names = {f.name for f in dataclasses.fields(loader.Options)}
    options = {k: v for k, v in given.items() if k in names}
    kwargs["options"] = loader.Options(**options)
    record.update(options)
  dataset = loader(FLAGS.data_dir, FLAGS.seed, FLAGS.image_size, **kwargs)
  data.base.check(dataset, FLAGS.dataset)
  return dataset, record


def not_a_file(path: str) -> str:
  """Why `path` is not a regular file to open, or "": a pipe is refused by
  its kind, since opening it waits for a writer that may never come. A path
  that cannot be examined is left to the reader, which names it."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return ""
  if stat.S_ISDIR(mode):
    return "is a directory"
  if not stat.S_ISREG(mode):
    return "is not a regular file (a device, a pipe or a socket)"
  return ""


def check_out(out: str) -> None:
  """Refuses an --out whose nearest existing parent is not a directory,
  before the dataset is loaded (makedirs would fail only after that).

  Raises:
    UserError: one line naming the file in the way.
  """
  parent = os.path.dirname(os.path.abspath(out))
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise UserError(f"--out={out}: {parent} is not a directory; give a path "
                    "under a directory")


def check_verifiable(directory: str) -> None:
  """Refuses a --verify that is not a shards directory, in words naming
  --verify, and a manifest or shard that is a pipe or device (its read
  would wait forever) before `shards.verify` opens them.

  Raises:
    UserError: one line naming the path and the fix.
  """
  from dist_loop.data import shard_format  # pylint: disable=g-import-not-at-top
  made = "pass a directory written by tools.make_shards"
  if not os.path.exists(directory):
    raise UserError(f"--verify={directory} does not exist; {made}")
  if not os.path.isdir(directory):
    raise UserError(f"--verify={directory} is not a directory; {made}")
  manifest = os.path.join(directory, shard_format.MANIFEST)
  if not os.path.lexists(manifest):
    raise UserError(f"--verify={directory} holds no {shard_format.MANIFEST};"
                    f" {made}")
  _refuse_unless_file(manifest)
  listed = shard_format.read_manifest(directory)
  for split in shard_format.SPLITS:
    for path in shard_format.paths(directory, listed, split):
      _refuse_unless_file(path)


def _refuse_unless_file(path: str) -> None:
  problem = not_a_file(path)
  if problem:
    raise UserError(f"{path} {problem}; make the shards again with "
                    "tools.make_shards")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  process_exit.skip_final_gc()
  console.start(0)
  console.setup(0)
  from dist_loop.data import shards  # pylint: disable=g-import-not-at-top
  try:
    if FLAGS.verify:
      if FLAGS.dataset or FLAGS.out:
        raise UserError("--verify checks a shards directory and writes "
                        "nothing; drop --dataset and --out, or --verify")
      check_verifiable(FLAGS.verify)
      print(shards.verify(FLAGS.verify))
      return 0
    if not (FLAGS.dataset and FLAGS.out):
      raise UserError("give --dataset and --out to make shards, or "
                      "--verify=DIR to check a shards directory")
    check_out(FLAGS.out)
    if FLAGS.format == "arrayrecord":
      shards.need_array_record()
    dataset, record = load_named()
    manifest = write(dataset, record)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  train = manifest["splits"]["train"]
  print(f"{FLAGS.out}: {train['records']} train / "
        f"{manifest['splits']['eval']['records']} eval records in "
        f"{len(train['files'])} {FLAGS.format} shards")
  return 0


def write(dataset, record):
  """`shard_writer.write` to --out, an OS error (a path it cannot create, a
  full disk) one line.

  Raises:
    UserError: as `shard_writer.write`, or the write failed.
  """
  from dist_loop.data import shard_writer  # pylint: disable=g-import-not-at-top
  try:
    return shard_writer.write(dataset, FLAGS.format, FLAGS.num_shards,
                              FLAGS.out, FLAGS.seed, record)
  except OSError as e:
    raise UserError(f"--out={FLAGS.out} cannot be written ({files.reason(e)});"
                    " give a directory you can write to") from None


if __name__ == "__main__":
  app.run(main)
