"""`lorafleet generate`: offline batch inference of a JSONL file, mixed adapters in one batch.

Every input line is one request:
  {"id", "adapter": name or null, "prompt": text | "prompt_token_ids": [...] | "messages": [chat],
   "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_p",
   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
   "logprobs": N, "prompt_logprobs": N}
Every output line (same order): {"id", "adapter", "prompt_token_ids", "token_ids", "text",
"finish_reason"} plus "error" when a request failed, and with "logprobs" / "prompt_logprobs" (0 to 20
alternatives) one {"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}]} per generated / prompt
token (the prompt's first: null), under the model's own distribution (the logits' log-softmax): per-adapter
perplexity of a dataset is one run of prompts with "prompt_logprobs": 0 and "max_tokens": 0 (the prompt
scored, nothing generated; max_tokens 0 only with prompt_logprobs). A bad line or a bad adapter fails
that request only; all the others run as one continuous batch. The sampling fields take
`serve`'s ranges (max_tokens between 1 and the model's context length, temperature in
[0, 2], ...: scheduler/openai_api.py checks both); defaults: max_tokens 64, greedy. Ids are
unique strings: a line repeating an earlier line's id fails as a duplicate; a failed line's error names its line.
`--input -` reads the requests from stdin, `--output -` writes the results to stdout; a results file is written whole
and renamed into place (through a link, to the file it points to), a pipe or a device (`/dev/stdout`) is written
to as it is. Exit status: 0 when every request finished, 1 when any failed (its line carries the error), 2 for bad
arguments (nothing runs), 130 when interrupted (the finished results are written).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

from lorafleet.common import outputs
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.sequence import AdapterRef, SamplingError, SamplingParams, Sequence, parse_token_ids
from lorafleet.scheduler import openai_api as oa

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_p",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs")
FIELDS = {"id", "adapter", "prompt", "prompt_token_ids", "messages", "prompt_logprobs", *SAMPLING_FIELDS}
DEFAULT_MAX_TOKENS = 64
STDIO = Path("-")  # --input / --output: stdin / stdout


class RequestError(ValueError):
    pass


def tokenizer_dir(model: Path) -> Path | None:
    """Where the model's tokenizer.json lives (converted once for a .gguf file, cached under the file's name, size and
    modification time: two files of one name, or a file replaced in place, never share a conversion). A .gguf file
    that cannot be read is a WeightsError saying so."""
    if model.is_dir():
        return model if (model / "tokenizer.json").is_file() else None
    from lorafleet import env
    from lorafleet.runner.demo import write_tokenizer
    from lorafleet.runner.model.weights import WeightsError

    st = model.stat()
    out = env.cache_dir() / "tokenizers" / f"{model.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))  # whole or not at all: renamed when done
    try:
        try:
            write_tokenizer(model, tmp)
        except (ValueError, EOFError, struct.error) as exc:  # gguf's reader: magic, truncation, shapes
            raise WeightsError(f"cannot read GGUF file {model} (truncated or not a GGUF file?): "
                               f"{type(exc).__name__}: {exc}") from None
        if out.exists() and not (out / "tokenizer.json").is_file():  # what an interrupted conversion may have left
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted it meanwhile: theirs is as good
            if not (out / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_path_problem(model: Path) -> str | None:
    """Why `model` cannot be a model (missing, a file that is not a .gguf, or a directory whose config.json
    names an architecture or setting the engine does not support), or None."""
    if not model.exists():
        return f"{model} does not exist (give a Hugging Face model directory or a .gguf file)"
    if not model.is_dir() and not model.is_file():  # a named pipe would block the tokenizer's read, a device too
        return (f"{model} is neither a directory nor a regular file (give a Hugging Face model directory or a "
                ".gguf file)")
    if model.is_file() and model.suffix != ".gguf":
        return f"{model} is a file but not a .gguf file (give a Hugging Face model directory or a .gguf file)"
    cfg = model / "config.json"
    if model.is_dir() and not cfg.is_file():
        return f"{model} has no config.json (give a Hugging Face model directory or a .gguf file)"
    if model.is_dir() and cfg.is_file():
        from lorafleet.models.contract import ModelConfigError
        from lorafleet.models.registry import config_from_hf

        try:
            hf = json.loads(cfg.read_text())
            if not isinstance(hf, dict):
                return f"{cfg} is not a JSON object"
            config_from_hf(hf, model.name)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return f"{cfg} is not valid JSON ({exc})"
        except ModelConfigError as exc:
            return f"{model}: {exc}"
        except Exception as exc:  # a field missing, of the wrong kind or out of range (heads = 0, ...)
            return f"{cfg}: cannot read the model's settings ({type(exc).__name__}: {exc})"
    return None


def output_problem(output: Path) -> str | None:
    """Why results cannot be written to `output` (outputs.problem; stdout always can), or None: asked before any
    request runs, so that a long run does not end unable to write them."""
    return None if output == STDIO else outputs.problem(output)


def input_problem(path: Path) -> str | None:
    """Why the requests cannot be read from `path` (missing, a directory), or None: a file, a pipe, a device or
    stdin (`-`)."""
    if path == STDIO:
        return None
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a directory"
    if not os.access(path, os.R_OK):
        return "is not readable"
    return None


def input_lines(path: Path) -> list[tuple[int, str | None]]:
    """(line number, text) of every non-blank line of a JSONL file (or of stdin: `-`), split at newlines only (JSON
    strings may hold U+2028 and other characters str.splitlines breaks at); text None for a line that is not UTF-8."""
    out = []
    data = sys.stdin.buffer.read() if path == STDIO else path.read_bytes()
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError:
            out.append((lineno, None))
            continue
        if line.strip():
            out.append((lineno, line))
    return out


def adapter_ref(name, rid: str, adapters_dir: Path | None) -> AdapterRef | None:
    """The adapter a line asks for: a folder directly inside `adapters_dir` (a name holding a path, such as
    `../x` or `/x`, would read an adapter from elsewhere), or None for the base model."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise RequestError(f"request {rid}: adapter must be a name or null")
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise RequestError(f"request {rid}: adapter {name!r} is not a name (the adapter folders are named by their "
                           "folder name inside --adapters)")
    if adapters_dir is None:
        raise RequestError(f"request {rid}: adapter {name!r} asked for but no --adapters directory given")
    return AdapterRef(name, str(adapters_dir / name))


def sampling_params(obj: dict, rid: str, max_model_len: int) -> SamplingParams:
    """A request's sampling fields, checked by `serve`'s own rules (openai_api.parse_common, the one definition of
    the ranges: max_tokens between 1 and the context length, temperature in [0, 2], top_p in (0, 1], ...), so a
    line that `serve` would answer 400 fails here with the same message; generate's defaults where a field is
    absent (max_tokens 64, at most the context; temperature 0: greedy). RequestError on a bad value."""
    given = {k: obj[k] for k in SAMPLING_FIELDS if obj.get(k) is not None}
    plp = obj.get("prompt_logprobs")
    if plp is not None and (not isinstance(plp, int) or isinstance(plp, bool) or not 0 <= plp <= oa.MAX_LOGPROBS):
        raise RequestError(f"request {rid}: prompt_logprobs must be an integer from 0 to {oa.MAX_LOGPROBS}")
    defaults = {"max_tokens": min(DEFAULT_MAX_TOKENS, max_model_len), "temperature": 0.0}  # generate's own
    if plp is not None and _zero(given.get("max_tokens")):  # the prompt scored alone (serve's echo + max_tokens 0):
        given["max_tokens"] = 1  # one token is computed with it and dropped (score_only)
    try:
        p = oa.parse_common({"model": "generate", **defaults, **given}, chat=False, max_tokens_cap=max_model_len)
        return SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature,
            top_p=p.top_p, top_k=p.top_k, seed=p.seed, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
            **p.extras(), prompt_logprobs=plp,
        )
    except oa.ApiError as exc:
        raise RequestError(f"request {rid}: {exc.message}") from None
    except SamplingError as exc:
        raise RequestError(f"request {rid}: {exc}") from None


def line_id(line: str, lineno: int) -> str:
    """The id a line gives (`line-N` when it gives none, gives one that is not a non-empty string, or is not a JSON
    object)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return f"line-{lineno}"
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and rid else f"line-{lineno}"


def failed(rid: str, error: str, adapter=None, prompt_ids=None) -> dict:
    """The output line of a request that did not run (with its adapter and prompt ids where the line gave them)."""
    return {"id": rid, "adapter": adapter, "prompt_token_ids": prompt_ids or [], "token_ids": [], "text": "",
            "finish_reason": "error", "error": error}


def line_fields(line: str | None) -> tuple[str | None, list[int]]:
    """A failed line's adapter name and prompt ids as it gave them, where they are well-formed (else None, [])."""
    try:
        obj = json.loads(line) if line is not None else None
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        return None, []
    adapter = obj.get("adapter") if isinstance(obj.get("adapter"), str) else None
    ids = obj.get("prompt_token_ids")
    ok = isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)
    return adapter, ids if ok else []


def parse_request(line: str, lineno: int, tokenizer, adapters_dir: Path | None, max_model_len: int) -> tuple[str, dict]:
    """-> (id, request dict with prompt_token_ids, params, adapter ref); RequestError on bad input.
    `max_model_len`: the model's context length, max_tokens' upper bound (as in `serve`)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RequestError(f"line {lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise RequestError(f"line {lineno}: a request must be a JSON object")
    if "id" in obj and not (isinstance(obj["id"], str) and obj["id"]):
        raise RequestError(f"line {lineno}: id must be a non-empty string, got {json.dumps(obj['id'])}")
    rid = obj.get("id", f"line-{lineno}")
    unknown = set(obj) - FIELDS
    if unknown:
        raise RequestError(f"request {rid}: unknown field(s) {sorted(unknown)}")
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if k in obj]
    if len(given) > 1:
        raise RequestError(f"request {rid}: give one of 'prompt', 'messages' and 'prompt_token_ids', not {given}")
    if "prompt_token_ids" in obj:
        try:
            ids = parse_token_ids(obj["prompt_token_ids"])
        except SamplingError as exc:
            raise RequestError(f"request {rid}: {exc}") from None
    elif "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise RequestError(f"request {rid}: messages must be a non-empty list of {{role, content}} strings")
        if tokenizer is None:
            raise RequestError(f"request {rid}: the model has no tokenizer; give prompt_token_ids")
        try:
            ids = tokenizer.encode_chat(msgs)
        except ValueError as exc:
            raise RequestError(f"request {rid}: {exc}") from None
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        if tokenizer is None:
            raise RequestError(f"request {rid}: the model has no tokenizer; give prompt_token_ids")
        ids = tokenizer.encode(obj["prompt"])
    else:
        raise RequestError(f"request {rid}: give a non-empty 'prompt', 'messages' or 'prompt_token_ids'")
    params = sampling_params(obj, rid, max_model_len)
    ref = adapter_ref(obj.get("adapter"), rid, adapters_dir)
    score_only = obj.get("prompt_logprobs") is not None and _zero(obj.get("max_tokens"))
    return rid, {"ids": ids, "params": params, "adapter": ref, "score_only": score_only}


def _zero(v) -> bool:
    """`max_tokens` given as the integer 0 (not false, not 0.0)."""
    return type(v) is int and v == 0


def logprob_entry(token: int, entry: list) -> dict:
    """One token's log-probability (the model's own: the logits' log-softmax) and its most likely alternatives."""
    lp, top = entry
    return {"token_id": token, "logprob": lp, "top_logprobs": [{"token_id": i, "logprob": v} for i, v in top]}


def write_results(output: Path, lines: list[dict]) -> None:
    """The results, one JSON line per input line: a file is written whole to a temporary file and then renamed into
    place (an interrupt while writing leaves the previous file or the new one, never half of it; through a link,
    the file it points to); stdout (`-`), a pipe or a device is written to directly."""
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    if output == STDIO:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = outputs.target(output)
    if target.exists() and not target.is_file():
        with target.open("w") as f:
            f.write(text)
        return
    tmp = outputs.partial(target)
    with tmp.open("w") as f:
        f.write(text)
    tmp.replace(target)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from lorafleet.common import cli_args

    p.add_argument("--model", type=Path, default=None,
                   help="HF model directory or .gguf file (default: the demo model, prepared on first use)")
    p.add_argument("--adapters", type=Path, default=None,
                   help="directory with one PEFT adapter per subfolder, named by each request's \"adapter\" "
                        "(default: the demo adapters pirate, shouty and terse with the demo model; none with --model)")
    p.add_argument("--input", type=Path, required=True, help="requests, one JSON object per line (- : stdin)")
    p.add_argument("--output", type=Path, required=True,
                   help="where to write results (JSONL, input order; - : stdout)")
    p.add_argument("--max-batch-size", type=cli_args.positive_int, default=32, help="requests batched together")
    p.add_argument("--kv-pages", type=cli_args.positive_int, default=None, help="KV cache pages (default: from memory)")
    p.add_argument("--page-size", type=cli_args.positive_int, default=16, help="tokens per KV page")
    p.add_argument("--max-lora-rank", type=cli_args.lora_rank, default=64,
                   help=f"largest adapter rank accepted (1-{cli_args.MAX_LORA_RANK})")
    p.add_argument("--lora-slots", type=cli_args.positive_int, default=None,
                   help="adapters resident at once (default: 8 on the CPU, 64 on a GPU)")
    p.add_argument("--dtype", default="auto", choices=cli_args.DTYPES,
                   help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", type=cli_args.device, help="auto (CUDA when available), cpu or cuda[:N]")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the KV pages of shared prompt "
                   "prefixes between requests (reused by default)")
    from lorafleet.runner.service.server import add_precision_arguments

    cli_args.add_batch_invariant_argument(p)
    add_precision_arguments(p)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lorafleet.runner.engine.engine import Engine
    from lorafleet.scheduler.tokenizer import Tokenizer

    model = args.model
    adapters_dir = args.adapters
    if model is None:
        from lorafleet.runner.demo import prepare

        demo = prepare()
        model, adapters_dir = demo / "model", adapters_dir or demo / "adapters"
    problem = input_problem(args.input)
    if problem:
        print(f"error: input file {args.input} {problem}", file=sys.stderr)
        return 2
    problem = output_problem(args.output)
    if (problem is None and STDIO not in (args.input, args.output) and args.output.exists()
            and os.path.samefile(args.output, args.input)):
        problem = f"is the input file {args.input}: the results would replace the requests (give another file)"
    if problem:
        print(f"error: --output {problem}", file=sys.stderr)
        return 2
    problem = model_path_problem(Path(model))
    if problem:
        print(f"error: --model {problem}", file=sys.stderr)
        return 2
    if adapters_dir is not None and not adapters_dir.is_dir():
        what = "is not a directory" if adapters_dir.exists() else "does not exist"
        print(f"error: adapters directory {adapters_dir} {what}", file=sys.stderr)
        return 2
    lines = input_lines(args.input)
    if not lines:
        print(f"warning: {args.input} holds no requests; nothing to run", file=sys.stderr)
        write_results(args.output, [])
        return 0
    tok_dir = tokenizer_dir(model)
    tokenizer = Tokenizer(tok_dir) if tok_dir else None

    cfg = EngineConfig(
        max_batch_size=args.max_batch_size, page_size=args.page_size, num_pages=args.kv_pages,
        max_lora_rank=args.max_lora_rank, lora_slots=args.lora_slots, dtype=args.dtype, device=args.device,
        requeue_evicted=True, prefix_cache=not args.no_prefix_cache, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, batch_invariant=args.batch_invariant,
    )
    engine = Engine(str(model), cfg)  # first: its context length bounds every line's max_tokens

    # One result per input line, keyed by line number (ids may repeat: every repeat fails as a duplicate).
    order: list[int] = []
    results: dict[int, dict] = {}
    seqs: list[Sequence] = []
    score_only: set[str] = set()  # lines with prompt_logprobs and max_tokens 0: no output tokens
    line_of: dict[str, int] = {}  # id of a request that runs -> its line
    seen: set[str] = set()
    for lineno, line in lines:
        error = None
        try:
            if line is None:
                raise RequestError(f"line {lineno}: not valid UTF-8")
            rid, req = parse_request(line, lineno, tokenizer, adapters_dir, engine.max_model_len)
        except RequestError as exc:
            rid = line_id(line, lineno) if line is not None else f"line-{lineno}"
            error = str(exc) if str(exc).startswith("line ") else f"line {lineno}: {exc}"
        if rid in seen:
            error = f"line {lineno}: request {rid}: duplicate id {rid!r} (it repeats an earlier line's id)" + (
                f"; also {error}" if error else "")
        seen.add(rid)
        order.append(lineno)
        if error is not None:
            results[lineno] = failed(rid, error, *line_fields(line))
            continue
        line_of[rid] = lineno
        seqs.append(Sequence(rid, req["ids"], req["params"], req["adapter"], arrival=float(lineno)))
        if req["score_only"]:
            score_only.add(rid)

    by_id = {s.id: s for s in seqs}
    t0 = time.perf_counter()
    n_tokens = 0
    finals: dict = {}

    def done(out):
        nonlocal n_tokens
        finals[out.seq_id] = out
        n_tokens += len(out.output_ids or [])
        bar.update(1)
        bar.set_postfix(tok_s=f"{n_tokens / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)

    interrupted = False

    def terminated(signum, frame):  # SIGTERM (a job's stop, kill): as Ctrl-C, so the finished results are written
        raise KeyboardInterrupt

    installed, previous = False, None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN:
        previous, installed = signal.signal(signal.SIGTERM, terminated), True
    log.info("running %d requests; SIGTERM or Ctrl-C writes the results so far", len(seqs))
    # (after that line; redrawn at most once a second where stderr is not a terminal: a log, not a screen)
    bar = tqdm(total=len(seqs), unit="req", disable=args.no_progress, file=sys.stderr,
               mininterval=0.1 if sys.stderr.isatty() else 1.0)
    try:
        finals.update(engine.run_to_completion(seqs, progress=done))
    except KeyboardInterrupt:  # keep what finished: the file gets every line, the unfinished ones as errors
        interrupted = True
    finally:
        if installed:  # (a handler installed outside Python reads back as None: the default then)
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    bar.close()
    elapsed = time.perf_counter() - t0
    for rid in set(line_of) - set(finals):
        s = by_id[rid]
        results[line_of[rid]] = failed(rid, f"line {line_of[rid]}: request {rid}: interrupted before it finished",
                                       s.adapter_name, s.prompt_ids)
    for rid, out in finals.items():
        s = by_id[rid]
        ids = out.output_ids or []
        if rid in score_only and out.finish_reason in ("stop", "length"):  # max_tokens 0: the prompt scored alone
            ids, out.logprobs, out.finish_reason = [], None, "length"
        results[line_of[rid]] = {
            "id": rid,
            "adapter": s.adapter_name,
            "prompt_token_ids": s.prompt_ids,
            "token_ids": ids,
            "text": tokenizer.decode(ids) if tokenizer else "",
            "finish_reason": out.finish_reason,
        }
        if out.logprobs is not None:
            results[line_of[rid]]["logprobs"] = [logprob_entry(t, e) for t, e in zip(ids, out.logprobs)]
        if out.prompt_logprobs is not None:
            results[line_of[rid]]["prompt_logprobs"] = [None] + [
                logprob_entry(t, e) for t, e in zip(s.prompt_ids[1:], out.prompt_logprobs)]
        if out.error:
            results[line_of[rid]]["error"] = f"line {line_of[rid]}: request {rid}: {out.error}"
    write_results(args.output, [results[key] for key in order])
    if interrupted:
        done_n = sum(1 for rid in line_of if rid in finals)
        print(f"interrupted: {done_n} of {len(line_of)} requests finished; results so far -> {args.output}",
              file=sys.stderr)
        return 130
    errors = sum(1 for key in order if results[key]["finish_reason"] == "error")
    print(f"{len(order)} requests ({errors} failed), {n_tokens} tokens in {elapsed:.1f}s "
          f"= {n_tokens / max(elapsed, 1e-9):.1f} tok/s -> {args.output}", file=sys.stderr)
    for key in order:
        if results[key]["finish_reason"] == "error":
            print(f"  {results[key]['id']}: {results[key]['error']}", file=sys.stderr)
    return 1 if errors else 0
