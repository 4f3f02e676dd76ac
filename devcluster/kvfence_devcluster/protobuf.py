"""The few protobuf bodies kubectl sends: its typed clients (`kubectl create secret generic`,
`kubectl create configmap`, `kubectl create namespace`) post `application/vnd.kubernetes.protobuf`
and do not fall back to JSON on 415. Everything else kubectl writes (apply, patch, edit,
delete) is JSON.

The wire format is read by hand (no protobuf runtime is a dependency) for exactly the fields
those commands can set, from Kubernetes' generated.proto: the `k8s\\0` envelope
(runtime.Unknown), ObjectMeta's name, generateName, namespace, labels and annotations, and the
kinds' own fields. Any other kind is refused with 415.
"""

import base64
from collections.abc import Callable, Iterator
from typing import Any

MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"


class ProtobufError(ValueError):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value): varints as int, length-delimited as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ProtobufError("truncated field")
            yield number, data[pos : pos + length]
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a string")
    return value.decode()


def _entry(value: int | bytes) -> tuple[str, bytes]:
    """A map<string, string|bytes> entry: key = 1, value = 2."""
    if not isinstance(value, bytes):
        raise ProtobufError("expected a map entry")
    key, item = "", b""
    for number, part in _fields(value):
        if number == 1:
            key = _text(part)
        elif number == 2 and isinstance(part, bytes):
            item = part
    return key, item


def _metadata(data: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    names = {1: "name", 2: "generateName", 3: "namespace"}
    for number, value in _fields(data):
        if number in names and value:  # proto2 sends unset strings as ""
            meta[names[number]] = _text(value)
        elif number in (11, 12):
            key, item = _entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = item.decode()
    return meta


def _secret(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in _fields(data):
        if number == 2:
            key, item = _entry(value)
            obj.setdefault("data", {})[key] = base64.b64encode(item).decode()
        elif number == 3 and value:
            obj["type"] = _text(value)
        elif number == 4:
            key, item = _entry(value)
            obj.setdefault("stringData", {})[key] = item.decode()
        elif number == 5:
            obj["immutable"] = bool(value)
    return obj


def _config_map(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in _fields(data):
        if number in (2, 3):
            key, item = _entry(value)
            if number == 2:
                obj.setdefault("data", {})[key] = item.decode()
            else:
                obj.setdefault("binaryData", {})[key] = base64.b64encode(item).decode()
        elif number == 4:
            obj["immutable"] = bool(value)
    return obj


def _namespace(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in _fields(data):
        if number == 2 and isinstance(value, bytes):
            finalizers = [_text(v) for n, v in _fields(value) if n == 1]
            obj["spec"] = {"finalizers": finalizers} if finalizers else {}
    return obj


KINDS: dict[tuple[str, str], Callable[[bytes], dict[str, Any]]] = {
    ("v1", "Secret"): _secret,
    ("v1", "ConfigMap"): _config_map,
    ("v1", "Namespace"): _namespace,
}


def decode(body: bytes) -> dict[str, Any]:
    """The object a protobuf body holds, as the JSON a client would have sent."""
    if not body.startswith(MAGIC):
        raise ProtobufError("the body does not start with the k8s protobuf envelope")
    api_version = kind = ""
    raw = b""
    for number, value in _fields(body[len(MAGIC) :]):
        if number == 1 and isinstance(value, bytes):
            for part_number, part in _fields(value):
                if part_number == 1:
                    api_version = _text(part)
                elif part_number == 2:
                    kind = _text(part)
        elif number == 2 and isinstance(value, bytes):
            raw = value
    reader = KINDS.get((api_version, kind))
    if reader is None:
        readable = ", ".join(k for _, k in KINDS)
        raise ProtobufError(
            f"{api_version} {kind} in protobuf is not served (only {readable}); send JSON"
        )
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": kind}
    for number, value in _fields(raw):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _metadata(value)
    obj.update(reader(raw))
    return obj
