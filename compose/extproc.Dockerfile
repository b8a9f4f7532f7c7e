# The ext_proc image (also runs the simulator: `extproc sim ...`). Build from the repository root:
#   docker build -f compose/extproc.Dockerfile -t extproc:local .
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc ./extproc
RUN pip install --no-cache-dir . && rm -rf /src

# The shipped policy, so the image starts on its own; the compose stacks mount the policies directory over it.
COPY policies /etc/extproc/policies

USER nobody
# 50051: ext_proc gRPC (Envoy's filter and access log).  9090: /metrics and /healthz (keep it off public networks).
EXPOSE 50051 9090
ENTRYPOINT ["extproc"]
CMD ["serve", "--policy", "/etc/extproc/policies/default.yaml", "--grpc", "0.0.0.0:50051", "--metrics", "0.0.0.0:9090"]
