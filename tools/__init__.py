"""Developer tools: benchmarks that are not tests."""
