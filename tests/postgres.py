"""A real PostgreSQL server on loopback for the tuner's external study storage (Debian's `postgresql`
package: its binaries live in /usr/lib/postgresql/<version>/bin, off PATH). PostgreSQL refuses to run as root, so
under root (CI containers) it runs as the package's `postgres` user."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from chunkpilot.lab.child_process import free_port, stop_process

HOW = "sudo apt-get install postgresql (Debian/Ubuntu), or put initdb and postgres on PATH"


def find(name: str) -> str | None:
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    return shutil.which(name) or (versions[-1] if versions else None)


class Postgres:
    def __init__(self) -> None:
        self.initdb, self.postgres = find("initdb"), find("postgres")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="chunkpilot-pg-"))
        self.proc: subprocess.Popen | None = None

    def _as_owner(self, argv: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return argv
        return ["runuser", "-u", "postgres", "--", *argv]

    def start(self, timeout: float = 60) -> "Postgres":
        data = self.dir / "data"
        self.dir.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        subprocess.run(self._as_owner([self.initdb, "-D", str(data), "-A", "trust", "-U", "chunkpilot",
                                       "--no-sync", "-E", "UTF8"]), check=True, capture_output=True, timeout=120)
        self.proc = subprocess.Popen(
            self._as_owner([self.postgres, "-D", str(data), "-p", str(self.port), "-h", "127.0.0.1",
                            "-k", str(self.dir), "-c", "fsync=off", "-c", "full_page_writes=off"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = psycopg.connect(host="127.0.0.1", port=self.port, user="chunkpilot", dbname="postgres",
                                       autocommit=True)
                break
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"PostgreSQL did not start on port {self.port}")
                time.sleep(0.2)
        conn.close()
        return self

    def database(self) -> str:
        """A new empty database; its URL as a user would write it in the tuner's Secret."""
        import uuid

        import psycopg

        name = f"tuner_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user="chunkpilot", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://chunkpilot@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 30)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
