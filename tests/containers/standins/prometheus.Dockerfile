# Stand-in for prom/prometheus:v3.1.0: Debian's prometheus (2.42) with the official image's
# entrypoint, and wget for compose.yaml's healthcheck (busybox has it in the official image).
ARG BASE=moe-l2-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
