"""The placement cost model (docs/placement-model.md): decode and prompt tokens/s for every place a MoE model's
routed experts can live (on the device, behind the expert cache, on the CPU, copied, read from the drive),
from a model's shape and a machine's measured constants, and the device budget's split the engine's
`--moe-cache-bytes auto` chooses.

    shape     Shape (by name, from a bench run, from a GGUF file), NotModelled
    machine   Machine and the free parameters; the H200 of 2026-12-04 and the machines scaled from it
    curve     CacheStats and ESFT_CURVE: the project's policy replayed on the ESFT trace
    hit_curve the hit curve file llama-server's auto placement reads (the shipped one: data/hit-curve-default.txt)
    split     choose_split: a layer's misses between copies and the CPU
    estimate  Placement, decode, prompt, the host's page cache
    choose    choose_layers_and_cache, engine_auto_split
    here      this machine (RAM, nvidia-smi's GPUs) and the placement predicted for a model on it
    multi_gpu two GPUs and more (issue 45): llama.cpp's layer split, stock --n-cpu-moe with --tensor-split,
              one cache on device 0, a cache per device

bench/placement_model.py checks the model against the measured runs (`--against`) and prints its tables;
`moe-l2 doctor --model M` prints what it predicts for this machine. Standard library only at import
time (numpy and moe_l2_gguf inside the functions that read a GGUF file), so that the bare interpreter of
a lent GPU machine runs the cost model's check with no venv.
"""
