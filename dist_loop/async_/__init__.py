"""The parts of the async mode that have no threads: a worker's gradient step
(`worker`), the applier of stale gradients (`applier`) and the staleness
policies (`policies`). `dist_loop.modes.async_mode` runs them in threads."""
