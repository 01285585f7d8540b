"""Adapter reads: the packed tensors against an fp32 reference built from the file itself, and the
reader processes (same result as in-process, errors named, a killed worker replaced, nothing left)."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_helpers import write_random_adapter
from lorafleet.common.peft_config import AdapterError, inspect_adapter
from lorafleet.models.contract import PROJ_INDEX
from lorafleet.models.registry import config_from_hf
from lorafleet.runner.lora.adapter import load_adapter
from lorafleet.runner.lora.host_tier import HostTier
from lorafleet.runner.lora.reader import PREFIX, SHM_DIR, AdapterReader
from lorafleet.runner.engine.sequence import AdapterRef


@pytest.fixture(scope="module")
def base(tiny_llama):
    import json

    return config_from_hf(json.loads((tiny_llama / "config.json").read_text())).base_shape()


@pytest.fixture(scope="module")
def mixed(tiny_llama, tmp_path_factory):
    """Several projections, a per-module rank and alpha, rslora: every branch of the packing."""
    return write_random_adapter(tiny_llama, tmp_path_factory.mktemp("mixed") / "mixed", r=8, alpha=16,
                                targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"), seed=3,
                                rank_pattern={"v_proj": 4}, alpha_pattern={"down_proj": 32}, use_rslora=True)


@pytest.fixture
def reader(base):
    r = AdapterReader(base, max_rank=16, dtype=torch.bfloat16, workers=2, pin=False, threads_per_worker=1).start()
    yield r
    r.close()


def reference(path, base, dtype):
    """(layer, proj) -> (A [r, in], B^T * scaling [r, out]) in `dtype`, from the file, in an fp32 loop."""
    spec = inspect_adapter("ref", path, base=base, max_rank=64)
    raw = load_file(str(path / "adapter_model.safetensors"))
    out = {}
    for m in spec.modules:
        a, b = raw[m.a_key].double(), raw[m.b_key].double()
        out[(m.layer, m.proj)] = (a.to(dtype), (b.t() * m.scaling).to(dtype))
    return out


def check_against_reference(ad, want, num_layers):
    assert set(ad.weights) == set(want)
    pk = ad.packed
    for (layer, proj), (a, bt) in want.items():
        got_a, got_bt = ad.weights[(layer, proj)]
        assert torch.equal(got_a, a), (layer, proj)  # a copy: exact
        # B^T * scaling: the reference rounds once from fp64, the loader scales in fp32: one ulp apart at most
        torch.testing.assert_close(got_bt, bt, rtol=torch.finfo(bt.dtype).eps, atol=0)
        assert pk.host_ranks[layer][PROJ_INDEX[proj]] == a.shape[0] == int(pk.ranks[layer, PROJ_INDEX[proj]])
    for p, t in pk.a.items():  # rows beyond a layer's rank, and layers not adapted, are zero
        for layer in range(num_layers):
            r = pk.host_ranks[layer][p]
            assert t[layer, r:].abs().sum() == 0 and pk.bt[p][layer, r:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_process_load_matches_the_fp32_reference(mixed, base, dtype):
    ad = load_adapter("mixed", mixed, base, max_rank=16, dtype=dtype)
    check_against_reference(ad, reference(mixed, base, dtype), base.num_layers)
    assert {k[1] for k in ad.weights} == {"q", "v", "o", "gate", "down"}
    assert {ad.weights[(0, "v")][0].shape[0], ad.weights[(0, "q")][0].shape[0]} == {4, 8}


def test_reader_process_gives_the_same_tensors(reader, mixed, base):
    ad = reader.read("mixed", str(mixed))
    check_against_reference(ad, reference(mixed, base, torch.bfloat16), base.num_layers)
    assert ad.spec.name == "mixed" and ad.nbytes > 0
    pids = {str(p) for p in reader.pids}
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and n[len(PREFIX):].split("-")[0] in pids]


def test_reader_errors_name_the_adapter_and_cross_the_process_boundary(reader, mixed, tmp_path):
    bad = tmp_path / "nan"
    shutil.copytree(mixed, bad)
    w = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in sorted(w) if "layers.1." in k and "v_proj.lora_B" in k)
    w[key][0, 0] = float("nan")
    save_file(w, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError) as e:
        reader.read("nanny", str(bad))
    assert e.value.adapter == "nanny" and f"tensor {key} contains NaN or Inf" in str(e.value)
    with pytest.raises(AdapterError, match="nowhere"):
        reader.read("nowhere", str(tmp_path / "missing"))
    err = pickle.loads(pickle.dumps(AdapterError("x", "why")))
    assert (err.adapter, err.reason, str(err)) == ("x", "why", "adapter 'x': why")
    assert reader.read("mixed", str(mixed)).spec.name == "mixed"  # the workers are fine afterwards


def test_overflow_to_inf_in_the_serving_dtype_is_refused(mixed, base, tmp_path):
    big = tmp_path / "big"
    shutil.copytree(mixed, big)
    w = load_file(str(big / "adapter_model.safetensors"))
    key = next(k for k in sorted(w) if "layers.0." in k and "q_proj.lora_A" in k)
    w[key][0, 1] = 3.4e38  # finite in fp32; above bfloat16's largest value plus half an ulp: Inf
    save_file(w, str(big / "adapter_model.safetensors"))
    load_adapter("big", big, base, max_rank=16, dtype=torch.float32)  # fine in fp32
    with pytest.raises(AdapterError) as e:
        load_adapter("big", big, base, max_rank=16, dtype=torch.bfloat16)
    assert str(e.value) == f"adapter 'big': tensor {key} overflows to Inf in bfloat16"


def test_a_nan_is_refused_naming_the_adapter_and_the_tensor_key_of_its_file(tiny_llama, base, tmp_path):
    """The refusal names the tensor as the user's adapter_model.safetensors does (the PEFT key, with its
    module k_proj), not the engine's internal projection name."""
    path = write_random_adapter(tiny_llama, tmp_path / "kq", r=4, alpha=8, targets=("q_proj", "k_proj"), seed=5)
    w = load_file(str(path / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    assert key in w
    w[key][1, 2] = float("nan")
    save_file(w, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError) as e:
        load_adapter("kq", path, base, max_rank=16, dtype=torch.bfloat16)
    assert e.value.adapter == "kq" and key in str(e.value)
    assert str(e.value) == f"adapter 'kq': tensor {key} contains NaN or Inf values"


def test_a_killed_reader_process_is_replaced(reader, mixed):
    import psutil

    reader.read("mixed", str(mixed))
    old = reader.pids
    assert len(old) == 2 and all(psutil.Process(p).ppid() == os.getpid() for p in old)
    for p in old:
        os.kill(p, 9)
    ad = reader.read("mixed", str(mixed))  # the first attempt meets a dead worker, the retry a new one
    assert ad.spec.name == "mixed" and reader.restarts == 1
    assert len(set(reader.pids) - set(old)) == 1


def test_closing_leaves_no_process_and_fails_later_reads(base, mixed):
    import psutil

    r = AdapterReader(base, max_rank=16, dtype=torch.bfloat16, workers=2, pin=False).start()
    r.read("mixed", str(mixed))
    procs = [psutil.Process(p) for p in r.pids]
    r.close()
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive and r.pids == []
    with pytest.raises(RuntimeError, match="closed"):
        r.read("mixed", str(mixed))


def test_reader_workers_exit_when_the_engine_process_dies(tmp_path, base, mixed):
    """A process holding readers is killed with SIGKILL: its reader processes go too (no orphans)."""
    import json
    import subprocess
    import sys

    import psutil

    script = tmp_path / "holder.py"
    script.write_text(
        "import json, sys, time, torch\n"
        "from lorafleet.common.peft_config import BaseShape\n"
        "from lorafleet.runner.lora.reader import AdapterReader\n"
        f"r = AdapterReader(BaseShape(**{json.dumps(dict(base.__dict__))}), 16, torch.bfloat16, workers=2, pin=False)\n"
        "r.start()\n"  # no main guard on purpose: the workers must not re-run this script
        "print(' '.join(map(str, r.pids)), flush=True)\n"
        "time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in holder.stdout.readline().split()]
        assert len(pids) == 2
        holder.kill()
        holder.wait()
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)
        assert not alive
    finally:
        holder.kill()


def test_host_tier_caches_counts_and_wraps_errors(base, mixed, tmp_path):
    calls = []

    def loader(ref):
        calls.append(ref.name)
        if ref.name == "broken":
            raise OSError("disk on fire at /secret/place")
        return load_adapter(ref.name, ref.source, base, 16, torch.float32)

    tier = HostTier(base, 16, torch.float32, capacity=1, pin=False, loader=loader)
    a = tier.get(AdapterRef("m", str(mixed)))
    assert tier.get(AdapterRef("m", str(mixed))) is a and calls == ["m"]
    tier.get(AdapterRef("n", str(mixed)))  # capacity 1: m leaves
    tier.get(AdapterRef("m", str(mixed)))
    assert calls == ["m", "n", "m"] and tier.stats["host_hits"] == 1 and tier.stats["disk_reads"] == 3
    with pytest.raises(AdapterError) as e:
        tier.get(AdapterRef("broken", "x"))
    assert "/secret" not in str(e.value) and "<path>" in str(e.value) and tier.stats["failures"] == 1


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_half_precision_files_are_scaled_in_float32(mixed, base, tmp_path, file_dtype, dtype):
    half = tmp_path / "half"
    shutil.copytree(mixed, half)
    w = {k: v.to(file_dtype) for k, v in load_file(str(half / "adapter_model.safetensors")).items()}
    if file_dtype == torch.float16:  # 40000 x scaling overflows float16 but not float32 or bfloat16
        w[next(k for k in sorted(w) if "layers.0." in k and "q_proj.lora_B" in k)][0, 0] = 40000.0
    save_file(w, str(half / "adapter_model.safetensors"))
    want = reference(half, base, dtype)
    if file_dtype == torch.float16 and dtype == torch.float16:
        with pytest.raises(AdapterError, match=r"tensor .*layers\.0\..*q_proj\.lora_B\.weight overflows to Inf in "
                                               r"float16 once scaled by"):
            load_adapter("half", half, base, max_rank=16, dtype=dtype)
        return
    check_against_reference(load_adapter("half", half, base, max_rank=16, dtype=dtype), want, base.num_layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float64_files_load_rounded_once(mixed, base, tmp_path, dtype):
    """F64 weights (an adapter saved from a float64 model; once refused as "not floating point") load, each value
    rounded once into the serving dtype: B^T * scaling computed in float64, as the fp64 reference does it. The
    values carry bits float32 cannot hold, so a float32 step anywhere on the way would show."""
    wide = tmp_path / "wide"
    shutil.copytree(mixed, wide)
    g = torch.Generator().manual_seed(7)
    w = {k: v.double() * (1 + 1e-9 * torch.randn(v.shape, generator=g, dtype=torch.float64))
         for k, v in load_file(str(wide / "adapter_model.safetensors")).items()}
    save_file(w, str(wide / "adapter_model.safetensors"))
    assert inspect_adapter("wide", wide, base=base).dtype == "F64"
    ad = load_adapter("wide", wide, base, max_rank=16, dtype=dtype)
    want = reference(wide, base, dtype)
    assert set(ad.weights) == set(want)
    for key, (a, bt) in want.items():
        assert torch.equal(ad.weights[key][0], a) and torch.equal(ad.weights[key][1], bt), key


def test_a_finished_load_whose_request_left_is_settled_not_leaked(base):
    """Only acquire() settles a load; a request cancelled while its adapter loaded never calls it again."""
    from concurrent.futures import Future

    from lorafleet.runner.lora.manager import AdapterManager, SlotState
    from lorafleet.runner.lora.pool import LoraPool

    class Done:
        def query(self):
            return True

    def fut(result=None, exc=None):
        f = Future()
        f.set_exception(exc) if exc else f.set_result(result)
        return f

    pool = LoraPool(base, num_slots=3, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    m = AdapterManager(pool, base)
    refs = [AdapterRef(f"a{i}", f"/x/a{i}") for i in range(3)]
    m.free_slots = []
    m.slots = {0: SlotState(refs[0], event=fut(Done())),  # loaded; its request left
               1: SlotState(refs[1], event=fut(exc=AdapterError("a1", "bad"))),  # failed; its request left
               2: SlotState(refs[2], event=Future())}  # still loading
    m.by_name = {r.name: i for i, r in enumerate(refs)}
    for r in refs:  # their requests were cancelled while waiting (Batcher.remove)
        m.abandon(r)
    assert m._take_slot() == 1  # the failed load's slot is freed first
    assert m._take_slot() == 0  # the finished one joined the LRU and is evicted
    assert m._take_slot() is None and 2 in m.slots and not m.slots[2].ready  # a load in flight is left alone


def test_a_full_shared_memory_folder_falls_back_to_the_temporary_folder(mixed, base, tmp_path, monkeypatch):
    """Containers get a 64 MiB /dev/shm by default: a hand-off that does not fit goes to disk instead."""
    import builtins
    import errno

    from lorafleet.runner.lora import reader as rd

    full, spare = tmp_path / "shm", tmp_path / "tmp"
    full.mkdir()
    spare.mkdir()
    monkeypatch.setattr(rd, "HANDOFF_DIRS", (str(full), str(spare)))

    def fake_open(path, *a, **k):
        if str(path).startswith(str(full)):
            f = builtins.open(path, *a, **k)
            f.close()  # the file exists, as after a partial write, and must not stay behind
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, *a, **k)

    monkeypatch.setattr(rd, "open", fake_open, raising=False)
    out = rd.read_to_shm("mixed", str(mixed), base, 16, "bfloat16")
    assert out["file"].startswith(str(spare)) and os.path.getsize(out["file"]) > 0
    assert os.listdir(full) == []


def test_a_hand_off_nobody_will_take_is_removed(mixed, base, tmp_path, monkeypatch):
    """The engine side went away while the worker read: its reply cannot be sent, the file goes."""
    import socket
    import threading
    from dataclasses import asdict

    from lorafleet.common.channel import BlockingChannel
    from lorafleet.runner.lora import reader as rd

    monkeypatch.setattr(rd, "HANDOFF_DIRS", (str(tmp_path),))
    closed = threading.Event()
    real_read = rd.read_to_shm

    def read_after_close(*a, **k):  # the read finishes only after the engine side has gone
        out = real_read(*a, **k)
        assert closed.wait(30)
        return out

    monkeypatch.setattr(rd, "read_to_shm", read_after_close)
    worker_end, engine_end = socket.socketpair()
    engine = BlockingChannel(engine_end)
    engine.send(["read", {"name": "mixed", "source": str(mixed), "base": asdict(base), "max_rank": 16,
                          "dtype": "bfloat16"}])
    failure = []

    def run():
        try:
            rd.serve(BlockingChannel(worker_end))
        except OSError as exc:
            failure.append(exc)

    t = threading.Thread(target=run)
    t.start()
    assert engine.recv_all(30)[0][0] == "ready"
    engine_end.close()  # before the reply
    closed.set()
    t.join(60)
    assert not t.is_alive() and failure  # the send failed
    assert [n for n in os.listdir(tmp_path) if n.startswith(PREFIX)] == []
