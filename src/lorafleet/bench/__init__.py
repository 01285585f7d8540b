"""`lorafleet bench {kernels,e2e,cpu,serve,relay,quality} [options]`: the benchmarks (each prints a table and writes JSON)."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "kernels": "lorafleet.bench.kernels",
    "e2e": "lorafleet.bench.e2e",
    "cpu": "lorafleet.bench.cpu",
    "serve": "lorafleet.bench.serve",
    "relay": "lorafleet.bench.relay",
    "quality": "lorafleet.bench.quality",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=sorted(BENCHES), help="kernels: SGMV vs peers (CUDA); e2e: 7B-shape serving "
                   "throughput vs peers (CUDA); cpu: generate vs HF+PEFT on the SmolLM2 demo; serve: OpenAI-API load "
                   "against `lorafleet serve` vs the offline engine, rate sweeps; relay: scheduler tokens per CPU-second; "
                   "quality: perplexity and top-1 agreement of FP8 weights and K/V pages")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of that benchmark (see `lorafleet bench X --help`)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.which])
    return int(module.main(args.args) or 0)
