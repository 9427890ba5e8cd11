"""`mlx-embed serve` leaves SIGINT to the server: the OS default while the
native serve runs (so Python's KeyboardInterrupt handler is not chained under
the server's), Python's own handler back if serve ever returns in-process."""

from __future__ import annotations

import signal
import sys
import threading
import types

import mlx_embed
import pytest

from mlx_embed import cli


def _fake_native(monkeypatch, serve):
    fake = types.ModuleType("mlx_embed._native")
    fake.serve = serve
    monkeypatch.setitem(sys.modules, "mlx_embed._native", fake)
    monkeypatch.setattr(mlx_embed, "_native", fake, raising=False)
    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code))
    return exits


@pytest.fixture
def python_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_is_the_os_default_while_the_server_runs(monkeypatch, python_sigint):
    during = []
    exits = _fake_native(monkeypatch, lambda argv: during.append(signal.getsignal(signal.SIGINT)) or 0)
    assert cli.main(["serve", "--port", "1"]) == 0
    assert during == [signal.SIG_DFL]
    assert exits == [0]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_handler_comes_back_when_serve_raises(monkeypatch, python_sigint):
    def boom(argv):
        raise RuntimeError("serve failed")

    exits = _fake_native(monkeypatch, boom)
    with pytest.raises(RuntimeError, match="serve failed"):
        cli.main(["serve"])
    assert exits == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_of_someone_elses_or_an_ignored_sigint_is_kept(monkeypatch):
    def own(signum, frame):
        pass

    for handler in (own, signal.SIG_IGN):
        previous = signal.signal(signal.SIGINT, handler)
        try:
            during = []
            _fake_native(monkeypatch, lambda argv: during.append(signal.getsignal(signal.SIGINT)) or 0)
            cli.main(["serve"])
            assert during == [handler]
            assert signal.getsignal(signal.SIGINT) is handler
        finally:
            signal.signal(signal.SIGINT, previous)


def test_serve_off_the_main_thread_leaves_signals_alone(monkeypatch, python_sigint):
    during, errors = [], []
    _fake_native(monkeypatch, lambda argv: during.append(signal.getsignal(signal.SIGINT)) or 0)

    def run():
        try:
            cli.main(["serve"])
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and errors == []
    assert during == [signal.default_int_handler]


def test_top_level_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out == f"mlx-embed {mlx_embed.__version__}\n"
