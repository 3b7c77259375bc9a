"""Throughput and serving benchmarks and the step timeline (Chrome trace + PNG); reads other packages
only through their public API.
"""
