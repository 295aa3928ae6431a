"""Benchmarks that run Ratchet from outside, as its users and operators see it: each starts
real ``ratchet`` processes (of this working tree, or of an earlier commit checked out beside
it) and measures them over HTTP. They live outside the product package: a dev install runs
them (``python -m benchmarks.<name>``), and neither the wheel nor the image ships them.

- ``neighbours``: another tenant's one-step task and webhook under hostile tenants' load,
  before and after a change, in the same run (docs/benchmarks/neighbours.md).
"""
