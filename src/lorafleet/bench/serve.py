"""`lorafleet bench serve`: OpenAI-API load against `lorafleet serve`, beside the offline engine.

Requests have ShareGPT-like lengths (`common/workloads.sharegpt_requests`, capped by
--max-prompt/--max-output), token-id prompts and `ignore_eos`, so every length is exact. Each
adapter mix (Punica's distinct, uniform, skewed, identical over --population adapter names,
plus `base`) is sent at each --rates value (`inf`: all at t=0; a number: Poisson arrivals per
second), streaming. It reports output tok/s, TTFT, TPOT, inter-token latency p50/p99, goodput
under --slo-ttft/--slo-tpot, and "GPUs busy": the time-weighted number of runners with a
non-empty batch, from the scheduler's admin state.

It starts `lorafleet serve` itself (once per --placement policy, with the same flags) or targets
--url. Adapter names map onto --weight-sets distinct weight sets by relative symlinks inside its
own adapters directory (copies of --adapters, or synthetic rank --rank adapters on all seven
projections). --synthetic-model 7b makes a Llama-2-7B-shape model directory whose weights the
runner draws on its device. With --offline (default when it starts the server) the same
requests then run through `Engine` in this process (torch is imported only then), and the
ratio online/offline is printed per mix. JSON to --out (key `serve`: online_output_tok_s and
online_over_offline per mix), a table, and with --plot a latency-versus-rate PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import signal
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from lorafleet.bench import procs
from lorafleet.bench.load import LoadRequest, run_load, summary
from lorafleet.common import cli_args
from lorafleet.common.workloads import assign, sharegpt_requests

MIXES = ("distinct", "uniform", "skewed", "identical", "base")
PREFIX_WORKLOADS = ("system-prompt", "sharegpt")


def parse_rate(s: str) -> float | None:
    return None if s in ("inf", "0", "all") else float(s)


def rate_arg(value: str) -> str:
    """--rates: inf (or all, or 0: every request at t=0) or a positive, finite number of requests per second."""
    s = value.strip().lower()
    if s in ("inf", "0", "all"):
        return s
    try:
        rate = float(s)
    except ValueError:
        rate = float("nan")
    if not (0 < rate < float("inf")):
        raise argparse.ArgumentTypeError(f"{value!r} is not a rate: a positive number of requests per second, or inf")
    return s


def rate_label(r: float | None) -> str:
    return "inf" if r is None else f"{r:g}"


# -- workload -------------------------------------------------------------------------------------
def make_requests(n: int, seed: int, vocab: int, max_prompt: int, max_output: int, max_len: int):
    out = []
    for ids, o in sharegpt_requests(n, seed, vocab):
        ids = ids[:max_prompt]
        o = max(1, min(o, max_output, max_len - len(ids) - 1))
        out.append((ids, o))
    return out


def prepare_adapters(args, root: Path, hf_config: dict) -> list[str]:
    """Weight sets in `root` (copied or synthetic); their folder names."""
    root.mkdir(parents=True, exist_ok=True)
    names = []
    if args.adapters:
        for d in sorted(p for p in Path(args.adapters).iterdir() if (p / "adapter_config.json").is_file()):
            if not (root / d.name).exists():
                shutil.copytree(d.resolve(), root / d.name)
            names.append(d.name)
        names = names[: args.weight_sets] if args.weight_sets else names
    else:
        from lorafleet.runner.model.synthetic import write_synthetic_adapter

        for k in range(args.weight_sets or 32):
            if not (root / f"w{k}" / "adapter_model.safetensors").is_file():
                write_synthetic_adapter(root / f"w{k}", hf_config, args.rank, args.seed + 1 + k)
            names.append(f"w{k}")
    if not names:
        raise SystemExit("no adapters: give --adapters DIR or leave it out for synthetic ones")
    return names


def mix_adapters(mix: str, n: int, population: int, weights: list[str], root: Path, seed: int) -> list[str | None]:
    """Adapter name of each request; names are relative symlinks to a weight set inside `root`."""
    if mix == "base":
        return [None] * n
    idx = list(range(n)) if mix == "distinct" else assign(mix, n, population, seed=seed)
    names = []
    for i in idx:
        name = f"{mix}-{i}"
        link = root / name
        if not link.exists():
            os.symlink(weights[i % len(weights)], link)  # relative: stays inside the adapters root
        names.append(name)
    return names


# -- the server ---------------------------------------------------------------------------------------
class Server:
    """`lorafleet serve` as a child process, with an admin token so its busy time can be read."""

    def __init__(self, args, model: Path, adapters: Path, placement: str, work: Path, extra: tuple[str, ...] = (),
                 tag: str = ""):
        self.token = secrets.token_urlsafe(16)
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = ["lorafleet", "--log-level", "WARNING", "serve", "--model", str(model), "--adapters", str(adapters),
               "--port", str(self.port), "--runners", str(args.runners), "--device", args.device,
               "--max-batch-size", str(args.max_batch_size), "--placement", placement,
               "--max-lora-rank", str(max(args.rank, 16))]
        for flag in ("kv_fraction", "kv_cache_gb", "kv_pages", "page_size", "lora_slots", "dtype"):
            v = getattr(args, flag)
            if v is not None:
                cmd += ["--" + flag.replace("_", "-"), str(v)]
        cmd += list(args.serve_arg) + list(extra)
        self.log = work / f"serve-{placement}{tag}.log"
        self.proc = procs.start(cmd, log=self.log, env={"LORAFLEET_ADMIN_TOKEN": self.token})

    def wait(self, timeout: float) -> None:
        try:
            procs.wait_ready(self.url, self.proc, timeout, "lorafleet serve")
        except RuntimeError as exc:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.is_file() else ""
            raise RuntimeError(f"{exc}; the end of {self.log}:\n{tail}") from None

    def stop(self) -> None:
        procs.stop(self.proc, 120)


def admin_state(url: str, token: str | None) -> dict | None:
    if not token:
        return None
    req = urllib.request.Request(f"{url}/admin/state", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except OSError:
        return None


def base_model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return next(m["id"] for m in json.loads(r.read())["data"] if not m.get("parent"))


def online_run(url: str, token: str | None, base: str, reqs, names, rate, args, salt: str | None = None) -> dict:
    load = [LoadRequest(name or base, ids, o, salt) for (ids, o), name in zip(reqs, names)]
    before = admin_state(url, token)
    results, wall = asyncio.run(run_load(url, load, rate=rate, seed=args.seed))
    after = admin_state(url, token)
    s = summary(results, wall, args.slo_ttft, args.slo_tpot)
    if before and after:
        b0 = {r["id"]: r.get("busy_seconds", 0.0) for r in before["runners"]}
        busy = {r["id"]: r.get("busy_seconds", 0.0) - b0.get(r["id"], 0.0) for r in after["runners"]}
        s["gpus_busy"] = round(sum(busy.values()) / wall, 3)
        s["busy_seconds"] = {k: round(v, 2) for k, v in busy.items()}
        s["adapter_loads"] = adapter_load_delta(before, after)
    return s


def adapter_load_delta(before: dict, after: dict) -> dict:
    """Adapter reads from disk during the run, over all runners: count and mean seconds per read
    (from the runners' adapter pool counters)."""
    def totals(state):
        pools = [r.get("adapter_pool") or {} for r in state.get("runners", [])]
        return (sum(p.get("disk_reads", 0) for p in pools), sum(p.get("load_seconds", 0.0) for p in pools),
                sum(p.get("worker_seconds", 0.0) for p in pools))

    (n0, t0, w0), (n1, t1, w1) = totals(before), totals(after)
    n = n1 - n0
    return {"disk_reads": n, "mean_read_s": round((t1 - t0) / n, 4) if n else None,
            "mean_worker_s": round((w1 - w0) / n, 4) if n else None}


def prefix_runs(args, model: Path, adapters_root: Path, weights: list[str], reqs, vocab: int, work: Path,
                log, save=lambda out: None) -> dict:
    """--prefix-workloads: per placement, the runners' prefix cache off then on (a server each), every workload
    through the OpenAI API. TTFT p50/p99, output tok/s and, from each response's usage, prompt tokens, those
    the runners' caches held (cached_tokens), those computed and the hit rate; the on / off ratios. Each
    workload runs at each of --rates (keys `WL@RATE` for a finite rate); `save` gets the results after every run."""
    from lorafleet.bench.prefix import on_over_off, system_prompt_requests

    rates = [parse_rate(r) for r in args.rates]  # each workload at each rate (inf: all at t=0)
    loads = {}
    for wl in args.prefix_workloads:
        if wl == "system-prompt":
            sys_reqs = system_prompt_requests(reqs, args.prefix_adapters, args.system_tokens, vocab)
            names = []
            for _ids, _o, k in sys_reqs:
                link = adapters_root / f"sys-{k}"
                if not link.exists():
                    os.symlink(weights[k % len(weights)], link)
                names.append(link.name)
            loads[wl] = ([(ids, o) for ids, o, _k in sys_reqs], names)
        else:
            loads[wl] = (reqs, mix_adapters("distinct", len(reqs), len(reqs), weights, adapters_root, args.seed))
    out: dict = {}
    for placement in args.placement:
        per = out.setdefault(placement, {})
        for cache in ("off", "on"):
            server = Server(args, model, adapters_root, placement, work,
                            extra=() if cache == "on" else ("--no-prefix-cache",), tag=f"-cache-{cache}")
            try:
                server.wait(args.ready_timeout)
                base = base_model_name(server.url)
                for (wl, (wl_reqs, names)), rate in ((item, rate) for item in loads.items() for rate in rates):
                    # (with several rates, each run's pages are salted apart: no run finds an earlier one's)
                    salt = f"rate-{rate_label(rate)}" if len(rates) > 1 else None
                    r = online_run(server.url, server.token, base, wl_reqs, names, rate, args, salt)
                    key = wl if rate is None else f"{wl}@{rate_label(rate)}"
                    r.update(placement=placement, workload=wl, cache=cache, rate=rate_label(rate))
                    per.setdefault(key, {})[cache] = r
                    log(f"{placement:>17} {key:>13} cache {cache:>3}: {r['output_tok_s']} tok/s, TTFT p50 "
                        f"{r['ttft_p50_s']}s p99 {r['ttft_p99_s']}s, prompt tokens computed "
                        f"{r['prompt_tokens_computed']} of {r['prompt_tokens']} (hit rate {r['hit_rate']:.0%}), "
                        f"{r['failed']} failed")
                    save(out)
            finally:
                server.stop()
        for wl, runs in per.items():
            on, off = runs["on"], runs["off"]
            runs["on_over_off"] = on_over_off(on, off)
    return out


def print_prefix_table(prefix: dict) -> None:
    print("| placement | workload | cache | done | output tok/s | TTFT p50/p99 (s) | prompt tokens computed | "
          "hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for placement, per in prefix.items():
        for wl, runs in per.items():
            for cache in ("off", "on"):
                r = runs[cache]
                print(f"| {placement} | {wl} | {cache} | {r['completed']}/{r['requests']} | {r['output_tok_s']} | "
                      f"{r['ttft_p50_s']}/{r['ttft_p99_s']} | {r['prompt_tokens_computed']} of {r['prompt_tokens']} | "
                      f"{r['hit_rate']:.1%} |")


# -- reporting -------------------------------------------------------------------------------------------
def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    keys = [("ttft_p99_s", "TTFT p99 (s)"), ("tpot_p50_ms", "TPOT p50 (ms)"),
            ("output_tok_s", "output tok/s"), ("gpus_busy", "GPUs busy (time-weighted)")]
    groups: dict[tuple, list] = {}
    for r in runs:
        if r["rate"] != "inf":
            groups.setdefault((r["placement"], r["mix"]), []).append(r)
    for ax, (key, label) in zip(axes.flat, keys):
        for (placement, mix), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: float(r["rate"]))
            ys = [r.get(key) for r in rs]
            if any(y is not None for y in ys):
                ax.plot([float(r["rate"]) for r in rs], ys, marker="o", label=f"{placement}, {mix}")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("lorafleet serve: latency and GPUs busy versus request rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def headline(runs: list[dict], offline: dict) -> dict:
    """The `serve` key of docs/benchmarks.json: all-at-once online figures per mix and their ratio."""
    out: dict = {"online_output_tok_s": {}, "online_over_offline": {}, "online_tpot_p50_ms": {}}
    for r in runs:
        if r["rate"] == "inf" and r["mix"] not in out["online_output_tok_s"]:
            out["online_output_tok_s"][r["mix"]] = r["output_tok_s"]
            out["online_tpot_p50_ms"][r["mix"]] = r["tpot_p50_ms"]
            off = offline.get(r["mix"])
            if off and off.get("output_tok_s") and r.get("output_tok_s"):
                out["online_over_offline"][r["mix"]] = round(r["output_tok_s"] / off["output_tok_s"], 3)
    if offline:
        out["offline_output_tok_s"] = {m: o["output_tok_s"] for m, o in offline.items()}
        out["offline_tpot_p50_ms"] = {m: o["tpot_p50_ms"] for m, o in offline.items()}
    return out


def print_table(runs: list[dict], offline: dict) -> None:
    print("| placement | mix | rate | done | output tok/s | TTFT p50/p99 (s) | TPOT p50/p99 (ms) | ITL p50/p99 (ms) "
          "| goodput tok/s | GPUs busy | online/offline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        off = offline.get(r["mix"]) if r["rate"] == "inf" else None
        ratio = f"{r['output_tok_s'] / off['output_tok_s']:.3f}" if off and r["output_tok_s"] else ""
        print(f"| {r['placement']} | {r['mix']} | {r['rate']} | {r['completed']}/{r['requests']} | {r['output_tok_s']} | "
              f"{r['ttft_p50_s']}/{r['ttft_p99_s']} | {r['tpot_p50_ms']}/{r['tpot_p99_ms']} | "
              f"{r['itl_p50_ms']}/{r['itl_p99_ms']} | {r.get('goodput_tok_s', '')} | {r.get('gpus_busy', '')} | {ratio} |")
    for mix, o in offline.items():
        print(f"| offline engine | {mix} | inf | {o['requests']}/{o['requests']} | {o['output_tok_s']} | "
              f"{o['ttft_p50_s']}/{o['ttft_p99_s']} | {o['tpot_p50_ms']}/{o['tpot_p99_ms']} | | | | |")


# -- main -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=cli_args.positive_int, default=1000,
                   help="requests of every run (each mix at each rate; default: 1000)")
    w.add_argument("--mixes", nargs="+", default=["distinct", "uniform", "skewed", "identical", "base"], choices=MIXES,
                   help="adapter mixes: distinct (an adapter per request), Punica's uniform, skewed and identical "
                        "over --population names, base (no adapter)")
    w.add_argument("--rates", nargs="+", type=rate_arg, default=["inf"],
                   help="request rates per second; inf: all at t=0 (default: inf)")
    w.add_argument("--population", type=cli_args.positive_int, default=256,
                   help="adapter names the mixes draw from (default: 256)")
    w.add_argument("--weight-sets", type=cli_args.positive_int, default=None,
                   help="distinct adapter weight sets (default: 32 synthetic, "
                   "or every adapter in --adapters)")
    w.add_argument("--rank", type=cli_args.lora_rank, default=16,
                   help="rank of synthetic adapters (all seven projections; default: 16)")
    w.add_argument("--max-prompt", type=cli_args.positive_int, default=1536,
                   help="cap on prompt tokens (default: 1536)")
    w.add_argument("--max-output", type=cli_args.positive_int, default=1024,
                   help="cap on output tokens (default: 1024)")
    w.add_argument("--seed", type=int, default=0, help="seed of the requests, adapter mixes, arrivals and "
                   "synthetic weights (default: 0)")
    w.add_argument("--slo-ttft", type=cli_args.positive_float, default=None,
                   help="goodput SLO: TTFT in seconds (default: none)")
    w.add_argument("--slo-tpot", type=cli_args.positive_float, default=None,
                   help="goodput SLO: TPOT in milliseconds (default: none)")
    w.add_argument("--prefix-workloads", nargs="*", default=[], choices=PREFIX_WORKLOADS, metavar="WL",
                   help="instead of the mixes: the prefix cache's workloads (system-prompt: each of "
                        "--prefix-adapters adapters has its own system prompt before every request's user turn; "
                        "sharegpt: one adapter per request, nothing shared), each with the runners' prefix cache "
                        "off and on (one server each), per --placement; default: none")
    w.add_argument("--system-tokens", type=cli_args.positive_int, default=1024,
                   help="system-prompt: tokens per adapter (default: 1024)")
    w.add_argument("--prefix-adapters", type=cli_args.positive_int, default=32,
                   help="system-prompt: adapters (default: 32)")
    s = p.add_argument_group("server")
    s.add_argument("--url", default=None, help="target a running scheduler instead of starting `lorafleet serve` "
                   "(env LORAFLEET_ADMIN_TOKEN, if set, is used to read GPUs busy)")
    s.add_argument("--model", type=cli_args.model_dir("config.json", "tokenizer.json"), default=None,
                   help="model directory, with its tokenizer.json (default: the demo model)")
    s.add_argument("--tokenizer-from", type=cli_args.model_dir("tokenizer.json"), default=None, metavar="DIR",
                   help="with --synthetic-model: copy the tokenizer files from DIR (default: the demo model's)")
    s.add_argument("--synthetic-model", choices=["7b"], default=None,
                   help="use a Llama-2-7B-shape model with random weights made on the runner's device")
    s.add_argument("--adapters", type=Path, default=None, help="adapters to copy as weight sets (default: synthetic)")
    s.add_argument("--placement", nargs="+", default=["busiest"],
                   choices=["busiest", "busiest-no-prefix", "least-loaded", "round-robin"],
                   help="scheduler placement policies, one server each (default: busiest, which prefers the runner "
                        "holding a request's prefix)")
    s.add_argument("--runners", type=cli_args.positive_int, default=1, help="runner processes of `lorafleet serve`")
    s.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda, for `lorafleet serve` "
                   "and the offline engine")
    s.add_argument("--max-batch-size", type=cli_args.positive_int, default=32, help="requests batched together on each runner and in "
                   "the offline engine")
    s.add_argument("--kv-fraction", type=cli_args.fraction, default=None,
                   help="GPU: share of free memory for each runner's KV cache (default: `lorafleet serve`'s)")
    s.add_argument("--kv-cache-gb", type=cli_args.positive_float, default=None,
                   help="CPU: KV cache of each runner in GiB (default: `lorafleet serve`'s)")
    s.add_argument("--kv-pages", type=cli_args.positive_int, default=None,
                   help="KV cache pages of each runner (default: `lorafleet serve`'s)")
    s.add_argument("--page-size", type=cli_args.positive_int, default=None, help="tokens per KV page (default: `lorafleet serve`'s)")
    s.add_argument("--lora-slots", type=cli_args.positive_int, default=None,
                   help="adapters resident on each runner's device at once (default: `lorafleet serve`'s)")
    s.add_argument("--dtype", default=None, help="weights and activations: auto, float32, bfloat16 or float16 "
                   "(default: `lorafleet serve`'s)")
    s.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for `lorafleet serve` (repeat; default: none)")
    s.add_argument("--ready-timeout", type=cli_args.positive_float, default=900.0,
                   help="seconds to wait for a started `lorafleet serve` to be ready (default: 900)")
    o = p.add_argument_group("output")
    o.add_argument("--offline", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the offline engine on the same requests (default: on unless --url)")
    o.add_argument("--work-dir", type=Path, default=None, help="model, adapters and logs (default: a temp dir)")
    o.add_argument("--out", type=cli_args.output_file, default=Path("bench_serve.json"),
                   help="results as JSON (default: bench_serve.json)")
    o.add_argument("--plot", type=cli_args.output_file, default=None, help="latency-versus-rate PNG (default: none)")
    o.add_argument("--merge", type=cli_args.results_file, nargs="+", default=None, metavar="JSON",
                   help="only merge result files of earlier runs (e.g. one per mix group or placement) into --out, "
                        "with their table, `serve` summary and --plot")


def merge(paths: list[Path]) -> dict:
    """The runs of several result files in one; ValueError names a file that is not a result of this bench."""
    parts = [json.loads(Path(f).read_text()) for f in paths]
    for f, part in zip(paths, parts):
        if "date" not in part or not all(isinstance(r, dict) and {"mix", "rate", "output_tok_s", "tpot_p50_ms"}
                                         <= r.keys() for r in part["runs"]):
            raise ValueError(f"{f} is not a result file of bench serve (its runs have no mix, rate and latencies)")
    runs = [r for part in parts for r in part["runs"]]
    offline = {m: o for part in parts for m, o in (part.get("offline") or {}).items()}
    steps = [s for part in parts for s in part.get("offline_steps") or []]
    out = {k: parts[0].get(k) for k in ("model", "max_batch_size", "device")}
    out.update(date=max(part["date"] for part in parts), merged_from=[str(f) for f in paths], runs=runs,
               offline=offline, serve=headline(runs, offline),
               runners=sorted({part.get("runners") for part in parts}),
               requests=sorted({part.get("requests") for part in parts}))
    if steps:
        from lorafleet.scheduler.simulate import fit_step_model

        out["offline_steps"], out["step_model"] = steps, fit_step_model(steps)
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    from lorafleet.cli import DocHelpFormatter

    p = argparse.ArgumentParser(prog="lorafleet bench serve", description=__doc__, formatter_class=DocHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the `lorafleet serve` it started is stopped too
    signal.signal(signal.SIGTERM, _interrupt)
    if args.merge:
        try:
            merged = merge(args.merge)
        except ValueError as exc:
            parser.error(str(exc))
        args.out.write_text(json.dumps(merged, indent=1))
        print_table(merged["runs"], merged["offline"])
        if args.plot:
            plot(merged["runs"], args.plot)
        return 0
    rates = [parse_rate(r) for r in args.rates]
    offline_on = args.offline if args.offline is not None else args.url is None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="lorafleet-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    model = args.model
    if args.synthetic_model or model is None:
        from lorafleet.runner.demo import prepare

        demo = args.tokenizer_from if args.synthetic_model and args.tokenizer_from else prepare() / "model"
        if args.synthetic_model:
            from lorafleet.models import registry
            from lorafleet.runner.model.synthetic import write_synthetic_model

            model = write_synthetic_model(work / "model-7b", registry.shapes()["llama2-7b"], seed=args.seed, tokenizer_from=demo)
        else:
            model = demo
    hf = json.loads((Path(model) / "config.json").read_text())
    max_len = int(hf.get("max_position_embeddings", 4096))
    reqs = make_requests(args.requests, args.seed, int(hf["vocab_size"]), args.max_prompt, args.max_output, max_len)
    adapters_root = work / "adapters"
    adapters_root.mkdir(parents=True, exist_ok=True)  # `lorafleet serve --adapters` needs it, also for `base` alone
    needs_adapters = any(m != "base" for m in args.mixes)
    weights = prepare_adapters(args, adapters_root, hf) if needs_adapters else []
    names = {m: mix_adapters(m, len(reqs), args.population, weights, adapters_root, args.seed) if m != "base"
             else [None] * len(reqs) for m in args.mixes}
    what = (f"prefix workloads {', '.join(args.prefix_workloads)}" if args.prefix_workloads else
            f"mixes {', '.join(args.mixes)}") + f"; rates {', '.join(rate_label(r) for r in rates)}"
    log(f"{len(reqs)} requests: mean prompt {sum(len(a) for a, _ in reqs) / len(reqs):.0f}, mean output "
        f"{sum(o for _, o in reqs) / len(reqs):.0f} tokens; {what}; {len(weights)} weight sets; work dir {work}")

    if args.prefix_workloads:
        if args.url:
            raise SystemExit("--prefix-workloads starts its own servers (cache off and on): leave out --url")
        if not weights:
            weights = prepare_adapters(args, adapters_root, hf)
        def save(prefix: dict, partial: bool) -> None:  # after every run: a run cut short keeps what it measured
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": str(model),
                                            "requests": len(reqs), "max_batch_size": args.max_batch_size,
                                            "runners": args.runners, "device": args.device,
                                            "system_tokens": args.system_tokens, "rates": args.rates,
                                            "prefix_adapters": args.prefix_adapters, "prefix": prefix,
                                            **({"partial": True} if partial else {})}, indent=1))

        prefix = prefix_runs(args, Path(model), adapters_root, weights, reqs, int(hf["vocab_size"]), work, log,
                             lambda p: save(p, True))
        save(prefix, False)
        print_prefix_table(prefix)
        return 1 if any(r["failed"] for per in prefix.values() for runs in per.values()
                        for k, r in runs.items() if k in ("on", "off")) else 0

    runs: list[dict] = []
    result = {"date": time.strftime("%Y-%m-%d"), "model": str(model), "requests": len(reqs),
              "max_batch_size": args.max_batch_size, "runners": args.runners, "device": args.device,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": runs}
    placements = ["(external)"] if args.url else args.placement
    for placement in placements:
        server = None
        if args.url:
            url, token = args.url.rstrip("/"), os.environ.get("LORAFLEET_ADMIN_TOKEN")
        else:
            server = Server(args, Path(model), adapters_root, placement, work)
            url, token = server.url, server.token
        try:
            if server:
                t0 = time.perf_counter()
                server.wait(args.ready_timeout)
                log(f"lorafleet serve ready ({placement}) in {time.perf_counter() - t0:.0f}s")
            base = base_model_name(url)
            for mix in args.mixes:
                for rate in rates:
                    s = online_run(url, token, base, reqs, names[mix], rate, args)
                    s.update(placement=placement, mix=mix, rate=rate_label(rate))
                    runs.append(s)
                    log(f"{placement:>12} {mix:>9} rate {rate_label(rate):>5}: {s['output_tok_s']} tok/s, TTFT p99 "
                        f"{s['ttft_p99_s']}s, TPOT p50 {s['tpot_p50_ms']}ms, GPUs busy {s.get('gpus_busy')}, "
                        f"{s['failed']} failed")
                    args.out.write_text(json.dumps(dict(result, partial=True), indent=1))
        finally:
            if server:
                server.stop()
    offline: dict = {}
    if offline_on:
        from lorafleet.bench import offline as off

        cfg = {"max_batch_size": args.max_batch_size, "max_lora_rank": max(args.rank, 16), "device": args.device}
        for flag, key in (("kv_fraction", "kv_fraction"), ("kv_cache_gb", "kv_cache_gb"), ("kv_pages", "num_pages"),
                          ("page_size", "page_size"), ("lora_slots", "lora_slots"), ("dtype", "dtype")):
            if getattr(args, flag) is not None:
                cfg[key] = getattr(args, flag)
        engine = off.engine_for(str(model), cfg)
        steps = []
        for mix in args.mixes:
            r = off.run(engine, reqs, names[mix], adapters_root, mix)
            steps += r.pop("steps")
            offline[mix] = r
            log(f"{'offline':>12} {mix:>9}: {r['output_tok_s']} tok/s, TTFT p99 {r['ttft_p99_s']}s, "
                f"TPOT p50 {r['tpot_p50_ms']}ms")
        from lorafleet.scheduler.simulate import fit_step_model

        result["step_model"] = fit_step_model(steps)
        result["offline_steps"] = steps
        engine.close()  # its adapter reader processes
        del engine
    result["offline"] = offline
    result["serve"] = headline(runs, offline)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(runs, offline)
    if args.plot:
        plot(runs, args.plot)
        log(f"wrote {args.plot}")
    failed = sum(r["failed"] for r in runs)
    return 1 if failed or any(math.isnan(r["output_tok_s"] or 0.0) for r in runs) else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
