# Stand-in for nvidia/cuda:13.0.1-devel-ubuntu24.04, for a one-off check that the llama image's CUDA
# builder stage compiles (cuda_builder.py; not part of the suite: ~30 min on 2 cores). The CUDA
# 13.0.1 toolkit's parts from NVIDIA's PyPI wheels, the way this machine's own toolkit is made,
# laid out as the image has them under /usr/local/cuda. CUDA 12's PyPI wheels hold no nvcc, so the
# image's default (12.8.1) has no stand-in. No libcuda link stub: the builder's cuda_toolchain.py
# builds its own when the toolkit lacks one.
ARG BASE=moe-l2-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip \
    && rm -rf /var/lib/apt/lists/*
# Every wheel installs under nvidia/cu13/ (bin/, include/, lib/, nvvm/): that tree becomes
# /usr/local/cuda, with lib64 beside lib and the unversioned .so names CMake links against.
RUN pip install --no-cache-dir --break-system-packages --no-deps --target /opt/cuda-wheels \
        nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-culibos==13.0.85 \
        nvidia-cublas==13.1.1.3 \
    && cp -a /opt/cuda-wheels/nvidia/cu13 /usr/local/cuda \
    && rm -rf /opt/cuda-wheels \
    && find /usr/local/cuda -name '__init__.py' -delete \
    && ln -s lib /usr/local/cuda/lib64 \
    && for lib in /usr/local/cuda/lib/*.so.*; do \
        ln -sf "$(basename "$lib")" "${lib%%.so.*}.so"; \
    done \
    && /usr/local/cuda/bin/nvcc --version
ENV PATH=/usr/local/cuda/bin:$PATH \
    CUDA_HOME=/usr/local/cuda
