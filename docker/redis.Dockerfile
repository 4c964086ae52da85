# A stand-in for redis:7 built from Debian's redis-server, for hosts that cannot pull images
# (scripts/local-base-images.sh builds it). Like the official image it runs as `redis` in /data.
ARG DEBIAN_IMAGE=carpool-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
VOLUME /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
