"""docs/deploy.md's Kubernetes manifests and gateway settings, checked for every field the probes and the drain rely
on: probes on /livez and /readyz at the container's port, a grace period that outlasts preStop + --drain-timeout,
one GPU, a Prometheus scrape of /metrics, an InferencePool that selects the Deployment's pods at their port, arguments
``blink`` accepts, metric names that a running server exports, and the image the repository's Dockerfile builds
(served as ``blink serve`` on its exposed port, by a user that is not root). (The HAProxy recipe runs in
test_router.py; the Dockerfile is linted by docs/gpu.md's snippet.)"""
import asyncio
import json
import re
import tomllib
from pathlib import Path

import pytest

import blink.version
import yaml

from blink.cli import _parser
from blink.nic.text import Tokenizer
from tests.nic.openai.local import local_server

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "docs" / "deploy.md"
ENGINE_STOP_S = 10          # the grace period's room for the engine's shutdown after the drain


def code_blocks(info: str) -> list[str]:
    """The fenced code blocks of docs/deploy.md whose info string is ``info`` (```yaml, ```haproxy, ...)."""
    return re.findall(rf"^```{info}\n(.*?)^```$", DEPLOY.read_text(), flags=re.DOTALL | re.MULTILINE)


def code_block(info: str) -> str:
    (block,) = code_blocks(info)
    return block


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    documents = [d for block in code_blocks("yaml") for d in yaml.safe_load_all(block)]
    by_kind = {d["kind"]: d for d in documents}
    assert len(by_kind) == len(documents), "one manifest per kind"
    return by_kind


def container(manifests) -> dict:
    (blink,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return blink


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_container_runs_a_blink_command_line_that_parses(manifests):
    blink = container(manifests)
    assert blink["command"] == ["blink"]
    args = _parser().parse_args(blink["args"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert args.port == blink["ports"][0]["containerPort"]


def test_the_probes_ask_the_right_endpoints_at_the_containers_port(manifests):
    blink = container(manifests)
    (port,) = blink["ports"]
    for probe, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        get = blink[probe]["httpGet"]
        assert get["path"] == path and get["port"] in (port["name"], port["containerPort"]), probe
    # Liveness must outlast a hiccup: at least --liveness-timeout before a restart.
    liveness, timeout_s = blink["livenessProbe"], float(option(blink["args"], "--liveness-timeout"))
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= timeout_s


def test_the_grace_period_outlasts_the_prestop_sleep_and_the_drain(manifests):
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    blink = container(manifests)
    drain_s = float(option(blink["args"], "--drain-timeout"))
    prestop_s = blink["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= prestop_s + drain_s + ENGINE_STOP_S


def test_one_gpu_per_replica_and_no_cpu_limit(manifests):
    resources = container(manifests)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert "cpu" not in resources["limits"], "a CPU limit throttles the agent"


def test_prometheus_scrapes_metrics_at_the_containers_port(manifests):
    blink = container(manifests)
    (port,) = blink["ports"]
    annotations = manifests["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    (endpoint,) = manifests["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == port["name"]
    assert manifests["PodMonitor"]["spec"]["selector"]["matchLabels"] == pod_labels(manifests)


def test_the_service_and_the_inference_pool_select_the_pods_at_their_port(manifests):
    (port,) = container(manifests)["ports"]
    assert manifests["Service"]["spec"]["selector"] == pod_labels(manifests)
    assert manifests["Service"]["spec"]["ports"][0]["targetPort"] in (port["name"], port["containerPort"])
    pool = manifests["InferencePool"]["spec"]
    assert pool["selector"]["matchLabels"] == pod_labels(manifests)
    assert [p["number"] for p in pool["targetPorts"]] == [port["containerPort"]]
    (backend,) = manifests["HTTPRoute"]["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", manifests["InferencePool"]["metadata"]["name"])


def pod_labels(manifests) -> dict:
    deployment = manifests["Deployment"]["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"] == labels
    return labels


def test_every_metric_the_page_names_is_exported(local_ring):
    """The endpoint picker's flags and the load-signal table name metrics that a server really exports."""
    from blink.models import default_model_path

    named = set(re.findall(r"\bblink_[a-z_]+\b", DEPLOY.read_text()))
    flags = dict(line.split("=", 1) for line in code_block("text").split())
    assert {flags["--total-queued-requests-metric"], flags["--total-running-requests-metric"],
            flags["--kv-cache-usage-percentage-metric"]} <= named

    async def exported():
        async with local_server(local_ring, Tokenizer(default_model_path())) as local:
            return set(await local.metrics())

    assert named <= asyncio.run(exported())


def test_the_load_signal_table_names_every_gauge_of_the_engine(local_ring):
    """Each gauge the engine keeps in the ring (the prefix cache's among them) is in the page's table."""
    from blink.nic.engine_metrics import engine_families
    from blink.ring.geometry import RingGeometry

    _, agent, _ = local_ring(RingGeometry(n_slots=4, max_prompt_tokens=8, max_output_tokens=8))
    gauges = {family.name for family in engine_families(agent.stats(), 0, agent.geometry.n_slots, "m")
              if family.type == "gauge" and family.name.startswith("blink_")}
    first_cells = re.findall(r"^\| (`blink_[^|]+)\|", DEPLOY.read_text(), flags=re.MULTILINE)
    table = {name for cell in first_cells for name in re.findall(r"`(blink_[a-z_]+)`", cell)}
    assert gauges and gauges <= table, gauges - table


def dockerfile() -> dict[str, list[str]]:
    """The Dockerfile's instructions of the final stage by keyword, each a list of their argument strings."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final = re.split(r"^FROM ", text, flags=re.MULTILINE)[-1]
    found = {}
    for line in final.splitlines():
        if line.strip() and not line.startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.setdefault(keyword, []).append(rest.strip())
    return found


def test_the_manifests_run_the_image_the_dockerfile_builds(manifests):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    built = set(re.findall(r"docker build -t (\S+) \.", (ROOT / "docs" / "gpu.md").read_text()
                           + (ROOT / "Dockerfile").read_text() + DEPLOY.read_text()))
    assert built == {container(manifests)["image"]}, built
    assert container(manifests)["image"].endswith(f"/{project['name']}:{blink.version.__version__}")


def test_the_image_serves_blink_on_its_exposed_port_as_a_user_and_checks_its_health():
    instructions = dockerfile()
    (port,) = (int(p) for p in instructions["EXPOSE"])
    (entrypoint,) = (json.loads(e) for e in instructions["ENTRYPOINT"])
    assert entrypoint[0] == "blink"
    args = _parser().parse_args(entrypoint[1:] + ["Qwen/Qwen3-8B"])     # what docker run's arguments append to
    assert (args.command, args.host, args.port, args.model_path) == ("serve", "0.0.0.0", port, "Qwen/Qwen3-8B")
    (healthcheck,) = instructions["HEALTHCHECK"]
    assert f"http://127.0.0.1:{port}/health" in healthcheck
    (user,) = instructions["USER"]
    assert user.isdigit() and int(user) != 0
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = re.findall(r"blink_serve-\S*\.whl.*?\[(\w+)\]", " ".join(instructions["RUN"]))
    assert installed and set(installed) <= set(extras), installed
