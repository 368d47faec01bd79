"""The runtime: cluster, devices, strategies, the terminal, TensorBoard,
the workdir, its lock and its checkpoints.

Takes values (paths, configs, callables), never a trainer.
"""
