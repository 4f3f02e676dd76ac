"""A pod on localhost: its directory, ports, volume files, environment and command line.

Each pod gets a directory (its volumes, HOME, termination-log files) and, for each declared
containerPort, a free port on 127.0.0.1. The Pod object is rewritten to show the allocated
ports (status.podIP is 127.0.0.1), so `http://<podIP>:<containerPort>` reaches the process.
The command line is adapted the same way: paths under a volumeMount point into the pod's
directory, `--*port*` flags whose value is a declared containerPort get the allocated port,
`--host 0.0.0.0` becomes 127.0.0.1 (as in a listening URL such as `--metrics
http://0.0.0.0:9090/metrics`, whose port is mapped too), and
`<svc>.<ns>.svc[.cluster.local][:port]` becomes `<the Service's clusterIP>:<port>` (which the
kube-proxy serves), or for a headless Service `127.0.0.1:<port of a Ready pod behind it>`.
"""

import re
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvfence_engine.tools.localproc import free_port

POD_IP = "127.0.0.1"
TERMINATION_LOG = "/dev/termination-log"
# Executables the images provide, mapped to this machine's.
VENV_BIN = Path(sys.executable).parent
COMMANDS = {
    "kvfence": str(VENV_BIN / "kvfence"),
    "python": sys.executable,
    "python3": sys.executable,
}
_VAR_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
# A URL a server listens on, on the pod's own address: its port is a declared containerPort.
_LISTEN_URL = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<host>0\.0\.0\.0|127\.0\.0\.1|localhost)"
    r":(?P<port>[0-9]+)(?P<rest>/.*)?"
)
_SERVICE_HOST = re.compile(
    r"\b(?P<service>[a-z]([-a-z0-9]*[a-z0-9])?)\.(?P<namespace>[a-z0-9]([-a-z0-9]*[a-z0-9])?)"
    r"\.svc(\.cluster\.local)?(:(?P<port>[0-9]+))?\b"
)


class NotReadyToStart(Exception):
    """The pod cannot start yet (a Secret or ConfigMap is missing); retried later.
    `reason` is the container waiting reason the real kubelet reports."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


class Unsupported(Exception):
    """The pod uses something the test kubelet does not emulate; it stays Pending."""


class ObjectLookup(Protocol):
    def config_data(
        self, kind: str, namespace: str, name: str
    ) -> tuple[dict[str, bytes], str] | None:
        """The decoded data and resourceVersion of a ConfigMap or Secret, or None if absent."""
        ...


ServiceResolver = Callable[[str, str, int | None], str | None]  # ns, service, port -> host:port


@dataclass
class PodSandbox:
    root: Path
    # The pod's securityContext.fsGroup: its volumes' files belong to this group, readable by
    # it (writable too for emptyDir), as the kubelet sets a volume's ownership.
    fs_group: int | None = None
    port_map: dict[int, int] = field(default_factory=dict)  # declared containerPort -> local port
    volume_paths: dict[str, Path] = field(default_factory=dict)
    # The objects behind each file volume (kind, name) -> resourceVersion, for resyncing.
    volume_sources: dict[str, dict[tuple[str, str], str]] = field(default_factory=dict)
    volume_files: dict[str, set[str]] = field(default_factory=dict)

    def termination_log(self, container: str) -> Path:
        return self.root / f"termination-log-{container}"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def allocate_ports(pod: dict[str, Any], sandbox: PodSandbox, taken: set[int]) -> None:
    """Give each declared containerPort a free local port (one no other pod was given) and
    write it into the pod spec."""
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            declared = int(port["containerPort"])
            if declared not in sandbox.port_map:
                local = free_port()
                while local in taken:
                    local = free_port()
                taken.add(local)
                sandbox.port_map[declared] = local
            port["containerPort"] = sandbox.port_map[declared]


def named_port(
    pod: Mapping[str, Any], port: Any, port_map: Mapping[int, int] | None = None
) -> int | None:
    """The local port behind a port name, or a declared number, of a pod whose ports were
    already rewritten (port_map: declared -> local)."""
    if isinstance(port, int) or str(port).isdigit():
        return (port_map or {}).get(int(port))
    for container in pod["spec"].get("containers") or []:
        for declared in container.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
    return None


# ---- environment and command line ---------------------------------------------------------


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: unknown references stay as written, `$$` is a `$`."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REFERENCE.sub(replace, text)


def _field(pod: Mapping[str, Any], path: str) -> str:
    meta, status = pod["metadata"], pod.get("status") or {}
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    values = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP", POD_IP),
        "status.podIPs": status.get("podIP", POD_IP),
        "status.hostIP": status.get("hostIP", POD_IP),
    }
    if path not in values:
        raise Unsupported(f"fieldRef {path!r} is not emulated")
    return str(values[path])


def _key_ref(kind: str, ref: dict[str, Any], namespace: str, lookup: ObjectLookup) -> str | None:
    found = lookup.config_data(kind, namespace, ref["name"])
    if found is None or ref["key"] not in found[0]:
        if ref.get("optional"):
            return None
        what = f'{kind.lower()} "{ref["name"]}"' + ("" if found is None else f" key {ref['key']!r}")
        raise NotReadyToStart("CreateContainerConfigError", f"{what} not found")
    return found[0][ref["key"]].decode()


def container_env(
    pod: dict[str, Any], container: dict[str, Any], lookup: ObjectLookup
) -> dict[str, str]:
    """The container's environment as Kubernetes builds it (envFrom first, then env in order,
    each value expanded against the variables before it)."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind = "Secret" if "secretRef" in source else "ConfigMap"
        ref = source.get("secretRef") or source.get("configMapRef") or {}
        found = lookup.config_data(kind, namespace, ref.get("name", ""))
        if found is None:
            if ref.get("optional"):
                continue
            raise NotReadyToStart(
                "CreateContainerConfigError", f'{kind.lower()} "{ref.get("name")}" not found'
            )
        prefix = source.get("prefix", "")
        env.update({prefix + key: value.decode() for key, value in found[0].items()})
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(str(var.get("value", "")), env)
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
            value = _key_ref(
                kind, source.get("secretKeyRef") or source["configMapKeyRef"], namespace, lookup
            )
            if value is not None:
                env[var["name"]] = value
        elif "fieldRef" in source:
            env[var["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
        else:
            raise Unsupported(f"env {var['name']!r}: {sorted(source)} is not emulated")
    return env


def _path_rewriter(mounts: list[tuple[str, str]]) -> Callable[[str], str]:
    """Replace mount paths wherever they appear as a path (`/etc/kvfence/x`, `--f=/tmp`,
    `echo x > /dev/termination-log` in a shell script), never inside a longer name."""
    if not mounts:
        return lambda value: value
    targets = dict(mounts)
    alternatives = "|".join(
        re.escape(m.rstrip("/") or "/") for m in sorted(targets, key=len, reverse=True)
    )
    pattern = re.compile(rf"(?<![\w.\-/])({alternatives})(?=/|$|[^\w.\-])")
    by_path = {m.rstrip("/") or "/": local for m, local in targets.items()}
    return lambda value: pattern.sub(lambda m: by_path[m.group(1)], value)


def _rewrite_services(value: str, resolve: ServiceResolver, notes: list[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        port = int(match["port"]) if match["port"] else None
        found = resolve(match["namespace"], match["service"], port)
        if found is None:
            service = f"{match['namespace']}/{match['service']}"
            notes.append(f"no Ready endpoint for Service {service}; left {match.group(0)} as is")
            return match.group(0)
        return found

    return _SERVICE_HOST.sub(replace, value)


def _rewrite_flags(argv: list[str], port_map: Mapping[int, int]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if not arg.startswith("--"):
            continue
        flag, has_value, value = arg.partition("=")
        target = i if has_value else i + 1
        if not has_value:
            if i + 1 >= len(out):
                continue
            value = out[i + 1]
        url = _LISTEN_URL.fullmatch(value)
        if "port" in flag.lower() and value.isdigit() and int(value) in port_map:
            value = str(port_map[int(value)])
        elif flag == "--host" and value == "0.0.0.0":  # the pod's address is 127.0.0.1
            value = POD_IP
        elif url and int(url["port"]) in port_map:  # --metrics=http://0.0.0.0:9090/metrics
            host = POD_IP if url["host"] == "0.0.0.0" else url["host"]
            value = f"{url['scheme']}{host}:{port_map[int(url['port'])]}{url['rest'] or ''}"
        else:
            continue
        out[target] = f"{flag}={value}" if has_value else value
    return out


@dataclass(frozen=True, slots=True)
class Spec:
    """A container's env, command and args as its process sees them: `$(VAR)` expanded,
    Services resolved, declared ports mapped to the pod's local ones (and, for a process,
    mount paths mapped to the pod's folders). `command` is None where the spec has none."""

    env: dict[str, str]
    command: list[str] | None
    args: list[str]
    notes: list[str]  # what the kubelet could not do, written to the container's log


def adapt_spec(
    pod: dict[str, Any],
    container: dict[str, Any],
    sandbox: PodSandbox,
    lookup: ObjectLookup,
    resolve_service: ServiceResolver,
    rewrite_paths: Callable[[str], str] = lambda value: value,
) -> Spec:
    notes: list[str] = []

    def adapt(value: str) -> str:
        return _rewrite_services(rewrite_paths(value), resolve_service, notes)

    env = {k: adapt(v) for k, v in container_env(pod, container, lookup).items()}
    command = [expand(str(c), env) for c in container.get("command") or []]
    args = [expand(str(a), env) for a in container.get("args") or []]
    line = _rewrite_flags([adapt(a) for a in [*command, *args]], sandbox.port_map)
    given = "command" in container and bool(container["command"])
    return Spec(env, line[: len(command)] if given else None, line[len(command) :], notes)


@dataclass(frozen=True, slots=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    notes: list[str]  # what the kubelet could not do, written to the container's log


def container_launch(
    pod: dict[str, Any],
    container: dict[str, Any],
    sandbox: PodSandbox,
    lookup: ObjectLookup,
    resolve_service: ServiceResolver,
    base_env: Mapping[str, str],
    default_command: list[str],
) -> Launch:
    """A container as a process on this machine: its volumes are the pod's folders, so every
    mount path in its env, command and args is rewritten to the folder."""
    mounts = [
        (m["mountPath"], str(sandbox.volume_paths[m["name"]] / m.get("subPath", "")).rstrip("/"))
        for m in container.get("volumeMounts") or []
        if m["name"] in sandbox.volume_paths
    ]
    termination_log = str(sandbox.termination_log(container["name"]))
    for path in {TERMINATION_LOG, container.get("terminationMessagePath") or TERMINATION_LOG}:
        mounts.append((path, termination_log))
    rewrite_paths = _path_rewriter(mounts)
    spec = adapt_spec(pod, container, sandbox, lookup, resolve_service, rewrite_paths)
    argv = [*(spec.command or default_command), *spec.args]
    argv[0] = COMMANDS.get(argv[0], argv[0])
    home = sandbox.root / "home"
    home.mkdir(parents=True, exist_ok=True)
    process_env = {"HOME": str(home), **base_env, **spec.env}
    working_dir = container.get("workingDir")
    cwd = Path(rewrite_paths(working_dir)) if working_dir else sandbox.root
    return Launch(argv, process_env, cwd, spec.notes)
