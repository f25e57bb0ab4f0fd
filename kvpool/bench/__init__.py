"""Benchmarks behind ``kvpool bench``: each reports ratios against a ceiling measured in the same run."""
