"""The run's configuration: errors, options, Config, registries.

The bottom layer: imports nothing above it and never TensorFlow.
"""
