"""Adapter and model sources: URI parsing and fetching from local, http(s), hf and s3 servers on loopback."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import socket
import threading
from pathlib import Path

import pytest

from lorafleet.common import sources
from lorafleet.common.peft_config import AdapterError, BaseShape, inspect_adapter

from model_helpers import write_adapter, write_safetensors  # noqa: E402

pytestmark = pytest.mark.timeout(60)


# --- fixtures: a tiny PEFT adapter and HF-style model folder ------------------------------------




TINY_BASE = BaseShape(num_layers=2, hidden_size=16, intermediate_size=32, q_dim=16, kv_dim=16, name="tiny")


def write_model(folder: Path, shards: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}))
    (folder / "tokenizer.json").write_text("{}")
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / name, {f"model.layers.{i}.mlp.up_proj.weight": (32, 16)})
        weight_map[f"model.layers.{i}.mlp.up_proj.weight"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; `/_fail/...` answers 500; hf mode maps /{org}/{repo}/resolve/{rev}/{path}."""

    hf_token: str | None = None
    hf_revisions: tuple[str, ...] = ("main",)

    def log_message(self, *args):  # quiet
        pass

    def translate_path(self, path):
        parts = path.split("?")[0].split("/")
        if self.server.hf and len(parts) >= 5 and parts[3] == "resolve":
            if parts[4] not in self.hf_revisions:
                return "/nonexistent"
            path = "/" + "/".join([parts[1], parts[2], *parts[5:]])
        return super().translate_path(path)

    def do_GET(self):
        if self.path.startswith("/_fail/"):
            self.send_error(500, "boom")
            return
        if self.server.hf and self.hf_token and self.headers.get("Authorization") != f"Bearer {self.hf_token}":
            self.send_error(401, "token needed")
            return
        self.server.hits.append(self.path)
        super().do_GET()


@contextlib.contextmanager
def serve(folder: Path, hf: bool = False):
    handler = functools.partial(_Handler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.hf = hf
    httpd.hits = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("uri, scheme, location, path, revision", [
    ("pvc://adapters/sql/v1", "pvc", "adapters", "sql/v1", ""),
    ("pvc://adapters", "pvc", "adapters", "", ""),
    ("https://example.org/a/b/", "https", "https://example.org/a/b", "", ""),
    ("http://minio.storage:9000/bucket/x", "http", "http://minio.storage:9000/bucket/x", "", ""),
    ("s3://my-bucket/loras/sql", "s3", "my-bucket", "loras/sql", ""),
    ("hf://org/repo", "hf", "org/repo", "", "main"),
    ("hf://org/repo@v1.0/sub/dir", "hf", "org/repo", "sub/dir", "v1.0"),
    ("file:///data/adapters/x", "file", "/data/adapters/x", "", ""),
    ("/data/adapters/x", "file", "/data/adapters/x", "", ""),
    ("relative/dir", "file", "relative/dir", "", ""),
])
def test_parse_source(uri, scheme, location, path, revision):
    src = sources.parse_source(uri)
    assert (src.scheme, src.location, src.path, src.revision) == (scheme, location, path, revision)
    assert src.remote == (scheme in ("http", "https", "s3", "hf"))


@pytest.mark.parametrize("uri, words", [
    ("ftp://host/x", "unsupported source scheme 'ftp'"),
    ("gs://bucket/x", "unsupported source scheme 'gs'"),
    ("", "empty"),
    ("pvc://Bad_Claim/x", "not a valid PersistentVolumeClaim"),
    ("pvc://claim/../etc", "'..' is not allowed"),
    ("s3://x/y", "not a valid S3 bucket"),
    ("hf://only-org", "expected hf://org/repo"),
    ("hf://org/repo@", "expected hf://org/repo"),
    ("https:///nohost", "no host"),
    ("https://h/x?sig=1", "query"),
    ("file://otherhost/x", "must be local"),
    ("https://[::1/x", "Invalid IPv6 URL"),  # urllib's own refusals name the URL too, never a bare ValueError
    ("https://example.com:99999/x", "Port out of range"),
    ("https://exa mple.com/x", "'exa mple.com' is not a valid host name"),  # never retried as unreachable
    ("https://-bad-.invalid/x", "'-bad-.invalid' is not a valid host name"),
    ("/adapters/a\0b", "cannot hold a NUL character"),  # once a bare ValueError from the first stat()
    ("file:///adapters/a%00b", "cannot hold a NUL character"),
    ("pvc://claim/a\0b", "cannot hold a NUL character"),
])
def test_parse_source_refuses(uri, words):
    with pytest.raises(sources.SourceError, match=words.replace("(", r"\(").replace("?", r"\?")):
        sources.parse_source(uri)


# --- local and pvc ---------------------------------------------------------------------------


def test_local_and_pvc_sources_resolve_in_place(tmp_path, monkeypatch):
    folder = write_adapter(tmp_path / "pvcroot" / "adapters" / "sql")
    monkeypatch.setenv("LORAFLEET_PVC_ROOT", str(tmp_path / "pvcroot"))
    assert sources.fetch_adapter("pvc://adapters/sql") == folder
    assert sources.fetch_adapter(f"file://{folder}") == folder
    assert sources.fetch_adapter(str(folder), sha256=sha(folder / "adapter_model.safetensors")) == folder
    with pytest.raises(sources.ChecksumMismatch, match="expected 0000"):
        sources.fetch_adapter(str(folder), sha256="0" * 64)
    with pytest.raises(sources.SourceNotFound, match="does not exist"):
        sources.fetch_adapter("pvc://adapters/missing", label="adapter missing")
    with pytest.raises(AdapterError, match="expected 0000"):
        sources.verify_sha256("sql", folder, "0" * 64)
    sources.verify_sha256("sql", folder, sha(folder / "adapter_model.safetensors"))


def test_pvc_root_default(monkeypatch):
    monkeypatch.delenv("LORAFLEET_PVC_ROOT", raising=False)
    assert sources.pvc_root() == Path("/mnt/lorafleet/pvc")
    assert sources.parse_source("pvc://c/p/q").local_path() == Path("/mnt/lorafleet/pvc/c/p/q")


# --- http(s) -----------------------------------------------------------------------------------


def test_https_fetch_caches_and_checks_sha256(tmp_path):
    root = tmp_path / "www"
    folder = write_adapter(root / "loras" / "sql", rank=8)
    digest = sha(folder / "adapter_model.safetensors")
    with serve(root) as httpd:
        url = f"http://127.0.0.1:{httpd.server_port}/loras/sql/"
        got = sources.fetch_adapter(url, cache_dir=tmp_path / "cache", sha256=digest)
        assert (got / "adapter_model.safetensors").read_bytes() == (folder / "adapter_model.safetensors").read_bytes()
        hits = len(httpd.hits)
        assert sources.fetch_adapter(url, cache_dir=tmp_path / "cache") == got  # cached: no new request
        assert sources.fetch_adapter(url, cache_dir=tmp_path / "cache", sha256=digest) == got
        assert len(httpd.hits) == hits
        spec = inspect_adapter("sql", got, base=TINY_BASE, max_rank=64)
        assert spec.max_rank == 8
        with pytest.raises(sources.ChecksumMismatch, match=f"sha256 is {digest}"):
            sources.fetch_adapter(url, cache_dir=tmp_path / "cache2", sha256="f" * 64)
        assert not list((tmp_path / "cache2").rglob("adapter_model.safetensors"))  # nothing half-written kept


def test_probe_reads_only_the_header(tmp_path):
    root = tmp_path / "www"
    folder = write_adapter(root / "big", rank=4)
    real = folder / "adapter_model.safetensors"
    with real.open("ab"):
        pass
    with serve(root) as httpd:
        url = f"http://127.0.0.1:{httpd.server_port}/big"
        probed = sources.probe_adapter(url, tmp_path / "probe")
        stub = probed / "adapter_model.safetensors"
        assert stub.stat().st_size == real.stat().st_size
        spec = inspect_adapter("big", probed, base=TINY_BASE, max_rank=64)
        assert spec.max_rank == 4 and spec.size_bytes == real.stat().st_size
        with pytest.raises(AdapterError, match="rank 4 exceeds"):
            inspect_adapter("big", probed, max_rank=2)
        sources.probe_adapter(url, tmp_path / "probe2", sha256=sha(real))
        with pytest.raises(sources.ChecksumMismatch):
            sources.probe_adapter(url, tmp_path / "probe3", sha256="a" * 64)


def test_http_errors_are_classified(tmp_path):
    with serve(tmp_path) as httpd:
        base = f"http://127.0.0.1:{httpd.server_port}"
        with pytest.raises(sources.SourceNotFound, match="404"):
            sources.fetch_adapter(f"{base}/nothing-here", cache_dir=tmp_path / "c")
        with pytest.raises(sources.SourceUnreachable, match="500"):
            sources.fetch_adapter(f"{base}/_fail/x", cache_dir=tmp_path / "c")
    with pytest.raises(sources.SourceUnreachable, match="unreachable"):
        sources.fetch_adapter(f"http://127.0.0.1:{free_port()}/x", cache_dir=tmp_path / "c", timeout=2)


# --- hf:// -------------------------------------------------------------------------------------


def test_hf_adapter_and_model(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    write_adapter(root / "org" / "loras" / "sql", rank=4)
    write_model(root / "org" / "tiny-llama")
    _Handler.hf_token, _Handler.hf_revisions = "secret", ("main", "v2")
    try:
        with serve(root, hf=True) as httpd:
            monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{httpd.server_port}")
            monkeypatch.delenv("HF_TOKEN", raising=False)
            with pytest.raises(sources.SourceError, match="set HF_TOKEN"):
                sources.fetch_adapter("hf://org/loras/sql", cache_dir=tmp_path / "c")
            monkeypatch.setenv("HF_TOKEN", "secret")
            got = sources.fetch_adapter("hf://org/loras@v2/sql", cache_dir=tmp_path / "c")
            assert inspect_adapter("sql", got).max_rank == 4
            assert any("/org/loras/resolve/v2/sql/adapter_config.json" in h for h in httpd.hits)
            with pytest.raises(sources.SourceNotFound):
                sources.fetch_adapter("hf://org/loras@nope/sql", cache_dir=tmp_path / "c")
            model = sources.fetch_model("hf://org/tiny-llama", cache_dir=tmp_path / "c")
            names = sorted(p.name for p in model.iterdir() if not p.name.startswith("."))
            assert names == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                             "model.safetensors.index.json", "tokenizer.json"]
            cfg = sources.read_model_config("hf://org/tiny-llama")
            assert cfg["hidden_size"] == 16
    finally:
        _Handler.hf_token, _Handler.hf_revisions = None, ("main",)


def test_model_sources(tmp_path):
    root = tmp_path / "www"
    write_model(root / "m", shards=1)
    (root / "single").mkdir()
    (root / "single" / "config.json").write_text((root / "m" / "config.json").read_text())
    write_safetensors(root / "single" / "model.safetensors", {"x": (2, 2)})
    (root / "q.gguf").write_bytes(b"GGUF" + bytes(60))
    with serve(root) as httpd:
        base = f"http://127.0.0.1:{httpd.server_port}"
        m = sources.fetch_model(f"{base}/single", cache_dir=tmp_path / "c")
        assert (m / "model.safetensors").is_file() and (m / "config.json").is_file()
        only_cfg = sources.fetch_model(f"{base}/m", cache_dir=tmp_path / "c2", config_only=True)
        assert [p.name for p in only_cfg.iterdir() if not p.name.startswith(".")] == ["config.json"]
        tok = sources.fetch_model(f"{base}/m", cache_dir=tmp_path / "c2", tokenizer_only=True)
        assert sorted(p.name for p in tok.iterdir() if not p.name.startswith(".")) == ["config.json", "tokenizer.json"]
        full = sources.fetch_model(f"{base}/m", cache_dir=tmp_path / "c2")
        assert (full / "model-00001-of-00001.safetensors").is_file()
        hits = len(httpd.hits)
        sources.fetch_model(f"{base}/m", cache_dir=tmp_path / "c2", tokenizer_only=True)  # the full copy serves
        assert len(httpd.hits) == hits
        gguf = sources.fetch_model(f"{base}/q.gguf", cache_dir=tmp_path / "c")
        assert gguf.name == "q.gguf" and gguf.read_bytes().startswith(b"GGUF")
        with pytest.raises(sources.SourceError, match="GGUF"):
            sources.read_model_config(f"{base}/q.gguf")
    assert sources.fetch_model(str(root / "m")) == root / "m"
    assert sources.read_model_config(str(root / "m"))["num_hidden_layers"] == 2


# --- s3:// -------------------------------------------------------------------------------------


def test_s3_adapter(tmp_path, monkeypatch):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        folder = write_adapter(tmp_path / "sql", rank=4)
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="loras")
        for f in folder.iterdir():
            s3.put_object(Bucket="loras", Key=f"team/sql/{f.name}", Body=f.read_bytes())
        digest = sha(folder / "adapter_model.safetensors")
        got = sources.fetch_adapter("s3://loras/team/sql", cache_dir=tmp_path / "c", sha256=digest)
        assert inspect_adapter("sql", got).max_rank == 4
        probed = sources.probe_adapter("s3://loras/team/sql", tmp_path / "probe")
        assert inspect_adapter("sql", probed).max_rank == 4
        with pytest.raises(sources.SourceNotFound):
            sources.fetch_adapter("s3://loras/team/none", cache_dir=tmp_path / "c")
        with pytest.raises(sources.SourceNotFound):
            sources.fetch_adapter("s3://no-such-bucket/x", cache_dir=tmp_path / "c")
    finally:
        server.stop()
