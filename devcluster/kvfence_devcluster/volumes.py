"""Pod volumes on disk: configMap, secret and projected volumes become files in the pod's
directory (rewritten atomically when their objects change), emptyDir a directory, hostPath and
mapped PersistentVolumeClaims the directories they name."""

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .sandbox import NotReadyToStart, ObjectLookup, PodSandbox, Unsupported


def _select_items(
    data: dict[str, bytes], items: list[dict[str, Any]] | None, default_mode: int, what: str
) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {key: (value, default_mode) for key, value in data.items()}
    files = {}
    for item in items:
        if item["key"] not in data:
            raise NotReadyToStart(
                "ContainerCreating", f"{what} has no key {item['key']!r} (referenced by items)"
            )
        files[item["path"]] = (data[item["key"]], int(item.get("mode", default_mode)))
    return files


def _source_files(
    source_kind: str,
    source: dict[str, Any],
    namespace: str,
    lookup: ObjectLookup,
    default_mode: int,
) -> tuple[dict[str, tuple[bytes, int]], tuple[str, str], str]:
    kind = "Secret" if source_kind == "secret" else "ConfigMap"
    name = source.get("secretName") or source.get("name") or ""
    found = lookup.config_data(kind, namespace, name)
    if found is None:
        if source.get("optional"):
            return {}, (kind, name), ""
        raise NotReadyToStart("ContainerCreating", f'{kind.lower()} "{name}" not found')
    data, resource_version = found
    files = _select_items(data, source.get("items"), default_mode, f'{kind.lower()} "{name}"')
    return files, (kind, name), resource_version


def volume_files(
    volume: dict[str, Any], namespace: str, lookup: ObjectLookup
) -> tuple[dict[str, tuple[bytes, int]], dict[tuple[str, str], str]]:
    """The files of a configMap, secret or projected volume, and the objects they came from."""
    files: dict[str, tuple[bytes, int]] = {}
    sources: dict[tuple[str, str], str] = {}
    if "projected" in volume:
        projected = volume["projected"]
        mode = int(projected.get("defaultMode", 0o644))
        for source in projected.get("sources") or []:
            (kind, spec), *_ = source.items()
            if kind not in ("secret", "configMap"):
                raise Unsupported(f"projected volume source {kind!r} is not emulated")
            found, key, rv = _source_files(kind, spec, namespace, lookup, mode)
            files.update(found)
            sources[key] = rv
        return files, sources
    kind = "secret" if "secret" in volume else "configMap"
    spec = volume[kind]
    mode = int(spec.get("defaultMode", 0o644))
    found, key, rv = _source_files(kind, spec, namespace, lookup, mode)
    return found, {key: rv}


def give_to_group(path: Path, group: int | None, mask: int) -> None:
    """The kubelet's volume ownership for an fsGroup: the group owns `path`, which gets `mask`
    (read for the group, write too where the volume is writable; a folder also keeps new files
    in the group). Where this process may not change a file's group (not root), it stays."""
    if group is None:
        return
    try:
        os.chown(path, -1, group)
    except PermissionError:
        return
    mode = path.stat().st_mode & 0o7777
    os.chmod(path, mode | mask | (0o2110 if path.is_dir() else 0))


def write_atomically(path: Path, content: bytes, mode: int, group: int | None = None) -> None:
    """Readers see the old file or the new one, never half of it (write, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(temp, mode)
        give_to_group(Path(temp), group, 0o440)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def sync_volume(
    sandbox: PodSandbox, volume: dict[str, Any], namespace: str, lookup: ObjectLookup
) -> bool:
    """(Re)write a file volume when its objects changed. True if anything was written."""
    name = volume["name"]
    files, sources = volume_files(volume, namespace, lookup)
    if sandbox.volume_sources.get(name) == sources and name in sandbox.volume_files:
        return False
    root = sandbox.volume_paths[name]
    for relative, (content, mode) in files.items():
        target = root / relative
        if not target.exists() or target.read_bytes() != content:
            write_atomically(target, content, mode, sandbox.fs_group)
    for gone in sandbox.volume_files.get(name, set()) - files.keys():
        (root / gone).unlink(missing_ok=True)
    sandbox.volume_sources[name], sandbox.volume_files[name] = sources, set(files)
    return True


FILE_VOLUMES = ("configMap", "secret", "projected")


def materialize_volumes(
    pod: dict[str, Any], sandbox: PodSandbox, lookup: ObjectLookup, claims: Mapping[str, Path]
) -> None:
    namespace = pod["metadata"]["namespace"]
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        if any(kind in volume for kind in FILE_VOLUMES):
            sandbox.volume_paths[name] = sandbox.root / "volumes" / name
            sync_volume(sandbox, volume, namespace, lookup)
        elif "emptyDir" in volume:
            sandbox.volume_paths[name] = sandbox.root / "volumes" / name
            sandbox.volume_paths[name].mkdir(parents=True, exist_ok=True)
            sandbox.volume_paths[name].chmod(0o777)  # as the kubelet makes it: any uid writes
            give_to_group(sandbox.volume_paths[name], sandbox.fs_group, 0o660)
        elif "hostPath" in volume:
            sandbox.volume_paths[name] = Path(volume["hostPath"]["path"])
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in claims:
                raise Unsupported(
                    f"volume {name!r}: PersistentVolumeClaim {claim!r} has no local directory "
                    "(pass claims={name: path} to the test cluster)"
                )
            sandbox.volume_paths[name] = Path(claims[claim])
        else:
            raise Unsupported(f"volume {name!r} of type {sorted(volume)} is not emulated")
