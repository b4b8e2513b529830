"""Checks what can be checked of deploy/ without a container engine: both files parse, the
compose services and the Dockerfile agree on ports and users, Prometheus scrapes the address
payledger's metrics listener is given and loads the alert rules. (The rules themselves, and the
dashboard, are checked against a real Prometheus by .ci/prometheus_check.py.)"""
import re
import sys

import yaml

compose = yaml.safe_load(open("deploy/compose.yaml"))
prometheus = yaml.safe_load(open("deploy/prometheus.yml"))
dockerfile = open("Dockerfile").read()
problems = []

services = compose["services"]
for name in ("postgres", "payledger", "prometheus"):
    if name not in services:
        problems.append(f"compose: no service {name}")
env = services["payledger"]["environment"]
metrics_port = env["PAYLEDGER_METRICS_LISTEN"].rsplit(":", 1)[1]
listen_port = env["PAYLEDGER_LISTEN"].rsplit(":", 1)[1]
targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
if targets != [f"payledger:{metrics_port}"]:
    problems.append(f"prometheus scrapes {targets}, payledger serves metrics on port {metrics_port}")
if prometheus["scrape_configs"][0].get("metrics_path", "/metrics") != "/metrics":
    problems.append("prometheus must scrape /metrics")
rules_mount = [v for v in services["prometheus"]["volumes"] if v.startswith("./rules.yml:")]
if not rules_mount or rules_mount[0].split(":")[1] not in prometheus.get("rule_files", []):
    problems.append("prometheus must load deploy/rules.yml (mounted by compose, named in rule_files)")
if "ARG PAYLEDGER_BUILD_COMMIT" not in dockerfile:
    problems.append("Dockerfile: ARG PAYLEDGER_BUILD_COMMIT must reach the build (payledger_build_info)")
host, user, password = "postgres", "payledger", "payledger"
url = env["DATABASE_URL"]
expected = f"postgres://{user}:{password}@{host}:5432/{services['postgres']['environment']['POSTGRES_DB']}"
if url != expected:
    problems.append(f"DATABASE_URL {url} does not match the postgres service ({expected})")
if services["payledger"]["depends_on"]["postgres"]["condition"] != "service_healthy":
    problems.append("payledger must wait for a healthy postgres")
ports = services["payledger"]["ports"]
if ports != [f"127.0.0.1:{listen_port}:{listen_port}"]:
    problems.append(f"payledger publishes {ports}, listens on {listen_port}")
if env.get("PAYLEDGER_INSECURE_ALLOW_UNAUTHENTICATED"):
    problems.append("the compose file must not turn authentication off")
jwks_mount = [v for v in services["payledger"]["volumes"] if v.endswith(":" + env["PAYLEDGER_AUTH_JWKS"] + ":ro")]
if not jwks_mount:
    problems.append("the JWKS named by PAYLEDGER_AUTH_JWKS is not mounted read-only")

if not re.search(r"^USER \d+:\d+$", dockerfile, re.M):
    problems.append("Dockerfile: USER must be numeric (uid:gid)")
if "strip " in dockerfile:
    problems.append("Dockerfile: the binary must keep its line tables (no strip)")
if "objcopy --compress-debug-sections=zlib target/release/payledger" not in dockerfile:
    problems.append("Dockerfile: the binary's line tables must be compressed (objcopy --compress-debug-sections=zlib)")
# Docker's default stop grace (10 s) equals the server's own: SIGKILL could land mid-shutdown.
grace = int(env.get("PAYLEDGER_SHUTDOWN_GRACE_SECONDS", 10))
stop = re.fullmatch(r"(\d+)s", str(services["payledger"].get("stop_grace_period", "10s")))
if not stop or int(stop.group(1)) < grace + 5:
    problems.append(f"compose: payledger's stop_grace_period must exceed its shutdown grace ({grace} s) by 5 s at least")
healthcheck = re.search(r"^HEALTHCHECK .*\n.*CMD \[(.*)\]", dockerfile, re.M)
if not healthcheck or '"health"' not in healthcheck.group(1):
    problems.append("Dockerfile: HEALTHCHECK must run `payledger health`")
exposed = re.search(r"^EXPOSE (.*)$", dockerfile, re.M).group(1).split()
for port in (listen_port, metrics_port):
    if port not in exposed:
        problems.append(f"Dockerfile: port {port} not exposed")

for problem in problems:
    print("deploy:", problem, file=sys.stderr)
sys.exit(1 if problems else 0)
