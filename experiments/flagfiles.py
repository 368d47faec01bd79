"""The command line as written, read before absl parses it.

Some of the command line must be known before the flags exist: the
flagfiles it names (read here rather than by absl, for the rules below),
then two flags that decide what the process does before the flags are
generated: `--verbosity` (how quietly TensorFlow starts) and
`--user_modules` (the user's code, whose components bring their own
flags). `expand_flagfiles` replaces each
`--flagfile` by the flags its file holds; `requested_verbosity` and
`requested_user_modules` read those two flags from the result.

A flagfile is read only if it is a regular file of at most
`MAX_FLAGFILE_BYTES`, checked with `os.stat` before it is opened: a device
(`/dev/zero`) would be read until memory runs out, and a FIFO with no
writer blocks `open()` forever.
"""

import codecs
import os
import stat
from typing import List, Sequence, Tuple

from absl import flags

from dist_loop.core.errors import UserError

_FLAGFILE = ("--flagfile", "-flagfile")
# A flagfile is a page of flags; anything larger is not one.
MAX_FLAGFILE_BYTES = 1 << 20
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (pipe)"),
          (stat.S_ISSOCK, "a socket"))


class FlagfileError(UserError):
  """A flagfile that cannot be used; the message names it and the fix.
  Exit code 2: the command line itself cannot be read."""

  exit_code = 2


def expand_flagfiles(argv: Sequence[str]) -> List[str]:
  """`argv` with each `--flagfile` replaced by the flags its file holds.

  As absl reads flagfiles (one argument per line, lines starting with `#`
  or `//` are comments, a file may name another with `--flagfile=PATH`,
  later flags win, nothing after `--` is read), except:

  * a relative nested `--flagfile=PATH` is looked up next to the file that
    names it first, then in the current directory (absl's only rule, so
    flagfiles written for it keep working);
  * files are read as UTF-8, and a leading byte-order mark is ignored;
  * a file that is not a regular file of at most `MAX_FLAGFILE_BYTES`,
    cannot be read or decoded, or includes itself, is a `FlagfileError`
    naming it (absl gives a traceback for an undecodable file, skips a loop
    with a warning, and reads a device or a FIFO as long as it gives).

  Raises:
    FlagfileError: naming the file and the fix.
  """
  out, args = list(argv[:1]), list(argv[1:])
  while args:
    arg = args.pop(0)
    if arg == "--":
      out += [arg] + args
      break
    if arg in _FLAGFILE:
      if not args:
        raise FlagfileError(f"{arg} needs a file name: {arg}=PATH")
      path = args.pop(0)
    elif arg.startswith(tuple(f + "=" for f in _FLAGFILE)):
      path = arg.split("=", 1)[1]
    else:
      out.append(arg)
      continue
    out += _read_flagfile(os.path.expanduser(path.strip()), ())
  return out


def _read_flagfile(path: str, including: Tuple[str, ...]) -> List[str]:
  """The arguments in flagfile `path`, nested flagfiles expanded.
  `including`: the files that led here, outermost first."""
  if not path:
    return []  # As absl: an empty --flagfile= names nothing.
  named = f"--flagfile={path}" + (f" (named in {including[-1]})"
                                  if including else "")
  if os.path.realpath(path) in map(os.path.realpath, including):
    raise FlagfileError(f"{named} includes itself: "
                        f"{' -> '.join(including + (path,))}; remove the "
                        "loop")
  data = _read_bounded(path, named)
  bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
  try:
    text = data[bom:].decode("utf-8")
  except UnicodeDecodeError as e:
    offset = bom + e.start
    raise FlagfileError(
        f"{named} is not UTF-8 text (byte 0x{data[offset]:02x} at offset "
        f"{offset}); save it as UTF-8") from None
  args = []
  for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
    line = line.strip()
    if not line or line.startswith(("#", "//")):
      continue
    if line in _FLAGFILE:
      raise FlagfileError(f"{named} has a line {line} without a file name; "
                          f"write {line}=PATH")
    if line.startswith(tuple(f + "=" for f in _FLAGFILE)):
      nested = os.path.expanduser(line.split("=", 1)[1].strip())
      args += _read_flagfile(_beside(nested, path), including + (path,))
    else:
      args.append(line)
  return args


def _read_bounded(path: str, named: str) -> bytes:
  """The bytes of `path`, checked with `os.stat` before it is opened to be
  a regular file of at most `MAX_FLAGFILE_BYTES`, and read no further
  (a file that grew in between is refused too)."""
  try:
    status = os.stat(path)
  except OSError as e:
    raise FlagfileError(f"cannot read {named}: {e.strerror}") from None
  mode, size = status.st_mode, status.st_size
  kind = next((what for test, what in _KINDS if test(mode)), None)
  if not stat.S_ISREG(mode):
    raise FlagfileError(f"{named} is {kind or 'not a regular file'}, not a "
                        "file of flags; save the flags to a file and name it")
  if size <= MAX_FLAGFILE_BYTES:
    try:
      with open(path, "rb") as f:
        data = f.read(MAX_FLAGFILE_BYTES + 1)
    except OSError as e:
      raise FlagfileError(f"cannot read {named}: {e.strerror}") from None
    size = len(data)
  if size > MAX_FLAGFILE_BYTES:
    raise FlagfileError(f"{named} has {size:,} bytes, more than a flagfile "
                        f"may have ({MAX_FLAGFILE_BYTES:,}); is it the "
                        "right file?")
  return data


def _beside(nested: str, including: str) -> str:
  """Where a nested flagfile is: next to the file that names it, else
  (absl's rule) relative to the current directory."""
  if not nested or os.path.isabs(nested):
    return nested
  beside = os.path.join(os.path.dirname(including), nested)
  return nested if os.path.exists(nested) and not os.path.exists(
      beside) else beside


def _early_values(argv: Sequence[str]) -> flags.FlagValues:
  """`--verbosity` (`-v`) and `--user_modules` of an expanded command line,
  parsed on their own before the other flags exist; their defaults if the
  command line does not parse (the real parse reports the error)."""
  values = flags.FlagValues()
  flags.DEFINE_integer("verbosity", 0, "", short_name="v", flag_values=values)
  flags.DEFINE_list("user_modules", [], "", flag_values=values)
  try:
    values(list(argv), known_only=True)
  except (flags.Error, OSError, ValueError):
    values.unparse_flags()
    values.mark_as_parsed()
  return values


def requested_verbosity(argv: Sequence[str]) -> int:
  """`--verbosity` (or `-v`) from a command line whose flagfiles are
  expanded; 0 if absent or unreadable."""
  return _early_values(argv).verbosity


def requested_user_modules(argv: Sequence[str]) -> List[str]:
  """`--user_modules` (comma-separated; the last occurrence wins, as for
  every flag) from a command line whose flagfiles are expanded."""
  return [m.strip() for m in _early_values(argv).user_modules if m.strip()]
