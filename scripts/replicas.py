#!/usr/bin/env python3
"""Several `mlx-embed-server` replicas behind nginx, on this machine's loopback.

    make build && .venv/bin/python scripts/replicas.py --replicas 2 --port 8080 [-- SERVER FLAGS]

starts the replicas on the ports after --port, nginx on --port with
deploy/nginx/nginx.conf (its upstream block rewritten for these ports), and
stops everything on Ctrl-C. tests/e2e/test_nginx.py and scripts/bench_scale.py
use the same functions.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
SERVER_BINARY = ROOT / "target" / "release" / "mlx-embed-server"
HOST = "127.0.0.1"  # loopback only


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def find_nginx() -> str:
    """The nginx binary: on PATH, or where Debian puts it (/usr/sbin is not
    on every user's PATH)."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if not found:
        raise FileNotFoundError("nginx is not installed: `make setup` installs it (apt-get install nginx)")
    return found


def render_nginx_conf(listen_port: int, upstream_ports: Sequence[int], conf: Path = NGINX_CONF) -> str:
    """deploy/nginx/nginx.conf with its replica lines and listen port replaced;
    every other directive stays as shipped."""
    text = conf.read_text()
    block = re.search(r"^([ \t]*)# replicas:begin\n(.*?)^[ \t]*# replicas:end\n", text, re.DOTALL | re.MULTILINE)
    if not block:
        raise ValueError(f"{conf}: no '# replicas:begin' ... '# replicas:end' block")
    indent = block.group(1)
    template = re.search(r"^[ \t]*server 127\.0\.0\.1:\d+(.*);$", block.group(2), re.MULTILINE)
    params = template.group(1) if template else ""
    servers = "".join(f"{indent}server {HOST}:{p}{params};\n" for p in upstream_ports)
    text = text[: block.start(2)] + servers + text[block.end(2):]
    text, n = re.subn(r"^(\s*)listen [^;]+;", rf"\g<1>listen {HOST}:{listen_port};", text, count=1, flags=re.MULTILINE)
    if n != 1:
        raise ValueError(f"{conf}: no listen directive")
    return text


def _get(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@dataclass
class Replica:
    """One `mlx-embed-server` process on a loopback port."""

    port: int
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        return _get(self.url + "/health") == 200

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (drain), then SIGKILL past `timeout`; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_replica(port: int, log_dir: Path, args: Sequence[str] = (), *, wait: bool = True,
                  timeout: float = 180, env: dict | None = None, binary: Path = SERVER_BINARY,
                  command: Sequence[str] | None = None) -> Replica:
    """Starts the server binary (or `command`, e.g. `python -m mlx_embed serve`) on `port`;
    with `wait`, returns once /health is 200."""
    if command is None:
        if not binary.exists():
            raise FileNotFoundError(f"{binary} is missing: run `make build`")
        command = [str(binary)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"replica-{port}.log"
    full_env = {**os.environ, "VIRTUAL_ENV": sys.prefix, "MLX_EMBED_LOG": "info", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*command, "--host", HOST, "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
        )
    replica = Replica(port=port, proc=proc, log_path=log_path, args=list(args))
    if wait:
        wait_healthy(replica, timeout)
    return replica


def wait_healthy(replica: Replica, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            raise RuntimeError(f"replica :{replica.port} exited with {replica.proc.returncode}:\n"
                               f"{replica.log()[-3000:]}")
        if replica.healthy():
            return
        time.sleep(0.2)
    replica.stop()
    raise TimeoutError(f"replica :{replica.port} not healthy after {timeout}s:\n{replica.log()[-3000:]}")


@dataclass
class Nginx:
    """nginx in the foreground with its files under `prefix`."""

    port: int
    proc: subprocess.Popen
    prefix: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def access_log(self) -> list[str]:
        """The access log lines so far (nginx flushes its buffer every second)."""
        path = self.prefix / "access.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def error_log(self) -> str:
        path = self.prefix / "nginx.err"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout: float = 20) -> int | None:
        """SIGQUIT: finish the requests in flight, then exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_nginx(port: int, upstream_ports: Sequence[int], prefix: Path, timeout: float = 20) -> Nginx:
    """Starts nginx on `port` in front of `upstream_ports`; returns once it accepts connections."""
    prefix.mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(port, upstream_ports))
    nginx = find_nginx()
    base = [nginx, "-p", str(prefix), "-c", str(conf)]
    check = subprocess.run([*base, "-e", "stderr", "-t"], check=False, capture_output=True, text=True,
                           timeout=timeout)
    if check.returncode != 0:
        raise RuntimeError(f"nginx -t failed:\n{check.stderr}")
    # The config's error_log goes to stderr, into nginx.err; -e only covers
    # what nginx logs before it has read the config.
    with open(prefix / "nginx.err", "ab") as err:
        proc = subprocess.Popen([*base, "-e", str(prefix / "startup.err")], stdout=err,
                                stderr=subprocess.STDOUT, cwd=prefix)
    server = Nginx(port=port, proc=proc, prefix=prefix)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited with {proc.returncode}:\n{server.error_log()[-3000:]}")
        try:
            with socket.create_connection((HOST, port), timeout=1):
                return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"nginx not accepting on :{port} after {timeout}s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    if "--" in argv:
        server_args = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8080, help="nginx's port; replicas take the next ones")
    p.add_argument("--dir", type=Path, default=Path("/tmp/mlx-embed-replicas"),
                   help="nginx prefix and replica logs")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    ports = [args.port + 1 + i for i in range(args.replicas)]
    replicas = [start_replica(port, args.dir, server_args, wait=False) for port in ports]
    nginx = None
    try:
        for r in replicas:
            wait_healthy(r)
        nginx = start_nginx(args.port, ports, args.dir)
        print(f"nginx on {nginx.url} -> replicas on {', '.join(r.url for r in replicas)} "
              f"(logs in {args.dir}); Ctrl-C stops", flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while nginx.proc.poll() is None:
            time.sleep(1)
        print(f"nginx exited with {nginx.proc.returncode}", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        if nginx:
            nginx.stop()
        for r in replicas:
            r.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
