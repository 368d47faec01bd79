"""The step core: the task's loss turned into shares and gradients, the
optimizers and their update, precision, per-replica values.
"""
