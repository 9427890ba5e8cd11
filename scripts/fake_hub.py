"""A Hugging Face cache and a Hugging Face Hub for tests, made from a local
model folder: the Hub cannot be reached from the test machines.

``cache_repo`` lays a folder out in a cache as huggingface_hub 2.x writes it
(``blobs/<etag>`` holding the bytes, ``snapshots/<commit>/<path>`` relative
links to them, ``refs/<branch or tag>`` holding the commit).

``FakeHub`` serves folders over HTTP on 127.0.0.1 with the endpoints
huggingface_hub's ``list_repo_files`` and ``snapshot_download`` call (point
``HF_ENDPOINT`` at ``hub.url``):

- ``GET /api/models/<repo>/revision/<rev>``: the repo's info, its ``sha``;
- ``GET /api/models/<repo>/tree/<rev>?recursive=...``: its files, one page;
- ``HEAD``/``GET /<repo>/resolve/<rev>/<path>``: a file, with the headers
  the client checks (``X-Repo-Commit``, ``ETag``, ``Content-Length``);

and answers an unknown repo, revision or file as the Hub does: 404 with its
``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``),
which huggingface_hub turns into its typed errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its path inside it (``/``-separated)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def etag(data: bytes) -> str:
    """A file's ETag as the Hub gives an LFS file's: its sha256."""
    return hashlib.sha256(data).hexdigest()


def cache_repo(
    cache: Path, repo_id: str, files: dict[str, bytes], *, commit: str, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Puts ``files`` in ``cache`` as the snapshot ``commit`` of ``repo_id``,
    with each of ``refs`` (branches or tags) pointing at it; returns the
    snapshot folder."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / etag(data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        path = repo / "refs" / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(commit)
    return snapshot


class FakeHub:
    """The Hub's few endpoints over ``repos``: repo id -> commit -> (refs,
    files). Every request's method and path is kept in ``requests``."""

    def __init__(self):
        self.repos: dict[str, dict[str, tuple[tuple[str, ...], dict[str, bytes]]]] = {}
        self.requests: list[tuple[str, str]] = []
        # The next this many requests are answered 503, as a Hub under load.
        self.unavailable = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: dict[str, bytes], *, commit: str, refs: tuple[str, ...] = ("main",)):
        """Adds the commit ``commit`` of ``repo_id`` holding ``files``, with
        ``refs`` pointing at it: a ref an earlier commit had moves here (a
        push to a branch), the earlier commits stay reachable by sha."""
        commits = self.repos.setdefault(repo_id, {})
        for other, (other_refs, other_files) in list(commits.items()):
            commits[other] = (tuple(r for r in other_refs if r not in refs), other_files)
        commits[commit] = (refs, files)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def _commit(self, repo_id: str, rev: str):
        for commit, (refs, _) in self.repos[repo_id].items():
            if rev in (commit, *refs):
                return commit
        return None

    def _answer(self, req: BaseHTTPRequestHandler, body: bool):
        path = unquote(urlsplit(req.path).path)
        self.requests.append((req.command, path))
        if self.unavailable > 0:
            self.unavailable -= 1
            return self._send(req, 503, b"busy", body, {"Content-Type": "text/plain"})
        m = re.fullmatch(r"/api/models/(.+)/(revision|tree)/([^/]+)(?:/.*)?", path) or re.fullmatch(
            r"/(.+)/(resolve)/([^/]+)/(.+)", path
        )
        if m is None:
            return self._error(req, 404, "RepoNotFound", f"no route {path}")
        repo_id, what, rev = m.group(1), m.group(2), m.group(3)
        if repo_id not in self.repos:
            return self._error(req, 404, "RepoNotFound", f"Repository Not Found for url: {path}")
        commit = self._commit(repo_id, rev)
        if commit is None:
            return self._error(req, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = self.repos[repo_id][commit][1]
        if what == "revision":
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": False,
                "siblings": [{"rfilename": name} for name in files],
            }
            return self._send(req, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
        if what == "tree":
            tree = [
                {
                    "type": "file",
                    "oid": etag(data),
                    "size": len(data),
                    "path": name,
                    "lfs": {"oid": etag(data), "size": len(data), "pointerSize": 134},
                }
                for name, data in files.items()
            ]
            return self._send(req, 200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
        name = m.group(4)
        if name not in files:
            return self._error(req, 404, "EntryNotFound", f"{name} does not exist", commit)
        data = files[name]
        return self._send(
            req,
            200,
            data,
            body,
            {"Content-Type": "application/octet-stream", "ETag": f'"{etag(data)}"', "X-Repo-Commit": commit},
        )

    def _error(self, req, status: int, code: str, message: str, commit: str | None = None):
        headers = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(req, status, json.dumps({"error": message}).encode(), req.command != "HEAD", headers)

    @staticmethod
    def _send(req, status: int, data: bytes, body: bool, headers: dict[str, str]):
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)
