"""What the benchmarks share: summaries and reports, throw-away tenants and tasks, the
processes they start and what they cost, and the write meter."""
