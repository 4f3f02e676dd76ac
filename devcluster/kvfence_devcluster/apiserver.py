"""The test Kubernetes API server: kmock's scaffold, with the store behind it.

kmock provides the HTTP server, the URL parsing into group/version/plural/namespace/name, its
bundled resource list, and its reaction DSL (a test can still inject a fault with
`server["patch", kmock.resource("v1", "pods")] << 500`). Its own object store
(KubernetesEmulator) is replaced by store.Store, which behaves like a kube-apiserver where
kopf, the kubernetes client and the operator depend on it (see store.py). What the real
kubectl needs on top is here too: discovery documents it can read (discovery.py), OpenAPI v3
(openapi.py), server-side printing (tables.py), the protobuf bodies of `kubectl create`
(protobuf.py), server-side apply, and namespaces.
"""

import asyncio
import json
import re
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import parsing, rendering

from . import discovery, openapi, protobuf, tables
from .admission import CrdAdmission, refuse
from .counting import RequestCounter, classify
from .protobuf import ProtobufError
from .resources import ApiError, ResourceType, bad_request, not_found
from .selectors import SelectorError, parse_field_selector, parse_label_selector
from .store import FULL, MERGE_PATCH, STRATEGIC_MERGE_PATCH, Store

REPO = Path(__file__).resolve().parents[2]
INFERENCE_DEPLOYMENT_CRD = REPO / "crds" / "inferencedeployment.yaml"
CRD_TYPE = ResourceType(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    "CustomResourceDefinition",
    namespaced=False,
    subresources=frozenset({"status"}),
)
# kmock matches every request against every reaction by scanning the kept request history
# (`request in reaction`), so each request costs O(kept x reactions): 1000 kept made a call
# take ~60 ms and an operator's reconcile pass ~2 s. Nothing reads that history, and a request
# is matched while it is being handled: only those are kept (a watch's, once it streams, not).
VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
APPLY_PATCH = "application/apply-patch+yaml"
PodLogs = Callable[[str, str, str | None], str | None]  # namespace, pod, container -> text
NAMESPACE_TYPE = ResourceType("", "v1", "namespaces", "Namespace", namespaced=False)
# The namespaces a kube-apiserver creates for itself.
INITIAL_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")
_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads `/api/v1/namespaces[/NAME[/status|finalize]]` as a namespace scope
    without a resource (and fails on the bare list): here they are the Namespace kind."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        name, subresource = [*parts[3:], None, None][:2]
        return parsing.ParsedPath("", "v1", "namespaces", None, name, subresource)
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path  # kmock's Request._parse looks it up in its module each time


def _reply(
    payload: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> rendering.Response:
    """Every answer carries its status explicitly: kmock copies the status (and merges the
    headers) of a returned Response into the reaction it came from, so an implicit 200 would
    inherit the last 404. Headers are therefore only set where they are always the same."""
    return rendering.Response(
        status=status, headers=dict(headers) if headers else None, payload=payload
    )


def _not_served() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def load_yaml(text: str | bytes) -> Any:
    """yaml.safe_load through libyaml where PyYAML has it (its wheels do): the CRD file every
    cluster installs is 200 KB, 0.4 s of CPU in pure Python, 0.06 s in C."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    store: Store = attrs.field(factory=Store)
    pod_logs: PodLogs | None = None
    counter: RequestCounter = attrs.field(factory=RequestCounter)  # counting.py
    _custom: set[tuple[str, str, str]] = attrs.field(factory=set, init=False)
    _printer_columns: dict[tuple[str, str, str], list[dict[str, Any]]] = attrs.field(
        factory=dict, init=False
    )
    _schemas: dict[tuple[str, str, str], dict[str, Any]] = attrs.field(factory=dict, init=False)
    _admissions: dict[tuple[str, str, str], CrdAdmission] = attrs.field(factory=dict, init=False)
    _strict_fields: bool = attrs.field(default=False, init=False)  # the request being served
    _matching: set[int] = attrs.field(factory=set, init=False)  # ids of requests being matched

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self.store.admit = self._admit
        # Below kmock's discovery handlers and any reaction a test adds; above its catch-all 404.
        self.fallback["get /openapi/v3"] << self._serve_openapi_root
        openapi_paths = re.compile(r"/openapi/v3/(api|apis/[^/]+)/[^/]+")
        self.fallback["get", openapi_paths] << self._serve_openapi
        self.fallback[kmock.action.WATCH] << self._serve_watch
        self.fallback[kmock.action.FETCH, kmock.subresource("log")] << self._serve_log
        self.fallback[kmock.action.LIST] << self._serve_list
        self.fallback[kmock.action.FETCH] << self._serve_fetch
        self.fallback[kmock.method.POST] << self._serve_create
        self.fallback[kmock.method.PUT] << self._serve_replace
        self.fallback[kmock.method.PATCH] << self._serve_patch
        self.fallback[kmock.method.DELETE] << self._serve_delete
        for namespace in INITIAL_NAMESPACES:
            created = self.store.create(NAMESPACE_TYPE, None, {"metadata": {"name": namespace}})
            self._activate(created)

    # ---- resources ------------------------------------------------------------------------

    def resource_type(self, group: str, version: str, plural: str) -> ResourceType:
        resource = kmock.resource(group, version, plural)
        if resource not in self.resources:
            raise _not_served()
        info = self.resources[resource]
        return ResourceType(
            group=group,
            version=version,
            plural=plural,
            kind=info.kind or plural.capitalize(),
            namespaced=bool(info.namespaced),
            subresources=frozenset(info.subresources),
            custom=(group, version, plural) in self._custom,
        )

    def resource_types(self) -> list[ResourceType]:
        return [
            self.resource_type(r.group or "", r.version or "", r.plural)
            for r in self.resources
            if r.plural and r.version is not None
        ]

    def register_crd(self, crd: dict[str, Any]) -> None:
        """Serve a CustomResourceDefinition's resources (discovery included)."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            key = (spec["group"], version["name"], names["plural"])
            self.resources[kmock.resource(*key)] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=VERBS,
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                subresources=set(version.get("subresources") or {}),
            )
            self._custom.add(key)
            self._printer_columns[key] = list(version.get("additionalPrinterColumns") or [])
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if isinstance(schema, dict):
                self._schemas[key] = schema
                self._admissions[key] = CrdAdmission(schema)

    def _admit(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        """A custom resource is checked against its CRD's schema as the apiextensions server
        does (admission.py): what `kubectl apply` of a mistyped manifest gets refused with."""
        admission = self._admissions.get((rt.group, rt.version, rt.plural)) if rt.custom else None
        if admission is None:
            return
        checked = {k: v for k, v in obj.items() if k != "status"}
        checked["metadata"] = {"name": obj["metadata"].get("name", "")}
        refuse(rt, obj, admission.refusals(checked), strict=self._strict_fields)

    def install_crd(self, crd: dict[str, Any]) -> dict[str, Any]:
        """Create a CRD object as `kubectl apply` would, and mark it Established."""
        created = self.store.create(CRD_TYPE, None, crd)
        self._establish(created)
        return created

    def _establish(self, crd: dict[str, Any]) -> None:
        self.register_crd(crd)
        spec = crd["spec"]
        conditions = [
            {"type": kind, "status": "True", "reason": reason, "message": message}
            for kind, reason, message in (
                ("NamesAccepted", "NoConflicts", "no conflicts found"),
                ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            )
        ]
        status = {
            "conditions": conditions,
            "acceptedNames": spec["names"],
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        }
        self.store.update(
            CRD_TYPE, None, crd["metadata"]["name"], lambda o: o.update(status=status), "status"
        )

    def _activate(self, namespace: dict[str, Any]) -> None:
        """A namespace is Active at once (nothing here terminates one slowly)."""
        self.store.update(
            NAMESPACE_TYPE,
            None,
            namespace["metadata"]["name"],
            lambda o: o.update(spec={"finalizers": ["kubernetes"]}, status={"phase": "Active"}),
            FULL,
        )

    def install_crd_file(self, path: Path = INFERENCE_DEPLOYMENT_CRD) -> dict[str, Any]:
        return self.install_crd(load_yaml(path.read_text()))

    # ---- discovery (kmock routes these paths to the methods it names) -----------------------

    def _discovery_entries(self) -> list[discovery.Entry]:
        entries: list[discovery.Entry] = []
        for resource in self.resources:
            info = self.resources[resource]
            served = {"status"} & set(info.subresources)
            if (resource.group, resource.plural) == ("", "pods"):
                served.add("log")
            entries.append((resource, info, served))
        return entries

    async def _serve_server_version(self, request: rendering.Request) -> Any:
        return _reply(discovery.SERVER_VERSION)

    async def _serve_api(self, request: rendering.Request) -> Any:
        return _reply(discovery.api_versions())

    async def _serve_apis(self, request: rendering.Request) -> Any:
        return _reply(discovery.group_list(self._discovery_entries()))

    async def _serve_group(self, request: rendering.Request) -> Any:
        assert request.resource is not None
        found = discovery.group(self._discovery_entries(), request.resource.group or "")
        return self._failure(_not_served()) if found is None else _reply(found)

    async def _serve_version(self, request: rendering.Request) -> Any:
        assert request.resource is not None
        found = discovery.resource_list(
            self._discovery_entries(), request.resource.group or "", request.resource.version or ""
        )
        return self._failure(_not_served()) if found is None else _reply(found)

    async def _serve_openapi_root(self, request: rendering.Request) -> Any:
        return _reply(openapi.root(self._discovery_entries(), self._schemas))

    async def _serve_openapi(self, request: rendering.Request) -> Any:
        parts = request.url.path.split("/")[3:]  # ["api", "v1"] or ["apis", group, version]
        group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
        found = openapi.document(self._discovery_entries(), group, version, self._schemas)
        return self._failure(_not_served()) if found is None else _reply(found)

    # ---- request handling -----------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        self.counter.count(
            classify(raw_request.method, raw_request.path, raw_request.query, raw_request.headers)
        )
        try:
            return await super().__call__(raw_request)
        finally:
            # kmock keeps every request (and its body) for assertions; an operator polling for
            # minutes would grow that without bound, and matching slows with it (see above).
            kept: list[Any] = self._requests  # kmock's own
            kept[:] = [r for r in kept if id(r) in self._matching]
            for reaction in self._payloads:
                reaction._requests.clear()  # what each one served

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """kmock's dispatch, with `request` kept in its history only while it is matched."""
        self._matching.add(id(request))
        try:
            return await super()._handle(request)
        finally:
            self._matching.discard(id(request))

    def _target(self, request: rendering.Request) -> tuple[ResourceType, str | None]:
        resource = request.resource
        if resource is None or not resource.plural or resource.version is None:
            raise _not_served()
        rt = self.resource_type(resource.group or "", resource.version, resource.plural)
        if not rt.namespaced and request.namespace:
            raise _not_served()
        served = {
            None,
            *rt.subresources,
            *(["log"] if rt.plural == "pods" and not rt.group else []),
        }
        if request.subresource not in served:
            raise _not_served()
        return rt, request.namespace if rt.namespaced else None

    @staticmethod
    def _body(request: rendering.Request) -> Any:
        if not request.body:
            return None
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type == protobuf.CONTENT_TYPE:
            try:
                return protobuf.decode(request.body)
            except ProtobufError as exc:
                raise ApiError(415, "UnsupportedMediaType", str(exc)) from None
        try:
            return json.loads(request.body)
        except ValueError:
            raise bad_request(
                "the request body is not JSON (YAML and protobuf are not served)"
            ) from None

    @staticmethod
    def _selectors(request: rendering.Request) -> tuple[Any, Any]:
        try:
            labels = parse_label_selector(request.params.get("labelSelector"))
            fields = parse_field_selector(request.params.get("fieldSelector"))
        except SelectorError as exc:
            raise bad_request(str(exc)) from None
        if request.name is not None:
            fields = (*fields, *parse_field_selector(f"metadata.name={request.name}"))
        return labels, fields

    @staticmethod
    def _failure(exc: ApiError) -> rendering.Response:
        return _reply(exc.status(), exc.code, headers={"Content-Type": "application/json"})

    @staticmethod
    def _wants_table(request: rendering.Request) -> bool:
        return tables.wants_table(request.headers.get("Accept", ""))

    def _table(
        self, rt: ResourceType, request: rendering.Request, objects: list[dict[str, Any]]
    ) -> dict[str, Any]:
        key = (rt.group, rt.version, rt.plural)
        printer = (
            tables.custom_columns(self._printer_columns.get(key, []))
            if rt.custom
            else tables.BUILTIN.get((rt.group, rt.plural), tables.DEFAULT)
        )
        return tables.table(
            printer, objects, self.store.resource_version, request.params.get("includeObject")
        )

    async def _serve_list(self, request: rendering.Request) -> Any:
        try:
            rt, namespace = self._target(request)
            labels, fields = self._selectors(request)
            items = self.store.list_objects(rt, namespace, labels, fields)
        except ApiError as exc:
            return self._failure(exc)
        if self._wants_table(request):
            return _reply(self._table(rt, request, items))
        return _reply(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version,
                "metadata": {"resourceVersion": self.store.resource_version, "continue": ""},
                "items": items,
            }
        )

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        try:
            rt, namespace = self._target(request)
            assert request.name is not None
            obj = self.store.get(rt, namespace, request.name)
        except ApiError as exc:
            return self._failure(exc)
        return _reply(self._table(rt, request, [obj]) if self._wants_table(request) else obj)

    async def _serve_log(self, request: rendering.Request) -> Any:
        try:
            rt, namespace = self._target(request)
            assert request.name is not None
            self.store.get(rt, namespace, request.name)
            container = request.params.get("container")
            text = (
                self.pod_logs(namespace or "", request.name, container) if self.pod_logs else None
            )
            if text is None:
                raise ApiError(400, "BadRequest", f"no log for container {container!r}")
        except ApiError as exc:
            return self._failure(exc)
        return _reply(text.encode(), headers={"Content-Type": "text/plain; charset=utf-8"})

    def _created(self, rt: ResourceType, created: dict[str, Any]) -> dict[str, Any]:
        """What a kube-apiserver's own controllers do at once with a new object."""
        if (rt.group, rt.plural) == (CRD_TYPE.group, CRD_TYPE.plural):
            self._establish(created)
        elif (rt.group, rt.plural) == ("", "namespaces"):
            self._activate(created)
            return self.store.get(rt, None, created["metadata"]["name"])
        return created

    def _updated(self, rt: ResourceType, updated: dict[str, Any]) -> dict[str, Any]:
        if (rt.group, rt.plural) == (CRD_TYPE.group, CRD_TYPE.plural):
            self.register_crd(updated)  # a re-applied CRD's columns and names take effect
        return updated

    def _deleted(self, rt: ResourceType, gone: dict[str, Any]) -> None:
        """A deleted namespace takes what is in it along, a deleted CRD its objects and its
        API (at once: a kube-apiserver passes through Terminating while it does this)."""
        name = gone["metadata"]["name"]
        if (rt.group, rt.plural) == ("", "namespaces"):
            for kind in self.resource_types():
                if kind.namespaced:
                    self.store.delete_collection(kind, name)
        elif (rt.group, rt.plural) == (CRD_TYPE.group, CRD_TYPE.plural):
            spec = gone["spec"]
            for version in spec["versions"]:
                key = (spec["group"], version["name"], spec["names"]["plural"])
                if key in self._custom:
                    self.store.delete_collection(self.resource_type(*key), None)
                    del self.resources[kmock.resource(*key)]
                    self._custom.discard(key)

    async def _serve_create(self, request: rendering.Request) -> Any:
        self._strict_fields = request.params.get("fieldValidation") == "Strict"
        try:
            rt, namespace = self._target(request)
            if request.name is not None:
                raise ApiError(405, "MethodNotAllowed", f"POST to {request.url.path} is not served")
            body = self._body(request)
            if request.params.get("dryRun") == "All":
                return _reply(self.store.create(rt, namespace, body, dry_run=True), 201)
            created = self._created(rt, self.store.create(rt, namespace, body))
        except ApiError as exc:
            return self._failure(exc)
        return _reply(created, 201)

    async def _serve_replace(self, request: rendering.Request) -> Any:
        self._strict_fields = request.params.get("fieldValidation") == "Strict"
        try:
            rt, namespace = self._target(request)
            if request.name is None:
                raise ApiError(405, "MethodNotAllowed", "PUT needs an object name")
            body = self._body(request)
            replaced = self.store.replace(rt, namespace, request.name, body, request.subresource)
            return _reply(self._updated(rt, replaced))
        except ApiError as exc:
            return self._failure(exc)

    async def _serve_patch(self, request: rendering.Request) -> Any:
        self._strict_fields = request.params.get("fieldValidation") == "Strict"
        try:
            rt, namespace = self._target(request)
            if request.name is None:
                raise ApiError(405, "MethodNotAllowed", "PATCH needs an object name")
            content_type = request.headers.get("Content-Type", "")
            if content_type.split(";")[0].strip().lower() == APPLY_PATCH:
                return self._server_side_apply(rt, namespace, request)
            patched = self.store.patch(
                rt, namespace, request.name, self._body(request), content_type, request.subresource
            )
            return _reply(self._updated(rt, patched))
        except ApiError as exc:
            return self._failure(exc)

    def _server_side_apply(
        self, rt: ResourceType, namespace: str | None, request: rendering.Request
    ) -> rendering.Response:
        """`kubectl apply --server-side`, reduced: the applied configuration (YAML or JSON)
        creates the object, or is merged into it (a JSON merge patch for custom resources, a
        strategic merge patch for built-in kinds). No field ownership is tracked (no
        managedFields, never a conflict), so a field left out of a later apply is kept."""
        assert request.name is not None
        try:
            applied = load_yaml(request.body or b"")
        except yaml.YAMLError as exc:
            raise bad_request(f"the applied configuration is not YAML: {exc}") from None
        if (
            not isinstance(applied, dict)
            or not applied.get("apiVersion")
            or not applied.get("kind")
        ):
            raise bad_request(
                "the applied configuration must be an object with apiVersion and kind"
            )
        if (applied.get("metadata") or {}).get("name", request.name) != request.name:
            raise bad_request("the name of the object does not match the name on the URL")
        if self.store.find(rt, namespace, request.name) is None:
            if request.subresource:
                raise not_found(rt, request.name)
            applied.setdefault("metadata", {})["name"] = request.name
            return _reply(self._created(rt, self.store.create(rt, namespace, applied)), 201)
        patch_type = MERGE_PATCH if rt.custom else STRATEGIC_MERGE_PATCH
        patched = self.store.patch(
            rt, namespace, request.name, applied, patch_type, request.subresource
        )
        return _reply(self._updated(rt, patched))

    async def _serve_delete(self, request: rendering.Request) -> Any:
        try:
            rt, namespace = self._target(request)
            options = self._body(request) or {}
            propagation = options.get("propagationPolicy") or request.params.get(
                "propagationPolicy"
            )
            if options.get("orphanDependents") or request.params.get("orphanDependents") == "true":
                propagation = "Orphan"
            if request.name is None:
                labels, fields = self._selectors(request)
                items = self.store.delete_collection(rt, namespace, labels, fields, propagation)
                return _reply(
                    {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "items": items}
                )
            before = self.store.get(rt, namespace, request.name)
            remaining = self.store.delete(
                rt, namespace, request.name, propagation, options.get("preconditions")
            )
            if remaining is None:
                self._deleted(rt, before)
        except ApiError as exc:
            return self._failure(exc)
        if remaining is not None or (rt.plural == "pods" and not rt.group):
            return _reply(remaining or before)  # pods, and objects held by finalizers
        return _reply(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {
                    "name": request.name,
                    "group": rt.group,
                    "kind": rt.plural,
                    "uid": before["metadata"]["uid"],
                },
            }
        )

    async def _serve_watch(self, request: rendering.Request) -> Any:
        self._matching.discard(id(request))  # matched: this reaction serves it while it streams
        try:
            rt, namespace = self._target(request)
            labels, fields = self._selectors(request)
            first, watcher = self.store.watch(
                rt, namespace, labels, fields, request.params.get("resourceVersion")
            )
        except ApiError as exc:
            if exc.code != 410:
                return self._failure(exc)
            # Too old: Kubernetes answers 200 with one ERROR event; kopf then re-lists.
            return _reply((b"", {"type": "ERROR", "object": exc.status()}))
        timeout = request.params.get("timeoutSeconds")
        bookmark = None
        if request.params.get("sendInitialEvents") == "true":
            bookmark = {
                "type": "BOOKMARK",
                "object": {
                    "kind": rt.kind,
                    "apiVersion": rt.api_version,
                    "metadata": {
                        "resourceVersion": self.store.resource_version,
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                },
            }
        events: AsyncGenerator[Any, None] = self._stream(
            first, watcher, float(timeout) if timeout else None, bookmark
        )
        if self._wants_table(request):
            events = self._tabulated(rt, request, events)
        return _reply(events, headers={"Content-Type": "application/json"})

    async def _stream(
        self,
        first: list[dict[str, Any]],
        watcher: Any,
        timeout: float | None,
        bookmark: dict[str, Any] | None,
    ) -> AsyncGenerator[Any, None]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            yield b""  # send the headers now, even if nothing happens for a while
            for event in first:
                yield event
            if bookmark is not None:
                yield bookmark
            while deadline is None or loop.time() < deadline:
                remaining = None if deadline is None else deadline - loop.time()
                try:
                    async with asyncio.timeout(remaining):  # not wait_for: loop.woken says why
                        event = await watcher.queue.get()
                except TimeoutError:
                    return
                yield event
        finally:
            self.store.unwatch(watcher)

    async def _tabulated(
        self, rt: ResourceType, request: rendering.Request, events: AsyncGenerator[Any, None]
    ) -> AsyncGenerator[Any, None]:
        """Watch events whose objects are one-row Tables (`kubectl get -w`)."""
        try:
            async for event in events:
                kind = event.get("type") if isinstance(event, dict) else None
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    event = {**event, "object": self._table(rt, request, [event["object"]])}
                yield event
        finally:
            await events.aclose()  # now, not when collected: it stops the store's watcher

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, ApiError):
            return aiohttp.web.json_response(exc.status(), status=exc.code)
        return await super()._render_error(exc)

    def internal_errors(self) -> list[Exception]:
        """Exceptions raised while serving (bugs here, not API errors like 404)."""
        try:
            errors = self.errors
        except RuntimeError:
            return []
        return [e for e in errors if not isinstance(e, kmock.KubernetesError | ApiError)]


def write_kubeconfig(path: Path, server_url: str, namespace: str = "default") -> Path:
    """A kubeconfig for the test server, for `KUBECONFIG=` subprocesses and
    `kubernetes.config.load_kube_config(config_file=...)`. The token is never checked."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvfence-test", "cluster": {"server": server_url}}],
        "users": [{"name": "kvfence-test", "user": {"token": "kvfence-test-token"}}],
        "contexts": [
            {
                "name": "kvfence-test",
                "context": {
                    "cluster": "kvfence-test",
                    "user": "kvfence-test",
                    "namespace": namespace,
                },
            }
        ],
        "current-context": "kvfence-test",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
