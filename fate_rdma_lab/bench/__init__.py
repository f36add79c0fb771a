"""Benchmarks: each prints JSON lines and a readable table of medians, labelled with the provider."""
