# Stand-in for nvidia/cuda:12.8.1-devel-ubuntu24.04, for a one-off check that the llama image's CUDA
# builder stage compiles (not part of the suite: ~30 min on 2 cores). The CUDA 12.8.1 toolkit's
# parts from NVIDIA's PyPI wheels (the versions that release shipped), laid out as the image has
# them under /usr/local/cuda. No libcuda link stub: the builder's cuda_toolchain.py builds its own
# when the toolkit lacks one.
ARG BASE=moe-l2-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip \
    && rm -rf /var/lib/apt/lists/*
# The wheels each hold one part (bin/, include/, lib/, nvvm/): merged into one tree, lib64 beside
# lib, and the unversioned .so names CMake's FindCUDAToolkit links against.
RUN pip install --no-cache-dir --break-system-packages --no-deps --target /opt/cuda-wheels \
        nvidia-cuda-nvcc-cu12==12.8.93 nvidia-cuda-runtime-cu12==12.8.90 \
        nvidia-cuda-cccl-cu12==12.8.90 nvidia-cublas-cu12==12.8.4.1 \
    && mkdir -p /usr/local/cuda \
    && for part in /opt/cuda-wheels/nvidia/*/; do cp -a "$part". /usr/local/cuda/; done \
    && rm -rf /opt/cuda-wheels /usr/local/cuda/__init__.py /usr/local/cuda/__pycache__ \
    && ln -s lib /usr/local/cuda/lib64 \
    && for lib in /usr/local/cuda/lib/*.so.*; do \
        ln -sf "$(basename "$lib")" "${lib%%.so.*}.so"; \
    done \
    && /usr/local/cuda/bin/nvcc --version
ENV PATH=/usr/local/cuda/bin:$PATH \
    CUDA_HOME=/usr/local/cuda
