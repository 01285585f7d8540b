"""`lorafleet serve`: the scheduler plus N runner processes on this machine.

The port is bound first, so a busy port is reported before anything is loaded. Each runner is
a front process with its engine core as a child (and, with `--tp N`, N - 1 more ranks); runners
run in their own session (so Ctrl-C reaches only this process, which then shuts down in order:
stop accepting, finish or cancel in-flight requests, stop runners, each of which stops its engine
core). A runner gets SIGTERM if this process dies, an engine core SIGKILL if its front dies (no
orphans), and a runner that dies while serving is restarted with backoff (`runner_procs.py`).
Scheduler and runners share a random runner credential (LORAFLEET_RUNNER_TOKEN) made here
unless one is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import secrets
import shlex
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from lorafleet.common import cli_args
from lorafleet.runner_procs import RunnerProcess, Supervisor, stop_children

log = logging.getLogger("lorafleet.serve")


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
    if getattr(args, "no_prefix_cache", False):
        cmd.append("--no-prefix-cache")
    if getattr(args, "batch_invariant", False):
        cmd.append("--batch-invariant")
    if getattr(args, "quantization", None):
        cmd += ["--quantization", args.quantization]
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if getattr(args, "tp", 1) > 1:
        cmd += ["--tp", str(args.tp)]
    threads = runner_threads(args, device)
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd


def runner_threads(args: argparse.Namespace, device: str) -> int | None:
    """torch threads of one runner: `--threads` when given; on the CPU, the cores this process may use
    divided among the runners (two engines with a thread per core each on the same cores run many times
    slower than one); on CUDA, the runner's own default."""
    if getattr(args, "threads", None):
        return args.threads
    if device != "cpu":
        return None
    from lorafleet.common.cpus import available_cpus, split

    return split(available_cpus(), args.runners)


def runner_devices(device: str, n: int, tp: int = 1) -> list[str]:
    """The first device of each runner: with `tp` GPUs per runner, runner i starts at cuda:i*tp."""
    if device.startswith("cuda") and ":" not in device:
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise SystemExit("--device cuda: no CUDA device is visible")
        if n * tp > count and tp > 1:
            raise SystemExit(f"--runners {n} --tp {tp} needs {n * tp} GPUs; {count} are visible")
        return [f"cuda:{(i * tp) % count}" for i in range(n)]
    if device == "auto":
        try:
            import torch

            if torch.cuda.is_available():
                return runner_devices("cuda", n, tp)
        except ImportError:
            pass
        return ["cpu"] * n
    return [device] * n


def wait_ready(runners: list[RunnerProcess], timeout: float) -> None:
    pending = {r.rid for r in runners}
    deadline = time.monotonic() + timeout
    last_note = 0.0
    while pending:
        for r in runners:
            rid, proc, url = r.rid, r.proc, r.url
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


def _shown(name: str) -> str:
    """A name as it may appear in plain text on a terminal (control characters escaped)."""
    return name if name.isprintable() else repr(name)


def python_command() -> str:
    """How the banner's Python example names its interpreter: this one where it runs in a virtual
    environment (the one `make run` made, which has the openai client), relative to the working directory
    when it lies under it; plain `python` otherwise."""
    if sys.prefix == sys.base_prefix:
        return "python"
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.quote(str(exe))


def banner(url: str, model_name: str, adapters: list[str], api_keys: bool = False, python: str = "python",
           unavailable: frozenset[str] = frozenset()) -> str:
    """The startup message; its shell examples quote every name, so any adapter name pastes safely.
    `python`: the interpreter command of the Python example (see python_command). `unavailable`: adapters whose
    files were refused at start: listed as such, never the example."""
    example = next((a for a in adapters if a not in unavailable), model_name)
    body = json.dumps({"model": example, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 48, "temperature": 0})
    names = ", ".join(_shown(n) + (" (unavailable)" if n in unavailable else "") for n in [model_name] + adapters)
    auth = " -H 'Authorization: Bearer YOUR_KEY'" if api_keys else ""
    lit = functools.partial(json.dumps, ensure_ascii=False)  # a JSON string is also a Python string literal
    code = (f"from openai import OpenAI; c = OpenAI(base_url={lit(url + '/v1')}, "
            f"api_key={lit('YOUR_KEY' if api_keys else 'none')}); print(c.chat.completions.create(model={lit(example)}, "
            'messages=[{"role": "user", "content": "Hi!"}]).choices[0].message.content)')
    return f"""
lorafleet is serving at {url}/v1   (models: {names})

  curl {shlex.quote(url + '/v1/chat/completions')} -H 'Content-Type: application/json'{auth} \\
    -d {shlex.quote(body)}

  {python} -c {shlex.quote(code)}

Press Ctrl-C to stop.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: the SmolLM2 demo model)")
    p.add_argument("--adapters", type=Path, default=None,
                   help="directory with one PEFT adapter per subfolder (default: the demo adapters with the demo "
                        "model, none with --model)")
    p.add_argument("--model-name", default=None,
                   help="the base model's name in the API (default: config.json's _name_or_path, else the folder or "
                        "file name; NAME for a Hugging Face cache snapshot of ORG/NAME)")
    p.add_argument("--host", default="127.0.0.1", help="address the OpenAI API listens on")
    p.add_argument("--port", type=cli_args.port, default=8000, help="port the OpenAI API listens on")
    p.add_argument("--runners", type=cli_args.positive_int, default=1,
                   help="runner processes to start; on the CPU they share the cores (see --threads)")
    p.add_argument("--threads", type=cli_args.positive_int, default=None, metavar="N",
                   help="CPU runners: torch threads of each runner (default: the cores this process may use, "
                        "divided among the runners, at least 1)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (CUDA when available, else CPU), cpu or cuda (runner i uses cuda:i)")
    p.add_argument("--max-batch-size", type=cli_args.positive_int, default=32, help="requests batched together on each runner")
    p.add_argument("--max-lora-rank", type=cli_args.lora_rank, default=64,
                   help=f"largest adapter rank the runners accept (1-{cli_args.MAX_LORA_RANK})")
    p.add_argument("--kv-pages", type=cli_args.positive_int, default=None,
                   help="KV cache pages of each runner (default: from --kv-cache-gb on the CPU, --kv-fraction on GPUs)")
    p.add_argument("--kv-cache-gb", type=cli_args.positive_float, default=None, help="CPU: KV cache of each runner in GiB (default: 1)")
    p.add_argument("--page-size", type=cli_args.positive_int, default=None, help="tokens per KV page (default: 16)")
    p.add_argument("--dtype", default="auto", choices=cli_args.DTYPES,
                   help="weights and activations: auto (float32 on the CPU, bfloat16 on CUDA), float32, bfloat16 or "
                        "float16")
    p.add_argument("--grace-seconds", type=cli_args.non_negative_float, default=20.0,
                   help="time to finish in-flight requests on stop")
    p.add_argument("--ready-timeout", type=cli_args.positive_float, default=600.0,
                   help="seconds to wait for runners to load")
    p.add_argument("--kv-fraction", type=cli_args.fraction, default=None,
                   help="GPU: share of free memory for each runner's KV cache (default: 0.85)")
    p.add_argument("--lora-slots", type=cli_args.positive_int, default=None,
                   help="adapters resident on each runner's device at once (default: 8 on the CPU, 64 on GPUs)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="runners step eagerly on CUDA")
    p.add_argument("--no-prefix-cache", action="store_true", help="runners keep no KV pages for later requests "
                   "(on by default: requests with the same prefix, adapter and cache salt reuse full pages)")
    cli_args.add_batch_invariant_argument(p)  # (passed to the runners)
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="runners hold the projection weights in FP8 (default: as the checkpoint stores them)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="runners' K/V pages: the model's dtype (auto, the default) or FP8")
    p.add_argument("--tp", type=cli_args.positive_int, default=1, help="tensor parallelism: GPUs per runner (runner i uses "
                   "cuda:i*tp .. cuda:i*tp+tp-1)")
    from lorafleet.scheduler import limits
    from lorafleet.scheduler.server import add_adapter_rescan_argument, add_api_key_argument, add_placement_argument

    add_adapter_rescan_argument(p)
    add_api_key_argument(p)
    add_placement_argument(p)
    limits.add_arguments(p)


def runner_env(adapters_dir: Path | None) -> dict:
    """The runners' environment: the adapter directory joins the source roots (it is what they load)."""
    from lorafleet import env
    from lorafleet.common.source_policy import default_roots

    roots = [str(r) for r in (env.source_roots() or default_roots())]
    if adapters_dir is not None:
        roots.append(str(Path(adapters_dir).resolve()))
    return {**os.environ, "LORAFLEET_SOURCE_ROOTS": os.pathsep.join(roots)}


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from lorafleet import env
    from lorafleet.scheduler import limits
    from lorafleet.scheduler.api_keys import ApiKeyFileError
    from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
    from lorafleet.scheduler.listen import ListenError, bind
    from lorafleet.scheduler.registry import AdapterRegistry
    from lorafleet.scheduler.server import (
        SHUTDOWN_BACKSTOP_S,
        SchedulerService,
        StartupError,
        create_app,
        load_api_keys,
        model_display_name,
        model_limits,
        watch_adapters,
    )
    from lorafleet.scheduler.tokenizer import Tokenizer

    try:  # before anything slow: a busy port or a bad key file is reported at once
        sock = bind(args.host, args.port)
        api_keys = load_api_keys(args)
    except (ListenError, ApiKeyFileError) as exc:
        log.error("%s", exc)
        return 2
    model, adapters_dir = args.model, args.adapters
    if model is None:
        from lorafleet.runner.demo import prepare

        from lorafleet.runner.demo import default_dir

        if not (default_dir() / "model" / "model.safetensors").is_file():
            log.info("preparing the demo model and adapters (first run only)...")
        demo = prepare()
        model, adapters_dir = str(demo / "model"), adapters_dir or demo / "adapters"
    from lorafleet.runner.service.generate import model_path_problem, tokenizer_dir

    model_path = Path(model)
    problem = model_path_problem(model_path)
    if problem:
        log.error("model path %s", problem)
        return 2
    tok_dir = tokenizer_dir(model_path) if model_path.suffix == ".gguf" else model_path
    # what the API needs besides the runners: the adapters' folder, the tokenizer, a name for the base model
    try:
        registry = AdapterRegistry.from_directory(adapters_dir) if adapters_dir else AdapterRegistry()
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return 2
    try:
        tokenizer = Tokenizer(tok_dir)
    except (OSError, ValueError) as exc:
        log.error("the API needs the model's tokenizer: %s (`lorafleet generate` runs token-id prompts without one)",
                  exc)
        return 2
    try:  # a config.json that cannot be read would leave the name and the context length guessed
        model_name = args.model_name or model_display_name(tok_dir if model_path.is_dir() else model_path)
        max_model_len = model_limits(tok_dir)
    except StartupError as exc:
        log.error("%s", exc)
        return 2
    if model_name in registry:
        log.error("the adapter folder %r has the base model's name, so requests could not reach it: rename the "
                  "folder or give the base model another name (--model-name)", model_name)
        return 2

    runners: list[RunnerProcess] = []
    supervisor = None
    devices = runner_devices(args.device, args.runners, args.tp)
    # One credential for this machine's scheduler and runners (CONTRACT: LORAFLEET_RUNNER_TOKEN).
    token = env.runner_token() or secrets.token_urlsafe(32)
    child_env = {**runner_env(adapters_dir), "LORAFLEET_RUNNER_TOKEN": token}
    try:
        for i, dev in enumerate(devices):
            port = free_port("127.0.0.1")
            rid = f"runner-{i}"
            r = RunnerProcess(rid, f"http://127.0.0.1:{port}", runner_command(args, str(model_path), port, rid, dev),
                              env=child_env)
            r.start()
            runners.append(r)
        log.info("started %d runner(s) on %s; loading %s", len(runners), ", ".join(devices), model_path.name)
        wait_ready(runners, args.ready_timeout)
        supervisor = Supervisor(runners)
        supervisor.start()
        directory = RunnerDirectory([RunnerEndpoint(r.rid, r.url) for r in runners])
        service = SchedulerService(
            tokenizer, model_name, registry, directory, limits=limits.from_args(args, max_model_len), api_keys=api_keys,
            admin_token=env.admin_token(), grace_seconds=args.grace_seconds, placement=args.placement,
            runner_token=token,
        )
        app = create_app(service)
        watch_adapters(app, registry, adapters_dir, args.adapter_rescan, service.model_name)
        url = f"http://{args.host}:{sock.getsockname()[1]}"  # (the port bound: --port 0 takes a free one)

        async def announce(app):
            broken = frozenset(n for n in registry.names() if registry.get(n).problem)
            print(banner(url, service.model_name, registry.names(), api_keys is not None, python_command(), broken),
                  flush=True)

        app.on_startup.append(announce)
        web.run_app(app, sock=sock, print=None, handle_signals=True, shutdown_timeout=SHUTDOWN_BACKSTOP_S)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if supervisor is not None:
            supervisor.stop()
        log.info("stopping %d runner(s)", len(runners))
        stop_children(runners, args.grace_seconds + 10)
        sock.close()
    log.info("stopped")
    return 0
