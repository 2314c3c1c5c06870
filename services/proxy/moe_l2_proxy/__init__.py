"""moe-l2 gateway: OpenAI- and Ollama-compatible API in front of the patched llama-server, with a
domain per request (header, predictor or keyword tier), hints to the cache-manager, streaming
relayed as it is generated and cancelled when the client leaves. `python -m moe_l2_proxy`."""
