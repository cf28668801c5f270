"""A loopback stand-in for the part of the Hugging Face Hub HTTP API that huggingface_hub 2.4 and
kernels 0.17.2 use to publish and fetch a kernel repository. Test infrastructure only: it binds
127.0.0.1 and keeps repositories in memory (git-like: branches point at commits, commits hold trees).

Endpoints (those HfApi.create_repo/create_branch/list_repo_tree/create_commit/list_repo_refs and
snapshot_download/hf_hub_download call): POST /api/repos/create, POST /api/kernels/{id}/branch/{b},
GET /api/kernels/{id}/refs, GET /api/kernels/{id}/tree/{rev}[/{path}], POST /api/kernels/{id}/preupload/{rev},
POST /api/kernels/{id}/commit/{rev} (ndjson, base64 "file" and "deletedFile" lines),
GET /api/kernels/{id}/revision/{rev}, POST /api/validate-yaml, GET /api/organizations/{org}/overview,
(a commit with ``create_pr=1`` opens a pull request, recorded in ``pulls``, and leaves the branch as it was),
HEAD/GET /kernels/{id}/resolve/{rev}/{path}.

Misbehaviour on demand, to test the client against a hostile or failing server: ``tamper`` (other
bytes, consistent ETag), ``etags`` / ``commit_headers`` (crafted ETag or X-Repo-Commit headers),
``gone`` (a listed file answers 404), ``broken`` (the body never comes), ``hold`` / ``half``
(requests wait, before any byte or after half the body, until the entry is removed: a client can be
killed at a known point), ``require_token`` (writes without a token, or with another token than the
one it names, get 401, as on the Hub).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo_id -> {"branches": {name: sha}, "commits": {sha: {path: bytes}}}
        self.requests: list[tuple[str, str]] = []
        self.tamper: dict[str, bytes] = {}  # path in repo -> bytes served instead (with a matching ETag)
        self.broken: set[str] = set()  # path suffixes whose download is cut off mid-body
        self.etags: dict[str, str] = {}  # path in repo -> ETag header sent instead (raw header value)
        self.commit_headers: dict[str, str] = {}  # path in repo -> X-Repo-Commit header sent instead
        self.gone: set[str] = set()  # paths listed in the tree whose download answers 404
        self.hold: set[str] = set()  # URL path prefixes whose requests wait (no byte sent) while listed
        self.half: set[str] = set()  # path suffixes whose GET sends half the body, then waits while listed
        self.waiting: list[str] = []  # requests that reached a hold or half (a client may now be killed)
        self.require_token: bool | str = False
        self.pulls: list[dict] = []  # pull requests opened by commits with create_pr: {"repo_id", "base", "commit"}
        self.lock = threading.Lock()
        self._n = 0
        handler = type("Handler", (_Handler,), {"hub": self})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.hold.clear()
        self.half.clear()
        self.server.shutdown()
        self.server.server_close()

    def wait_while(self, entries: set[str], key: str, path: str, timeout: float = 120.0) -> None:
        self.waiting.append(path)
        deadline = time.monotonic() + timeout
        while key in entries and time.monotonic() < deadline:
            time.sleep(0.02)

    def _new_commit(self, tree: dict[str, bytes]) -> str:
        self._n += 1
        h = hashlib.sha1(b"commit %d\0" % self._n)
        for path, data in sorted(tree.items()):
            h.update(path.encode() + b"\0" + data)
        return h.hexdigest()

    def resolve(self, repo_id: str, rev: str) -> str | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None
        if rev in repo["branches"]:
            return repo["branches"][rev]
        return rev if rev in repo["commits"] else None

    def files(self, repo_id: str, rev: str) -> dict[str, bytes]:
        return self.repos[repo_id]["commits"][self.resolve(repo_id, rev)]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client killed mid-request is part of the tests


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes | dict | list = b"", headers: dict | None = None, head: bool = False):
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str):
        self._send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def _dispatch(self, method: str):
        url = urlparse(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        hub = self.hub
        hub.requests.append((method, path))
        held = next((prefix for prefix in list(hub.hold) if path.startswith(prefix)), None)
        if held is not None:
            hub.wait_while(hub.hold, held, path)
        token = self.headers.get("Authorization")
        if method == "POST" and hub.require_token and (
                not token or (isinstance(hub.require_token, str) and token != f"Bearer {hub.require_token}")):
            self._body()
            return self._error(401, "Unauthorized", "Invalid username or password.")
        m = re.fullmatch(r"/kernels/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:  # file downloads only read, and may wait (half): outside the lock
            return self._resolve(method, m.group(1), m.group(2), m.group(3))
        with hub.lock:
            if method == "POST" and path == "/api/repos/create":
                return self._create_repo(json.loads(self._body()))
            if method == "POST" and path == "/api/validate-yaml":
                self._body()
                return self._send(200, {"errors": [], "warnings": []})
            m = re.fullmatch(r"/api/organizations/([^/]+)/overview", path)
            if m:
                return self._send(200, {"name": m.group(1), "trustedKernelPublisher": False})
            m = re.fullmatch(r"/api/kernels/([^/]+/[^/]+)/(refs|branch|tree|preupload|commit|revision)(?:/(.*))?", path)
            if m:
                repo_id, action, rest = m.group(1), m.group(2), m.group(3) or ""
                if repo_id not in hub.repos:
                    return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                return getattr(self, f"_{action}")(method, repo_id, rest, query)
        self._error(404, "NotFound", f"no route {method} {path}")

    def _create_repo(self, payload: dict):
        repo_id = f"{payload['organization']}/{payload['name']}"
        if payload.get("type") != "kernel":
            return self._error(400, "BadRequest", "this fake hub holds kernel repositories only")
        if repo_id in self.hub.repos:  # the Hub answers 409 with the url, which create_repo(exist_ok=True) reads
            return self._send(409, {"error": "You already created this kernel repo",
                                    "url": f"{self.hub.url}/kernels/{repo_id}"}, {"X-Error-Code": "Conflict"})
        sha = self.hub._new_commit({})
        self.hub.repos[repo_id] = {"branches": {"main": sha}, "commits": {sha: {}}}
        self._send(200, {"url": f"{self.hub.url}/kernels/{repo_id}", "name": repo_id})

    def _refs(self, method, repo_id, rest, query):
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": sha}
                    for b, sha in sorted(self.hub.repos[repo_id]["branches"].items())]
        self._send(200, {"branches": branches, "converts": [], "tags": []})

    def _branch(self, method, repo_id, rest, query):
        payload = json.loads(self._body() or b"{}")
        repo = self.hub.repos[repo_id]
        if rest in repo["branches"]:
            return self._error(409, "Conflict", f"Branch {rest} already exists")
        start = self.hub.resolve(repo_id, payload.get("startingPoint") or "main")
        repo["branches"][rest] = start
        self._send(200, {})

    def _tree(self, method, repo_id, rest, query):
        rev, _, prefix = rest.partition("/")
        if self.hub.resolve(repo_id, rev) is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = self.hub.files(repo_id, rev)
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        base = prefix.rstrip("/") + "/" if prefix else ""
        entries, dirs = [], set()
        for p in sorted(files):
            if not p.startswith(base):
                continue
            parts = p[len(base):].split("/")
            for i in range(1, len(parts)):
                dirs.add((base + "/".join(parts[:i]), i))
            if recursive or len(parts) == 1:
                entries.append({"type": "file", "oid": git_blob_id(files[p]), "size": len(files[p]), "path": p})
        for d, depth in sorted(dirs):
            if recursive or depth == 1:
                entries.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d})
        if prefix and not entries:
            return self._error(404, "EntryNotFound", f"{prefix} does not exist on {rev}")
        self._send(200, entries)

    def _preupload(self, method, repo_id, rest, query):
        payload = json.loads(self._body())
        files = self.hub.files(repo_id, rest)
        out = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                "oid": git_blob_id(files[f["path"]]) if f["path"] in files else None} for f in payload["files"]]
        self._send(200, {"files": out, "commitOid": self.hub.resolve(repo_id, rest)})

    def _commit(self, method, repo_id, rest, query):
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        repo = self.hub.repos[repo_id]
        if rest not in repo["branches"]:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest}")
        tree = dict(repo["commits"][repo["branches"][rest]])
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                tree[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in tree:
                    return self._error(404, "EntryNotFound", f"A file with this name doesn't exist: {value['path']}")
                del tree[value["path"]]
            elif key != "header":
                return self._error(400, "BadRequest", f"unsupported commit operation {key}")
        sha = self.hub._new_commit(tree)
        repo["commits"][sha] = tree
        if query.get("create_pr", ["0"])[0] in ("1", "true", "True"):  # the branch stays; the change waits in a PR
            self.hub.pulls.append({"repo_id": repo_id, "base": rest, "commit": sha})
            number = len(self.hub.pulls)
            return self._send(200, {"commitUrl": f"{self.hub.url}/kernels/{repo_id}/commit/{sha}", "commitOid": sha,
                                    "pullRequestUrl": f"{self.hub.url}/kernels/{repo_id}/discussions/{number}",
                                    "success": True})
        repo["branches"][rest] = sha
        self._send(200, {"commitUrl": f"{self.hub.url}/kernels/{repo_id}/commit/{sha}", "commitOid": sha,
                         "success": True})

    def _revision(self, method, repo_id, rest, query):
        sha = self.hub.resolve(repo_id, rest)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest}")
        files = self.hub.repos[repo_id]["commits"][sha]
        self._send(200, {"id": repo_id, "sha": sha, "siblings": [{"rfilename": p} for p in sorted(files)]})

    def _resolve(self, method, repo_id, rev, path):
        sha = self.hub.resolve(repo_id, rev)
        if sha is None:
            return self._error(404, "RepoNotFound" if repo_id not in self.hub.repos else "RevisionNotFound",
                               f"{repo_id}@{rev} not found")
        files = self.hub.repos[repo_id]["commits"][sha]
        commit = self.hub.commit_headers.get(path, sha)
        if path not in files or path in self.hub.gone:
            return self._send(404, {"error": f"{path} does not exist on {rev}"},
                              {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
        data = self.hub.tamper.get(path, files[path])
        headers = {"X-Repo-Commit": commit, "ETag": self.hub.etags.get(path, f'"{git_blob_id(data)}"'),
                   "Content-Type": "application/octet-stream"}
        half = next((s for s in list(self.hub.half) if path.endswith(s)), None)
        if method == "GET" and half is not None:  # half the body, then wait (the client is killed meanwhile)
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.hub.wait_while(self.hub.half, half, path)
            self.close_connection = True
            return
        if method == "GET" and any(path.endswith(b) for b in self.hub.broken):  # announce a body, hang up
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.flush()  # no body at all: each resume attempt fails the same way
            self.close_connection = True
            return
        self._send(200, data, headers, head=method == "HEAD")
