# Stand-in for python:3.12.8-slim-bookworm: Debian's python3 (3.11) on the debootstrapped base.
# The services need `python` on PATH, venv and pip, as the official slim image has them.
ARG BASE=moe-l2-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python-is-python3 \
    && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
