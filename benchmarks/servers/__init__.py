"""The processes a benchmark starts besides Ratchet: the baselines it is measured against (a
bare FastAPI endpoint, a raw Celery chain) and the OpenAI-compatible stub model."""
