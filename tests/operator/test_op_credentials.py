"""Derived per-pool credentials, the hosts-file resolver, and the admin client's user-facing errors."""

from __future__ import annotations

import argparse
import asyncio
import socket

import aiohttp
import pytest

from lorafleet.common.hosts import HostsFileResolver, client_session, parse_hosts
from lorafleet.operator import cli
from lorafleet.operator.admin import AdminClient, SchedulerUnavailable, describe_failure
from lorafleet.operator.credentials import Credentials, KeyError_

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32


def test_tokens_are_stable_and_distinct_per_purpose_namespace_and_pool():
    c = Credentials(KEY)
    assert c.admin_token("ml", "llama") == Credentials(KEY).admin_token("ml", "llama")  # a restart: the same
    tokens = {c.admin_token("ml", "llama"), c.runner_token("ml", "llama"), c.admin_token("ml2", "llama"),
              c.admin_token("ml", "llama2"), Credentials(b"j" * 32).admin_token("ml", "llama")}
    assert len(tokens) == 5
    # No ambiguity from joining: ("a-b", "c") and ("a", "b-c") differ.
    assert c.admin_token("a-b", "c") != c.admin_token("a", "b-c")
    tok = c.runner_token("ml", "llama")
    assert len(tok) >= 40 and tok.replace("-", "").replace("_", "").isalnum()
    assert KEY.decode() not in tok and c.fingerprint not in tok and len(c.fingerprint) == 12
    assert Credentials(b"j" * 32).fingerprint != c.fingerprint


def test_key_file_errors_are_clear(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(KeyError_, match="holds 3 bytes; at least 16"):
        Credentials.from_file(short)
    with pytest.raises(KeyError_, match="cannot read the credentials key file"):
        Credentials.from_file(tmp_path / "missing")
    good = tmp_path / "key"
    good.write_text("x" * 48 + "\n")
    assert Credentials.from_file(good).key == b"x" * 48  # surrounding whitespace is not part of the key


def test_operator_refuses_a_bad_key_file_before_starting(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--credentials-key-file", str(tmp_path / "missing")])
    assert cli.config_from_args(args).credentials_key_file == str(tmp_path / "missing")
    with pytest.raises(SystemExit, match="lorafleet operator: cannot read the credentials key file"):
        cli.run(args)


def test_hosts_file_resolver(tmp_path):
    assert parse_hosts("# c\n127.1.2.3 a.ns.svc a.ns.svc.cluster.local  # x\n\n10.0.0.1 a.ns.svc\n::1 six\n") == {
        "a.ns.svc": "127.1.2.3", "a.ns.svc.cluster.local": "127.1.2.3", "six": "::1"}
    hosts = tmp_path / "hosts"

    async def main():
        resolver = HostsFileResolver(hosts)
        try:
            assert resolver.table() == {}  # no file yet: DNS only
            hosts.write_text("127.9.8.7 sched.ml.svc\n")
            (entry,) = await resolver.resolve("sched.ml.svc.", 8000)
            assert entry["host"] == "127.9.8.7" and entry["port"] == 8000 and entry["family"] == socket.AF_INET
            hosts.write_text("127.9.8.6 sched.ml.svc other\n")  # changes count at once
            assert (await resolver.resolve("SCHED.ml.svc", 80))[0]["host"] == "127.9.8.6"
            assert (await resolver.resolve("localhost", 80))[0]["host"] in ("127.0.0.1", "::1")  # falls back
        finally:
            await resolver.close()
        # A session that uses it reaches a server by a name only the file knows.
        from aiohttp import web

        async def ok(request):
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/x", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        hosts.write_text("127.0.0.1 only-in-the-file.test\n")
        async with client_session(hosts) as session:
            async with session.get(f"http://only-in-the-file.test:{port}/x") as resp:
                assert (await resp.json()) == {"ok": True}
        await runner.cleanup()

    asyncio.run(main())


def test_admin_errors_are_sentences_not_exception_reprs():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        async with aiohttp.ClientSession() as session:
            with pytest.raises(SchedulerUnavailable) as err:
                await AdminClient(session, f"http://127.0.0.1:{port}", "t", timeout=2).state()
            assert str(err.value) == ("the pool's scheduler is not reachable: the connection was refused "
                                      "(is its pod running?)")
            with pytest.raises(SchedulerUnavailable) as err:
                await AdminClient(session, "http://no-such-host.invalid:8000", "t", timeout=5).state()
            assert str(err.value) == "the pool's scheduler is not reachable: its address does not resolve"

    asyncio.run(main())
    assert describe_failure(asyncio.TimeoutError(), 10.0) == "it did not answer within 10s"
    assert describe_failure(aiohttp.ServerDisconnectedError(), 10.0) == "it closed the connection"
