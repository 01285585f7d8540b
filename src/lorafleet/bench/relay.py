"""`lorafleet bench relay`: tokens the scheduler relays per CPU-second of its own process.

Three processes: fake runners (`fake_runner.py`, the real runner protocol, no model), the real
`lorafleet scheduler`, and this process as the client: `--streams` concurrent streaming
completions (token-id prompts, `ignore_eos`, usage counted by the server). The figure is
completion tokens delivered / the scheduler process's CPU seconds (user + system) over the
run, so it holds on a busy machine; wall-clock throughput is printed too.

`--step-ms` paces the fake runners' steps (every active request gets one token per step, one
line per runner per step, as a GPU runner does): then each client gets one SSE write per token
and the figure is the CPU cost at that pace. 0 runs them as fast as their streams drain: the
scheduler is saturated, reads several steps at once and writes each client all its new tokens
in one chunk, and the figure is its relay capacity (the headline `relay_tokens_per_cpu_s`).
JSON to --out; --profile runs the scheduler under cProfile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

from lorafleet.bench import procs
from lorafleet.bench.load import LoadRequest, run_load, summary
from lorafleet.common import cli_args


def default_model() -> Path:
    from lorafleet.runner.demo import prepare

    return prepare() / "model"


def measure(args: argparse.Namespace, model: Path, step_ms: float, log) -> dict:
    """One run at `step_ms`; its processes' logs are kept in a temporary folder only where the run fails."""
    tmp = Path(tempfile.mkdtemp(prefix="lorafleet-relay-"))
    ok = False
    fake = procs.start(["lorafleet.bench.fake_runner", "--runners", str(args.runners), "--max-batch",
                        str(args.max_batch), "--step-ms", str(step_ms), "--port-file", str(tmp / "ports.json")],
                       log=tmp / "fake.log")
    sched = None
    try:
        urls = procs.wait_file(tmp / "ports.json", fake, 30)["urls"]
        port = procs.free_port()
        cmd = ["lorafleet", "--log-level", "WARNING", "scheduler", "--model", str(model), "--port", str(port),
               "--max-queue", str(max(1024, args.streams * 4)), "--model-name", "base"]
        for i, u in enumerate(urls):
            cmd += ["--runner", f"fake-{i}={u}"]
        if args.profile:  # the scheduler under cProfile; the profile is written when it exits
            cmd = ["cProfile", "-o", f"{args.profile}.step{step_ms:g}", "-m", *cmd]
        sched = procs.start(cmd, log=tmp / "scheduler.log")
        url = f"http://127.0.0.1:{port}"
        procs.wait_ready(url, sched, 60, "scheduler")
        prompt = list(range(1000, 1000 + args.prompt_tokens))
        warm = [LoadRequest("base", prompt, 4) for _ in range(min(args.streams, 32))]
        asyncio.run(run_load(url, warm))
        reqs = [LoadRequest("base", prompt, args.tokens) for _ in range(args.requests)]
        cpu0, t0 = procs.cpu_seconds(sched.pid), time.perf_counter()
        results, wall = asyncio.run(run_load(url, reqs, max_concurrency=args.streams))
        cpu = procs.cpu_seconds(sched.pid) - cpu0
        s = summary(results, wall)
        out = {"step_ms": step_ms, "streams": args.streams, "runners": args.runners, "requests": args.requests,
               "tokens_per_request": args.tokens, "relayed_tokens": s["output_tokens"],
               "scheduler_cpu_s": round(cpu, 3), "wall_s": round(time.perf_counter() - t0, 3),
               "relay_tokens_per_cpu_s": round(s["output_tokens"] / cpu) if cpu > 0 else None,
               "relay_tokens_per_wall_s": s["output_tok_s"], "failed": s["failed"],
               "itl_p50_ms": s["itl_p50_ms"], "itl_p99_ms": s["itl_p99_ms"]}
        log(f"step {step_ms:g} ms: {out['relayed_tokens']} tokens, scheduler {cpu:.2f} CPU-s -> "
            f"{out['relay_tokens_per_cpu_s']} tokens per CPU-second ({out['relay_tokens_per_wall_s']} per wall-second, "
            f"{s['failed']} failed)")
        if s["failed"]:
            out["errors"] = s.get("errors")
        ok = not s["failed"]
        return out
    finally:
        if sched is not None:
            procs.stop(sched, 30)
        procs.stop(fake, 10)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"the processes' logs are in {tmp}")


def build_parser() -> argparse.ArgumentParser:
    from lorafleet.cli import DocHelpFormatter

    p = argparse.ArgumentParser(prog="lorafleet bench relay", description=__doc__, formatter_class=DocHelpFormatter)
    p.add_argument("--model", type=cli_args.model_dir("tokenizer.json"), default=None,
                   help="tokenizer directory (default: the demo model)")
    p.add_argument("--streams", type=cli_args.positive_int, default=256, help="concurrent streaming clients")
    p.add_argument("--requests", type=cli_args.positive_int, default=1024, help="requests in all")
    p.add_argument("--tokens", type=cli_args.positive_int, default=200, help="completion tokens per request")
    p.add_argument("--prompt-tokens", type=cli_args.positive_int, default=16,
                   help="prompt length of every request, in tokens")
    p.add_argument("--runners", type=cli_args.positive_int, default=4, help="fake runners")
    p.add_argument("--max-batch", type=cli_args.positive_int, default=64, help="max batch of each fake runner")
    p.add_argument("--step-ms", type=cli_args.non_negative_float, nargs="+", default=[0.0, 20.0],
                   help="fake runner step times to measure (0: unpaced, the scheduler saturated)")
    p.add_argument("--out", type=cli_args.output_file, default=Path("bench_relay.json"),
                   help="results as JSON (default: bench_relay.json)")
    p.add_argument("--profile", type=Path, default=None, help="run the scheduler under cProfile; write PATH.stepN (default: no profile)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = args.model or default_model()

    def log(msg):
        print(msg, flush=True)

    runs = [measure(args, model, s, log) for s in args.step_ms]
    # The headline is the saturated run (unpaced runners): what one scheduler CPU can relay when it
    # is the bottleneck. Paced runs show the cost when every client gets one token per write.
    head = next((r for r in runs if r["step_ms"] == 0), runs[0])
    result = {"date": time.strftime("%Y-%m-%d"), "runs": runs,
              "relay_tokens_per_cpu_s": head["relay_tokens_per_cpu_s"], "headline_step_ms": head["step_ms"]}
    args.out.write_text(json.dumps(result, indent=1))
    print("| fake runner step | streams | tokens | scheduler CPU-s | tokens per CPU-s | tokens per wall-s | ITL p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['step_ms']:g} ms | {r['streams']} | {r['relayed_tokens']} | {r['scheduler_cpu_s']} | "
              f"{r['relay_tokens_per_cpu_s']} | {r['relay_tokens_per_wall_s']} | {r['itl_p50_ms']} |")
    return 0 if all(not r["failed"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
