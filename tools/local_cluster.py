"""The addresses of a local cluster: free localhost ports, and the
TF_CONFIG cluster spec that `tools/launch.py` hands to every task."""

import random
import socket
from typing import Dict, List, Optional, Sequence

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 20000  # Below it, well-known services are more common.


def _ephemeral_ports() -> Optional[range]:
  """The kernel's range for outgoing connections' local ports, if known."""
  try:
    with open(_EPHEMERAL_RANGE_FILE, encoding="ascii") as f:
      low, high = (int(x) for x in f.read().split())
    return range(low, high + 1)
  except (OSError, ValueError):
    return None


def free_ports(n: int) -> List[int]:
  """n distinct localhost ports that are free now and stay likely free.

  Ports are held open together, then released, and each task binds its
  own a few seconds later (after importing TensorFlow). A port the kernel
  picks (bind to 0) is an ephemeral one: in that gap, any outgoing
  connection, such as the cluster's own gRPC channels, can be given it.
  So the ports are drawn at random outside the ephemeral range (below it,
  or above it), where the kernel never puts an outgoing connection. Only
  if no such port is free, or the range is unknown (not Linux), does the
  kernel pick.
  """
  ephemeral = _ephemeral_ports()
  candidates: List[int] = []
  if ephemeral is not None:  # Below the range, or above it (1024-65535?).
    candidates = [*range(_LOWEST_PORT, max(ephemeral.start, _LOWEST_PORT)),
                  *range(max(ephemeral.stop, _LOWEST_PORT), 65536)]
    random.SystemRandom().shuffle(candidates)
  sockets, ports = [], []
  try:
    for port in candidates:
      if len(ports) == n:
        break
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      try:
        s.bind(("", port))  # All interfaces, as the TensorFlow server binds.
      except OSError:
        s.close()
        continue
      sockets.append(s)
      ports.append(port)
    while len(ports) < n:
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("localhost", 0))
      sockets.append(s)
      ports.append(s.getsockname()[1])
    return ports
  finally:
    for s in sockets:
      s.close()


def cluster_spec(num_workers: int, num_ps: int,
                 ports: Optional[Sequence[int]] = None) -> Dict[str, List[str]]:
  """The localhost cluster: workers only, or chief + workers + ps."""
  jobs = ([("worker", num_workers)] if num_ps == 0
          else [("chief", 1), ("worker", num_workers), ("ps", num_ps)])
  total = sum(n for _, n in jobs)
  ports = list(ports) if ports is not None else free_ports(total)
  spec = {}
  for job, n in jobs:
    spec[job] = [f"localhost:{ports.pop(0)}" for _ in range(n)]
  return spec
