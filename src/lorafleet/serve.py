"""`lorafleet serve`: the scheduler plus N runners on this machine.

Each runner is a front process with its engine core as a child; runners run in their own
session (so Ctrl-C reaches only this process, which then shuts down in order: stop
accepting, finish or cancel in-flight requests, stop runners, each of which stops its
engine core). A runner gets SIGTERM if this process dies, an engine core SIGKILL if its
front dies (no orphans). Scheduler and runners share a random runner credential
(LORAFLEET_RUNNER_TOKEN) made here unless one is set.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger("lorafleet.serve")


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def runner_command(args: argparse.Namespace, model: str, port: int, rid: str, device: str) -> list[str]:
    cmd = [sys.executable, "-m", "lorafleet", "--log-level", args.log_level, "runner", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--id", rid, "--device", device,
           "--max-batch-size", str(args.max_batch_size), "--max-lora-rank", str(args.max_lora_rank),
           "--dtype", args.dtype, "--grace-seconds", str(args.grace_seconds)]
    if args.kv_pages:
        cmd += ["--kv-pages", str(args.kv_pages)]
    if args.page_size:
        cmd += ["--page-size", str(args.page_size)]
    if args.kv_cache_gb:
        cmd += ["--kv-cache-gb", str(args.kv_cache_gb)]
    if getattr(args, "kv_fraction", None):
        cmd += ["--kv-fraction", str(args.kv_fraction)]
    if getattr(args, "lora_slots", None):
        cmd += ["--lora-slots", str(args.lora_slots)]
    if getattr(args, "no_cuda_graphs", False):
        cmd.append("--no-cuda-graphs")
    return cmd


def runner_devices(device: str, n: int) -> list[str]:
    if device.startswith("cuda") and ":" not in device:
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise SystemExit("--device cuda: no CUDA device is visible")
        return [f"cuda:{i % count}" for i in range(n)]
    if device == "auto":
        try:
            import torch

            if torch.cuda.is_available():
                return runner_devices("cuda", n)
        except ImportError:
            pass
        return ["cpu"] * n
    return [device] * n


def wait_ready(procs: list[tuple[str, subprocess.Popen, str]], timeout: float) -> None:
    pending = {rid for rid, _, _ in procs}
    deadline = time.monotonic() + timeout
    last_note = 0.0
    while pending:
        for rid, proc, url in procs:
            if rid not in pending:
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"runner {rid} exited with code {proc.returncode} while loading (see its log above)")
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        pending.discard(rid)
                        log.info("runner %s ready at %s", rid, url)
            except urllib.error.HTTPError as exc:
                try:
                    error = json.loads(exc.read()).get("error")
                except ValueError:
                    error = None
                if error:  # its engine core failed to load the model: no point in waiting
                    raise RuntimeError(f"runner {rid}: {error}") from None
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"runners {sorted(pending)} not ready after {timeout:.0f}s")
        if pending and time.monotonic() - last_note > 10:
            log.info("waiting for runner(s) %s to load the model...", ", ".join(sorted(pending)))
            last_note = time.monotonic()
        time.sleep(0.3)


def stop_children(procs: list[tuple[str, subprocess.Popen, str]], grace: float) -> None:
    for _, proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for rid, proc, _ in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("runner %s did not stop in %.0fs; killing it", rid, grace)
            proc.kill()
            proc.wait()


def banner(url: str, model_name: str, adapters: list[str]) -> str:
    example = adapters[0] if adapters else model_name
    body = json.dumps({"model": example, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 48, "temperature": 0})
    names = ", ".join([model_name] + adapters)
    return f"""
lorafleet is serving at {url}/v1   (models: {names})

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{example}', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"

Press Ctrl-C to stop.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: the SmolLM2 demo model)")
    p.add_argument("--adapters", type=Path, default=None, help="adapter directory (default: the demo adapters)")
    p.add_argument("--model-name", default=None, help="the base model's name in the API (default: from config.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--runners", type=int, default=1, help="runner processes to start")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (runner i uses cuda:i)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--kv-pages", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--grace-seconds", type=float, default=20.0, help="time to finish in-flight requests on stop")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for runners to load")
    p.add_argument("--kv-fraction", type=float, default=None, help="GPU: share of free memory for each runner's KV cache")
    p.add_argument("--lora-slots", type=int, default=None,
                   help="adapters resident on each runner's device at once")
    p.add_argument("--no-cuda-graphs", action="store_true", help="runners step eagerly on CUDA")
    from lorafleet.scheduler.server import add_placement_argument

    add_placement_argument(p)


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from lorafleet import env
    from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
    from lorafleet.scheduler.registry import AdapterRegistry
    from lorafleet.scheduler.server import SchedulerService, create_app, model_display_name, model_limits
    from lorafleet.scheduler.tokenizer import Tokenizer

    model, adapters_dir = args.model, args.adapters
    if model is None:
        from lorafleet.runner.demo import prepare

        log.info("preparing the demo model and adapters (first run only)...")
        demo = prepare()
        model, adapters_dir = str(demo / "model"), adapters_dir or demo / "adapters"
    model_path = Path(model)
    tok_dir = model_path
    if model_path.suffix == ".gguf":
        from lorafleet.runner.generate import tokenizer_dir

        tok_dir = tokenizer_dir(model_path)
    registry = AdapterRegistry.from_directory(adapters_dir) if adapters_dir else AdapterRegistry()

    procs = []
    devices = runner_devices(args.device, args.runners)
    # One credential for this machine's scheduler and runners (CONTRACT: LORAFLEET_RUNNER_TOKEN).
    token = env.runner_token() or secrets.token_urlsafe(32)
    child_env = {**os.environ, "LORAFLEET_RUNNER_TOKEN": token}
    try:
        for i, dev in enumerate(devices):
            port = free_port("127.0.0.1")
            rid = f"runner-{i}"
            proc = subprocess.Popen(runner_command(args, str(model_path), port, rid, dev), start_new_session=True,
                                    preexec_fn=_die_with_parent, env=child_env)
            procs.append((rid, proc, f"http://127.0.0.1:{port}"))
        log.info("started %d runner(s) on %s; loading %s", len(procs), ", ".join(devices), model_path.name)
        wait_ready(procs, args.ready_timeout)
        directory = RunnerDirectory([RunnerEndpoint(rid, url) for rid, _, url in procs])
        service = SchedulerService(
            Tokenizer(tok_dir), args.model_name or model_display_name(tok_dir if model_path.is_dir() else model_path),
            registry, directory,
            max_model_len=model_limits(tok_dir), admin_token=env.admin_token(), grace_seconds=args.grace_seconds,
            placement=args.placement, runner_token=token,
        )
        app = create_app(service)
        url = f"http://{args.host}:{args.port}"

        async def announce(app):
            print(banner(url, service.model_name, registry.names()), flush=True)

        app.on_startup.append(announce)
        web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True,
                    shutdown_timeout=args.grace_seconds + 5)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        log.info("stopping %d runner(s)", len(procs))
        stop_children(procs, args.grace_seconds + 10)
    log.info("stopped")
    return 0
