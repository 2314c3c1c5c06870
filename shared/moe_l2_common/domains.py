"""The default domain taxonomy's names.

The predictor owns the full taxonomy (descriptions, keywords, examples); this is only the list
of names every service agrees on, so a domain tag means the same thing everywhere.
"""

DEFAULT_DOMAINS: tuple[str, ...] = (
    "codegen",
    "debug",
    "math",
    "logic",
    "general_qa",
    "creative_write",
    "translate",
    "chinese_tech",
)

# Requests that carry no domain tag are counted under this one by the llama-server telemetry.
UNTAGGED = "untagged"
