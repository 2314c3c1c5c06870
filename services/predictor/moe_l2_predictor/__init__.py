"""moe-l2 domain predictor. Not built yet: `python -m` reports that and exits."""
