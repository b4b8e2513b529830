#!/usr/bin/env python3
"""deploy/'s alert rules and Grafana dashboard against a real Prometheus and a real payledger.

1. `promtool check rules` and `promtool test rules` on deploy/rules.yml.
2. A payledger server (SQLite, /metrics on), a Prometheus scraping it every second with the
   rules loaded, and a short load: `payledger-tools demo` (one refused call among them),
   `payledger-tools bench --scenario mixed` with duplicates, and `payledger health`.
3. Every alert and recording expression, every dashboard query and every dashboard variable is
   then asked of that Prometheus: each must parse, each metric it names must be one the server
   exposes (or a recording rule of deploy/rules.yml, or Prometheus's own `up`), each rule must
   evaluate without error, and each dashboard query and variable must return data.

Exits 1 naming every failure. Binaries: target/debug/payledger and payledger-tools (built
first); `prometheus` and `promtool` from Debian's `prometheus` package.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "deploy", "rules.yml")
RULE_TESTS = os.path.join(ROOT, "deploy", "rules.test.yml")
DASHBOARD = os.path.join(ROOT, "deploy", "grafana-dashboard.json")
BIN = os.path.join(ROOT, "target", "debug")
# What the dashboard's Grafana variables stand for in this check.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$job": "payledger", "$instance": ".*"}
# Words of PromQL that are not metric names.
KEYWORDS = {
    "and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
    "group_right", "offset", "inf", "nan", "Inf", "NaN",
}


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def query(prometheus, expr):
    """The API's answer to an instant query (a 400 for a parse error is an answer too)."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return get(url)
    except urllib.error.HTTPError as error:
        return json.load(error)


def metric_names(expr):
    """The metric names an expression selects: identifiers outside label matchers, ranges,
    strings and grouping clauses, not called as functions, not PromQL words."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        following = text[match.end():].lstrip()
        if word in KEYWORDS or following.startswith("("):
            continue
        if re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def dashboard_queries():
    with open(DASHBOARD) as file:
        dashboard = json.load(file)
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    variables = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            definition = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            variables.append((variable["name"], definition))
    return queries, variables


def substitute(expr):
    for name, value in SUBSTITUTIONS.items():
        expr = expr.replace(name, value)
    return expr


def wait_for(what, check, seconds):
    """Polls `check` for up to `seconds`; False (and a line saying so) if it never held."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if check():
                return True
        except OSError:
            pass
        time.sleep(0.5)
    print(f"prometheus check: never {what} within {seconds} s")
    return False


def main():
    failures = []
    check(failures)
    for failure in failures:
        print(f"FAILED: {failure}")
    if failures:
        sys.exit(1)
    print("prometheus check: every rule and dashboard query holds against a real Prometheus")


def check(failures):
    print("promtool check rules / test rules")
    for command in (["promtool", "check", "rules", RULES], ["promtool", "test", "rules", RULE_TESTS]):
        if subprocess.run(command).returncode != 0:
            failures.append(" ".join(command[:3]) + " failed (above)")

    queries, variables = dashboard_queries()

    work = tempfile.mkdtemp(prefix="payledger-prometheus-")
    grpc_port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    processes = []
    try:
        server_log = open(os.path.join(work, "payledger.log"), "w")
        processes.append(subprocess.Popen(
            [os.path.join(BIN, "payledger"), "serve", "--listen", f"127.0.0.1:{grpc_port}",
             "--metrics-listen", f"127.0.0.1:{metrics_port}",
             "--database-url", f"sqlite:{work}/ledger.db?mode=rwc", "--log-filter", "warn"],
            stdout=server_log, stderr=subprocess.STDOUT))
        with open(os.path.join(work, "prometheus.yml"), "w") as config:
            config.write(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                f"rule_files: [{json.dumps(RULES)}]\n"
                "scrape_configs:\n  - job_name: payledger\n    static_configs:\n"
                f"      - targets: ['127.0.0.1:{metrics_port}']\n")
        prometheus_log = open(os.path.join(work, "prometheus.log"), "w")
        processes.append(subprocess.Popen(
            ["prometheus", f"--config.file={work}/prometheus.yml", f"--storage.tsdb.path={work}/data",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            stdout=prometheus_log, stderr=subprocess.STDOUT))
        prometheus = f"http://127.0.0.1:{prometheus_port}"

        def scraped():
            result = query(prometheus, 'up{job="payledger"}')["data"]["result"]
            return bool(result) and result[0]["value"][1] == "1"

        if not wait_for("a successful scrape of payledger", scraped, 60):
            failures.append("Prometheus never scraped payledger's /metrics")
            return
        target = f"http://127.0.0.1:{grpc_port}"
        tools = os.path.join(BIN, "payledger-tools")
        print("load: demo, bench mixed with duplicates, health")
        subprocess.run([tools, "demo", "--target", target, "--allow-test-data"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([tools, "bench", "--target", target, "--allow-test-data", "--scenario", "mixed",
                        "--total", "1500", "--concurrency", "8", "--duplicate-ratio", "0.1", "--progress", "never"],
                       check=True, stdout=subprocess.DEVNULL)
        for _ in range(3):
            subprocess.run([os.path.join(BIN, "payledger"), "health", "--target", target], check=True,
                           stdout=subprocess.DEVNULL)
        # Rates over 1m need two scrapes after the load; rules need an evaluation after them.
        time.sleep(5)
        wait_for("an evaluation of every rule", lambda: all(
            rule.get("health") == "ok"
            for group in get(f"{prometheus}/api/v1/rules")["data"]["groups"] for rule in group["rules"]), 30)

        names = set(get(f"{prometheus}/api/v1/label/__name__/values")["data"])
        # The rules as Prometheus loaded them from deploy/rules.yml, with their last evaluation.
        groups = get(f"{prometheus}/api/v1/rules")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        if not rules:
            failures.append("Prometheus loaded no rule from deploy/rules.yml")
        recorded = {rule["name"] for rule in rules if rule["type"] == "recording"}
        known = names | recorded | {"up"}

        def check_names(where, expr):
            for name in sorted(metric_names(expr) - known):
                failures.append(f"{where}: names {name}, which payledger does not expose")

        for rule in rules:
            where = f"rule {rule['name']}"
            check_names(where, rule["query"])
            answer = query(prometheus, rule["query"])
            if answer["status"] != "success":
                failures.append(f"{where}: {answer.get('error')}")
            if rule.get("health") != "ok":
                failures.append(f"{where}: evaluated {rule.get('health')}: {rule.get('lastError')}")

        for title, expr in queries:
            where = f"dashboard panel {title!r}"
            expr = substitute(expr)
            check_names(where, expr)
            answer = query(prometheus, expr)
            if answer["status"] != "success":
                failures.append(f"{where}: {answer.get('error')}: {expr}")
            elif not answer["data"]["result"]:
                failures.append(f"{where}: no data: {expr}")
        for name, definition in variables:
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", substitute(definition))
            if not match:
                failures.append(f"dashboard variable {name}: not label_values(selector, label): {definition}")
                continue
            selector, label = match.groups()
            check_names(f"dashboard variable {name}", selector)
            series = get(f"{prometheus}/api/v1/series?" + urllib.parse.urlencode({"match[]": selector}))["data"]
            if not any(label in labels for labels in series):
                failures.append(f"dashboard variable {name}: no series of {selector} with a {label} label")
        print(f"{len(rules)} rules, {len(queries)} dashboard queries, {len(variables)} variables "
              f"checked against {len(names)} metric names")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        if failures:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
