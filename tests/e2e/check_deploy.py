#!/usr/bin/env python3
"""Checks deploy/ without a cluster, Helm or Docker: exits 1 listing every problem found.

  python3 tests/e2e/check_deploy.py        (needs PyYAML: pip install -r deploy/requirements-dev.txt)

What it checks:
- every YAML file outside the Helm templates parses; every Kubernetes object names its kind;
- the Helm chart: Chart.yaml fields, values.flags is exactly the server's flag set, every
  .Values path a template reads exists, every included template is defined, every .Files.Get
  target exists, template delimiters balance;
- deploy/k8s is what the chart renders with its defaults (args, ports, probes, grace period,
  resources, security, PDB) and matches the Dockerfile (ports, uid, entrypoint); the image's
  build context holds every project header its sources include;
- the Grafana dashboard: JSON, variables, unique panel ids, templated datasource, every contract
  metric shown, only contract metrics used;
- the Prometheus rules: only contract metrics (or recorded series) used, alerts carry severity
  and summary;
- with promtool on PATH: `promtool check rules` on the rules and on the dashboard's queries, and
  `promtool test rules`; with helm on PATH (deploy/requirements-dev.txt installs it): `helm lint`,
  the chart rendered with its defaults equals deploy/k8s, and its AttendSocket directory options
  render (and refuse bad values); with kubectl on PATH: `kubectl kustomize` of deploy/k8s and
  deploy.
"""

import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:
    sys.exit("check_deploy: PyYAML is missing; pip install -r deploy/requirements-dev.txt")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kvpool"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "kvpool-dashboard.json"
# The labels that tell kvpool deployments apart (the ServiceMonitor sets kubernetes_namespace);
# every dashboard query selects both through variables of the same names.
DEPLOYMENT_LABELS = ("kubernetes_namespace", "job")
RULES = DEPLOY / "prometheus" / "kvpool-rules.yaml"
RULES_TEST = DEPLOY / "prometheus" / "kvpool-rules_test.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"

# The server's flags (the contract between kvpool-server and its deployments), as defined in
# its main.
SERVER_MAIN = ROOT / "service" / "server_main.cc"
SERVER_FLAGS = set(re.findall(r"^ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,", SERVER_MAIN.read_text(), re.M))

# The metrics the server exports (the contract between the server, the dashboard and the rules),
# as its sources register them.
CONTRACT_METRICS = {
    name
    for path in sorted((ROOT / "service").rglob("*.cc"))
    for name in re.findall(r'Add(?:Gauge|Counter|Histogram)\(\s*"(kvpool_\w+)"', path.read_text())
}
HISTOGRAMS = {"kvpool_rpc_duration_seconds"}
SERIES_RE = re.compile(r"(?<![\w:])(kvpool[_:][A-Za-z0-9_:]*)")


class Report:
    """Collects problems; every check appends and carries on so one run lists them all."""

    def __init__(self):
        self.problems = []

    def error(self, where, what):
        self.problems.append(f"{where}: {what}")

    def expect_equal(self, where, what, got, want):
        if got != want:
            self.error(where, f"{what} is {got!r}, expected {want!r}")


def rel(path):
    return path.relative_to(ROOT)


def load_yaml_docs(report, path):
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        report.error(rel(path), f"YAML does not parse: {e}")
        return []


def series_used(expr):
    """kvpool series names (metrics and recorded series) read by a PromQL expression."""
    return set(SERIES_RE.findall(expr))


def allowed_series(recorded):
    allowed = set(CONTRACT_METRICS) | set(recorded)
    for h in HISTOGRAMS:
        allowed |= {h + "_bucket", h + "_sum", h + "_count"}
    return allowed


def base_metric(series):
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix) and series[: -len(suffix)] in HISTOGRAMS:
            return series[: -len(suffix)]
    return series


def run_tool(report, where, argv):
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        report.error(where, f"`{' '.join(argv)}` failed:\n{proc.stdout}{proc.stderr}")
    return proc


# ---- plain YAML and Kubernetes objects ----------------------------------------------------------

def check_yaml_files(report):
    templates = CHART / "templates"
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        if templates in path.parents or path.suffix not in (".yaml", ".yml"):
            continue
        docs = load_yaml_docs(report, path)
        if K8S in path.parents and path.name != "kustomization.yaml":
            for doc in docs:
                for key in ("apiVersion", "kind"):
                    if key not in doc:
                        report.error(rel(path), f"object without {key}")
                if not doc.get("metadata", {}).get("name"):
                    report.error(rel(path), "object without metadata.name")


def k8s_objects(report):
    objects = {}
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml_docs(report, path):
            objects[doc.get("kind")] = doc
    return objects


# ---- Helm chart ---------------------------------------------------------------------------------

def resolve(values, dotted):
    node = values
    for key in dotted.strip(".").split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def check_chart(report):
    chart_docs = load_yaml_docs(report, CHART / "Chart.yaml")
    values_docs = load_yaml_docs(report, CHART / "values.yaml")
    if not chart_docs or not values_docs:
        return None, None
    chart, values = chart_docs[0], values_docs[0]
    for key in ("apiVersion", "name", "version", "appVersion"):
        if key not in chart:
            report.error("Chart.yaml", f"missing {key}")
    report.expect_equal("Chart.yaml", "apiVersion", chart.get("apiVersion"), "v2")
    flags = set(values.get("flags", {}))
    for name in sorted(SERVER_FLAGS - flags):
        report.error("values.yaml", f"server flag --{name} has no value under flags")
    for name in sorted(flags - SERVER_FLAGS):
        report.error("values.yaml", f"flags.{name} is not a server flag")
    gpu = values.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    report.expect_equal("values.yaml", "resources.limits nvidia.com/gpu", gpu, 1)

    sources = {p: p.read_text() for p in sorted((CHART / "templates").iterdir()) if p.is_file()}
    defined = set()
    for text in sources.values():
        defined |= set(re.findall(r'define "([^"]+)"', text))
    for path, text in sources.items():
        where = rel(path)
        if text.count("{{") != text.count("}}"):
            report.error(where, "unbalanced {{ }}")
        for dotted in re.findall(r"\.Values((?:\.[A-Za-z_][\w-]*)+)", text):
            if not resolve(values, dotted):
                report.error(where, f".Values{dotted} is not in values.yaml")
        for name in re.findall(r'(?:include|template) "([^"]+)"', text):
            if name not in defined:
                report.error(where, f'template "{name}" is not defined')
        for name in re.findall(r'\.Files\.Get "([^"]+)"', text):
            if not (CHART / name).is_file():
                report.error(where, f"{name} does not exist in the chart")
    return chart, values


def flag_arg(name, value):
    """One server argument as the chart's kvpool.flagValue helper prints it."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float) and value.is_integer():
        text = str(int(value))
    else:
        text = str(value)
    return f"--{name}={text}"


def check_k8s_matches_chart(report, chart, values, objects):
    where = "deploy/k8s"
    sts = objects.get("StatefulSet")
    if sts is None:
        report.error(where, "no StatefulSet")
        return
    flags = values["flags"]
    spec = sts["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    report.expect_equal(where, "StatefulSet replicas", spec.get("replicas"), values["replicas"])
    report.expect_equal(where, "container image", container.get("image"),
                        f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}")
    report.expect_equal(where, "server args", container.get("args"),
                        [flag_arg(k, flags[k]) for k in sorted(flags)])
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    report.expect_equal(where, "container ports", ports,
                        {"grpc": flags["port"], "metrics": flags["metrics_port"],
                         "attend": flags["attend_socket_port"]})
    grace = (values["preStopSleepSeconds"] + math.ceil(flags["shutdown_grace_ms"] / 1000)
             + values["terminationGraceMarginSeconds"])
    report.expect_equal(where, "terminationGracePeriodSeconds",
                        pod.get("terminationGracePeriodSeconds"), grace)
    if grace * 1000 <= flags["shutdown_grace_ms"] + values["preStopSleepSeconds"] * 1000:
        report.error(where, "termination grace does not cover preStop plus --shutdown_grace_ms")
    report.expect_equal(where, "preStop", container["lifecycle"]["preStop"]["exec"]["command"],
                        ["sleep", str(values["preStopSleepSeconds"])])
    for probe in ("startup", "readiness", "liveness"):
        got = dict(container.get(probe + "Probe", {}))
        want = dict(values["probes"][probe])
        want["grpc"] = {"port": flags["port"]}
        if values["probes"]["grpcService"]:
            want["grpc"]["service"] = values["probes"]["grpcService"]
        report.expect_equal(where, f"{probe}Probe", got, want)
    report.expect_equal(where, "resources", container.get("resources"), values["resources"])
    report.expect_equal(where, "container securityContext", container.get("securityContext"),
                        values["securityContext"])
    report.expect_equal(where, "pod securityContext", pod.get("securityContext"),
                        values["podSecurityContext"])
    report.expect_equal(where, "tolerations", pod.get("tolerations"), values["tolerations"])
    socket_dir = [v for v in pod.get("volumes", []) if v["name"] == "attend-socket"]
    report.expect_equal(where, "attend-socket volume (chart default attendSocketDir.type)",
                        bool(socket_dir), bool(values["attendSocketDir"]["type"]))
    report.expect_equal(where, "extra containers", pod["containers"][1:], values["extraContainers"])
    shm = [v for v in pod.get("volumes", []) if v["name"] == "dshm"]
    report.expect_equal(where, "/dev/shm size", shm[0]["emptyDir"].get("sizeLimit") if shm else None,
                        values["shmSize"])
    pdb = objects.get("PodDisruptionBudget", {})
    report.expect_equal(where, "PDB maxUnavailable", pdb.get("spec", {}).get("maxUnavailable"),
                        values["podDisruptionBudget"]["maxUnavailable"])
    headless = next((d for d in load_yaml_docs(report, K8S / "service-headless.yaml")), {})
    report.expect_equal(where, "headless Service clusterIP", headless.get("spec", {}).get("clusterIP"),
                        "None")
    report.expect_equal(where, "StatefulSet serviceName", spec.get("serviceName"),
                        headless.get("metadata", {}).get("name"))
    report.expect_equal(where, "headless Service ports",
                        {p["name"]: p["port"] for p in headless.get("spec", {}).get("ports", [])},
                        {"grpc": flags["port"], "attend": flags["attend_socket_port"]})


def check_dockerfile(report, values):
    where = rel(DOCKERFILE)
    text = DOCKERFILE.read_text()
    exposed = set()
    for line in re.findall(r"^EXPOSE\s+(.+)$", text, re.M):
        exposed |= {int(p.split("/")[0]) for p in line.split()}
    report.expect_equal(where, "EXPOSE", exposed,
                        {values["flags"]["port"], values["flags"]["metrics_port"],
                         values["flags"]["attend_socket_port"]})
    users = re.findall(r"^USER\s+(\d+)", text, re.M)
    report.expect_equal(where, "USER", users[-1:], [str(values["podSecurityContext"]["runAsUser"])])
    if not re.search(r'^ENTRYPOINT \["[^"]*/kvpool-server"\]', text, re.M):
        report.error(where, "ENTRYPOINT is not kvpool-server")
    for variant in ("cuda", "cpu"):
        for stage in ("build-base", "runtime-base"):
            if f"AS {stage}-{variant}" not in text:
                report.error(where, f"no {stage}-{variant} stage")


def check_docker_context(report):
    """Every project header that the sources the image copies include is copied too, and let
    through by the build context's .dockerignore (a header left out breaks the image's build)."""
    where = rel(DOCKERFILE)
    copied = [src.rstrip("/") for src in
              re.findall(r"^COPY\s+(?!--)(\S+)\s", DOCKERFILE.read_text(), re.M)]
    ignore = DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]

    def covered(path, prefixes):
        return any(path == p or path.startswith(p + "/") for p in prefixes)

    for top in copied:
        if not (ROOT / top).is_dir():
            continue
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".h", ".cc", ".cu", ".cuh") or not covered(str(rel(path)), allowed):
                continue
            for header in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M):
                if not (ROOT / header).is_file():
                    continue  # generated (kvpool/v1/...) or a dependency's
                if not covered(header, copied) or not covered(header, allowed):
                    report.error(where, f"{rel(path)} includes {header}, which the image's "
                                        "build context does not hold")


# ---- dashboard and rules ------------------------------------------------------------------------

def recorded_series(report):
    docs = load_yaml_docs(report, RULES)
    groups = docs[0].get("groups", []) if docs else []
    return groups, {r["record"] for g in groups for r in g.get("rules", []) if "record" in r}


def check_rules(report, groups, recorded):
    where = rel(RULES)
    allowed = allowed_series(recorded)
    for group in groups:
        for rule in group.get("rules", []):
            name = rule.get("record") or rule.get("alert")
            if ("record" in rule) == ("alert" in rule):
                report.error(where, f"rule {name!r} must have exactly one of record, alert")
            for series in sorted(series_used(rule.get("expr", "")) - allowed):
                report.error(where, f"{name}: {series} is not a contract metric")
            if "record" in rule and not re.fullmatch(r"kvpool:[a-z0-9_]+:[a-z0-9_]+", name):
                report.error(where, f"recorded series {name} is not named kvpool:<metric>:<op>")
            if "alert" in rule:
                if rule.get("labels", {}).get("severity") not in ("warning", "critical"):
                    report.error(where, f"alert {name} has no warning/critical severity")
                if not rule.get("annotations", {}).get("summary"):
                    report.error(where, f"alert {name} has no summary")


def dashboard_panels(dashboard):
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def check_dashboard(report, recorded):
    where = rel(DASHBOARD)
    try:
        dashboard = json.loads(DASHBOARD.read_text())
    except json.JSONDecodeError as e:
        report.error(where, f"JSON does not parse: {e}")
        return []
    if not dashboard.get("uid"):
        report.error(where, "no uid")
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    for name in ("datasource", "kubernetes_namespace", "job", "namespace", "pod"):
        if name not in variables:
            report.error(where, f"no ${name} variable")
    if variables.get("datasource", {}).get("type") != "datasource":
        report.error(where, "$datasource is not a datasource variable")
    allowed = allowed_series(recorded)
    ids, used, exprs = set(), set(), []
    for panel in dashboard_panels(dashboard):
        pid = panel.get("id")
        if pid in ids:
            report.error(where, f"panel id {pid} used twice")
        ids.add(pid)
        if "gridPos" not in panel:
            report.error(where, f"panel {pid} has no gridPos")
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            report.error(where, f"panel {pid} does not use the $datasource variable")
        if not panel.get("targets"):
            report.error(where, f"panel {pid} ({panel.get('title')}) has no query")
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            exprs.append(expr)
            series = series_used(expr)
            used |= {base_metric(s) for s in series}
            for s in sorted(series - allowed):
                report.error(where, f"panel {pid}: {s} is not a contract metric")
            # Releases of one name in two Kubernetes namespaces share a job: both pick one.
            for selector in re.findall(r"kvpool_\w+\{[^}]*\}|kvpool_\w+(?![\w{(])", expr):
                if any(f'{label}=~"${label}"' not in selector for label in DEPLOYMENT_LABELS):
                    report.error(where, f"panel {pid}: {selector} does not select the deployment")
    for metric in sorted(CONTRACT_METRICS - used):
        report.error(where, f"no panel shows {metric}")
    return exprs


def check_with_promtool(report, dashboard_exprs):
    if shutil.which("promtool") is None:
        print("check_deploy: promtool not on PATH, skipping PromQL syntax and rule unit tests")
        return
    run_tool(report, rel(RULES), ["promtool", "check", "rules", str(RULES)])
    run_tool(report, rel(RULES_TEST), ["promtool", "test", "rules", str(RULES_TEST)])
    substitutions = {"$__rate_interval": "5m", "$namespace": ".*", "$pod": ".*"}
    rules = []
    for i, expr in enumerate(dashboard_exprs):
        for var, text in substitutions.items():
            expr = expr.replace(var, text)
        rules.append({"record": f"dashboard:query_{i}:check", "expr": expr})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
        f.flush()
        run_tool(report, rel(DASHBOARD), ["promtool", "check", "rules", f.name])


def helm_template(report, where, *sets):
    """Objects of `helm template kvpool` with --set `sets`, or None (and a problem) on failure."""
    argv = ["helm", "template", "kvpool", str(CHART)]
    for item in sets:
        argv += ["--set", item]
    proc = run_tool(report, where, argv)
    return [d for d in yaml.safe_load_all(proc.stdout) if d] if proc.returncode == 0 else None


def pod_spec(objects):
    return next(d for d in objects if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def check_with_helm(report):
    """The chart lints, renders deploy/k8s with its defaults (release name kvpool), mounts the
    AttendSocket directory as asked, and refuses a socket outside it or an unknown volume type."""
    if shutil.which("helm") is None:
        print("check_deploy: helm not on PATH, skipping helm lint and template renders")
        return
    where = rel(CHART)
    run_tool(report, where, ["helm", "lint", str(CHART)])
    rendered = helm_template(report, where)
    if rendered is None:
        return
    k8s = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in load_yaml_docs(report, path):
                k8s[(doc["kind"], doc["metadata"]["name"])] = doc
    got = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    report.expect_equal(where, "objects rendered with the defaults", sorted(got), sorted(k8s))
    for key in sorted(set(got) & set(k8s)):
        report.expect_equal(where, f"rendered {key[0]} {key[1]} spec", got[key].get("spec"),
                            k8s[key].get("spec"))

    mount = {"name": "attend-socket", "mountPath": "/run/kvpool"}
    socket = "flags.attend_unix_socket=/run/kvpool/attend.sock"
    per_pod = "flags.attend_unix_socket=/run/kvpool/$(POD_NAME).sock"
    host = helm_template(report, where, "attendSocketDir.type=hostPath", per_pod)
    if host is not None:
        pod = pod_spec(host)
        report.expect_equal(where, "hostPath socket volume",
                            [v for v in pod["volumes"] if v["name"] == "attend-socket"],
                            [{"name": "attend-socket",
                              "hostPath": {"path": "/run/kvpool", "type": "Directory"}}])
        if mount not in pod["containers"][0]["volumeMounts"]:
            report.error(where, "hostPath socket directory not mounted in the server container")
    worker = {"name": "worker", "image": "worker:1", "volumeMounts": [mount]}
    shared = helm_template(report, where, "attendSocketDir.type=emptyDir", socket,
                           "extraContainers[0].name=worker", "extraContainers[0].image=worker:1",
                           "extraContainers[0].volumeMounts[0].name=attend-socket",
                           "extraContainers[0].volumeMounts[0].mountPath=/run/kvpool")
    if shared is not None:
        pod = pod_spec(shared)
        report.expect_equal(where, "emptyDir socket volume",
                            [v for v in pod["volumes"] if v["name"] == "attend-socket"],
                            [{"name": "attend-socket", "emptyDir": {}}])
        report.expect_equal(where, "extra containers", pod["containers"][1:], [worker])
    # Ports turned off (-1) leave no port, Service port or scrape of theirs.
    helm_template(report, where, "flags.attend_unix_socket=/tmp/attend.sock")  # /tmp is writable
    closed = helm_template(report, where, "flags.metrics_port=-1", "flags.attend_socket_port=-1",
                           "serviceMonitor.enabled=true")
    if closed is not None:
        ports = [p for d in closed if d["kind"] == "Service" for p in d["spec"]["ports"]]
        ports += pod_spec(closed)["containers"][0]["ports"]
        report.expect_equal(where, "ports rendered with metrics and attend ports off",
                            sorted(p["name"] for p in ports), ["grpc", "grpc"])
        kinds = sorted(d["kind"] for d in closed)
        if "ServiceMonitor" in kinds or kinds.count("Service") != 1:
            report.error(where, f"metrics objects rendered with metrics_port=-1: {kinds}")
    # Servers of one node would share a hostPath socket unless its name holds the pod's; without a
    # socket directory the server can create its socket only in its writable mounts.
    for bad in (["attendSocketDir.type=emptyDir", "flags.attend_unix_socket=/tmp/attend.sock"],
                ["attendSocketDir.type=nfs", socket],
                ["attendSocketDir.type=hostPath", socket],
                [socket]):
        argv = ["helm", "template", "kvpool", str(CHART)] + [a for b in bad for a in ("--set", b)]
        if subprocess.run(argv, capture_output=True, cwd=ROOT).returncode == 0:
            report.error(where, f"helm template accepted {' '.join(bad)}")


def check_with_kubectl(report):
    if shutil.which("kubectl") is None:
        print("check_deploy: kubectl not on PATH, skipping kustomize builds")
        return
    want = {
        K8S: ["PodDisruptionBudget", "Service", "Service", "StatefulSet"],
        DEPLOY: ["ConfigMap", "ConfigMap", "PodDisruptionBudget", "Service", "Service",
                 "ServiceMonitor", "StatefulSet"],
    }
    for folder, kinds in want.items():
        proc = run_tool(report, rel(folder), ["kubectl", "kustomize", str(folder)])
        if proc.returncode == 0:
            got = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
            report.expect_equal(rel(folder), "kustomize output kinds", got, kinds)


def main():
    report = Report()
    check_yaml_files(report)
    chart, values = check_chart(report)
    # The cross-checks index values.yaml freely, so they run only on a chart that passed.
    if values is not None and not report.problems:
        check_k8s_matches_chart(report, chart, values, k8s_objects(report))
        check_dockerfile(report, values)
    check_docker_context(report)
    groups, recorded = recorded_series(report)
    check_rules(report, groups, recorded)
    exprs = check_dashboard(report, recorded)
    check_with_promtool(report, exprs)
    check_with_helm(report)
    check_with_kubectl(report)
    for problem in report.problems:
        print(f"FAIL {problem}")
    print(f"check_deploy: {len(report.problems)} problem(s)")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
