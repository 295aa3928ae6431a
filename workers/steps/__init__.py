"""One step of the agent loop: the runner (lease, run, go on), what a step knows, its
model half and its tool half, and its fenced writes."""
