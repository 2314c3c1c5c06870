"""Wire contracts between the services: one module per HTTP contract, used by both sides."""
