"""How an update is split and its gradients travel: the modes, the
reducers of data parallelism, staleness and stragglers.
"""
