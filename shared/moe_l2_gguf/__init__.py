"""GGUF model files: the expert index of a model (what the cache-manager pins), and generated models
(the planted demo model, random-weight models with real MoE shapes). Above the contracts only.
"""
