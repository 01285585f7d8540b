"""The prefix cache's workloads for `lorafleet bench e2e --prefix-workloads`, each run with the cache off and
on, one after the other, on the same engine:

- `system-prompt`: every adapter of a population has its own system prompt (1,024 tokens by default) before
  each request's ShareGPT-like user turn; all requests at t = 0, or (`rate`) Poisson arrivals at that many
  requests per second, so TTFT is the prefill's and not the wait for a batch place.
- `multi-turn`: conversations of four turns on one adapter each; a turn is sent, with the whole conversation
  so far (earlier prompts and the answers the engine gave), when the previous turn ends.
- `sharegpt`: the usual mix, one adapter per request, nothing shared: what the cache costs when nothing
  repeats (at t = 0, or at `rate` as above).

Reported per run: output tok/s, TTFT p50/p99 (multi-turn: of turns 2-4 too), prompt tokens computed (the
rows of prompt chunks), prompt tokens looked up and found in the cache.
"""

from __future__ import annotations

import time

import numpy as np

WORKLOADS = ("system-prompt", "multi-turn", "sharegpt")


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _submit(engine, rid: str, ids: list[int], out: int, name: str | None, source: str, arrival: float):
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    ref = AdapterRef(name, source) if name is not None else None
    engine.submit(Sequence(rid, ids, SamplingParams(max_tokens=out, ignore_eos=True), ref, arrival=arrival))


def _summary(label, engine, t0, first, sent, ends, n_out, n_in, prefill, stats0, extra=None) -> dict:
    """`n_in`: each request's prompt tokens (the cache's query counter stays still with the cache off)."""
    wall = time.perf_counter() - t0
    ttft = [first[k] - sent[k] for k in first]
    hits = engine.blocks.stats["hits"] - stats0["hits"]
    prompt, total = sum(n_in.values()), sum(n_out.values())
    res = {"label": label, "requests": len(n_out), "output_tokens": total, "seconds": round(wall, 2),
           "output_tok_s": round(total / wall, 1), "ttft_p50_s": round(pct(ttft, 50), 3),
           "ttft_p99_s": round(pct(ttft, 99), 3), "prompt_tokens": prompt, "prompt_tokens_computed": prefill,
           "prompt_tokens_cached": hits, "hit_rate": round(hits / prompt, 3) if prompt else 0.0}
    res.update(extra or {})
    return res


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Offsets (s) of `n` Poisson arrivals at `rate` per second from 0 (all 0.0 when rate <= 0)."""
    if rate <= 0:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def _steps(engine, label, first, ends, on_end=None, due=None) -> int:
    """Step until the engine is idle and nothing is due; first-token and end times; on_end(seq_id, output_ids)
    per finished request (it may submit more); `due` [(time, submit())] in time order: each submitted once
    perf_counter() reaches its time (the engine waits for the next when it has nothing else). The prompt rows
    computed."""
    prefill = 0
    due = list(due or [])[::-1]
    while engine.has_work() or due:
        while due and due[-1][0] <= time.perf_counter():
            due.pop()[1]()
        if not engine.has_work():
            time.sleep(max(0.0, min(due[-1][0] - time.perf_counter(), 0.05)))
            continue
        outs = engine.step()
        prefill += engine.last_step[0]
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.seq_id not in first:
                first[o.seq_id] = now
            if o.finished:
                if o.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"{label}: request {o.seq_id} ended with {o.finish_reason}: {o.error}")
                ends[o.seq_id] = now
                if on_end is not None:
                    on_end(o.seq_id, o.output_ids)
    return prefill


def system_prompt_requests(reqs, adapters: int, system_tokens: int, vocab: int) -> list[tuple[list[int], int, int]]:
    """`reqs` [(user prompt ids, output tokens)] -> [(prompt ids, output tokens, adapter k)]: request i on
    adapter k = i % adapters, after that adapter's own system prompt of `system_tokens` tokens."""
    systems = [tokens(system_tokens, 1000 + k, vocab) for k in range(adapters)]
    return [(systems[i % adapters] + ids, o, i % adapters) for i, (ids, o) in enumerate(reqs)]


def _timed(engine, t0: float, rate: float, items, sent: dict, n_out: dict, n_in: dict) -> list:
    """[(rid, ids, out, adapter name, source)] -> `due` for _steps: each submitted at its Poisson arrival
    (`rate` per second; all at t0 when 0), its TTFT counted from then."""
    def submit(i, rid, ids, o, name, src):
        now = time.perf_counter()
        _submit(engine, rid, ids, o, name, src, float(i))
        sent[rid] = now

    due = []
    for i, ((rid, ids, o, name, src), at) in enumerate(zip(items, arrivals(len(items), rate))):
        n_out[rid], n_in[rid] = o, len(ids)
        due.append((t0 + at, lambda i=i, rid=rid, ids=ids, o=o, name=name, src=src: submit(i, rid, ids, o, name, src)))
    return due


def run_system_prompt(engine, reqs, adapters: int, system_tokens: int, vocab: int, label: str, source=str,
                      rate: float = 0.0) -> dict:
    """`reqs` [(user prompt ids, output tokens)]; see system_prompt_requests. `rate`: see arrivals."""
    stats0 = dict(engine.blocks.stats)
    t0 = time.perf_counter()
    first, sent, ends, n_out, n_in = {}, {}, {}, {}, {}
    items = [(f"s{i}", ids, o, f"sys{k}", source(k))
             for i, (ids, o, k) in enumerate(system_prompt_requests(reqs, adapters, system_tokens, vocab))]
    prefill = _steps(engine, label, first, ends, due=_timed(engine, t0, rate, items, sent, n_out, n_in))
    return _summary(label, engine, t0, first, sent, ends, n_out, n_in, prefill, stats0,
                    {"adapters": adapters, "system_tokens": system_tokens, "rate": rate or None})


def run_multi_turn(engine, conversations: int, turns: int, adapters: int, vocab: int, label: str, seed: int = 0,
                   source=str, user_tokens: tuple[int, int] = (40, 200), output_tokens: tuple[int, int] = (60, 160)) -> dict:
    """`conversations` chats of `turns` turns, all starting at t = 0; turn t + 1 (its history and a new user
    message) is sent when turn t ends."""
    rng = np.random.default_rng(seed)
    users = {(c, t): tokens(int(rng.integers(*user_tokens)), 10_000 + c * turns + t, vocab)
             for c in range(conversations) for t in range(turns)}
    outs = {(c, t): int(rng.integers(*output_tokens)) for c in range(conversations) for t in range(turns)}
    history: dict[int, list[int]] = {c: [] for c in range(conversations)}
    stats0 = dict(engine.blocks.stats)
    t0 = time.perf_counter()
    first, sent, ends, n_out, n_in = {}, {}, {}, {}, {}

    def send(c: int, t: int) -> None:
        rid = f"c{c}t{t}"
        history[c] = history[c] + users[(c, t)]
        _submit(engine, rid, history[c], outs[(c, t)], f"chat{c % adapters}", source(c % adapters), float(c))
        sent[rid], n_out[rid], n_in[rid] = time.perf_counter(), outs[(c, t)], len(history[c])

    def on_end(rid: str, output_ids) -> None:
        c, t = (int(x) for x in rid[1:].split("t"))
        history[c] = history[c] + list(output_ids or [])
        if t + 1 < turns:
            send(c, t + 1)

    for c in range(conversations):
        send(c, 0)
    prefill = _steps(engine, label, first, ends, on_end)
    later = [first[k] - sent[k] for k in first if not k.endswith("t0")]
    return _summary(label, engine, t0, first, sent, ends, n_out, n_in, prefill, stats0,
                    {"conversations": conversations, "turns": turns,
                     "ttft_later_turns_p50_s": round(pct(later, 50), 3),
                     "ttft_later_turns_p99_s": round(pct(later, 99), 3)})


def run_sharegpt(engine, reqs, label: str, source=str, rate: float = 0.0) -> dict:
    """The usual requests, one adapter each: nothing to share. `rate`: see arrivals."""
    stats0 = dict(engine.blocks.stats)
    t0 = time.perf_counter()
    first, sent, ends, n_out, n_in = {}, {}, {}, {}, {}
    items = [(f"g{i}", ids, o, f"one{i}", source(i)) for i, (ids, o) in enumerate(reqs)]
    prefill = _steps(engine, label, first, ends, due=_timed(engine, t0, rate, items, sent, n_out, n_in))
    return _summary(label, engine, t0, first, sent, ends, n_out, n_in, prefill, stats0, {"rate": rate or None})


def on_over_off(on: dict, off: dict) -> dict:
    """The cache-on / cache-off ratios of one workload's two runs (output tok/s, TTFT p50, prompt tokens
    computed; TTFT p50 of later turns where the runs have it)."""
    ratio = {"output_tok_s": round(on["output_tok_s"] / off["output_tok_s"], 3) if off["output_tok_s"] else None,
             "ttft_p50": round(on["ttft_p50_s"] / off["ttft_p50_s"], 3) if off["ttft_p50_s"] else None,
             "prompt_tokens_computed": round(on["prompt_tokens_computed"] / max(off["prompt_tokens_computed"], 1), 3)}
    if "ttft_later_turns_p50_s" in on:
        ratio["ttft_later_turns_p50"] = round(on["ttft_later_turns_p50_s"] / off["ttft_later_turns_p50_s"], 3)
    return ratio


def run_workloads(engine, workloads, reqs, vocab: int, log, adapters: int = 32, system_tokens: int = 1024,
                  conversations: int = 64, source=str, user_tokens=(40, 200), output_tokens=(60, 160),
                  rate: float = 0.0) -> dict:
    """Each workload with the prefix cache off, then on (the same engine; cached pages dropped in between);
    the on / off ratios. `rate` (requests/s, Poisson; 0: all at t = 0) for system-prompt and sharegpt."""
    out = {}
    for wl in workloads:
        runs = {}
        for on in (False, True):
            engine.blocks.clear_cache()
            engine.blocks.caching = on
            label = f"{wl} (cache {'on' if on else 'off'})"
            if wl == "system-prompt":
                r = run_system_prompt(engine, reqs, adapters, system_tokens, vocab, label, source, rate)
            elif wl == "multi-turn":
                r = run_multi_turn(engine, conversations, 4, adapters, vocab, label, source=source,
                                   user_tokens=user_tokens, output_tokens=output_tokens)
            else:
                r = run_sharegpt(engine, reqs, label, source, rate)
            runs["on" if on else "off"] = r
            log(f"{label:>28}: {r['output_tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s"
                f"  prompt tokens computed {r['prompt_tokens_computed']} of {r['prompt_tokens']}"
                f" (hit rate {r['hit_rate']:.0%})" + (f"  later turns TTFT p50 {r['ttft_later_turns_p50_s']:.2f}s"
                                                       if "ttft_later_turns_p50_s" in r else ""))
        on, off = runs["on"], runs["off"]
        out[wl] = {**runs, "on_over_off": on_over_off(on, off)}
    engine.blocks.caching = True
    return out
