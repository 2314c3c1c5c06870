# Stand-in for redis:7.4.2-alpine: Debian's redis-server (7.0), run as compose.yaml runs the official
# image, with the official image's entrypoint behaviour (redis-entrypoint.sh).
ARG BASE=moe-l2-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["redis-server"]
