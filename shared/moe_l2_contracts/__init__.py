"""The contracts between moe-l2's services: wire schemas, domain names, the service table, the admin token.

The bottom layer: it imports nothing of the project, so every service and the operations layer can
depend on it without dragging another service in (the import-linter contract in pyproject.toml).
"""
