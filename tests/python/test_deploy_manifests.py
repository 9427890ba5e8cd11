"""deploy/k8s and deploy/nginx: schema-valid, and their numbers agree with the server's.

The manifests are checked against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail); no cluster runs them here.
The timings and limits are compared with the defaults the server binary
reports in --help, so a changed default shows up as a failing test.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
SERVER_BINARY = ROOT / "target" / "release" / "mlx-embed-server"
# The newest schemas the checker ships, and an older release still in wide use.
VERSIONS = [kubernetes_validate.latest_version(), "1.30.0"]


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def by_kind(kind: str) -> dict:
    found = [d for _, d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def server_defaults() -> dict[str, str]:
    """`--flag` -> default, from the server binary's own --help."""
    if not SERVER_BINARY.exists():
        pytest.fail(f"{SERVER_BINARY} is missing: run `make build` (make test does)")
    text = subprocess.run([str(SERVER_BINARY), "--help"], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    defaults, flag = {}, None
    for line in text.splitlines():
        m = re.match(r"\s+(?:-\w, )?(--[a-z-]+)", line)
        if m:
            flag = m.group(1)
        d = re.search(r"\[default: ([^\]]+)\]", line)
        if d and flag:
            defaults[flag] = d.group(1)
    return defaults


def test_every_kind_is_there():
    assert sorted(d["kind"] for _, d in documents()) == [
        "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly(version):
    for name, doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any error


def test_the_checker_rejects_a_broken_manifest():
    """The validation above can fail: a misspelled field and a wrong type are caught."""
    deployment = by_kind("Deployment")
    misspelled = copy.deepcopy(deployment)
    misspelled["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = misspelled["spec"][
        "template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(misspelled, VERSIONS[0], strict=True)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, VERSIONS[0], strict=True)


def container() -> dict:
    return by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]


def env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"]}


def test_grace_period_covers_prestop_and_drain(server_defaults):
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    c = container()
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep = int(pre_stop[1])
    drain = int(env()["MLX_EMBED_DRAIN_TIMEOUT_SECS"])
    assert drain == int(server_defaults["--drain-timeout-secs"])
    assert sleep >= 5, "endpoints need a few seconds to drop the pod"
    assert pod["terminationGracePeriodSeconds"] > sleep + drain
    # Liveness must not kill a pod while it drains (/health is 503 then).
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > pod["terminationGracePeriodSeconds"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # Readiness drops the pod at the first 503.
    assert c["readinessProbe"]["failureThreshold"] == 1


def test_deployment_service_and_hpa_agree():
    deployment, service = by_kind("Deployment"), by_kind("Service")
    hpa, pdb = by_kind("HorizontalPodAutoscaler"), by_kind("PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = container()["ports"][0]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert int(env()["MLX_EMBED_PORT"]) == port["containerPort"]
    assert env()["MLX_EMBED_HOST"] == "0.0.0.0"  # the server listens on loopback by default
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2 and pdb["spec"]["minAvailable"] == hpa["spec"]["minReplicas"] - 1
    resources = container()["resources"]
    assert resources["requests"] == resources["limits"]
    assert int(env()["MLX_EMBED_WORKERS"]) == int(resources["requests"]["cpu"])


def test_queue_metric_named_in_the_hpa_exists():
    text = (K8S / "hpa.yaml").read_text()
    assert "mlx_embed_queued_inputs" in text
    metrics_rs = (ROOT / "crates" / "mlx-embed-server" / "src" / "metrics.rs").read_text()
    assert '"mlx_embed_queued_inputs"' in metrics_rs


def nginx_directive(name: str) -> str:
    values = re.findall(rf"^\s*{name}\s+([^;]+);", NGINX_CONF.read_text(), re.MULTILINE)
    assert len(values) == 1, f"{name}: {values}"
    return values[0].strip()


def seconds(value: str) -> int:
    m = re.fullmatch(r"(\d+)s", value)
    assert m, value
    return int(m.group(1))


def test_nginx_limits_follow_the_server(server_defaults):
    size = nginx_directive("client_max_body_size")
    assert re.fullmatch(r"\d+m", size)
    assert int(size[:-1]) * 1024 * 1024 == int(server_defaults["--max-body-bytes"])
    queue_wait_s = int(server_defaults["--max-queue-wait-ms"]) / 1000
    read = seconds(nginx_directive("proxy_read_timeout"))
    # A large answer may wait for room, then as long again in the queue.
    assert read > 2 * queue_wait_s, "nginx must outwait the server's own bounds"
    assert seconds(nginx_directive("proxy_send_timeout")) > 2 * queue_wait_s
    # Retries: bounded in tries and time, and on POST too (embedding is idempotent).
    retry_on = nginx_directive("proxy_next_upstream").split()
    assert {"error", "timeout", "http_503", "non_idempotent"} <= set(retry_on)
    assert "http_429" not in retry_on
    assert 2 <= int(nginx_directive("proxy_next_upstream_tries")) <= 3
    assert seconds(nginx_directive("proxy_next_upstream_timeout")) >= 2 * read
    assert re.search(r"^\s*least_conn;", NGINX_CONF.read_text(), re.MULTILINE)
    assert int(nginx_directive("keepalive")) > 0
    assert nginx_directive("proxy_http_version") == "1.1"
    # The server closes an idle connection only after nginx has stopped reusing it,
    # or nginx could send a request down a connection the server is closing.
    assert seconds(nginx_directive("keepalive_timeout")) < int(server_defaults["--client-timeout-secs"])
    # nginx's own 413 words the server's limit.
    conf = NGINX_CONF.read_text()
    limit = int(server_defaults["--max-body-bytes"])
    # Four shapes; the OpenAI one words it twice (`error.message` and `detail`).
    assert conf.count(f"request body is larger than the limit of {limit} bytes (--max-body-bytes)") == 5


def test_replicas_script_waits_out_the_drain(server_defaults, monkeypatch):
    """scripts/replicas.py gives each replica its --drain-timeout-secs (plus
    a margin) before SIGKILL; it killed them at 60 s whatever the flag said."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import replicas as rp

    monkeypatch.delenv("MLX_EMBED_DRAIN_TIMEOUT_SECS", raising=False)
    assert rp.drain_seconds([]) == rp.DEFAULT_DRAIN_SECS == int(server_defaults["--drain-timeout-secs"])
    assert rp.drain_seconds(["--drain-timeout-secs", "120"]) == 120
    assert rp.drain_seconds(["--drain-timeout-secs=7"]) == 7
    assert rp.drain_seconds([], {"MLX_EMBED_DRAIN_TIMEOUT_SECS": "90"}) == 90
