"""Sizes, counts and ports on the command line are refused by argparse in one line when out of range: a batch of 0
once hung every command, `serve --port 70000` listened on 4464 (getaddrinfo wraps the port) while it announced
70000, and `serve --page-size 0` silently ran with 16."""

from __future__ import annotations

import argparse

import pytest

from lorafleet.common import cli_args
from lorafleet.scheduler.listen import ListenError, bind


@pytest.mark.parametrize("fn,value,ok", [
    (cli_args.positive_int, "1", 1), (cli_args.positive_int, "0", None), (cli_args.positive_int, "-3", None),
    (cli_args.positive_int, "2.5", None), (cli_args.port, "0", 0), (cli_args.port, "65535", 65535),
    (cli_args.port, "65536", None), (cli_args.port, "70000", None), (cli_args.port, "-1", None),
    (cli_args.positive_float, "0.5", 0.5), (cli_args.positive_float, "0", None), (cli_args.positive_float, "inf", None),
    (cli_args.positive_float, "nan", None), (cli_args.fraction, "1", 1.0), (cli_args.fraction, "1.5", None),
    (cli_args.non_negative_int, "0", 0), (cli_args.non_negative_int, "-1", None),
    (cli_args.non_negative_int, "1.5", None), (cli_args.non_negative_float, "0", 0.0),
    (cli_args.non_negative_float, "2.5", 2.5), (cli_args.non_negative_float, "-0.1", None),
    (cli_args.non_negative_float, "inf", None), (cli_args.non_negative_float, "nan", None),
])
def test_ranges(fn, value, ok):
    if ok is None:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(value)
    else:
        assert fn(value) == ok


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--port", "70000"], "--port"), (["serve", "--page-size", "0"], "--page-size"),
    (["serve", "--runners", "0"], "--runners"), (["serve", "--max-batch-size", "0"], "--max-batch-size"),
    (["runner", "--model", "m", "--tp", "0"], "--tp"), (["runner", "--model", "m", "--kv-fraction", "2"], "--kv-fraction"),
    (["scheduler", "--model", "m", "--port", "99999"], "--port"),
    # these reached the engine core (a traceback from torch.set_num_threads or the engine's ValueError), ran with a
    # negative grace, or were refused only after serve's runners had loaded the model
    (["serve", "--threads", "-1"], "--threads"), (["runner", "--model", "m", "--threads", "0"], "--threads"),
    (["serve", "--grace-seconds", "-5"], "--grace-seconds"), (["serve", "--ready-timeout", "0"], "--ready-timeout"),
    (["runner", "--model", "m", "--grace-seconds", "nan"], "--grace-seconds"),
    (["runner", "--model", "m", "--admit-wait-steps", "-1"], "--admit-wait-steps"),
    (["runner", "--model", "m", "--decode-prefill-tokens", "0"], "--decode-prefill-tokens"),
    (["serve", "--max-sequences-per-request", "0"], "--max-sequences-per-request"),
    (["serve", "--max-completion-tokens", "0"], "--max-completion-tokens"),
    (["scheduler", "--model", "m", "--runner-queue", "-1"], "--runner-queue"),
    (["serve", "--prefix-affinity-tokens", "-1"], "--prefix-affinity-tokens"),
    # was read as "never" (0 is the documented never), and nan as a rescan that never came
    (["serve", "--adapter-rescan", "-1"], "--adapter-rescan"),
    (["serve", "--adapter-rescan", "nan"], "--adapter-rescan"),
])
def test_commands_refuse_them_in_one_line(argv, flag, capsys):
    from lorafleet import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err, err


def test_bind_refuses_a_port_it_would_wrap():
    with pytest.raises(ListenError, match="a port is between 0 and 65535"):
        bind("127.0.0.1", 70000)
