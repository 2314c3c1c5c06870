"""The domain library: the taxonomy, its keyword matcher and language detection, with their data.

Shared by the gateway's keyword fallback and the predictor's tiers; above the contracts only.
"""
