"""moe-l2 gateway (OpenAI and Ollama APIs). Not built yet: `python -m` reports that and exits."""
