"""The command line as a new user meets it: every flag of every command (benchmarks included) says
what it does and its default; a command whose extra is not installed names the extra in one line;
a busy port's message says how to pick another the way the server was started; a scheduler given no
usable model says so in one line; the test tools' stores stay out of git."""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet import cli

REPO = Path(__file__).resolve().parents[1]


def subparser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"lorafleet {command}", formatter_class=cli.HelpFormatter)
    importlib.import_module(cli.COMMANDS[command][0]).add_arguments(p)
    return p


@pytest.mark.parametrize("command", ["serve", "generate", "runner", "scheduler"])
def test_every_flag_says_what_it_does_and_its_default(command):
    p = subparser(command)
    formatter = p._get_formatter()
    for action in p._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        assert action.help and len(action.help) > 8, f"lorafleet {command} {flag}: no help"
        if action.required:
            continue
        shown = formatter._get_help_string(action) % {"default": action.default}
        assert "default" in shown.lower(), f"lorafleet {command} {flag}: no default in {shown!r}"


def test_scheduler_model_name_help_states_the_true_default(tmp_path):
    from lorafleet.scheduler.server import model_display_name

    help_text = " ".join(subparser("scheduler").format_help().split())
    assert "(default: the last part of config.json's _name_or_path; without one," in help_text, help_text
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text('{"_name_or_path": "org/real-name"}')
    assert model_display_name(tmp_path / "folder") == "real-name"


@pytest.mark.parametrize("case, expected", [
    ("missing", "model path {model} does not exist (give the base model's directory"),
    ("no-tokenizer", "the API needs the model's tokenizer: {model} has no tokenizer.json"),
    ("bad-tokenizer", "the API needs the model's tokenizer: {model}/tokenizer.json cannot be read"),
    ("bad-tokenizer-config", "the API needs the model's tokenizer: {model}/tokenizer_config.json is not readable JSON"),
    ("list-tokenizer-config", "{model}/tokenizer_config.json must hold a JSON object, found list"),
])
def test_scheduler_without_a_usable_model_says_why_in_one_line(tmp_path, case, expected):
    model = tmp_path / "model"
    if case != "missing":
        model.mkdir()
    if case == "bad-tokenizer":
        (model / "tokenizer.json").write_text("not json")
    if case.endswith("tokenizer-config"):
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(model / "tokenizer.json"))
        (model / "tokenizer_config.json").write_text("{not json" if case.startswith("bad") else "[1, 2]")
    r = subprocess.run([sys.executable, "-m", "lorafleet", "scheduler", "--model", str(model), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert expected.format(model=model) in lines[0], r.stderr


def test_generate_says_the_demo_adapters_are_the_default():
    help_text = " ".join(subparser("generate").format_help().split())
    assert "default: the demo adapters" in help_text and "pirate" in help_text


def test_formatter_adds_defaults_only_where_the_help_lacks_them():
    p = argparse.ArgumentParser(formatter_class=cli.HelpFormatter)
    p.add_argument("--a", type=int, default=7, help="some number")
    p.add_argument("--b", type=int, default=7, help="some number (default: seven)")
    p.add_argument("--c", action="store_true", help="a switch")
    text = " ".join(p.format_help().split())
    assert "some number (default: 7)" in text and "(default: seven)" in text and "default: 7) (" not in text
    assert "a switch (default: off)" in text


def test_a_missing_extra_is_named_in_one_line_without_a_traceback(tmp_path):
    # torch made unimportable, as after a plain `pip install lorafleet`
    code = ("import sys; sys.modules['torch'] = None\n"
            "from lorafleet.cli import main\n"
            f"sys.exit(main(['generate', '--input', {str(tmp_path / 'in.jsonl')!r}, '--output', "
            f"{str(tmp_path / 'out.jsonl')!r}]))")
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "lorafleet[runner]" in lines[0] and "torch" in lines[0]


def test_a_module_outside_the_extras_still_raises():
    exc = ModuleNotFoundError("No module named 'nothere'", name="nothere")
    assert cli.missing_extra(exc) is None
    assert "lorafleet[gpu]" in cli.missing_extra(ModuleNotFoundError("x", name="flashinfer.jit"))


@pytest.mark.parametrize("hint, expected", [(None, "--port {next}"), ("make run PORT=<port>", "make run PORT={next}")])
def test_busy_port_message_says_how_to_choose_another(monkeypatch, hint, expected):
    from lorafleet.scheduler.listen import ListenError, bind

    if hint is None:
        monkeypatch.delenv("LORAFLEET_PORT_HINT", raising=False)
    else:
        monkeypatch.setenv("LORAFLEET_PORT_HINT", hint)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as err:
            bind("127.0.0.1", port)
    message = str(err.value)
    assert f"port {port} on 127.0.0.1 is already in use" in message
    assert message.endswith(expected.format(next=port + 1)), message
    if hint is not None:
        assert "--port" not in message


def test_make_run_tells_serve_it_was_started_by_make():
    r = subprocess.run(["make", "-n", "run", "PORT=8123"], cwd=REPO, capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if " serve " in x)
    assert "LORAFLEET_PORT_HINT='make run PORT=<port>'" in line and "--port 8123" in line


def test_test_tool_stores_are_ignored_by_git():
    for path in (".schemathesis/cache/manifest.json", ".hypothesis/examples/x"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=30)
        assert r.returncode == 0, f"{path} is not ignored"


def every_parser() -> dict[str, argparse.ArgumentParser]:
    """Every parser of the `lorafleet` command, by its command line: the top level, each subcommand (with
    its arguments added as `cli.main` adds them), argparse subcommands nested under those, and the
    benchmarks that `lorafleet bench X` hands its remaining arguments to (each module's `build_parser()`)."""
    from lorafleet import bench

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(prog: str, p: argparse.ArgumentParser) -> None:
        found[prog] = p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    if prog == "lorafleet":  # the top level adds a command's arguments only when it runs
                        importlib.import_module(cli.COMMANDS[name][0]).add_arguments(child)
                    walk(f"{prog} {name}", child)

    walk("lorafleet", cli.build_parser())
    which = next(a for a in found["lorafleet bench"]._actions if a.dest == "which")
    assert sorted(which.choices) == sorted(bench.BENCHES)
    for name in which.choices:
        walk(f"lorafleet bench {name}", importlib.import_module(bench.BENCHES[name]).build_parser())
    return found


def test_every_option_of_every_command_has_help_that_states_its_default():
    """Walks every parser of the CLI (see every_parser). For each option, -h/--help, --version and options
    whose default is argparse.SUPPRESS left out:
    - its help is a non-empty text;
    - unless the option is required, or its default is None or False (nothing given / a switch left off),
      its help as `--help` prints it says "default" (the formatter appends "(default: X)", or the text
      says it in words: "default: all", "default: none", ...). Empty defaults ('' or []) must say it too;
    - no help renders a default as a Python list (`['...']`): lists print as plain words."""
    problems = []
    parsers = every_parser()
    assert {"lorafleet simulate", "lorafleet bench serve", "lorafleet bench relay"} <= set(parsers)
    for prog, p in sorted(parsers.items()):
        formatter = p._get_formatter()
        for action in p._actions:
            if (not action.option_strings or action.default is argparse.SUPPRESS
                    or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
                continue
            flag = action.option_strings[-1]
            if not (action.help or "").strip():
                problems.append(f"{prog} {flag}: no help")
                continue
            shown = " ".join(formatter._expand_help(action).split())
            if "['" in shown or "[Path" in shown or "PosixPath(" in shown:
                problems.append(f"{prog} {flag}: default rendered as Python: {shown!r}")
            if action.required or action.default is None or action.default is False:
                continue
            if "default" not in shown.lower():
                problems.append(f"{prog} {flag}: default {action.default!r} not stated in {shown!r}")
        if "['" in p.format_help():
            problems.append(f"{prog}: a Python list in --help")
    assert not problems, "\n".join(problems)


def test_an_unknown_flag_is_named_by_its_commands_parser(capsys):
    """`lorafleet serve --bogus` once answered with the top level's usage; now the command's own."""
    for argv, prog in ((["serve", "--bogus-flag"], "lorafleet serve"), (["--bogus"], "lorafleet")):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"{prog}: error: unrecognized arguments: {argv[-1]}" in err, err
        assert err.startswith(f"usage: {prog} ")
