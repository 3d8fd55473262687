"""A local stand-in for the Hugging Face Hub's HTTP API, as much of it as `snapshot_download` uses: repository
info at a revision, the file tree, and `resolve` (HEAD for metadata, GET for content). It serves a model folder on
loopback and counts the content downloads, so a test can tell a fresh download from a kept one."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response

from chunkpilot.lab.child_process import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors",)  # stored with Git LFS on the Hub: ETag is the content's sha256


class FakeHub:
    def __init__(self, repo: str, folder: Path, revision: str = "main") -> None:
        self.repo, self.revision = repo, revision
        self.files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        self.downloads: list[str] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def _etag(self, name: str) -> str:
        data = self.files[name]
        if name.endswith(LFS_SUFFIXES):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id

    def _app(self) -> FastAPI:
        app = FastAPI()
        org, name = self.repo.split("/")

        def known(o: str, n: str, rev: str) -> bool:
            return (o, n) == (org, name) and rev in (self.revision, COMMIT)

        @app.get("/api/models/{o}/{n}/revision/{rev}")
        def info(o: str, n: str, rev: str):
            if not known(o, n, rev):
                return Response(status_code=404, headers={"X-Error-Code": "RepoNotFound"})
            return {"id": self.repo, "modelId": self.repo, "sha": COMMIT, "private": False,
                    "siblings": [{"rfilename": f} for f in self.files]}

        @app.get("/api/models/{o}/{n}/tree/{rev}")
        def tree(o: str, n: str, rev: str):
            if not known(o, n, rev):
                return Response(status_code=404)
            out = []
            for f, data in self.files.items():
                entry = {"type": "file", "path": f, "size": len(data),
                         "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
                if f.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                out.append(entry)
            return out

        @app.api_route("/{o}/{n}/resolve/{rev}/{filename:path}", methods=["GET", "HEAD"])
        def resolve(o: str, n: str, rev: str, filename: str, request: Request):
            if not known(o, n, rev) or filename not in self.files:
                return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound"})
            data = self.files[filename]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self._etag(filename)}"',
                       "Content-Length": str(len(data))}
            if request.method == "HEAD":
                return Response(status_code=200, headers=headers)
            self.downloads.append(filename)
            return Response(content=data, headers=headers, media_type="application/octet-stream")

        return app

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the stand-in hub did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
