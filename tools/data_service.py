r"""A tf.data service on this host: a dispatcher and N workers, one process.

    python -m tools.data_service --num_workers=2 --port=5050 --timeout_s=3600

prints `grpc://localhost:5050` and serves until SIGTERM, Ctrl-C or
`--timeout_s`. Trainers then pass `--data_service=grpc://localhost:5050`
(`tools.launch --num_data_workers=N` starts it for its cluster). What the
service does with the input and which guarantees hold: dist_loop/data/
service.py and docs/data.md.

`--port=0` (the default) takes a free port. A port outside 0..65535 or one
already in use is refused in one line: gRPC would take the first modulo
65536, and shares the second with the program already there (SO_REUSEPORT),
printing an address that is not this service's alone.
"""

import argparse
import errno
import signal
import socket
import sys
import threading
from typing import Optional


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.data_service")
  parser.add_argument("--num_workers", type=int, default=2)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--timeout_s", type=float, default=24 * 3600.0)
  args = parser.parse_args(argv)
  if args.num_workers < 1:
    print("error: --num_workers must be at least 1", file=sys.stderr)
    return 2
  problem = port_problem(args.port)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  from dist_loop.runtime import console  # pylint: disable=g-import-not-at-top
  console.start(0)
  from dist_loop.data import service  # pylint: disable=g-import-not-at-top
  address, servers = service.start_local(args.num_workers, args.port)
  print(address, flush=True)
  stop.wait(args.timeout_s)
  del servers
  return 0


def port_problem(port: int) -> Optional[str]:
  """Why the dispatcher cannot have `port`, or None.

  A plain socket without SO_REUSEPORT is bound to it first (with
  SO_REUSEADDR, so a connection of the past in TIME_WAIT does not count):
  the kernel refuses it while any program listens there, which gRPC's own
  bind would not notice. What listens later, before the dispatcher binds,
  is not seen.
  """
  if not 0 <= port <= 65535:
    return (f"--port={port} is not a TCP port; use 1..65535, or 0 for a "
            "free one")
  if port == 0:
    return None
  for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
    error = _bind_error(family, host, port)
    if error is None or error.errno in (errno.EAFNOSUPPORT,
                                        errno.EADDRNOTAVAIL):
      continue  # Free here, or no IPv6 on this host: nothing listens.
    if error.errno == errno.EADDRINUSE:
      return (f"--port={port} is in use by another program; stop it, or "
              "pass another port, or 0 for a free one")
    return (f"--port={port} cannot be bound ({error.strerror}); pass "
            "another port, or 0 for a free one")
  return None


def _bind_error(family, host: str, port: int) -> Optional[OSError]:
  """The error of binding a plain socket of `family` to (host, port)."""
  try:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      probe.bind((host, port))
  except OSError as e:
    return e
  return None


if __name__ == "__main__":
  sys.exit(main())
