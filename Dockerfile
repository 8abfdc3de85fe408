# cloche's container image. Build it with scripts/image.sh [TAG] (it makes the base image
# from the machine's Debian mirror when it is missing); run it as the README's deployment
# section says (runsc inside needs --cap-add SYS_ADMIN --security-opt seccomp=unconfined).
ARG BASE=cloche-base:bookworm

# Build stage: the virtualenv with cloche, and the sandbox runtime (site-packages that code
# inside the sandboxes imports). Each layer changes only with its own inputs.
FROM ${BASE} AS build
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3 python3-venv >/dev/null \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/cloche
# PEM certificates pip trusts besides its own (scripts/image.sh passes the machine's local
# CAs, /usr/local/share/ca-certificates, for networks whose proxy re-signs TLS).
ARG EXTRA_CA_CERTS=""
RUN python3 -m venv .venv \
    && cat .venv/lib/python3*/site-packages/pip/_vendor/certifi/cacert.pem >/opt/ca.pem \
    && printf '%s\n' "$EXTRA_CA_CERTS" >>/opt/ca.pem
ENV PIP_CERT=/opt/ca.pem
COPY runtime-requirements.txt ./
RUN .venv/bin/pip install --no-cache-dir -q --disable-pip-version-check \
        --target .runtime/site-packages -r runtime-requirements.txt
COPY pyproject.toml ./
# Optional extras of pyproject.toml to install too, comma-separated: `cluster` (Ray) makes the
# image of cluster mode's pods (scripts/image.sh --cluster; deploy/kubernetes/cluster/).
ARG CLOCHE_EXTRAS=""
RUN .venv/bin/python -c 'import os, tomllib; project = tomllib.load(open("pyproject.toml", "rb"))["project"]; extras = [e.strip() for e in os.environ.get("CLOCHE_EXTRAS", "").split(",") if e.strip()]; print(*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e]), sep="\n")' >requirements.txt \
    && .venv/bin/pip install --no-cache-dir -q --disable-pip-version-check -r requirements.txt
COPY README.md ./
COPY src ./src
RUN .venv/bin/pip install --no-cache-dir -q --disable-pip-version-check --no-deps . \
    && .venv/bin/pip uninstall -y -q pip setuptools

# Final stage: Python (no compiler, no pip), runsc from bookworm-backports (by the install
# script's own runsc step), tini as PID 1, and the two directories built above.
FROM ${BASE}
COPY scripts/install.sh /tmp/install.sh
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3 tini >/dev/null \
    && bash -c 'source /tmp/install.sh && install_runsc' \
    && rm -rf /var/lib/apt/lists/* /tmp/install.sh
COPY --from=build /opt/cloche/.runtime /opt/cloche/.runtime
COPY --from=build /opt/cloche/.venv /opt/cloche/.venv
# matplotlib's font list, built as the sandboxes see this stage's fonts (cloche.sandbox.fonts):
# a session's first plot reads it instead of scanning every font.
RUN /opt/cloche/.venv/bin/python -m cloche.sandbox.fonts /opt/cloche/.runtime/site-packages
ENV PATH=/opt/cloche/.venv/bin:$PATH \
    CLOCHE_HOST=0.0.0.0 \
    CLOCHE_RUNTIME_DIR=/opt/cloche/.runtime/site-packages \
    CLOCHE_DATA_DIR=/var/lib/cloche
# Sessions' saved state (--data-dir); runsc's own state stays in /run/cloche.
VOLUME /var/lib/cloche
EXPOSE 8000 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c 'import os, urllib.request; urllib.request.urlopen("http://127.0.0.1:%s/health" % os.environ.get("CLOCHE_HTTP_PORT", "8080"), timeout=4)'
# tini forwards SIGTERM to cloche (which pauses or closes sessions and exits 0) and reaps the
# orphans that runsc leaves to PID 1.
ENTRYPOINT ["tini", "--", "cloche"]
CMD ["serve"]
