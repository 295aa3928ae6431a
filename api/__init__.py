"""The HTTP side: FastAPI routes, auth, request schemas and problem+json errors."""
