# syntax=docker/dockerfile:1
# tools/image/build.sh passes a local equivalent: BASE=localhost/python:3.11-slim-bookworm
ARG BASE=python:3.11-slim-bookworm

# Build stage: wheels for the project and its dependencies.
FROM ${BASE} AS build
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY app ./app
# Bytecode compiled here, once, valid whatever the files' times (unchecked-hash): without it
# every start compiles each module from source (the runtime writes no .pyc), and the
# compiler's leftovers stay in the heap, some 34 MiB of the working set.
RUN pip install --no-compile . \
 && python -m compileall -q --invalidation-mode unchecked-hash /opt/venv/lib

# Runtime stage: the virtualenv only, as an unprivileged user.
FROM ${BASE}
LABEL org.opencontainers.image.title="workload-manager" \
      org.opencontainers.image.description="Node workload manager for single-node K3S clusters"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    APP_ENV=production \
    DATA_DIR=/tmp/workload-manager \
    MIGRATIONS_DIR=/app/migrations
COPY --from=build /opt/venv /opt/venv
COPY migrations /app/migrations
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin manager
USER 10001
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["workload-manager"]
CMD ["serve"]
