"""The rendered manifests (scripts/check-kubernetes) held to the API schemas
and to what the relay does. Each failure is printed; the exit code is 1 if
any. Usage: check-kubernetes.py --venv DIR --relay BINARY RENDER.yaml..."""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import kubernetes_validate
import yaml

# The Kubernetes versions the manifests must be valid for (EKS's supported
# range at the time of writing, and the newest the validator knows).
VERSIONS = ["1.30.0", "1.32.0", "1.34.0"]
CRD_GROUPS = ("monitoring.coreos.com/",)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
failures = []


def fail(render, what):
    failures.append(f"{os.path.basename(render)}: {what}")


def validate_schemas(render, docs):
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                fail(render, f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {e.message}")


def mebibytes(quantity):
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity)
    if not m:
        raise ValueError(f"memory {quantity!r}: use Ki, Mi or Gi")
    return int(m.group(1)) * units[m.group(2)]


def relay_check(relay, toml):
    """`run --check` of a configuration: its summary, or why it failed."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml)
    env = dict(os.environ, OUTBOX_RELAY_DATABASE_URL="postgres://relay@db.invalid:5432/app")
    r = subprocess.run([relay, "run", "--check", "--config", f.name], capture_output=True, text=True, env=env)
    os.unlink(f.name)
    return r.returncode == 0, r.stdout + r.stderr


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def probe_live(relay, toml, paths):
    """Start the relay with this configuration and a database that accepts
    the connection and never answers (start-up waits on it): the probe paths
    must answer on the configured port, liveness 200, readiness 503."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = re.search(r'metrics_addr\s*=\s*"[^"]*:(\d+)"', toml).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml)
    env = dict(os.environ, OUTBOX_RELAY_DATABASE_URL=f"postgres://relay@127.0.0.1:{silent.getsockname()[1]}/app")
    env["OUTBOX_RELAY_CONNECT_TIMEOUT"] = "60s"
    p = subprocess.Popen([relay, "run", "--config", f.name], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    answers = {}
    try:
        deadline = time.time() + 20
        while time.time() < deadline and get(f"http://127.0.0.1:{port}/healthz")[0] == 0:
            if p.poll() is not None:
                break
            time.sleep(0.1)
        for path in paths:
            answers[path] = get(f"http://127.0.0.1:{port}{path}")[0]
    finally:
        p.kill()
        p.wait()
        silent.close()
        os.unlink(f.name)
    return answers


def check_deployment(render, deployment, docs, relay, live_checked):
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    name = deployment["metadata"]["name"]
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mount = next(m for m in container["volumeMounts"] if "configMap" in volumes[m["name"]])
    config_name = volumes[mount["name"]]["configMap"]["name"]
    if config_name not in configmaps:
        fail(render, f"{name}: ConfigMap {config_name} not rendered")
        return
    toml = configmaps[config_name]["data"]["relay.toml"]
    args = container["args"]
    if args != ["run", "--config", mount["mountPath"] + "/relay.toml"]:
        fail(render, f"{name}: args {args} do not run the mounted relay.toml")
    if "OUTBOX_RELAY_DATABASE_URL" not in {e["name"] for e in container.get("env", [])}:
        fail(render, f"{name}: no OUTBOX_RELAY_DATABASE_URL")
    ok, summary = relay_check(relay, toml)
    if not ok:
        fail(render, f"{name}: run --check refused its configuration: {summary.strip()}")
        return
    bound = int(re.search(r"memory bound: (\d+) MiB", summary).group(1))
    limit = mebibytes(container["resources"]["limits"]["memory"])
    if limit < bound:
        fail(render, f"{name}: memory limit {limit} MiB under the relay's bound {bound} MiB")
    port = int(re.search(r'metrics_addr\s*=\s*"[^"]*:(\d+)"', toml).group(1))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {}
    for kind in ("livenessProbe", "readinessProbe"):
        get_ = container[kind]["httpGet"]
        probes[kind] = get_["path"]
        if ports.get(get_["port"], get_["port"]) != port:
            fail(render, f"{name}: {kind} on port {get_['port']}, the relay serves on {port}")
    if probes != {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}:
        fail(render, f"{name}: probes {probes}: liveness is /healthz, readiness /readyz")
    if toml in live_checked:
        return
    live_checked.add(toml)
    answers = probe_live(relay, toml, ["/healthz", "/readyz", "/metrics"])
    expected = {"/healthz": 200, "/readyz": 503, "/metrics": 200}
    if answers != expected:
        fail(render, f"{name}: the relay started with its configuration answered {answers}, expected {expected}")


def check_services(render, docs):
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selected = [d for d in deployments
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        if len(selected) != 1:
            fail(render, f"Service {svc['metadata']['name']} selects {len(selected)} Deployments")
            continue
        (container,) = selected[0]["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        for p in svc["spec"]["ports"]:
            if p["targetPort"] not in names:
                fail(render, f"Service {svc['metadata']['name']}: targetPort {p['targetPort']} is not a container port")
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        selected = [d for d in deployments
                    if pdb["spec"]["selector"]["matchLabels"].items()
                    <= d["spec"]["template"]["metadata"]["labels"].items()]
        if len(selected) != 1:
            fail(render, f"PodDisruptionBudget {pdb['metadata']['name']} selects {len(selected)} Deployments")


def check_monitoring(render, docs):
    with open(os.path.join(REPO, "deploy/prometheus-alerts.yml")) as f:
        groups = yaml.safe_load(f)["groups"]
    with open(os.path.join(REPO, "deploy/grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    for r in rules:
        if r["spec"]["groups"] != groups:
            fail(render, "PrometheusRule differs from deploy/prometheus-alerts.yml (scripts/check-kubernetes --sync)")
    for cm in (d for d in docs if d["kind"] == "ConfigMap" and "grafana-dashboard.json" in d.get("data", {})):
        if json.loads(cm["data"]["grafana-dashboard.json"]) != dashboard:
            fail(render, "dashboard ConfigMap differs from deploy/grafana-dashboard.json (scripts/check-kubernetes --sync)")
    services = [d for d in docs if d["kind"] == "Service"]
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        match = sm["spec"]["selector"]["matchLabels"].items()
        selected = [s for s in services if match <= s["metadata"].get("labels", {}).items()]
        ports = {p["name"] for s in selected for p in s["spec"]["ports"]}
        if not selected or any(e["port"] not in ports for e in sm["spec"]["endpoints"]):
            fail(render, f"ServiceMonitor {sm['metadata']['name']} selects no Service with its port")
    if any(d["kind"] == "Deployment" for d in docs) and (len(rules) != 1):
        fail(render, f"{len(rules)} PrometheusRules: one per render (the alerts would fire once per copy)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv")
    ap.add_argument("--relay", required=True)
    ap.add_argument("renders", nargs="+")
    a = ap.parse_args()
    live_checked = set()
    for render in a.renders:
        with open(render) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        validate_schemas(render, docs)
        check_services(render, docs)
        check_monitoring(render, docs)
        for d in docs:
            if d["kind"] == "Deployment":
                check_deployment(render, d, docs, a.relay, live_checked)
            if d["kind"] in ("Deployment", "Job") and "namespace" not in d["metadata"]:
                fail(render, f"{d['kind']} {d['metadata']['name']} has no namespace")
    for f in failures:
        print(f"check-kubernetes: {f}", file=sys.stderr)
    sys.exit(1 if failures else 0)


main()
