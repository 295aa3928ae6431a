"""Ratchet's benchmarks: each measures Ratchet against a baseline taken in the same run and
reports the ratio. A checkout's dev install runs them (``ratchet bench NAME``, or ``python -m
benchmarks.neighbours``); neither the wheel nor the image holds them.

- one module per benchmark, named for what it measures: ``checkpoint``, ``limiter``,
  ``delivery``, ``capacity``, ``submissions`` (``ratchet bench api``), ``history``,
  ``throughput``, ``dashboard``, ``fairness``, ``neighbours``;
- ``cli``: the ``ratchet bench`` commands;
- ``harness/``: what they share (reports, throw-away tenants, the processes they start, the
  write meter);
- ``servers/``: what they measure against or stand up besides Ratchet;
- ``checkouts``, ``hostile``, ``flood``, ``quiet``: the noisy-neighbour benchmark's sides and
  tenants (docs/benchmarks/neighbours.md).
"""
