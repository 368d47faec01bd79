"""One chunk of layers, and the ops of its F, I, W and B (inside a trace).

`B` differentiates the chunk's outputs with respect to its input and its
variables at once (`tf.gradients`). The inputs (the activations and the
regularisation received from the previous chunk) are differentiated as
independent leaves: the regularisation may itself depend on the received
activations, and that path belongs to the previous chunk. Zero-bubble
schedules split B in two, and no FLOP is done twice:

* the *joins* are the ops where a weight meets the data: an op with a float
  input that comes from the chunk's trainable variables only (through
  reads, casts, reshapes: the *weight side*) and another that does not
  (`MatMul(h, kernel)`, `BiasAdd`, `Mul(x, gamma)`, ...); they are found
  in the ops F created;
* `I` differentiates the outputs with respect to the input and to every
  join's outputs: the whole data-path backward, once. The gradients at
  the joins, and the joins' data inputs, are what W needs, and stay alive
  until it runs (this is the memory that deferring W costs);
* `W` differentiates each join alone with respect to its weight side (one
  op: `x^T dz` for a MatMul), then the weight side down to the variables.
  It never goes back through the data path.

The ops a gradient function builds that I or W does not use (the
data-input gradient of a join in W, the weight gradient in I) are pruned
when the function is instantiated, as TensorFlow prunes every op whose
value nobody reads.

With recompute, F keeps only its input; I or B runs the forward again
first (as `tf.recompute_grad` would) and differentiates the new ops. Layers
whose forward changes state (batch-norm statistics, dropout seeds) then
change it twice, as with `tf.recompute_grad`.
"""

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

# head(output, regularisation or None, *head_args) -> (the scalar to
# differentiate, anything else to keep), run after the last chunk's layers.
Head = Callable[..., Tuple[tf.Tensor, object]]


@dataclasses.dataclass
class Record:
  """What F leaves for the backward of one micro-batch."""

  x: tf.Tensor  # The chunk's input.
  reg_in: Optional[tf.Tensor]  # Regularisation of the chunks before.
  ys: List[tf.Tensor]  # What is differentiated: [out(, reg)] or [target].
  extra: object = None  # The head's other results (the last chunk).
  ops: Sequence[tf.Operation] = ()  # The forward's ops (for the joins).
  head_args: tuple = ()


@dataclasses.dataclass
class Kept:
  """What I leaves for W: the gradients at the joins' outputs."""

  joins: List[Tuple[tf.Operation, List[Tuple[tf.Tensor, tf.Tensor]]]]
  # Outputs on the weight side alone (a regulariser), with their gradients.
  weight_outputs: List[Tuple[tf.Tensor, tf.Tensor]]
  weight_side: set  # ids of the weight-side tensors.


class Chunk:
  """Consecutive layers that run as one unit of a pipeline schedule."""

  def __init__(self, layers, first: bool, recompute: bool,
               head: Optional[Head] = None, split_backward: bool = True):
    """Args:
      layers: the chunk's Keras layers, in order.
      first: the model's first chunk (its input is data: no gradient).
      recompute: keep only the input between F and the backward.
      head: for the model's last chunk, the loss (see `Head`).
      split_backward: whether the schedule runs the backward as I and W
        (F then lists its ops, to find the joins).
    """
    self.layers = list(layers)
    self.first = first
    self.recompute = recompute
    self.head = head
    self.split_backward = split_backward
    self.variables = [v for layer in self.layers
                      for v in layer.trainable_variables]

  def _run(self, x, reg_in, head_args) -> Record:
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations()) if self.split_backward else None
    out = x
    for layer in self.layers:
      out = layer(out, training=True)
    losses = [tf.cast(l, tf.float32)
              for layer in self.layers for l in layer.losses]
    reg = reg_in
    if losses:
      reg = tf.add_n(([] if reg_in is None else [reg_in]) + losses)
    extra = None
    if self.head is None:
      ys = [out] + ([] if reg is None else [reg])
    else:
      target, extra = self.head(out, reg, *head_args)
      ys = [target]
    ops = () if start is None else graph.get_operations()[start:]
    return Record(x, reg_in, ys, extra, ops, head_args)

  def forward(self, x, reg_in, *head_args) -> Record:
    """F: the chunk on one micro-batch. `head_args` go to the head."""
    record = self._run(x, reg_in, head_args)
    if self.recompute:
      record.ops = ()  # The backward differentiates its own copy.
    return record

  def _inputs(self, record) -> List[tf.Tensor]:
    """What the previous chunk gets gradients for: [x(, reg_in)]."""
    if self.first:
      return []
    return [record.x] + ([] if record.reg_in is None else [record.reg_in])

  def _for_backward(self, record) -> Record:
    if self.recompute:
      return self._run(record.x, record.reg_in, record.head_args)
    return record

  def backward(self, record, grads_out) -> Tuple[list, list]:
    """B: (gradients for the previous chunk, one per variable)."""
    record = self._for_backward(record)
    inputs = self._inputs(record)
    grads = tf.gradients(record.ys, inputs + self.variables,
                         grad_ys=grads_out, stop_gradients=inputs,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return ([tf.convert_to_tensor(g) for g in grads[:len(inputs)]],
            [tf.convert_to_tensor(g) for g in grads[len(inputs):]])

  def input_grad(self, record, grads_out) -> Tuple[list, Kept]:
    """I: (gradients for the previous chunk, what W needs)."""
    record = self._for_backward(record)
    inputs = self._inputs(record)
    joins, weight_side = find_joins(record.ops, self.variables)
    zs = [z for op in joins for z in _floats(op.outputs)]
    grads = tf.gradients(record.ys, inputs + zs, grad_ys=grads_out,
                         stop_gradients=inputs)
    kept, at = [], len(inputs)
    for op in joins:
      pairs = []
      for z in _floats(op.outputs):
        if grads[at] is not None:
          pairs.append((z, tf.convert_to_tensor(grads[at])))
        at += 1
      if pairs:
        kept.append((op, pairs))
    grads_out = grads_out or [None] * len(record.ys)
    outputs = [(y, g if g is not None else tf.ones_like(y))
               for y, g in zip(record.ys, grads_out) if id(y) in weight_side]
    to_send = [tf.zeros_like(t) if g is None else tf.convert_to_tensor(g)
               for t, g in zip(inputs, grads)]
    return to_send, Kept(kept, outputs, weight_side)

  def weight_grad(self, kept: Kept) -> List[tf.Tensor]:
    """W: one gradient per variable, from what I kept."""
    sums = {}  # id(weight-side tensor) -> [tensor, gradient]

    def add(t, g):
      if id(t) in sums:
        sums[id(t)][1] = sums[id(t)][1] + g
      else:
        sums[id(t)] = [t, g]

    # Through each join alone (every float input of a join stops the
    # backward: a join's data input may itself depend on its weight side,
    # as in a normalisation, and that path is I's). One call per level:
    # a join fed directly by another cannot share its call, since stopping
    # at its input would stop the other join's own gradient too.
    for level in _levels(kept.joins):
      ys = [z for _, pairs in level for z, _ in pairs]
      side = list({id(t): t for op, _ in level for t in _floats(op.inputs)
                   if id(t) in kept.weight_side}.values())
      local = tf.gradients(
          ys, side, grad_ys=[g for _, pairs in level for _, g in pairs],
          stop_gradients=[t for op, _ in level for t in _floats(op.inputs)])
      for t, g in zip(side, local):
        if g is not None:
          add(t, tf.convert_to_tensor(g))
    for y, g in kept.weight_outputs:
      add(y, g)
    if not sums:
      return [tf.zeros_like(v) for v in self.variables]
    ys, grads = zip(*sums.values())
    return [tf.convert_to_tensor(g) for g in tf.gradients(
        list(ys), self.variables, grad_ys=list(grads),
        unconnected_gradients=tf.UnconnectedGradients.ZERO)]


def _floats(tensors) -> List[tf.Tensor]:
  return [t for t in tensors if t.dtype.is_floating]


def _levels(joins):
  """The (op, pairs) of `joins` in groups where no join takes another's
  output as an input, in order."""
  level, groups = {}, []
  for op, pairs in joins:
    n = max([level[id(t.op)] + 1 for t in op.inputs if id(t.op) in level],
            default=0)
    level[id(op)] = n
    if n == len(groups):
      groups.append([])
    groups[n].append((op, pairs))
  return groups


def find_joins(ops: Sequence[tf.Operation], variables
               ) -> Tuple[List[tf.Operation], set]:
  """The join ops among `ops` (in creation order), and the ids of the
  weight-side tensors.

  A read of one of `variables` is on the weight side; so is the output of
  an op whose float inputs all are. An op with float inputs on both sides
  is a join.
  """
  graph = tf.compat.v1.get_default_graph()
  handles = {id(graph.capture(v.handle)) for v in variables}
  weight_side, joins = set(), []
  for op in ops:
    if op.type == "ReadVariableOp":
      if id(op.inputs[0]) in handles:
        weight_side.update(id(t) for t in op.outputs)
      continue
    floats = _floats(op.inputs)
    on_weight_side = [t for t in floats if id(t) in weight_side]
    if not on_weight_side:
      continue
    if len(on_weight_side) == len(floats):
      weight_side.update(id(t) for t in op.outputs)
    else:
      joins.append(op)
  return joins, weight_side
