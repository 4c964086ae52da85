# A stand-in for python:3.11-slim built from Debian packages, for hosts that cannot pull images
# (scripts/local-base-images.sh builds it). The venv at /usr/local puts `python`, `pip` and
# site-packages where the official image has them, and keeps pip off Debian's system Python.
ARG DEBIAN_IMAGE=carpool-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV LANG=C.UTF-8
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /usr/local \
 && python --version
CMD ["python3"]
