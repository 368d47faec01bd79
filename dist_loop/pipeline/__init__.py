"""Pipeline model parallelism: partition, schedules as data, executor,
timeline. The Trainer that uses them is `dist_loop.modes.pipeline`."""
