"""Code shared by every moe-l2 service: contracts, configuration, GGUF tooling."""

__version__ = "0.1.0"
