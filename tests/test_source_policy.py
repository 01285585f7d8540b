"""The source policy: addresses checked after DNS and on every redirect, pinned connections,
credentials that stay on their host, local paths confined to the source roots."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading
from pathlib import Path

import pytest

from lorafleet.common import sources
from lorafleet.common.peft_config import AdapterError
from lorafleet.common.source_policy import SourcePolicy, address_refusal
from lorafleet.runner.service.adapter_fetch import local_adapter_dir
from lorafleet.scheduler.registry import AdapterRegistry
from model_helpers import write_adapter

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("addr, allow_private, refused", [
    ("127.0.0.1", False, "loopback"),
    ("::1", False, "loopback"),
    ("::ffff:127.0.0.1", False, "loopback"),
    ("64:ff9b::7f00:1", False, "loopback"),
    ("10.1.2.3", False, "private"),
    ("192.168.0.7", False, "private"),
    ("172.16.5.4", False, "private"),
    ("100.64.0.1", False, "private"),
    ("fd12::1", False, "private"),
    ("169.254.1.1", False, "link-local"),
    ("fe80::1", False, "link-local"),
    ("169.254.169.254", False, "metadata"),
    ("169.254.169.254", True, "metadata"),
    ("fd00:ec2::254", True, "metadata"),
    ("::ffff:169.254.169.254", True, "metadata"),
    ("0.0.0.0", True, "unspecified"),
    ("224.0.0.1", True, "multicast"),
    ("127.0.0.1", True, None),
    ("10.1.2.3", True, None),
    ("8.8.8.8", False, None),
    ("2606:4700::1111", False, None),
])
def test_address_classes(addr, allow_private, refused):
    got = address_refusal(addr, allow_private)
    assert (got is None) == (refused is None) and (refused is None or refused in got), got


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers from a per-server route table {path: (status, headers, body)}; records requests."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.seen.append((self.path, dict(self.headers)))
        status, headers, body = self.server.routes.get(self.path, (404, {}, b"nope"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def server(host="127.0.0.1", routes=None):
    httpd = http.server.ThreadingHTTPServer((host, 0), _Recorder)
    httpd.routes, httpd.seen = routes or {}, []
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def private_off(monkeypatch):
    monkeypatch.setenv("LORAFLEET_ALLOW_PRIVATE_SOURCES", "0")


def test_loopback_is_refused_by_default_without_contacting_it(monkeypatch, tmp_path):
    private_off(monkeypatch)
    with server(routes={"/a/adapter_config.json": (200, {}, b"{}")}) as httpd:
        port = httpd.server_port
        for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]"):
            with pytest.raises(sources.SourceRefused) as err:
                sources.fetch_adapter(f"http://{host}:{port}/a", cache_dir=tmp_path)
            msg = str(err.value)
            assert "not allowed by the source policy" in msg
            assert "loopback" not in msg and (host != "localhost" or "127.0.0.1" not in msg), msg
        assert httpd.seen == []
    with pytest.raises(sources.SourceRefused):
        sources.read_model_config("http://169.254.169.254/latest/meta-data")


def test_a_name_with_one_private_address_is_refused(monkeypatch):
    private_off(monkeypatch)
    real = socket.getaddrinfo

    def fake(host, port, *a, **kw):
        if host == "mixed.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", port))]
        return real(host, port, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with pytest.raises(sources.SourceRefused, match="mixed.example"):
        SourcePolicy(allow_private=False).resolve("mixed.example", 80, "test")


def test_connection_goes_to_the_checked_address(tmp_path, monkeypatch):
    """The name is resolved once per hop; the connection is made to that address (no rebinding)."""
    calls = []
    real = socket.getaddrinfo
    with server(routes={"/m/config.json": (200, {}, b'{"hidden_size": 16}')}) as httpd:
        def fake(host, port, *a, **kw):
            if host == "models.example":
                calls.append(host)
                # a rebinding resolver would answer differently the second time
                ip = "127.0.0.1" if len(calls) == 1 else "169.254.169.254"
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]
            return real(host, port, *a, **kw)

        monkeypatch.setattr(socket, "getaddrinfo", fake)
        cfg = sources.read_model_config(f"http://models.example:{httpd.server_port}/m")
        assert cfg == {"hidden_size": 16} and calls == ["models.example"]
        assert httpd.seen[0][1]["Host"] == f"models.example:{httpd.server_port}"


def test_every_redirect_is_checked(tmp_path):
    with server() as httpd:
        httpd.routes["/go/config.json"] = (302, {"Location": "http://169.254.169.254/latest/config.json"}, b"")
        with pytest.raises(sources.SourceRefused, match="169.254.169.254"):
            sources.read_model_config(f"http://127.0.0.1:{httpd.server_port}/go")
        httpd.routes["/loop/config.json"] = (302, {"Location": "/loop/config.json"}, b"")
        with pytest.raises(sources.SourceRefused, match="redirects"):
            sources.read_model_config(f"http://127.0.0.1:{httpd.server_port}/loop")
        httpd.routes["/ftp/config.json"] = (302, {"Location": "ftp://files.example/x"}, b"")
        with pytest.raises(sources.SourceRefused, match="only http and https"):
            sources.read_model_config(f"http://127.0.0.1:{httpd.server_port}/ftp")


def test_hf_token_never_follows_a_redirect_to_another_host(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    with server("127.0.0.1") as hub, server("127.0.0.2") as cdn:
        cdn_url = f"http://127.0.0.2:{cdn.server_port}"
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            hub.routes[f"/org/a/resolve/main/{name}"] = (302, {"Location": f"/org/a/moved/{name}"}, b"")
            hub.routes[f"/org/a/moved/{name}"] = (307, {"Location": f"{cdn_url}/blob/{name}"}, b"")
        folder = write_adapter(tmp_path / "src")
        for f in folder.iterdir():
            cdn.routes[f"/blob/{f.name}"] = (200, {}, f.read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.server_port}")
        got = sources.fetch_adapter("hf://org/a", cache_dir=tmp_path / "cache")
        assert (got / "adapter_model.safetensors").read_bytes() == (folder / "adapter_model.safetensors").read_bytes()
    assert hub.seen and all(h.get("Authorization") == "Bearer hf-secret" for _, h in hub.seen)  # same host: kept
    assert cdn.seen and all("Authorization" not in h for _, h in cdn.seen)  # another host: dropped


def test_unreachable_errors_do_not_describe_the_network(monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(sources.SourceUnreachable) as err:
        sources.fetch_adapter(f"http://127.0.0.1:{port}/x", cache_dir=tmp_path, timeout=2)
    assert str(err.value).endswith(": unreachable") and "refused" not in str(err.value).lower()


def test_s3_endpoint_passes_the_policy(monkeypatch, tmp_path):
    private_off(monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(sources.SourceRefused, match="S3 endpoint"):
        sources.fetch_adapter("s3://bucket/x", cache_dir=tmp_path)


# --- local paths ----------------------------------------------------------------------------


def test_local_paths_only_under_the_roots(tmp_path, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    good = write_adapter(root / "good")
    secret = write_adapter(outside / "secret")
    (root / "escape").symlink_to(secret)  # a symlink inside the root to a folder outside it
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (root / "half" / "adapter_model.safetensors").symlink_to(secret / "adapter_model.safetensors")
    monkeypatch.setenv("LORAFLEET_SOURCE_ROOTS", str(root))
    assert sources.fetch_adapter(str(good)) == good.resolve()
    assert sources.fetch_adapter(f"file://{good}") == good.resolve()
    for uri in (str(secret), f"file://{secret}", str(root / "escape"), str(root / "good" / ".." / ".." / "outside"),
                str(root / "half"), "relative/dir"):
        with pytest.raises(sources.SourceRefused) as err:
            sources.fetch_adapter(uri)
        assert str(tmp_path) not in str(err.value).replace(uri, ""), err.value
    monkeypatch.setenv("LORAFLEET_PVC_ROOT", str(tmp_path / "pvc"))
    write_adapter(tmp_path / "pvc" / "claim" / "ad")
    with pytest.raises(sources.SourceRefused):  # the PVC root is a root only by default
        sources.fetch_adapter("pvc://claim/ad")
    monkeypatch.delenv("LORAFLEET_SOURCE_ROOTS")
    assert sources.fetch_adapter("pvc://claim/ad") == (tmp_path / "pvc" / "claim" / "ad").resolve()


def test_runner_refuses_paths_outside_the_roots_without_showing_them(tmp_path, monkeypatch):
    root = tmp_path / "root"
    write_adapter(root / "ok")
    elsewhere = write_adapter(tmp_path / "elsewhere")
    monkeypatch.setenv("LORAFLEET_SOURCE_ROOTS", str(root))
    assert local_adapter_dir("ok", str(root / "ok")) == (root / "ok").resolve()
    for source in (str(elsewhere), "elsewhere", "/etc", str(root / "missing")):
        with pytest.raises(AdapterError) as err:
            local_adapter_dir("x", source)
        assert str(err.value).startswith("adapter 'x': ") and str(tmp_path) not in str(err.value)
        assert "/etc" not in str(err.value)


def test_directory_registry_skips_symlinks_that_leave_it(tmp_path):
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "inside")
    (adapters / "alias").symlink_to(adapters / "inside")  # stays inside: served
    (adapters / "evil").symlink_to(write_adapter(tmp_path / "outside"))
    reg = AdapterRegistry.from_directory(adapters)
    assert reg.names() == ["alias", "inside"]
    assert Path(reg.get("alias").source) == (adapters / "inside").resolve()


def test_directory_registry_warns_about_folders_that_are_not_adapters(tmp_path, caplog):
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "real")
    (adapters / "empty").mkdir()
    (adapters / ".hidden").mkdir()
    (adapters / "notes.txt").write_text("x")
    with caplog.at_level("WARNING"):
        reg = AdapterRegistry.from_directory(adapters)
    assert reg.names() == ["real"]
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 1 and "empty" in warned[0] and "adapter_config.json" in warned[0]


def test_roots_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAFLEET_SOURCE_ROOTS", os.pathsep.join([str(tmp_path / "a"), "", str(tmp_path / "b")]))
    monkeypatch.setenv("LORAFLEET_ALLOW_PRIVATE_SOURCES", "1")
    pol = SourcePolicy.from_env()
    assert pol.roots == (tmp_path / "a", tmp_path / "b") and pol.allow_private
    monkeypatch.setenv("LORAFLEET_SOURCE_ROOTS", "")
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LORAFLEET_ALLOW_PRIVATE_SOURCES", "0")
    pol = SourcePolicy.from_env()
    assert tmp_path / "cache" in pol.roots and not pol.allow_private
