#!/bin/sh
# As the official image's entrypoint: without a config file Redis runs in protected mode and refuses
# every client that is not on loopback, so a bare `redis-server ...` gets --protected-mode no.
if [ "$1" = redis-server ]; then
    shift
    exec redis-server "$@" --protected-mode no
fi
exec "$@"
