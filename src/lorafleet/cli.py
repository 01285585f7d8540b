"""The `lorafleet` command: one console script, one subcommand per job.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; modules are imported only when their subcommand runs, so the
scheduler and operator never import torch.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import sys

from lorafleet import __version__, env

# A module that a command needs and the base install lacks -> the extra that brings it.
EXTRAS = {"torch": "runner", "safetensors": "runner", "gguf": "runner", "tqdm": "runner",
          "flashinfer": "gpu", "transformers": "convert", "sentencepiece": "convert"}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """--log-level: one of LOG_LEVELS, any case."""
    level = str(value).strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS[:4])}, got {value!r}")
    return level


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it in words; a list
    default prints as its items joined by spaces, as they are given on the command line."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if action.default is None or (isinstance(action.default, (str, list, tuple)) and not action.default):
            return text  # nothing to print: an empty default is said in words where it matters
        return f"{text} (default: %(default)s)"

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, (list, tuple)):
            action = copy.copy(action)
            action.default = " ".join(str(x) for x in action.default)
        return super()._expand_help(action)


class DocHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter for a parser whose description is a docstring laid out by hand (printed as written)."""


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """One line naming the extra that provides a missing module, or None (not a module of an extra)."""
    top = (exc.name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    extra = EXTRAS[top]
    return f"this command needs {top}, which comes with the [{extra}] extra: pip install 'lorafleet[{extra}]'"


# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("lorafleet.serve", "run the scheduler and N runners on this machine (OpenAI-compatible API)"),
    "generate": ("lorafleet.runner.service.generate", "offline batch inference of a JSONL file, mixed adapters in one batch"),
    "prepare-demo": ("lorafleet.runner.demo", "write the SmolLM2 demo model (HF directory) and demo adapters"),
    "runner": ("lorafleet.runner.service.server", "run one runner service (the engine behind HTTP)"),
    "scheduler": ("lorafleet.scheduler.server", "run the scheduler service (OpenAI API, placement, migration)"),
    "operator": ("lorafleet.operator.cli", "run the Kubernetes operator (kopf)"),
    "simulate": ("lorafleet.scheduler.simulate", "simulate placement policies over a cluster trace"),
    "bench": ("lorafleet.bench", "benchmarks: kernels, e2e, cpu, serve, relay, quality"),
    "build-kernels": ("lorafleet.runner.kernels", "build the SGMV CUDA extension ahead of time"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafleet",
        description="Serve hundreds of LoRA fine-tunes of one base model from a shared GPU pool.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lorafleet {__version__}")
    parser.add_argument("--log-level", default=env.log_level(), type=log_level,
                        help="DEBUG, INFO, WARNING or ERROR (default: INFO, or env LORAFLEET_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        p.set_defaults(_module=module)
        # Arguments are added lazily in main() for the chosen command only.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Find the subcommand first so only its module is imported (and its --help is complete).
    command = next((a for a in argv if a in COMMANDS), None)
    if command is not None:
        try:
            module = importlib.import_module(COMMANDS[command][0])
        except ModuleNotFoundError as exc:
            if (line := missing_extra(exc)) is None:
                raise
            print(f"lorafleet {command}: {line}", file=sys.stderr)
            return 2
        sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        module.add_arguments(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser: its usage, not the top level's
        (sub if command is not None else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from lorafleet.common.peft_config import AdapterError
    from lorafleet.env import EnvError
    from lorafleet.models.contract import ModelError

    try:
        return int(module.run(args) or 0)
    except (ModelError, AdapterError, EnvError) as exc:  # a model, adapter or setting that cannot be used: say why
        print(f"lorafleet {command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (line := missing_extra(exc)) is None:
            raise
        print(f"lorafleet {command}: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
