"""What both the API and the workers need: settings, the database, the stores, the registry.

``shared`` imports neither ``api`` nor ``workers``.
"""
