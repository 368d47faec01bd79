r"""A tf.data service on this host: a dispatcher and N workers, one process.

    python -m tools.data_service --num_workers=2 --port=5050 --timeout_s=3600

prints `grpc://localhost:5050` and serves until SIGTERM, Ctrl-C or
`--timeout_s`. Trainers then pass `--data_service=grpc://localhost:5050`
(`tools.launch --num_data_workers=N` starts it for its cluster). What the
service does with the input and which guarantees hold: dist_loop/data/
service.py and docs/data.md.
"""

import argparse
import signal
import sys
import threading


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.data_service")
  parser.add_argument("--num_workers", type=int, default=2)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--timeout_s", type=float, default=24 * 3600.0)
  args = parser.parse_args(argv)
  if args.num_workers < 1:
    print("error: --num_workers must be at least 1", file=sys.stderr)
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


if __name__ == "__main__":
  sys.exit(main())
