"""The deployment files of deploy/: each is what its tool accepts, and runs the real ``otel-forge monitor``.

- The systemd unit passes ``systemd-analyze verify`` (an unknown directive fails it, which a broken
  copy shows), keeps the hardening a reviewer looks for, and leaves open what the agent reads.
- The Kubernetes manifests load into the Kubernetes API's own models (the ``kubernetes`` client)
  with nothing dropped on the way back (a misspelt field would be), and agree with each other: the
  Service selects the DaemonSet's pods and names its port, the ServiceMonitor selects the Service.
- The Containerfile runs as a user of its own, from a pinned base image, ``otel-forge monitor``.

Every command line (ExecStart, the container's command, the image's CMD) goes through otel-forge's
own parser, and every environment they set resolves through the settings table, so a flag or a
variable that does not exist fails here.
"""

from __future__ import annotations

import inspect
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from otel_forge.cli import build_parser
from otel_forge.cli.options import config_from_args
from otel_forge.config import SETTINGS, ForgeConfig

ROOT = Path(__file__).parent.parent.parent
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "otel-forge-monitor.service"
UNIT_DEFAULTS = DEPLOY / "systemd" / "otel-forge.default"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
KUBERNETES = DEPLOY / "kubernetes"
SETTING_VARIABLES = {name for setting in SETTINGS for name in setting.env}


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This machine's otel-forge variables unset: a config sees only what the deployment sets."""
    for name in SETTING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def monitor_config(argv: list[str], variables: dict[str, str], environ: pytest.MonkeyPatch) -> ForgeConfig:
    """What ``argv`` (``otel-forge monitor ...``) resolves to in ``variables``, through the CLI's parser."""
    assert Path(argv[0]).name == "otel-forge" and argv[1] == "monitor", argv
    for name, value in variables.items():
        environ.setenv(name, value)
    args = build_parser().parse_args(argv[1:])  # a flag it does not know exits 2
    assert args.command == "monitor"
    return config_from_args(args)


def strictly_under(path: str, directory: str) -> bool:
    return Path(directory) in Path(path).parents


# --- systemd ---------------------------------------------------------------------------------


def unit_directives(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as systemd reads it: sections of directives, each with every value it was given
    (Environment= and SystemCallFilter= are given more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"continuation lines are not parsed here: {line}"
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


UNIT_SERVICE = unit_directives(UNIT.read_text())["Service"]


def service_value(key: str) -> str:
    """The directive's last value (the one systemd uses), or "" for one not set."""
    return UNIT_SERVICE.get(key, [""])[-1]


def otel_forge_script() -> str:
    """The console script of the Python running the tests (verify needs ExecStart to exist)."""
    beside = Path(sys.executable).parent / "otel-forge"
    found = str(beside) if beside.exists() else shutil.which("otel-forge")
    if found is None:
        pytest.fail("no otel-forge console script: pip install -e .")
    return found


def verify_problems(unit_text: str, directory: Path) -> list[str]:
    """What ``systemd-analyze verify`` says about ``unit_text`` installed as the unit, with its
    ExecStart pointing at this machine's otel-forge. Verify exits 0 on an unknown directive and
    only prints it, so any line naming the unit is a problem; a non-zero exit is one too."""
    systemd_analyze = shutil.which("systemd-analyze")
    if systemd_analyze is None:
        pytest.skip("no systemd-analyze (Debian's systemd package; ./run-tests installs it)")
    installed = re.sub(r"^ExecStart=\S+", f"ExecStart={otel_forge_script()}", unit_text, count=1, flags=re.MULTILINE)
    path = directory / UNIT.name
    path.write_text(installed)
    result = subprocess.run(
        [systemd_analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60
    )
    output = (result.stdout + result.stderr).splitlines()
    problems = [line for line in output if UNIT.name in line]
    if result.returncode != 0:
        problems.append(f"exit {result.returncode}: {' | '.join(output)}")
    return problems


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    assert verify_problems(UNIT.read_text(), tmp_path) == []


def test_verify_as_run_here_fails_a_unit_with_an_unknown_directive(tmp_path):
    broken = UNIT.read_text().replace("ProtectHome=yes", "ProtectHomeDirectories=yes")
    problems = verify_problems(broken, tmp_path)
    assert any("ProtectHomeDirectories" in problem for problem in problems), problems


def test_the_unit_runs_otel_forge_monitor_with_real_settings(environ):
    argv = shlex.split(service_value("ExecStart").replace("$OPTIONS", ""))
    assert Path(argv[0]).is_absolute() and argv[1:] == ["monitor"]
    variables = dict(value.split("=", 1) for value in UNIT_SERVICE["Environment"])
    assert set(variables) - {"OPTIONS"} <= SETTING_VARIABLES
    # %S is the state directories' root, /var/lib for a system service.
    variables = {name: value.replace("%S", "/var/lib") for name, value in variables.items()}
    config = monitor_config(argv, variables, environ)
    assert (config.prometheus_host, config.prometheus_port) == ("0.0.0.0", 9464)
    # The spool is in the unit's own state directory, below it (with DynamicUser= it is a symlink,
    # which otel-forge refuses as a spool root).
    assert strictly_under(config.spool_dir, f"/var/lib/{service_value('StateDirectory')}")


def test_the_unit_is_hardened_and_reads_its_settings_from_etc_default():
    expected = {
        "EnvironmentFile": "-/etc/default/otel-forge",
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",  # empty: no capability at all
        "AmbientCapabilities": "",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateMounts": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "RestrictNamespaces": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "SystemCallArchitectures": "native",
        "StateDirectory": "otel-forge",
    }
    assert {key: service_value(key) for key in expected} == expected
    assert set(service_value("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert UNIT_SERVICE["SystemCallFilter"][0] == "@system-service"


def test_the_unit_leaves_proc_sys_and_the_gpus_readable():
    # Each of these would hide /proc/stat, /proc/meminfo or /dev/nvidia* (ProtectClock= implies a
    # DeviceAllow= list, which shuts out every device not on it).
    assert service_value("PrivateDevices") in ("", "no")
    assert service_value("ProtectClock") in ("", "no")
    assert "DeviceAllow" not in UNIT_SERVICE and "DevicePolicy" not in UNIT_SERVICE
    assert "ProcSubset" not in UNIT_SERVICE and "ProtectProc" not in UNIT_SERVICE


def test_the_example_etc_default_names_real_settings_and_flags(environ):
    """Every line of the example, commented out or not, as if it were set."""
    assignments = re.findall(r"^#?([A-Z][A-Z0-9_]*)=(.*)$", UNIT_DEFAULTS.read_text(), flags=re.MULTILINE)
    variables = dict(assignments)
    assert len(variables) == len(assignments) and set(variables) - {"OPTIONS"} <= SETTING_VARIABLES
    argv = shlex.split(service_value("ExecStart").replace("$OPTIONS", variables.pop("OPTIONS")))
    config = monitor_config(argv, variables, environ)
    assert config.node_id == "gpu-node-001" and config.otlp_endpoint == "http://localhost:4318"


# --- Kubernetes ------------------------------------------------------------------------------


def kubernetes_documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def api_model(document: dict[str, Any], model: str) -> Any:
    """``document`` as the Kubernetes client's model ``model`` (``V1DaemonSet``), the way the client
    reads an API server's answer. The client drops fields its model does not have: serialized
    back, the document must come out as it went in."""
    from kubernetes.client import ApiClient

    with ApiClient() as client:
        text = json.dumps(document)
        if "response_text" in inspect.signature(client.deserialize).parameters:
            parsed = client.deserialize(text, model, "application/json")
        else:  # older clients read the text from a response object
            parsed = client.deserialize(SimpleNamespace(data=text), model)
        assert client.sanitize_for_serialization(parsed) == document, f"fields {model} does not have"
    return parsed


def only(name: str, model: str) -> Any:
    (document,) = kubernetes_documents(name)
    return api_model(document, model)


DAEMONSET = "daemonset.yaml"
SERVICE = "service.yaml"


def the_container() -> Any:
    (container,) = only(DAEMONSET, "V1DaemonSet").spec.template.spec.containers
    return container


def container_port(container: Any, port: int | str) -> int:
    """A port by number or by the container's name for it."""
    numbers = {p.name: p.container_port for p in container.ports}
    return numbers[port] if isinstance(port, str) else port


def pod_environment(container: Any) -> dict[str, str]:
    """The container's environment as the kubelet makes it: the downward API's values (made up
    here), then ``$(NAME)`` of a variable defined above replaced by its value."""
    downward = {"spec.nodeName": "gpu-node-1", "metadata.name": "otel-forge-x7k2p", "metadata.namespace": "otel-forge"}
    values: dict[str, str] = {}
    for variable in container.env:
        if variable.value_from is not None:
            values[variable.name] = downward[variable.value_from.field_ref.field_path]
        else:
            values[variable.name] = re.sub(
                r"\$\((\w+)\)", lambda match: values.get(match.group(1), match.group(0)), variable.value
            )
    return values


def test_every_manifest_loads_into_the_kubernetes_api_models():
    models = {"namespace.yaml": "V1Namespace", DAEMONSET: "V1DaemonSet", SERVICE: "V1Service"}
    for name, model in models.items():
        parsed = only(name, model)
        assert parsed.metadata.name == "otel-forge"
        assert name == "namespace.yaml" or parsed.metadata.namespace == "otel-forge"


def test_the_daemonset_runs_otel_forge_monitor_on_the_port_it_declares(environ):
    container = the_container()
    config = monitor_config(container.command + container.args, pod_environment(container), environ)
    assert config.prometheus_host == "0.0.0.0"  # probes and Prometheus come from off the pod
    assert container_port(container, "metrics") == config.prometheus_port
    assert config.resource_attributes == {
        "k8s.node.name": "gpu-node-1",
        "k8s.pod.name": "otel-forge-x7k2p",
        "k8s.namespace.name": "otel-forge",
    }


def test_the_daemonset_runs_unprivileged_on_a_read_only_root():
    pod = only(DAEMONSET, "V1DaemonSet").spec.template.spec
    container = the_container()
    assert pod.security_context.run_as_non_root is True and pod.security_context.run_as_user != 0
    assert container.security_context.run_as_non_root is True
    assert container.security_context.read_only_root_filesystem is True
    assert container.security_context.allow_privilege_escalation is False
    assert container.security_context.capabilities.drop == ["ALL"]
    assert pod.automount_service_account_token is False
    assert pod.host_network is True and not pod.host_pid
    assert container.image.rpartition(":")[2] not in ("", "latest") and container.image_pull_policy == "IfNotPresent"


def test_the_daemonset_gives_the_downward_api_names_and_runs_on_gpu_nodes():
    pod = only(DAEMONSET, "V1DaemonSet").spec.template.spec
    fields = {v.name: v.value_from.field_ref.field_path for v in the_container().env if v.value_from}
    assert fields == {"NODE_NAME": "spec.nodeName", "POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert {(t.key, t.operator, t.effect) for t in pod.tolerations} >= {("nvidia.com/gpu", "Exists", "NoSchedule")}
    resources = the_container().resources
    assert set(resources.requests) == set(resources.limits) == {"cpu", "memory"}


def test_the_daemonset_writes_only_into_its_volumes(environ):
    """Its spool (below an emptyDir: otel-forge refuses a root that anyone may write into, as a
    fresh emptyDir is) and /tmp; the root filesystem is read-only."""
    pod = only(DAEMONSET, "V1DaemonSet").spec.template.spec
    container = the_container()
    empty_dirs = {volume.name for volume in pod.volumes if volume.empty_dir is not None}
    mounts = {mount.mount_path: mount.name for mount in container.volume_mounts}
    assert mounts.keys() == {"/var/lib/otel-forge", "/tmp"} and set(mounts.values()) <= empty_dirs
    spool_dir = monitor_config(container.command + container.args, pod_environment(container), environ).spool_dir
    assert strictly_under(spool_dir, "/var/lib/otel-forge")


def test_the_probes_and_annotations_ask_the_metrics_port():
    container = the_container()
    template = only(DAEMONSET, "V1DaemonSet").spec.template
    port = container_port(container, "metrics")
    for probe in (container.liveness_probe, container.readiness_probe):
        assert probe.http_get.path == "/metrics" and container_port(container, probe.http_get.port) == port
    annotations = template.metadata.annotations
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_service_selects_the_daemonsets_pods_and_their_metrics_port():
    daemonset = only(DAEMONSET, "V1DaemonSet")
    service = only(SERVICE, "V1Service")
    labels = daemonset.spec.template.metadata.labels
    assert daemonset.spec.selector.match_labels.items() <= labels.items()
    assert service.spec.selector.items() <= labels.items()
    (port,) = service.spec.ports
    assert port.name == "metrics" and container_port(the_container(), port.target_port) == 9464


def test_the_servicemonitor_selects_the_service_and_its_port_name():
    """A CRD the client has no model of: its structure checked by hand, against the Prometheus
    Operator's monitoring.coreos.com/v1 fields."""
    (monitor,) = kubernetes_documents("servicemonitor.yaml")
    service = only(SERVICE, "V1Service")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == service.metadata.namespace
    spec = monitor["spec"]
    assert spec.keys() <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels"}
    assert spec["selector"].keys() == {"matchLabels"}
    assert spec["selector"]["matchLabels"].items() <= service.metadata.labels.items()
    assert spec["namespaceSelector"] == {"matchNames": [service.metadata.namespace]}
    endpoint_fields = {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings", "metricRelabelings"}
    assert spec["endpoints"] and all(endpoint.keys() <= endpoint_fields for endpoint in spec["endpoints"])
    port_names = {port.name for port in service.spec.ports}
    assert [endpoint["port"] for endpoint in spec["endpoints"]] == ["metrics"] and "metrics" in port_names
    for endpoint in spec["endpoints"]:
        assert endpoint["path"] == "/metrics"
        for relabeling in endpoint.get("relabelings", []):
            assert relabeling.keys() <= {"sourceLabels", "separator", "targetLabel", "regex", "replacement", "action"}


def test_the_kustomization_applies_the_namespace_daemonset_and_service():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["namespace.yaml", DAEMONSET, SERVICE]
    (image,) = kustomization["images"]
    assert image["name"] == the_container().image.rpartition(":")[0]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return  # kustomize renders without a cluster, but needs kubectl; the lists above are checked anyway
    rendered = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all(rendered) if doc}
    assert sorted(documents) == ["DaemonSet", "Namespace", "Service"]
    (container,) = api_model(documents["DaemonSet"], "V1DaemonSet").spec.template.spec.containers
    assert container.image == f"{image['newName']}:{image['newTag']}"


# --- the container image ---------------------------------------------------------------------


def containerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


INSTRUCTIONS = containerfile_instructions(CONTAINERFILE.read_text())


def instruction_values(keyword: str) -> list[str]:
    return [arguments for name, arguments in INSTRUCTIONS if name == keyword]


def image_environment() -> dict[str, str]:
    """The final stage's ENV (``KEY=value`` forms)."""
    final = max(i for i, (name, _) in enumerate(INSTRUCTIONS) if name == "FROM")
    variables: dict[str, str] = {}
    for name, arguments in INSTRUCTIONS[final:]:
        if name == "ENV":
            for word in shlex.split(arguments):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {word}: the legacy 'ENV KEY value' form"
                variables[key] = value
    return variables


def test_the_image_runs_otel_forge_monitor_as_pid_1(environ):
    # Exec form: otel-forge is PID 1 and gets SIGTERM itself (the shell form would put sh there).
    entrypoint, command = (json.loads(instruction_values(k)[-1]) for k in ("ENTRYPOINT", "CMD"))
    config = monitor_config(entrypoint + command, image_environment(), environ)
    assert config.prometheus_host == "0.0.0.0"
    assert instruction_values("EXPOSE") == [str(config.prometheus_port)]
    (volume,) = (json.loads(value) for value in instruction_values("VOLUME"))
    assert any(strictly_under(config.spool_dir, path) for path in volume)


def test_the_image_runs_as_the_daemonsets_non_root_user():
    user = instruction_values("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0  # numeric: runAsNonRoot can only check a number
    assert int(user) == only(DAEMONSET, "V1DaemonSet").spec.template.spec.security_context.run_as_user


def test_the_base_image_is_pinned_to_a_tag():
    defaults = dict(value.split("=", 1) for value in instruction_values("ARG") if "=" in value)
    for value in instruction_values("FROM"):
        image = re.sub(r"\$\{(\w+)\}", lambda match: defaults[match.group(1)], value.split()[0])
        name, _, tag = image.rpartition(":")
        assert "/" not in tag and tag not in ("", "latest"), image


def test_the_image_copies_what_pip_install_needs_from_the_checkout():
    sources = [word for value in instruction_values("COPY") if "--from" not in value for word in value.split()[:-1]]
    assert sources and all((ROOT / source).exists() for source in sources)
    assert {"pyproject.toml", "otel_forge"} <= set(sources)


# --- the README ------------------------------------------------------------------------------


def test_the_readme_says_what_every_file_is_and_names_only_real_settings():
    readme = (DEPLOY / "README.md").read_text()
    files = [path.relative_to(DEPLOY) for path in DEPLOY.rglob("*") if path.is_file() and path.name != "README.md"]
    assert [str(path) for path in files if str(path) not in readme] == []
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert [link for link in links if not (DEPLOY / link).exists()] == []
    for path in [DEPLOY / "README.md", *(DEPLOY / path for path in files)]:
        named = set(re.findall(r"\b((?:OTEL|MLFLOW)_[A-Z0-9_]+)", path.read_text()))
        assert named <= SETTING_VARIABLES, f"{path.name}: {sorted(named - SETTING_VARIABLES)}"
