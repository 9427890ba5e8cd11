#!/usr/bin/env python3
"""Several `mlx-embed-server` replicas behind nginx, on this machine's loopback.

    make build && .venv/bin/python scripts/replicas.py --replicas 2 --port 8080 [-- SERVER FLAGS]

starts the replicas on the ports after --port, nginx on --port with
deploy/nginx/nginx.conf (its upstream block rewritten for these ports, its
body limit and read timeouts for the server flags), and stops everything on
Ctrl-C or SIGTERM, start-up included. It exits 1 when a port is taken, a
replica or nginx fails to start, or nginx exits on its own.
tests/e2e/test_nginx.py, tests/e2e/test_replicas_script.py and
scripts/bench_scale.py use the same functions.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The server gets this interpreter's venv; run by a python outside any venv, it is left to find ./.venv itself.
VENV_ENV = {"VIRTUAL_ENV": sys.prefix} if sys.prefix != sys.base_prefix else {}
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
SERVER_BINARY = ROOT / "target" / "release" / "mlx-embed-server"
HOST = "127.0.0.1"  # loopback only
# What nginx waits for an answer beyond twice the replicas'
# --max-queue-wait-ms (a wait for answer room, then one in the queue): the
# model call after admission (the shipped 135 s is twice the default 60 s
# plus this).
READ_TIMEOUT_MARGIN_S = 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """A socket listens on `port` (any address). After a stop this is what
    "still held" means: a bind test also fails while another program's
    outgoing connection has the port as its source port (the ports these
    scripts pick come from the ephemeral range, and on a busy machine one
    freed is soon taken that way, or left in TIME_WAIT by a client, which
    SO_REUSEADDR does not pass). Linux reads /proc/net/tcp{,6}; elsewhere
    the bind test stands in."""
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return not port_free(port)
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is TCP_LISTEN.
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def port_free(port: int) -> bool:
    """Nobody listens on `port` (TIME_WAIT leftovers do not count: nginx and
    the server bind with SO_REUSEADDR too)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def find_nginx() -> str:
    """The nginx binary: on PATH, or where Debian puts it (/usr/sbin is not
    on every user's PATH)."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if not found:
        raise FileNotFoundError("nginx is not installed: `make setup` installs it (apt-get install nginx)")
    return found


def server_setting(server_args: Sequence[str], flag: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value the server takes for `flag` ("--max-body-bytes"): from its
    arguments (last one wins), else from its MLX_EMBED_* variable (`env` over
    this process's environment, as start_replica passes it), else None."""
    value = None
    for i, arg in enumerate(server_args):
        if arg == flag and i + 1 < len(server_args):
            value = server_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    if value is None:
        value = {**os.environ, **(env or {})}.get("MLX_EMBED_" + flag[2:].upper().replace("-", "_")) or None
    return value


# The server's own --drain-timeout-secs default (crates/mlx-embed-server/src/config.rs).
DEFAULT_DRAIN_SECS = 30


def drain_seconds(server_args: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """How long a replica may drain after SIGTERM: its --drain-timeout-secs."""
    value = _int_setting(server_args, "--drain-timeout-secs", env)
    return DEFAULT_DRAIN_SECS if value is None else value


def _int_setting(server_args: Sequence[str], flag: str, env: Mapping[str, str] | None) -> int | None:
    value = server_setting(server_args, flag, env)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{flag} {value!r} is not a whole number") from None
    if number < 0:
        raise ValueError(f"{flag} {value!r} is negative")
    return number


def _sub(pattern: str, repl: str, text: str, conf: Path, count: int = 1) -> str:
    text, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
    if n != count:
        raise ValueError(f"{conf}: expected {count} match(es) of {pattern!r}, found {n}")
    return text


def render_nginx_conf(listen_port: int, upstream_ports: Sequence[int], conf: Path = NGINX_CONF,
                      server_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> str:
    """deploy/nginx/nginx.conf with its replica lines and listen port replaced,
    and its limits made to follow the replicas' settings (`server_args`, or
    their MLX_EMBED_* variables in `env` over this environment):

    * --max-body-bytes: client_max_body_size, the body buffer and nginx's own
      413 messages, so nginx neither refuses a body the replicas take nor
      words another limit than theirs;
    * --client-timeout-secs: the upstream keepalive_timeout is lowered below
      it (never raised), so nginx closes an idle connection to a replica
      before the replica does and never sends a request into one the
      replica is closing;
    * --max-queue-wait-ms: proxy_read_timeout (and proxy_send_timeout) is
      raised to twice it plus READ_TIMEOUT_MARGIN_S (never lowered), and
      proxy_next_upstream_timeout to twice that. nginx resends a POST that timed out (`timeout` with
      `non_idempotent`), so a read timeout shorter than what a replica may
      legitimately take would compute a request twice.

    Every other directive stays as shipped."""
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

    body = _int_setting(server_args, "--max-body-bytes", env)
    if body is not None:
        # 0 would mean "no limit" to nginx; the server refuses every body then.
        size = max(body, 1)
        text = _sub(r"^(\s*)client_max_body_size [^;]+;", rf"\g<1>client_max_body_size {size};", text, conf)
        text = _sub(r"^(\s*)client_body_buffer_size [^;]+;", rf"\g<1>client_body_buffer_size {size};", text, conf)
        text, n = re.subn(r"limit of \d+ bytes \(--max-body-bytes\)", f"limit of {body} bytes (--max-body-bytes)", text)
        if n == 0:
            raise ValueError(f"{conf}: no 'limit of N bytes (--max-body-bytes)' message")

    client_timeout = _int_setting(server_args, "--client-timeout-secs", env)
    if client_timeout is not None:
        idle = min(_seconds(text, "keepalive_timeout", conf), max(client_timeout - 5, 1))
        text = _sub(r"^(\s*)keepalive_timeout [^;]+;", rf"\g<1>keepalive_timeout {idle}s;", text, conf)

    queue_wait_ms = _int_setting(server_args, "--max-queue-wait-ms", env)
    if queue_wait_ms is not None:
        shipped_read = _seconds(text, "proxy_read_timeout", conf)
        read = max(shipped_read, 2 * math.ceil(queue_wait_ms / 1000) + READ_TIMEOUT_MARGIN_S)
        retries = max(_seconds(text, "proxy_next_upstream_timeout", conf), 2 * read)
        text = _sub(r"^(\s*)proxy_read_timeout [^;]+;", rf"\g<1>proxy_read_timeout {read}s;", text, conf)
        text = _sub(r"^(\s*)proxy_send_timeout [^;]+;", rf"\g<1>proxy_send_timeout {read}s;", text, conf)
        text = _sub(r"^(\s*)proxy_next_upstream_timeout [^;]+;",
                    rf"\g<1>proxy_next_upstream_timeout {retries}s;", text, conf)
    return text


def _seconds(text: str, directive: str, conf: Path) -> int:
    found = re.findall(rf"^\s*{directive} (\d+)s;", text, re.MULTILINE)
    if len(found) != 1:
        raise ValueError(f"{conf}: expected one '{directive} <N>s;', found {len(found)}")
    return int(found[0])


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

    terminated: bool = False

    def terminate(self) -> None:
        """SIGTERM, once: the replica drains. A second signal would make it
        drop its open connections and exit at once."""
        if not self.terminated and self.proc.poll() is None:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (drain), then SIGKILL past `timeout`; the exit code."""
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int):
    """A `preexec_fn` that has Linux send the child `signum` when the process
    that starts it dies, even by SIGKILL, so no replica or nginx outlives a
    killed replicas.py. None (no hook) off Linux, or off the main thread:
    the signal fires when the starting *thread* exits, and a worker thread
    of a test or benchmark may exit long before its children should."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        # The parent may have died before prctl: then nobody would signal us.
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return hook


def start_replica(port: int, log_dir: Path, args: Sequence[str] = (), *, wait: bool = True,
                  timeout: float = 180, env: dict | None = None, binary: Path = SERVER_BINARY,
                  command: Sequence[str] | None = None, new_session: bool = False) -> Replica:
    """Starts the server binary (or `command`, e.g. `python -m mlx_embed serve`) on `port`;
    with `wait`, returns once /health is 200. `new_session` keeps a terminal's
    Ctrl-C from reaching the replica, so the only signal it gets is the caller's."""
    if command is None:
        if not binary.exists():
            raise FileNotFoundError(f"{binary} is missing: run `make build`")
        command = [str(binary)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"replica-{port}.log"
    full_env = {**os.environ, **VENV_ENV, "MLX_EMBED_LOG": "info", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*command, "--host", HOST, "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT, start_new_session=new_session,
            preexec_fn=die_with_parent(signal.SIGTERM),  # SIGTERM: the replica drains
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

    def ready(self) -> bool:
        """nginx has bound its listen port: the master writes its pid file
        (the config's `pid nginx.pid`) only after opening its listening
        sockets, and removes it on exit. Connecting alone would not tell:
        another program on the port accepts too, while nginx retries the bind
        for a few seconds and then exits."""
        try:
            pid = int((self.prefix / "nginx.pid").read_text().strip() or 0)
        except (OSError, ValueError):
            return False
        if pid != self.proc.pid or self.proc.poll() is not None:
            return False
        try:
            with socket.create_connection((HOST, self.port), timeout=1):
                return True
        except OSError:
            return False


def spawn_nginx(port: int, upstream_ports: Sequence[int], prefix: Path, timeout: float = 20, *,
                server_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                new_session: bool = False) -> Nginx:
    """Checks and starts nginx on `port` in front of `upstream_ports`, its
    limits following the replicas' `server_args` and `env` (render_nginx_conf);
    does not wait for it (wait_nginx)."""
    prefix.mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(port, upstream_ports, server_args=server_args, env=env))
    nginx = find_nginx()
    base = [nginx, "-p", str(prefix), "-c", str(conf)]
    check = subprocess.run([*base, "-e", "stderr", "-t"], check=False, capture_output=True, text=True,
                           timeout=timeout)
    if check.returncode != 0:
        raise RuntimeError(f"nginx -t failed:\n{check.stderr}")
    # A pid file left by an nginx that was killed would not be ours.
    (prefix / "nginx.pid").unlink(missing_ok=True)
    # The config's error_log goes to stderr, into nginx.err; -e only covers
    # what nginx logs before it has read the config.
    with open(prefix / "nginx.err", "ab") as err:
        proc = subprocess.Popen([*base, "-e", str(prefix / "startup.err")], stdout=err,
                                stderr=subprocess.STDOUT, cwd=prefix, start_new_session=new_session,
                                preexec_fn=die_with_parent(signal.SIGQUIT))  # SIGQUIT: graceful
    return Nginx(port=port, proc=proc, prefix=prefix)


def wait_nginx(server: Nginx, timeout: float = 20) -> None:
    """Returns once `server` listens on its port; raises if it exits first
    (its port taken, say) or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"nginx exited with {server.proc.returncode}:\n{server.error_log()[-3000:]}")
        if server.ready():
            return
        time.sleep(0.05)
    raise TimeoutError(f"nginx not listening on :{server.port} after {timeout}s:\n{server.error_log()[-3000:]}")


def start_nginx(port: int, upstream_ports: Sequence[int], prefix: Path, timeout: float = 20, *,
                server_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Nginx:
    """Starts nginx on `port` in front of `upstream_ports`; returns once it listens there."""
    server = spawn_nginx(port, upstream_ports, prefix, timeout, server_args=server_args, env=env)
    try:
        wait_nginx(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


class StopSignals:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, except
    inside `held()`: a signal that arrives while a child is being started is
    acted on once the child is on the caller's list, so no child is started
    that nobody stops. After `stopping()`, signals are only noted: a second
    Ctrl-C must not cut short the stopping of the children."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._held = 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and not self._held:
            raise KeyboardInterrupt

    @contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if self.signum is not None and not self._held:
            raise KeyboardInterrupt

    def stopping(self) -> None:
        self._held += 1


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
    p.add_argument("--server-binary", type=Path, default=SERVER_BINARY,
                   help="the replicas' server (default: %(default)s; e.g. another build)")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    ports = [args.port + 1 + i for i in range(args.replicas)]
    # Before anything starts: a replica whose port is taken would find out only
    # after loading its model, and nginx only after retrying its bind.
    busy = [port for port in [args.port, *ports] if not port_free(port)]
    if busy:
        print(f"replicas.py: port(s) {', '.join(map(str, busy))} already in use on {HOST} "
              f"(nginx takes --port {args.port}, the replicas the {args.replicas} after it)", file=sys.stderr)
        return 1
    try:
        render_nginx_conf(args.port, ports, server_args=server_args)
    except ValueError as e:
        print(f"replicas.py: {e}", file=sys.stderr)
        return 1

    signals = StopSignals()
    replicas: list[Replica] = []
    nginx = None
    code = 0
    try:
        for port in ports:
            with signals.held():
                replicas.append(start_replica(port, args.dir, server_args, wait=False, binary=args.server_binary,
                                              new_session=True))
        for r in replicas:
            wait_healthy(r)
        with signals.held():
            nginx = spawn_nginx(args.port, ports, args.dir, server_args=server_args, new_session=True)
        wait_nginx(nginx)
        print(f"nginx on {nginx.url} -> replicas on {', '.join(r.url for r in replicas)} "
              f"(logs in {args.dir}); Ctrl-C stops", flush=True)
        while nginx.proc.poll() is None:
            time.sleep(1)
        print(f"replicas.py: nginx exited with {nginx.proc.returncode}:\n{nginx.error_log()[-3000:]}",
              file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        pass
    except (OSError, RuntimeError, TimeoutError, ValueError, subprocess.SubprocessError) as e:
        print(f"replicas.py: {e}", file=sys.stderr)
        code = 1
    finally:
        signals.stopping()
        if replicas or nginx:
            print("replicas.py: stopping nginx and the replicas (they drain first)", file=sys.stderr, flush=True)
        if nginx:
            nginx.stop()
        # All at once, so they drain side by side rather than one after another,
        # each given its whole --drain-timeout-secs (it was cut at 60 s).
        for r in replicas:
            r.terminate()
        for r in replicas:
            r.stop(timeout=drain_seconds(server_args) + 5)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
