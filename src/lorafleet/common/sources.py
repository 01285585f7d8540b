"""Where adapters and base models come from: parse a source URI, get its files locally.

Sources (torch-free; the operator, the scheduler and the runners share this module):

- ``pvc://claim/path``: a PersistentVolumeClaim mounted at ``$LORAFLEET_PVC_ROOT/claim``
  (default ``/mnt/lorafleet/pvc``); resolved to a local path, nothing is copied.
- ``https://host/folder`` (and ``http://`` for in-cluster servers): the folder's files are
  downloaded, ``{url}/adapter_config.json`` and so on.
- ``s3://bucket/prefix``: objects ``prefix/<file>`` through boto3 (``AWS_ENDPOINT_URL`` and
  the usual AWS variables are honoured).
- ``hf://org/repo[@revision][/subdir]``: Hugging Face files at
  ``{HF_ENDPOINT or https://huggingface.co}/org/repo/resolve/{revision}/{subdir/}file``,
  with ``HF_TOKEN`` as a bearer token when set.
- ``file:///path`` and plain paths: local folders.

Anything else is refused with `SourceError`. Every fetch passes the source policy
(`source_policy.py`): network destinations are checked after DNS resolution and on every
redirect, local paths must resolve under the source roots; refusals are `SourceRefused`.
Downloads go to a cache folder (atomic renames,
so concurrent fetches are safe) and remote sources are treated as immutable: pin a revision
or a sha256 when the content may change. `probe_adapter` fetches only what validation needs
(the config and the safetensors header, plus a streamed sha256 check when one is given).
"""

from __future__ import annotations

import hashlib
import http.client
import ipaddress
import json
import os
import re
import shutil
import struct
import logging
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable

from lorafleet.common import safe_http
from lorafleet.common.peft_config import CONFIG_FILE, WEIGHTS_FILE
from lorafleet.common.source_errors import (  # noqa: F401 - re-exported
    ChecksumMismatch,
    SourceError,
    SourceNotFound,
    SourceRefused,
    SourceUnreachable,
)
from lorafleet.common.source_policy import SourcePolicy

SCHEMES = ("pvc", "https", "http", "s3", "hf", "file")
REMOTE_SCHEMES = ("https", "http", "s3", "hf")
DEFAULT_PVC_ROOT = "/mnt/lorafleet/pvc"
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
MAX_HEADER = 100 * 1024 * 1024

# Files of an HF model folder: required first, then optional ones (tokenizer, generation defaults).
MODEL_CONFIG = "config.json"
MODEL_OPTIONAL = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

# Errors of a transfer that broke off midway (the source may answer again later).
_TRANSFER_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError,
                                                    http.client.HTTPException)
try:  # pragma: no cover - depends on boto3 being installed
    from botocore.exceptions import BotoCoreError as _BotoCoreError

    _TRANSFER_ERRORS += (_BotoCoreError,)
except ImportError:  # pragma: no cover
    pass

log = logging.getLogger(__name__)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def pvc_root() -> Path:
    """LORAFLEET_PVC_ROOT: where pods mount the claims of pvc:// sources."""
    from lorafleet import env

    return env.pvc_root()


def default_cache_dir() -> Path:
    from lorafleet import env

    return env.cache_dir() / "sources"


@dataclass(frozen=True)
class Source:
    """A parsed source URI. `location`/`path` mean, per scheme:

    pvc: claim / path inside it; http(s): folder URL / -; s3: bucket / key prefix;
    hf: ``org/repo`` / subfolder (with `revision`); file: absolute or relative path / -.
    """

    uri: str
    scheme: str
    location: str
    path: str = ""
    revision: str = ""

    @property
    def remote(self) -> bool:
        return self.scheme in REMOTE_SCHEMES

    def local_path(self) -> Path:
        """The local folder (or file) of a pvc:// or file source."""
        if self.scheme == "pvc":
            return pvc_root() / self.location / self.path if self.path else pvc_root() / self.location
        if self.scheme == "file":
            return Path(self.location)
        raise SourceError(f"{self.uri} is remote; fetch it first")

    def child(self, name: str) -> "Source":
        """The source of a file or folder inside this one."""
        if self.scheme in ("http", "https"):
            return Source(self.uri, self.scheme, f"{self.location}/{name}")
        if self.scheme == "file":
            return Source(self.uri, self.scheme, str(Path(self.location) / name))
        joined = f"{self.path}/{name}" if self.path else name
        return Source(self.uri, self.scheme, self.location, joined, self.revision)


def _safe_relpath(path: str, uri: str) -> str:
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise SourceError(f"{uri!r}: '..' is not allowed in a source path")
    return "/".join(parts)


_HOST_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


def _host_name(host: str) -> bool:
    """Whether `host` (lowercase, as urllib gives it) is an IP address or a DNS name of valid labels."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return len(host) <= 253 and all(_HOST_LABEL.match(label) for label in host.removesuffix(".").split("."))


def parse_source(uri: str) -> Source:
    """Parse a source URI; raise SourceError for unknown schemes and malformed URIs."""
    if not isinstance(uri, str) or not uri.strip():
        raise SourceError("empty source")
    uri = uri.strip()
    # No file name holds a NUL: the OS calls would raise a bare ValueError ("embedded null byte") past every
    # caller's handling of a source that cannot be read
    if "\0" in uri or (uri.lower().startswith("file:") and "\0" in urllib.parse.unquote(uri)):
        raise SourceError(f"{uri!r}: a source cannot hold a NUL character")
    if "://" not in uri:
        return Source(uri, "file", uri)
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise SourceError(
            f"unsupported source scheme {scheme!r} in {uri!r}: use pvc://, https:// (http:// in-cluster), s3://, hf://, file:// or a local path"
        )
    try:  # urllib refuses some malformed URLs itself (an unclosed IPv6 bracket, a port out of range)
        parsed = urllib.parse.urlparse(uri)
        host, _ = parsed.hostname, parsed.port
    except ValueError as exc:
        raise SourceError(f"{uri!r}: {exc}") from None
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise SourceError(f"{uri!r}: file:// sources must be local (file:///path)")
        if not parsed.path:
            raise SourceError(f"{uri!r}: file:// needs a path")
        return Source(uri, "file", urllib.parse.unquote(parsed.path))
    if scheme in ("http", "https"):
        if not host:
            raise SourceError(f"{uri!r}: no host")
        if not _host_name(host):
            raise SourceError(f"{uri!r}: {host!r} is not a valid host name or IP address")
        if parsed.query or parsed.fragment:
            raise SourceError(f"{uri!r}: a folder URL cannot carry a query or fragment")
        return Source(uri, scheme, uri.rstrip("/"))
    head, _, tail = rest.partition("/")
    if scheme == "pvc":
        if not _DNS_LABEL.match(head):
            raise SourceError(f"{uri!r}: {head!r} is not a valid PersistentVolumeClaim name")
        return Source(uri, "pvc", head, _safe_relpath(tail, uri))
    if scheme == "s3":
        if not re.match(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", head):
            raise SourceError(f"{uri!r}: {head!r} is not a valid S3 bucket name")
        return Source(uri, "s3", head, _safe_relpath(tail, uri))
    # hf://org/repo[@revision][/subdir]
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise SourceError(f"{uri!r}: expected hf://org/repo[@revision][/subdir]")
    org, name = parts[0], parts[1]
    revision = "main"
    if "@" in name:
        name, revision = name.split("@", 1)
    if not _HF_PART.match(org) or not _HF_PART.match(name) or not revision:
        raise SourceError(f"{uri!r}: expected hf://org/repo[@revision][/subdir]")
    return Source(uri, "hf", f"{org}/{name}", _safe_relpath("/".join(parts[2:]), uri), revision)


# --- opening one remote file -------------------------------------------------------------------


def local_source_path(src: Source, what: str) -> Path:
    """The local path of a pvc:// or file source, symlinks resolved, confined to the source roots."""
    return SourcePolicy.from_env().confine(src.local_path(), what)


def _hf_url(src: Source) -> str:
    endpoint = (os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")
    rev = urllib.parse.quote(src.revision, safe="")
    return f"{endpoint}/{src.location}/resolve/{rev}/{urllib.parse.quote(src.path)}"


def _open_http(url: str, uri: str, timeout: float, token: str | None = None) -> tuple[IO[bytes], int | None]:
    """GET one file under the source policy; errors say what happened, not where it failed inside."""
    try:
        resp = safe_http.open_url(url, timeout=timeout, token=token)
    except safe_http.HTTPStatusError as exc:
        where = exc.url
        if exc.status == 404:
            raise SourceNotFound(f"{where} not found (HTTP 404)") from None
        if exc.status in (401, 403):
            hint = " (set HF_TOKEN for gated or private repositories)" if uri.startswith("hf://") else ""
            raise SourceError(f"{where}: access denied (HTTP {exc.status}){hint}") from None
        if exc.status >= 500 or exc.status in (408, 429):
            raise SourceUnreachable(f"{where}: HTTP {exc.status} {exc.reason}") from None
        raise SourceError(f"{where}: HTTP {exc.status} {exc.reason}") from None
    length = resp.getheader("Content-Length")
    return resp, int(length) if length and length.isdigit() else None


def _s3_client(timeout: float):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:  # pragma: no cover - boto3 is in the images
        raise SourceError("s3:// sources need boto3 (pip install boto3)") from None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    if endpoint:
        origin = safe_http.Origin.of(endpoint)
        SourcePolicy.from_env().resolve(origin.host, origin.port, "the S3 endpoint")
    cfg = Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 2})
    return boto3.client("s3", endpoint_url=endpoint, config=cfg)


def _open_s3(src: Source, timeout: float) -> tuple[IO[bytes], int | None]:
    from botocore import exceptions as bex

    where = f"s3://{src.location}/{src.path}"
    try:
        obj = _s3_client(timeout).get_object(Bucket=src.location, Key=src.path)
    except bex.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchKey", "NoSuchBucket", "404") or status == 404:
            raise SourceNotFound(f"{where} not found ({code or status})") from None
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
            raise SourceError(f"{where}: access denied ({code})") from None
        if status is not None and status >= 500:
            raise SourceUnreachable(f"{where}: {code or status}") from None
        raise SourceError(f"{where}: {code or exc}") from None
    except bex.NoCredentialsError:
        raise SourceError(f"{where}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)") from None
    except (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError,
            bex.ConnectionClosedError) as exc:
        log.info("%s: %s", where, exc)
        raise SourceUnreachable(f"{where}: unreachable") from None
    return obj["Body"], obj.get("ContentLength")


def _open(src: Source, timeout: float) -> tuple[IO[bytes], int | None]:
    """Open one file of a source for reading: (stream, size or None)."""
    if src.scheme in ("http", "https"):
        return _open_http(src.location, src.uri, timeout)
    if src.scheme == "hf":
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        return _open_http(_hf_url(src), src.uri, timeout, token)
    if src.scheme == "s3":
        return _open_s3(src, timeout)
    path = local_source_path(src, src.uri)
    if not path.is_file():
        raise SourceNotFound(f"{src.uri}: file not found")
    return path.open("rb"), path.stat().st_size


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = stream.read(min(CHUNK, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _check(name: str, digest: str, sha256: str | None) -> None:
    if sha256 and digest != sha256.lower():
        raise ChecksumMismatch(f"{name}: sha256 is {digest}, expected {sha256.lower()}")


def _download(src: Source, dest: Path, timeout: float, sha256: str | None = None) -> str:
    """Copy one file to `dest` atomically; return its sha256 (checked against `sha256` if given)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    stream, _ = _open(src, timeout)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with stream, os.fdopen(fd, "wb") as out:
            while chunk := stream.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
        digest = h.hexdigest()
        _check(f"{src.uri} {dest.name}", digest, sha256)
        os.replace(tmp, dest)
        return digest
    except _TRANSFER_ERRORS as exc:
        raise SourceUnreachable(f"{src.uri}: download of {dest.name} failed ({exc})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _header_stub(src: Source, dest: Path, timeout: float, sha256: str | None) -> None:
    """Write the safetensors header of `src` into `dest`, sized like the real file (sparse).

    The tensor data is never stored; with `sha256` it is streamed through the hash.
    """
    stream, size = _open(src, timeout)
    h = hashlib.sha256()
    try:
        with stream:
            head = _read_exact(stream, 8)
            if len(head) < 8:
                raise SourceError(f"{src.uri}: {dest.name} is truncated")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER:
                raise SourceError(f"{src.uri}: {dest.name} has an impossible header length {n}")
            header = _read_exact(stream, n)
            h.update(head + header)
            total = 8 + len(header)
            if sha256 or size is None:
                while chunk := stream.read(CHUNK):
                    h.update(chunk)
                    total += len(chunk)
            else:
                total = size
    except _TRANSFER_ERRORS as exc:
        raise SourceUnreachable(f"{src.uri}: reading {dest.name} failed ({exc})") from None
    _check(f"{src.uri} {dest.name}", h.hexdigest(), sha256)
    with dest.open("wb") as out:
        out.write(head + header)
        out.truncate(max(total, 8 + len(header)))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cache_folder(cache_dir: Path | str | None, kind: str, src: Source) -> Path:
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    tail = (src.path or src.location).rstrip("/").split("/")[-1] or src.scheme
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:60]
    key = hashlib.sha256(f"{src.uri}\n{src.revision}".encode()).hexdigest()[:16]
    return root / kind / f"{slug}-{key}"


# --- adapters ----------------------------------------------------------------------------------


def verify_sha256(name: str, folder: Path | str, sha256: str) -> None:
    """Check the sha256 of `folder`/adapter_model.safetensors; AdapterError naming `name` if not."""
    from lorafleet.common.peft_config import AdapterError, weights_file

    weights = weights_file(name, Path(folder))
    digest = _sha256_file(weights)
    if digest != sha256.lower():
        raise AdapterError(name, f"{WEIGHTS_FILE} has sha256 {digest}, expected {sha256.lower()}")


def fetch_adapter(uri: str, *, cache_dir: Path | str | None = None, sha256: str | None = None,
                  timeout: float = 60.0, label: str | None = None) -> Path:
    """A local folder holding the adapter's adapter_config.json and adapter_model.safetensors.

    Local and pvc:// sources are used in place (their sha256 is checked when given); remote
    ones are downloaded once into `cache_dir` (default ``$LORAFLEET_CACHE/sources``).
    Local folders (and the files in them) must resolve under the source roots. Raises
    SourceError (or a subclass); messages name the source as `label` (default: the URI) and
    never show the local path it resolved to.
    """
    src = parse_source(uri)
    label = label or uri
    if not src.remote:
        path = local_source_path(src, label)
        if not path.is_dir():
            raise SourceNotFound(f"{label}: folder does not exist")
        policy = SourcePolicy.from_env()
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            if (path / f).is_symlink():
                policy.confine(path / f, f"{label}: {f}")
        if sha256:
            weights = path / WEIGHTS_FILE
            if not weights.is_file():
                raise SourceNotFound(f"{label}: {WEIGHTS_FILE} not found")
            _check(f"{label} {WEIGHTS_FILE}", _sha256_file(weights), sha256)
        return path
    folder = _cache_folder(cache_dir, "adapters", src)
    stamp = folder / f"{WEIGHTS_FILE}.sha256"
    cfg, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if cfg.is_file() and weights.is_file() and stamp.is_file():
        digest = stamp.read_text().strip()
        if not sha256 or digest == sha256.lower():
            return folder
    _download(src.child(CONFIG_FILE), cfg, timeout)
    digest = _download(src.child(WEIGHTS_FILE), weights, timeout, sha256)
    stamp.write_text(digest + "\n")
    return folder


def probe_adapter(uri: str, dest: Path | str, *, sha256: str | None = None, timeout: float = 30.0) -> Path:
    """Fetch what validating an adapter needs into the empty folder `dest`: the config and a
    stand-in of the weights file holding only its header (same size, sparse). Local sources
    are returned in place. Raises SourceError (or a subclass) with a clear message.
    """
    src = parse_source(uri)
    if not src.remote:
        return fetch_adapter(uri, sha256=sha256, timeout=timeout)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _download(src.child(CONFIG_FILE), dest / CONFIG_FILE, timeout)
    _header_stub(src.child(WEIGHTS_FILE), dest / WEIGHTS_FILE, timeout, sha256)
    return dest


# --- base models -------------------------------------------------------------------------------


def _split_file(src: Source) -> tuple[Source, str] | None:
    """(folder source, file name) when the source names a single .gguf file."""
    target = src.location if src.scheme in ("http", "https", "file") else src.path
    if not target.lower().endswith(".gguf"):
        return None
    if src.scheme in ("http", "https"):
        base, _, name = src.location.rpartition("/")
        return Source(src.uri, src.scheme, base), name
    if src.scheme == "file":
        p = Path(src.location)
        return Source(src.uri, "file", str(p.parent)), p.name
    base, _, name = src.path.rpartition("/")
    return Source(src.uri, src.scheme, src.location, base, src.revision), name


def _model_files(src: Source, folder: Path, timeout: float) -> Iterable[str]:
    """Names of the weight files, from the safetensors index when there is one."""
    try:
        _download(src.child(SAFETENSORS_INDEX), folder / SAFETENSORS_INDEX, timeout)
    except SourceNotFound:
        return [SAFETENSORS_SINGLE]
    try:
        index = json.loads((folder / SAFETENSORS_INDEX).read_text())
        shards = sorted(set(index["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SourceError(f"{src.uri}: {SAFETENSORS_INDEX} is malformed ({exc!r})") from None
    for shard in shards:
        _safe_relpath(shard, src.uri)
    return shards


def fetch_model(uri: str, *, cache_dir: Path | str | None = None, timeout: float = 60.0,
                config_only: bool = False, tokenizer_only: bool = False) -> Path:
    """A local HF model folder (config.json, tokenizer files, safetensors shards) or GGUF file.

    Local and pvc:// sources are returned in place. Remote folders are downloaded once into
    `cache_dir`; optional files (tokenizer, generation config) are skipped when absent.
    `tokenizer_only` skips the weights (what the scheduler needs); `config_only` fetches just
    config.json (enough to learn the model's shape). A GGUF file is always fetched whole.
    """
    src = parse_source(uri)
    if not src.remote:
        path = local_source_path(src, uri)
        if not path.exists():
            raise SourceNotFound(f"model {uri} does not exist")
        return path
    single = _split_file(src)
    if single is not None:
        folder_src, name = single
        folder = _cache_folder(cache_dir, "models", src)
        if not (folder / name).is_file():
            _download(folder_src.child(name), folder / name, timeout)
        return folder / name
    folder = _cache_folder(cache_dir, "models", src)
    levels = [".config-complete", ".tokenizer-complete", ".complete"]  # each includes the ones before
    level = 0 if config_only else 1 if tokenizer_only else 2
    if any((folder / mark).is_file() for mark in levels[level:]):
        return folder
    _download(src.child(MODEL_CONFIG), folder / MODEL_CONFIG, timeout)
    if level >= 1:
        for name in MODEL_OPTIONAL:
            try:
                _download(src.child(name), folder / name, timeout)
            except SourceNotFound:
                pass
    if level >= 2:
        for name in _model_files(src, folder, timeout):
            if not (folder / name).is_file():
                _download(src.child(name), folder / name, timeout)
    (folder / levels[level]).write_text("ok\n")
    return folder


def read_model_config(uri: str, *, timeout: float = 30.0) -> dict:
    """The base model's config.json as a dict (downloads only that file, into a temp folder)."""
    src = parse_source(uri)
    if _split_file(src) is not None:
        raise SourceError(f"{uri}: a GGUF file carries no config.json")
    if not src.remote:
        path = local_source_path(src, uri) / MODEL_CONFIG
        if not path.is_file():
            raise SourceNotFound(f"{uri}: {MODEL_CONFIG} not found")
        text = path.read_text()
    else:
        with tempfile.TemporaryDirectory(prefix="lorafleet-config-") as tmp:
            _download(src.child(MODEL_CONFIG), Path(tmp) / MODEL_CONFIG, timeout)
            text = (Path(tmp) / MODEL_CONFIG).read_text()
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise SourceError(f"{uri}: config.json is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise SourceError(f"{uri}: config.json must hold a JSON object")
    return cfg


def remove_cached(uri: str, *, cache_dir: Path | str | None = None) -> None:
    """Forget the cached copy of a remote adapter (e.g. after it was deleted)."""
    src = parse_source(uri)
    if src.remote:
        shutil.rmtree(_cache_folder(cache_dir, "adapters", src), ignore_errors=True)
