"""deploy/k8s and deploy/systemd: valid for their tools, and in agreement with kvpool's config and each other.

Kubernetes manifests are checked offline against the API schemas bundled in
the ``kubernetes-validate`` package (strict: unknown fields are errors);
systemd units by ``systemd-analyze verify`` where systemd is installed.
"""

from __future__ import annotations

import configparser
import dataclasses
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support import REPO

from kvpool.cli import build_parser
from kvpool.config import load_config
from kvpool.etcd import EtcdTarget, parse_endpoints

DEPLOY = REPO / "deploy"
K8S, SYSTEMD = DEPLOY / "k8s", DEPLOY / "systemd"
K8S_HA = K8S / "ha"  # applied instead of configmap.yaml and master.yaml for masters on etcd
_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _manifests(where: Path = K8S) -> list[dict]:
    docs = [d for f in sorted(where.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    assert docs, f"no manifests in {where}"
    return docs


def _one(kind: str, name: str, where: Path = K8S) -> dict:
    found = [d for d in _manifests(where) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def _bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)([KMGT]i)", quantity)
    assert match is not None, f"not a quantity in Ki/Mi/Gi/Ti: {quantity!r}"
    number, unit = match.groups()
    return int(number) * _QUANTITY[unit]


def _k8s_config(tmp_path: Path, where: Path = K8S):
    path = tmp_path / "kvpool.json"
    path.write_text(_one("ConfigMap", "kvpool-config", where)["data"]["kvpool.json"])
    return load_config(path, env={})


def _follows_the_masters(config) -> None:
    """Masters elect in etcd; nodes and clients follow etcd://(the same endpoints)/(the same cluster)."""
    assert config.master.etcd and config.master.leader_ttl_s >= 2
    for target in (config.node.master, config.client.master):
        parsed = EtcdTarget.parse(target)
        assert parsed is not None, f"{target!r} does not follow the masters through etcd"
        assert parsed == EtcdTarget(tuple(parse_endpoints(config.master.etcd)), config.master.cluster)


def test_every_manifest_is_valid_for_the_kubernetes_api():
    version = kubernetes_validate.latest_version()
    for doc in _manifests():
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in _manifests())
    assert kinds == [("ConfigMap", "kvpool-config"), ("DaemonSet", "kvpool-node"), ("Deployment", "kvpool-master"),
                     ("Namespace", "kvpool"), ("Service", "kvpool-master"), ("Service", "kvpool-node")]
    assert {d["metadata"].get("namespace", "kvpool") for d in _manifests()} == {"kvpool"}


def test_the_validator_rejects_a_misspelt_field():
    daemonset = _one("DaemonSet", "kvpool-node")
    daemonset["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, kubernetes_validate.latest_version(), strict=True)


def test_k8s_config_and_manifests_agree(tmp_path):
    config = _k8s_config(tmp_path)
    node = _one("DaemonSet", "kvpool-node")["spec"]["template"]
    master = _one("Deployment", "kvpool-master")["spec"]["template"]
    (node_c,), (master_c,) = node["spec"]["containers"], master["spec"]["containers"]
    # The DRAM tier fits in /dev/shm, which fits in the pod's memory limit (tmpfs pages count against it).
    volumes = {v["name"]: v for v in node["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in node_c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and _bytes(shm["sizeLimit"]) >= config.node.tiers.dram.bytes
    assert _bytes(node_c["resources"]["limits"]["memory"]) >= _bytes(shm["sizeLimit"]) + (512 << 20)
    # The SSD directory is on the hostPath volume: it outlives the pod.
    ssd_mount = next(p for p in mounts if config.node.tiers.ssd.dir.startswith(p.rstrip("/") + "/"))
    assert "hostPath" in volumes[mounts[ssd_mount]]
    # Ports, Prometheus annotations and Services follow the config.
    node_ports = {p["name"]: p["containerPort"] for p in node_c["ports"]}
    master_ports = {p["name"]: p["containerPort"] for p in master_c["ports"]}
    ns, ms = config.node.server, config.master.server
    assert node_ports == {"grpc": ns.port, "metrics": ns.metrics_port, "data": config.node.data_port}
    assert (master_ports["grpc"], master_ports["metrics"]) == (ms.port, ms.metrics_port)
    assert int(node["metadata"]["annotations"]["prometheus.io/port"]) == config.node.server.metrics_port
    assert int(master["metadata"]["annotations"]["prometheus.io/port"]) == config.master.server.metrics_port
    assert config.node.master == config.client.master == f"kvpool-master.kvpool.svc.cluster.local:{ms.port}"
    assert _one("Service", "kvpool-node")["spec"]["clusterIP"] == "None"  # one DNS record per node pod
    for name, tmpl in (("kvpool-master", master), ("kvpool-node", node)):
        assert _one("Service", name)["spec"]["selector"].items() <= tmpl["metadata"]["labels"].items()
        assert tmpl["metadata"]["labels"]["app.kubernetes.io/component"] == name  # the job label in Prometheus
    # Per-pod variables name real config fields; the command line parses.
    env = {e["name"]: "pod-x:7610" for e in node_c["env"] if e["name"].startswith("KVPOOL_")}  # valid for each
    assert env and load_config(None, env=env).node.node_id == "pod-x:7610"
    for container in (node_c, master_c):
        args = build_parser().parse_args(container["args"][1:])
        assert args.config == "/etc/kvpool/kvpool.json"
        assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/etc/kvpool"] == "config"


def test_ha_manifests_are_valid_and_replace_the_single_master():
    version = kubernetes_validate.latest_version()
    for doc in _manifests(K8S_HA):
        kubernetes_validate.validate(doc, version, strict=True)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in _manifests(K8S_HA))
    assert kinds == [("ConfigMap", "kvpool-config"), ("PodDisruptionBudget", "kvpool-master"),
                     ("Service", "kvpool-master"), ("StatefulSet", "kvpool-master")]
    assert {d["metadata"]["namespace"] for d in _manifests(K8S_HA)} == {"kvpool"}
    # What HA replaces in the base (the rest, namespace.yaml and node.yaml, is applied with it).
    base = {(d["kind"], d["metadata"]["name"]): f.name for f in sorted(K8S.glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d}
    replaced = {base[k] for k in base if k[1] in ("kvpool-config", "kvpool-master")}
    assert replaced == {"configmap.yaml", "master.yaml"}


def test_ha_config_and_manifests_agree(tmp_path):
    config, base = _k8s_config(tmp_path, K8S_HA), _k8s_config(tmp_path, K8S)
    _follows_the_masters(config)
    # Apart from the election and whom to follow, the same settings as the base (which node.yaml is checked against).
    assert dataclasses.replace(config.master, etcd="", cluster=base.master.cluster,
                               leader_ttl_s=base.master.leader_ttl_s) == base.master
    assert dataclasses.replace(config.node, master=base.node.master) == base.node
    assert dataclasses.replace(config.client, master=base.client.master) == base.client
    sts = _one("StatefulSet", "kvpool-master", K8S_HA)
    pdb = _one("PodDisruptionBudget", "kvpool-master", K8S_HA)
    service = _one("Service", "kvpool-master", K8S_HA)
    assert sts["spec"]["replicas"] >= 2 and 1 <= pdb["spec"]["minAvailable"] < sts["spec"]["replicas"]
    tmpl = sts["spec"]["template"]
    (master_c,) = tmpl["spec"]["containers"]
    args = build_parser().parse_args(master_c["args"][1:])
    assert args.command == "master" and args.config == "/etc/kvpool/kvpool.json"
    assert {m["mountPath"]: m["name"] for m in master_c["volumeMounts"]}["/etc/kvpool"] == "config"
    # Each master advertises its own pod IP (a variable defined before it) as a real config field.
    env = [e["name"] for e in master_c["env"]]
    advertise = next(e for e in master_c["env"] if e["name"] == "KVPOOL_MASTER_ADVERTISE_HOST")
    assert advertise["value"] == "$(POD_IP)" and env.index("POD_IP") < env.index(advertise["name"])
    assert load_config(None, env={advertise["name"]: "10.1.2.3"}).master.advertise_host == "10.1.2.3"
    # A standby's gRPC health is NOT_SERVING by design: a gRPC probe would keep it unready or restart it.
    ports = {p["name"]: p["containerPort"] for p in master_c["ports"]}
    assert (ports["grpc"], ports["metrics"]) == (config.master.server.port, config.master.server.metrics_port)
    for probe in ("readinessProbe", "livenessProbe"):
        assert set(master_c[probe]) & {"grpc", "httpGet", "exec"} == set(), probe
        assert master_c[probe]["tcpSocket"]["port"] == config.master.server.port
    assert int(tmpl["metadata"]["annotations"]["prometheus.io/port"]) == config.master.server.metrics_port
    # Headless, with standbys listed: Prometheus scrapes every master under job kvpool-master.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    for selector in (service["spec"]["selector"], sts["spec"]["selector"]["matchLabels"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= tmpl["metadata"]["labels"].items()
    assert tmpl["metadata"]["labels"]["app.kubernetes.io/component"] == "kvpool-master"


def test_prometheus_kubernetes_config_scrapes_the_services_on_the_metrics_ports(tmp_path):
    config = _k8s_config(tmp_path)
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())["scrape_configs"]
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in scrape}
    assert jobs["kvpool-master"]["names"] == ["kvpool-master.kvpool.svc.cluster.local"]
    assert jobs["kvpool-master"]["port"] == config.master.server.metrics_port
    assert jobs["kvpool-node"]["names"] == ["kvpool-node.kvpool.svc.cluster.local"]
    assert jobs["kvpool-node"]["port"] == config.node.server.metrics_port


class _CaseKeepingParser(configparser.ConfigParser):
    def optionxform(self, optionstr: str) -> str:
        return optionstr  # systemd's keys are case-sensitive (ConfigParser lowercases them)


def _unit(name: str) -> configparser.ConfigParser:
    parser = _CaseKeepingParser(strict=False, interpolation=None, delimiters=("=",))
    parser.read_string((SYSTEMD / name).read_text())
    return parser


@pytest.mark.parametrize("name", ["kvpool-master.service", "kvpool-node.service"])
def test_systemd_units_restart_are_hardened_and_run_kvpool_with_the_config(name):
    unit = _unit(name)
    service = unit["Service"]
    assert service["Restart"] == "always" and float(service["RestartSec"]) > 0
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "CapabilityBoundingSet": "", "RestrictSUIDSGID": "yes"}.items():
        assert service[key] == value, key
    exe, *args = shlex.split(service["ExecStart"])
    assert exe.endswith("/kvpool")
    parsed = build_parser().parse_args(args)
    assert parsed.command == name.split("-")[1].split(".")[0] and parsed.config == "/etc/kvpool/kvpool.json"
    if name == "kvpool-node.service":
        # A private /dev would hide the arena from same-host engines; the SSD tier lives in the StateDirectory.
        assert service.get("PrivateDevices", "no") == "no" and service["StateDirectory"] == "kvpool"
    else:  # numba caches the index's compiled kernels where the read-only system lets it write
        assert f"NUMBA_CACHE_DIR=%C/{service['CacheDirectory']}/" in service["Environment"]


def test_systemd_example_config_and_environment_load():
    config = load_config(SYSTEMD / "kvpool.json", env={})
    assert config.node.tiers.ssd.dir.startswith("/var/lib/kvpool/")  # the node unit's StateDirectory
    env = dict(line.split("=", 1) for line in (SYSTEMD / "node.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert load_config(SYSTEMD / "kvpool.json", env=env).node.resolved_advertise() == env["KVPOOL_NODE_ADVERTISE"]


def test_systemd_ha_config_and_master_environment_load():
    config = load_config(SYSTEMD / "kvpool-ha.json", env={})
    _follows_the_masters(config)
    base = load_config(SYSTEMD / "kvpool.json", env={})
    assert dataclasses.replace(config.node, master=base.node.master) == base.node
    env = dict(line.split("=", 1) for line in (SYSTEMD / "master.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert set(env) == {"KVPOOL_MASTER_ADVERTISE_HOST"}
    assert load_config(SYSTEMD / "kvpool-ha.json", env=env).master.advertise_host == env["KVPOOL_MASTER_ADVERTISE_HOST"]
    assert _unit("kvpool-master.service")["Service"]["EnvironmentFile"] == "-/etc/kvpool/master.env"


def test_systemd_analyze_verify_finds_nothing_to_complain_about(tmp_path):
    analyze, kvpool = shutil.which("systemd-analyze"), shutil.which("kvpool")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (systemd); the unit files are still parsed above")
    assert kvpool, "the kvpool script is not on PATH (pip install -e .)"
    names = ["kvpool-master.service", "kvpool-node.service"]
    for name in names:  # verify checks that ExecStart's binary exists: point it at this install
        (tmp_path / name).write_text((SYSTEMD / name).read_text().replace("/opt/kvpool/bin/kvpool", kvpool))
    done = subprocess.run([analyze, "verify", "--man=no", *names], check=False, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
