"""What every benchmark of bench/ shares, written once: a script puts bench/ on sys.path (as it does for
data_paths) and imports from here.

    servers  BenchError, Interrupted and the SIGTERM handler; the llama-server to measure (given or built),
             whether it replays route traces, a ggml-rpc-server as a llama-server's device
    timing   median, paired_ratio (the median of the pairs' ratios), rotated (a request round's order)
    prompts  the benches' ordinary-text prompts, cut to a number of words
    models   the model served: a GGUF given, or a shape of moe_l2_gguf.model_shapes written
    traces   the order of a trace's sequences that makes the domains take turns, a trace of some of them
    output   the machine's figures (/proc/meminfo too), the JSON written whole, the logs' folder, a table's cell

The routing data (the ESFT ids, the H200 table of 2026-12-04) is found by bench/data_paths.py alone.
Standard library only at import time, so the bare interpreter of a lent GPU machine imports it.
"""
