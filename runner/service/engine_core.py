"""The engine core: a process that owns the device and runs `Engine.step()` in a busy loop.

Started by the runner's front (`engine_client.py`) as `python -m lorafleet.runner.service.engine_core
--fd N`, where N is its end of a socketpair (`channel.py` lists the messages). No HTTP, no
asyncio, no thread but the heartbeat's: between two steps it reads whatever the front sent (submit,
cancel, state, shutdown) without waiting, and after each step it sends one message with the
outputs of the whole batch (plus a state snapshot at most every 0.1 s, and whenever a
request joined or left the batch, so the front's view of batch and free KV pages is current
when a request's first token or its end is reported).
Idle, it blocks on the channel.

A thread of its own sends ["beat"] every BEAT_S once the model is loaded, during long steps too: the front takes a
core it has heard nothing from for LORAFLEET_ENGINE_STALL_S (a stopped or frozen process) as dead.

Failure: an exception in a step sends ["fatal", reason] and exits with status 3; a failed
model load sends ["fatal", ...] and exits with status 2. After a step failure the front reports
the runner unhealthy with that reason and ends every in-flight request; after a failed load
`lorafleet runner` logs the reason and exits. The core exits when the channel
closes (the front died) and, on Linux, is killed by the kernel if the front process dies
(PR_SET_PDEATHSIG); Ctrl-C in a terminal is left to the front, which shuts the core down in
order.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time

from lorafleet import env
from lorafleet.common.procs import die_with_parent
from lorafleet.common.channel import BlockingChannel, ChannelClosed
from lorafleet.models.contract import ModelError

log = logging.getLogger("lorafleet.runner.service.engine_core")

SNAPSHOT_EVERY_S = 0.1  # how stale the front's state may be while the engine is busy
BEAT_S = 1.0  # the heartbeat's period
IDLE_WAIT_S = 0.5  # idle: wake this often to refresh idle_seconds in the snapshot


def engine_config_from_dict(d: dict):
    from lorafleet.runner.config import EngineConfig

    fields = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in d.items() if k in fields})


def build_engine(model: str, config: dict):
    """An Engine for a model path: HF directory, .gguf, or a synthetic model directory (weights
    drawn on the device); with `tp` > 1 it starts the other tensor-parallel ranks."""
    from lorafleet.runner.engine.engine import Engine

    return Engine(model, engine_config_from_dict(config))


def sequence_from_wire(d: dict):
    from lorafleet.runner.engine.sequence import AdapterRef, Sequence, sampling_from_dict

    a = d.get("adapter")
    ref = AdapterRef(a["name"], a["source"], a.get("sha256"), a.get("version")) if a else None
    return Sequence(d["id"], list(d["prompt_ids"]), sampling_from_dict(d.get("sampling") or {}), ref,
                    arrival=float(d.get("arrival") or time.time()), cache_salt=d.get("cache_salt"),
                    priority=int(d.get("priority") or 0))


def ready_info(engine) -> dict:
    mc = engine.model_config
    bs = mc.base_shape()
    return {"page_size": engine.config.page_size, "max_model_len": engine.max_model_len, "model": mc.name,
            "vocab_size": mc.vocab_size, "max_lora_rank": engine.config.max_lora_rank,
            "adapter_dtype": str(engine.lora_pool.dtype if engine.lora_pool is not None else engine.dtype
                                 ).removeprefix("torch."),
            "base_shape": {"num_layers": bs.num_layers, "hidden_size": bs.hidden_size,
                           "intermediate_size": bs.intermediate_size, "q_dim": bs.q_dim, "kv_dim": bs.kv_dim,
                           "name": bs.name, "family": bs.family},
            "pid": os.getpid(), "state": engine.state()}


class Fault:
    """LORAFLEET_ENGINE_FAULT=step:N raises in the N-th step (to test crash handling; unset in production)."""

    def __init__(self, spec: str | None):
        self.at = int(spec.split(":", 1)[1]) if spec and spec.startswith("step:") else None
        self.steps = 0

    def check(self) -> None:
        self.steps += 1
        if self.at is not None and self.steps >= self.at:
            raise RuntimeError(f"injected engine fault at step {self.steps} (LORAFLEET_ENGINE_FAULT)")


def serve(ch: BlockingChannel, engine) -> int:
    """The busy loop; returns the exit status."""
    fault = Fault(env.engine_fault())
    last_snap = 0.0
    idle_reported = False
    started: set[str] = set()  # requests that have produced output
    while True:
        busy = engine.has_work()
        want_state = False
        try:
            msgs = ch.recv_all(0.0 if busy else IDLE_WAIT_S)
        except ChannelClosed:
            return 0
        for msg in msgs:
            op = msg[0]
            if op == "submit":
                try:
                    engine.submit(sequence_from_wire(msg[1]))
                except (KeyError, TypeError, ValueError) as exc:
                    rid = msg[1].get("id") if isinstance(msg[1], dict) else None
                    ch.send(["step", [[rid, [], "error", f"bad request: {exc}"]], None])
            elif op == "cancel":
                engine.cancel(msg[1])
            elif op == "state":
                want_state = True
            elif op == "shutdown":
                return 0
        if not engine.has_work():
            if want_state or not idle_reported or not msgs:
                ch.send(["state", engine.state()])  # idle: keep idle_seconds fresh
                idle_reported = True
            continue
        idle_reported = False
        try:
            fault.check()
            outputs = engine.step()
        except Exception as exc:  # a bug or a device error: this engine can no longer be trusted
            log.exception("engine step failed")
            ch.send(["fatal", f"engine step failed: {type(exc).__name__}: {exc}"])
            return 3
        now = time.perf_counter()
        changed = False  # a request joined or left the batch: the front's state must show it
        wire = []
        for o in outputs:
            if o.finish_reason is not None:
                changed = True
                started.discard(o.seq_id)
            elif o.seq_id not in started:
                started.add(o.seq_id)
                changed = True
            if o.new_token_ids or o.finish_reason is not None or o.prompt_logprobs is not None:
                entry = [o.seq_id, o.new_token_ids, o.finish_reason, o.error]
                extra = [o.cached_tokens, o.logprobs, o.prompt_logprobs]  # (stream.py: the optional elements)
                while extra and extra[-1] is None:
                    extra.pop()
                entry += extra
                wire.append(entry)
        state = None
        if changed or want_state or now - last_snap > SNAPSHOT_EVERY_S:
            state, last_snap = engine.state(), now
        if wire or state is not None:
            ch.send(["step", wire, state])


def start_heartbeat(ch: BlockingChannel, period: float = BEAT_S) -> threading.Event:
    """A daemon thread that sends ["beat"] every `period` seconds until the returned event is set or the channel
    fails: it runs while a step holds the main thread (torch releases the GIL), so only a stopped or frozen process
    goes quiet."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(period):
            try:
                ch.send(["beat"])
            except OSError:
                return

    threading.Thread(target=beat, name="engine-core-heartbeat", daemon=True).start()
    return stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.runner.service.engine_core")
    p.add_argument("--fd", type=int, required=True, help="this process's end of the socketpair")
    p.add_argument("--log-level", default=env.log_level())
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Adapter-load threads take the GIL for a few dozen short tensor operations per adapter (the disk
    # read itself runs in reader processes); with the step loop busy, each take waits up to this
    # interval (5 ms by default), which made a load take a quarter of a second.
    sys.setswitchinterval(0.0005)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front decides
    die_with_parent()
    if os.getppid() == 1:
        return 1  # the front is already gone
    ch = BlockingChannel(socket.socket(fileno=args.fd))
    try:
        first = ch.recv_all(None)
    except ChannelClosed:
        return 0
    init = first[0]
    if init[0] != "init":
        ch.send(["fatal", f"expected init, got {init[0]!r}"])
        return 2
    if any(later[0] == "shutdown" for later in first[1:]):
        return 0  # the front was stopped while this process started: nothing to load
    threads = (init[1].get("config") or {}).get("threads")
    if threads:  # the CPUs this runner was given (`--threads`; `serve --runners N` divides the machine)
        import torch

        torch.set_num_threads(int(threads))
    try:
        engine = build_engine(init[1]["model"], init[1].get("config") or {})
    except Exception as exc:
        if not isinstance(exc, ModelError):  # a model or checkpoint we refuse: the front logs its message, once
            log.exception("model load failed")
        ch.send(["fatal", f"model load failed: {type(exc).__name__}: {exc}"])
        return 2
    ch.send(["ready", ready_info(engine)])
    beats = start_heartbeat(ch)
    for later in first[1:]:  # anything the front sent before ready (it should not)
        log.warning("dropped channel message %r sent before ready", later[0])
    try:
        return serve(ch, engine)
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        beats.set()
        engine.close()  # the other tensor-parallel ranks, if any


if __name__ == "__main__":
    sys.exit(main())
