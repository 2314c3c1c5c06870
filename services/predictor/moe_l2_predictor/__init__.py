"""moe-l2 domain predictor: keyword, TF-IDF and semantic tiers combined into one calibrated answer."""
