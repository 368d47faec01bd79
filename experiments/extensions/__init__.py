"""Worked examples of research code: each module registers a model, mode,
policy, schedule or compressor. Nothing imports them: a run loads the ones
it uses by flag, as it loads a user's own module from anywhere,
`--user_modules=experiments.extensions.residual_cnn` (see
`experiments/user_modules.py`)."""
