"""The step pipeline on the CPU: one step batch for every executor, overlapped scheduling (step N+1
queued before step N's ids are read back), chunked prefill and batch-invariant steps (decode and prompt rows as two
passes) all give the tokens of the plain synchronous, unchunked engine (fp32, greedy and seeded sampling), with
adapters, stop tokens found one step late, cancellation and eviction; no page is leaked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.executor.cuda_graph import GraphRunner
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from lorafleet.runner.engine.step_batch import RowWork, StepBatch, build_step_batch, split64
from model_helpers import write_random_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("pipe-adapters")
    return {"a8": write_random_adapter(tiny_llama, d / "a8", r=8, alpha=16, targets=ALL, seed=21),
            "a4": write_random_adapter(tiny_llama, d / "a4", r=4, alpha=4, targets=("v_proj", "down_proj"), seed=22)}


def requests(adapters, n=14, seed=0, stops=None, max_tokens=12):
    """Mixed adapters, greedy and seeded sampling, prompts of 3..45 tokens."""
    g = torch.Generator().manual_seed(seed)
    names = [None, "a8", "a4"]
    out = []
    for i in range(n):
        ids = torch.randint(3, 512, (int(torch.randint(3, 46, (1,), generator=g)),), generator=g).tolist()
        name = names[i % 3]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.9 if i % 4 == 1 else 0.0,
                                seed=1000 + i, stop_token_ids=tuple((stops or {}).get(f"r{i}", ())))
        out.append(Sequence(f"r{i}", ids, params, AdapterRef(name, str(adapters[name])) if name else None,
                            arrival=float(i)))
    return out


def engine(model, **cfg):
    base = dict(device="cpu", max_batch_size=8, page_size=4, num_pages=400, max_lora_rank=8)
    base.update(cfg)
    return Engine(str(model), EngineConfig(**base))


def run(eng, seqs):
    done = eng.run_to_completion(seqs)
    assert eng.blocks.free_pages == eng.blocks.num_pages
    return {k: (v.output_ids, v.finish_reason) for k, v in done.items()}


MODES = {
    "overlap": dict(overlap=True),
    "chunked": dict(chunked_prefill=True, max_step_tokens=11),
    "overlap+chunked": dict(overlap=True, chunked_prefill=True, max_step_tokens=9),
    "chunked+decode cap": dict(overlap=True, chunked_prefill=True, max_step_tokens=40, decode_prefill_tokens=3),
    "batch invariant": dict(chunked_prefill=True, max_step_tokens=11, batch_invariant=True),
    "overlap+batch invariant": dict(overlap=True, chunked_prefill=True, max_step_tokens=9, batch_invariant=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_pipeline_modes_equal_the_plain_engine(tiny_llama, adapters, mode):
    plain = run(engine(tiny_llama), requests(adapters))
    # stop tokens that really occur mid-stream: with overlap they are seen one step late
    stops = {k: (ids[4],) for k, (ids, _) in list(plain.items())[::2]}
    ref = run(engine(tiny_llama), requests(adapters, stops=stops))
    assert sum(r == "stop" for _, r in ref.values()) >= 5
    eng = engine(tiny_llama, **MODES[mode])
    eng.runner.phases = {}
    launched = record_launches(eng)
    got = run(eng, requests(adapters, stops=stops))
    assert got == ref
    if "chunked" in mode or "invariant" in mode:
        assert eng.batcher.max_step_tokens == MODES[mode]["max_step_tokens"]
    mixed = [parts for parts in launched if any(b.num_prefill and b.num_decode for b in parts)]
    if "invariant" in mode:  # every step with both kinds of rows ran them as two passes, decode rows first
        split = [parts for parts in launched if len(parts) == 2]
        assert len(split) >= 3 and not mixed
        assert all(p[0].decode_only and p[1].num_prefill == p[1].batch_size for p in split)
    else:
        assert mixed and all(len(parts) == 1 for parts in launched)


def record_launches(eng) -> list[list[StepBatch]]:
    """The batches of every step the engine launches from now on, a list per step (its parts)."""
    launched, real = [], eng.runner.launch_parts

    def launch_parts(batches, prev=None, readback=True):
        launched.append(list(batches))
        return real(batches, prev, readback)

    eng.runner.launch_parts = launch_parts
    return launched


def test_chunked_prefill_splits_long_prompts_and_keeps_decodes_running(tiny_llama):
    eng = engine(tiny_llama, chunked_prefill=True, max_step_tokens=16)
    short = [Sequence(f"d{i}", [5 + i, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), arrival=float(i))
             for i in range(4)]
    for s in short:
        eng.submit(s)
    eng.step()
    long_ = Sequence("long", list(range(3, 103)), SamplingParams(max_tokens=3, ignore_eos=True), arrival=10.0)
    eng.submit(long_)
    sizes = []
    while long_.num_cached < 100:
        before = {s.id: len(s.output_ids) for s in short}
        eng.step()
        sizes.append(eng.last_step)
        assert all(len(s.output_ids) == before[s.id] + 1 for s in short)  # every decode advanced
    assert all(pf + nd <= 16 for pf, nd in sizes) and len(sizes) >= 100 // 12
    ref = engine(tiny_llama).run_to_completion([Sequence("long", list(range(3, 103)),
                                                         SamplingParams(max_tokens=3, ignore_eos=True))])
    done = eng.run_to_completion([])
    assert done["long"].output_ids == ref["long"].output_ids


def test_decode_prefill_cap_limits_prompt_rows_only_in_steps_with_decodes(tiny_llama):
    """decode_prefill_tokens: a step carrying decodes takes at most that many prompt rows; a step
    without decodes still takes the whole budget; the long prompt's tokens equal the unchunked run."""
    eng = engine(tiny_llama, chunked_prefill=True, max_step_tokens=40, decode_prefill_tokens=5)
    first = Sequence("first", list(range(3, 63)), SamplingParams(max_tokens=40, ignore_eos=True), arrival=0.0)
    eng.submit(first)
    eng.step()
    assert eng.last_step == (40, 0)  # nothing decodes yet: the whole step budget
    long_ = Sequence("long", list(range(7, 77)), SamplingParams(max_tokens=3, ignore_eos=True), arrival=1.0)
    eng.submit(long_)
    sizes = []
    while long_.num_cached < 70:
        eng.step()
        sizes.append(eng.last_step)
    with_decodes = [pf for pf, nd in sizes if nd]
    assert with_decodes and max(with_decodes) <= 5 and sum(pf for pf, _ in sizes) == 20 + 70
    assert len(with_decodes) == (90 - 40) // 5  # the rest came 5 rows at a time
    done = eng.run_to_completion([])
    ref = engine(tiny_llama).run_to_completion([Sequence("long", list(range(7, 77)),
                                                         SamplingParams(max_tokens=3, ignore_eos=True))])
    assert done["long"].output_ids == ref["long"].output_ids
    with pytest.raises(ValueError, match="decode_prefill_tokens"):
        engine(tiny_llama, chunked_prefill=True, max_step_tokens=40, decode_prefill_tokens=0)


def test_eviction_and_resume_under_overlap_and_chunks(tiny_llama, adapters):
    seqs = requests(adapters, n=10, seed=3, max_tokens=24)
    full = run(engine(tiny_llama, requeue_evicted=True), seqs)
    eng = engine(tiny_llama, requeue_evicted=True, num_pages=40, overlap=True, chunked_prefill=True,
                 max_step_tokens=10)
    evictions = 0
    for s in requests(adapters, n=10, seed=3, max_tokens=24):
        eng.submit(s)
    done = {}
    while eng.has_work():
        running = list(eng.batcher.running)
        for o in eng.step():
            if o.finished:
                done[o.seq_id] = (o.output_ids, o.finish_reason)
        evictions += sum(1 for s in running if s in eng.batcher.waiting)
    assert evictions > 0
    assert done == full
    assert eng.blocks.free_pages == eng.blocks.num_pages


def test_cancel_while_a_step_is_in_flight(tiny_llama, adapters):
    eng = engine(tiny_llama, overlap=True)
    seqs = requests(adapters, n=6, seed=4, max_tokens=40)
    for s in seqs:
        eng.submit(s)
    streamed: dict[str, list[int]] = {}
    for _ in range(4):
        for o in eng.step():
            streamed.setdefault(o.seq_id, []).extend(o.new_token_ids)
    assert eng._inflight is not None  # a step is queued whose ids are not read yet
    eng.cancel("r1")
    ended = {}
    while eng.has_work():
        for o in eng.step():
            streamed.setdefault(o.seq_id, []).extend(o.new_token_ids)
            if o.finished:
                ended[o.seq_id] = o
    assert ended["r1"].finish_reason == "cancelled"
    assert streamed["r1"] == ended["r1"].output_ids  # nothing streamed after the cancel, nothing missing
    assert all(ended[f"r{i}"].finish_reason == "length" for i in (0, 2, 3, 4, 5))
    assert eng.blocks.free_pages == eng.blocks.num_pages


def test_decode_graph_plumbing_equals_eager_steps(tiny_llama, adapters):
    """The decode-graph executor's static buffers, padding rows (scratch page, no segment) and
    table copies, run without capture on the CPU, against plain eager steps."""
    ref = run(engine(tiny_llama), requests(adapters, n=11, seed=5))
    eng = engine(tiny_llama, overlap=True)
    g = GraphRunner(eng.model, eng.attention, eng.lora_pool, eng.sgmv, eng.config.page_size,
                    eng.config.max_batch_size, eng.kv.num_pages - 1, use_graphs=False)
    g.capture_all()
    eng.runner.graphs = g
    eng.runner.phases = {}
    assert run(eng, requests(adapters, n=11, seed=5)) == ref
    assert eng.runner.phases["graph"][3] > 10  # decode steps went through the graph executor
    assert {b for b in g.static} == {1, 2, 4, 8}


def test_step_batch_layout_and_wire_round_trip(tiny_llama):
    eng = engine(tiny_llama)
    mk = lambda i, n, slot: Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=5), arrival=float(i))  # noqa: E731
    seqs = [mk(i, n, 0) for i, n in enumerate((6, 1, 9, 2))]
    for s, slot in zip(seqs, (3, 1, 1, 3)):
        s.slot = slot
        eng.blocks.grow(s.pages, s.num_tokens + 1)
    # s1 and s3 decode (s3's last token is pending on the device); s0 and s2 are prefill chunks
    seqs[3].output_ids, seqs[3].num_pending = [7], 1
    work = [RowWork(seqs[0], 2, 6, True), RowWork(seqs[1], 0, 1, True), RowWork(seqs[2], 0, 4, False),
            RowWork(seqs[3], 3, 4, True)]
    prev = StepBatch.__new__(StepBatch)
    prev.sample_pos = {id(seqs[3]): 5}
    b = build_step_batch(work, 4, 8, prev)
    # prefill part first (slot 3 at the seam with the decode part), then decode rows; s1's one-token
    # prompt at position 0 is a one-row prefill, not a decode
    assert [s.id for s in b.seqs] == ["s1", "s2", "s0", "s3"] and b.num_prefill == 3
    assert b.qo_indptr == [0, 1, 5, 9, 10] and b.kv_lens == [1, 4, 6, 4]
    assert b.seg_indptr == (0, 5, 10) and b.seg_slots == (1, 3)
    v = split64(b.packed64, b.num_tokens, b.batch_size, b.num_pending, len(b.sample_idx))
    assert v["positions"].tolist() == [0, 0, 1, 2, 3, 2, 3, 4, 5, 3]
    assert v["input_ids"].tolist()[:9] == [3, 3, 4, 5, 6, 5, 6, 7, 8] and b.num_pending == 1
    assert v["pending_rows"].tolist() == [9] and v["pending_src"].tolist() == [5]
    assert v["logit_rows"].tolist() == [0, 4, 8, 9]
    assert b.sample_idx == [0, 2, 3]  # s2's chunk does not reach its last token
    assert v["sample_idx"].tolist() == [0, 2, 3]  # ... and travels with the one int64 copy to the device
    assert b.packedf is None  # every row greedy: no sampling parameters to copy
    pages = seqs[0].pages
    assert v["slot_mapping"].tolist()[5:9] == [pages[p // 4] * 4 + p % 4 for p in range(2, 6)]
    w = StepBatch.from_wire(b.to_wire())
    assert torch.equal(w.packed64, b.packed64) and torch.equal(w.packed32, b.packed32)
    assert (w.qo_indptr, w.kv_lens, w.page_tables, w.seg_indptr, w.sample_idx, w.uniform) == (
        b.qo_indptr, b.kv_lens, b.page_tables, b.seg_indptr, b.sample_idx, b.uniform)
    assert w.packedf is None
    # non-greedy rows: their parameters go as one float32 [5, S] pack, rebuilt on the wire's other side
    seqs[1].params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, min_p=0.05)
    b2 = build_step_batch(work, 4, 8, prev)
    assert b2.packedf is not None and b2.packedf.shape == (5, 3)
    k = b2.sample_idx.index(b2.seqs.index(seqs[1]))
    assert [b2.packedf[0, j].item() for j in range(3) if j != k] == [0.0, 0.0]  # the greedy rows
    t, tp, tk, u, mp = b2.packedf[:, k].tolist()
    assert (round(t, 6), round(tp, 6), tk, round(mp, 6)) == (0.7, 0.9, 40.0, 0.05) and 0 <= u < 1
    assert u == pytest.approx(b2.uniform[k])
    assert torch.equal(StepBatch.from_wire(b2.to_wire()).packedf, b2.packedf)
    with pytest.raises(RuntimeError, match="pending"):
        build_step_batch(work, 4, 8, None)


def test_the_cpu_default_prefills_long_prompts_in_chunks_that_let_others_through(tiny_llama, tmp_path):
    """On the CPU too, by default, a long prompt is prefilled 512 rows at a time: a request already decoding
    keeps getting a token every step while the long prompt is prefilled (not one long stall), and cancelling the
    long one takes effect between its chunks."""
    import json
    import shutil

    model = tmp_path / "long-context"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    eng = Engine(str(model), EngineConfig(device="cpu", page_size=4, num_pages=1000))
    assert eng.batcher.max_step_tokens == 512
    long_ids = [3 + (i * 7) % 500 for i in range(1800)]
    eng.submit(Sequence("short", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), arrival=0.0))
    eng.step()  # the short request is decoding
    eng.submit(Sequence("long", long_ids, SamplingParams(max_tokens=2, ignore_eos=True), arrival=1.0))
    tokens, steps = {"short": [], "long": []}, 0
    while eng.has_work():
        steps += 1
        for o in eng.step():
            tokens[o.seq_id].extend([steps] * len(o.new_token_ids or []))
    long_first = tokens["long"][0]
    assert long_first >= 1800 // 512  # the long prompt took several steps
    during = [t for t in tokens["short"] if t < long_first]
    assert len(during) >= 3 and all(b - a <= 1 for a, b in zip(during, during[1:]))  # a token every step

    eng.submit(Sequence("long2", [t + 1 for t in long_ids], SamplingParams(max_tokens=2, ignore_eos=True)))
    eng.step()
    eng.step()  # two chunks in
    eng.cancel("long2")
    outs = []
    for _ in range(4):
        outs += eng.step()
    assert any(o.seq_id == "long2" and o.finish_reason == "cancelled" for o in outs)
    assert not eng.has_work() and eng.blocks.free_pages + eng.blocks.cached_pages >= eng.blocks.num_pages


def test_a_batch_invariant_engine_takes_the_decode_kernel_that_follows_a_requests_own_length(tiny_llama):
    """EngineConfig.batch_invariant: the decode rows' attention on the project's kernel (its chunks follow a request's
    own length), or where flashinfer's is named, its tensor-core decode with every request's K/V one chunk
    (decode_no_split, which its other decode kernel cannot take)."""
    from lorafleet.runner.engine.engine import invariant_kernels

    assert invariant_kernels(KernelChoices()).decode_kernel == "lorafleet"
    assert invariant_kernels(KernelChoices(decode_kernel="lorafleet")).decode_kernel == "lorafleet"
    assert not invariant_kernels(KernelChoices()).decode_no_split
    fi = invariant_kernels(KernelChoices(decode_kernel="flashinfer", decode_tc="0"))
    assert (fi.decode_kernel, fi.decode_tc, fi.decode_no_split) == ("flashinfer", "1", True)
    for tc in ("auto", "0"):
        with pytest.raises(ValueError, match="decode_no_split takes flashinfer's tensor-core decode"):
            KernelChoices(decode_tc=tc, decode_no_split=True)
    eng = engine(tiny_llama, batch_invariant=True)
    assert eng.config.batch_invariant and eng.config.kernels.decode_kernel == "lorafleet"
    assert engine(tiny_llama).config.kernels.decode_kernel == "auto"


def test_a_batch_invariant_engine_caches_pages_for_the_next_step_only(tiny_llama):
    """With the prefix cache, a request admitted beside another with the same prompt finds the pages that request's
    prompt fills in the same step. In a batch-invariant engine the step's decode-shaped rows run in a pass before its
    prompt rows, so such pages are cached from the next step on: two equal prompts of two full pages and one token
    arriving together (the second would have one row left, computed before the first's pages), then a third after them
    that finds both pages. The tokens are the one-pass engine's, and the third request's prompt is found cached."""
    prompt = list(range(5, 14))  # 9 tokens, pages of 4

    def go(**cfg):
        eng = engine(tiny_llama, enable_lora=False, **cfg)
        first = [Sequence(f"r{i}", list(prompt), SamplingParams(max_tokens=6, ignore_eos=True), arrival=float(i))
                 for i in range(2)]
        for s in first:
            eng.submit(s)
        for _ in range(3):
            eng.step()
        late = Sequence("r2", list(prompt), SamplingParams(max_tokens=6, ignore_eos=True), arrival=9.0)
        done = eng.run_to_completion([late])
        out = {s.id: s.output_ids for s in first} | {"r2": done["r2"].output_ids}
        return out, late.cached_tokens

    want, _ = go(prefix_cache=False)
    assert go()[0] == want
    got, cached = go(batch_invariant=True)
    assert got == want and cached == 8


def test_a_batch_invariant_engine_says_where_the_invariance_does_not_hold(tiny_llama, caplog):
    """invariance_gaps: the CPU's products; on CUDA, products not on the wgmma kernel, decode batches beyond its 64
    rows, decode attention left on flashinfer's."""
    from types import SimpleNamespace as NS

    from lorafleet.runner.engine.engine import invariance_gaps

    with caplog.at_level("WARNING"):
        engine(tiny_llama, batch_invariant=True)
    assert "does not hold everywhere here: the CPU's matrix products" in caplog.text
    cuda, cfg = torch.device("cuda"), EngineConfig()
    assert invariance_gaps(cfg, cuda, NS(bf16_sm90=True), NS(own=object())) == []
    assert invariance_gaps(cfg, cuda, NS(bf16_sm90=True), NS()) == []  # (torch attention: no split)
    assert invariance_gaps(cfg, cuda, NS(bf16_sm90=True), NS(own=None, decode_no_split=True)) == []
    gaps = invariance_gaps(EngineConfig(max_batch_size=128), cuda, NS(bf16_sm90=False), NS(own=None))
    assert len(gaps) == 2 and "cuBLAS" in gaps[0] and "flashinfer" in gaps[1]
    assert "128" in invariance_gaps(EngineConfig(max_batch_size=128), cuda, NS(bf16_sm90=True), NS())[0]


def test_a_batch_invariant_engine_reports_the_log_probabilities_of_one_pass(tiny_llama, adapters):
    """Requests that ask for their tokens' and their prompts' log-probabilities, some prefilled in steps run as two
    passes: every token and prompt position has its entries, the chosen ids and log-probabilities those of the
    one-pass engine (fp32: within rounding)."""
    def go(**cfg):
        eng = engine(tiny_llama, chunked_prefill=True, max_step_tokens=11, **cfg)
        launched = record_launches(eng)
        seqs = requests(adapters, n=10)
        for i, s in enumerate(seqs):
            s.params = dataclasses.replace(s.params, temperature=0.0, logprobs=2,
                                           prompt_logprobs=1 if i % 3 == 0 else None)
        got = {}
        for s in seqs:
            eng.submit(s)
        while eng.has_work():
            for out in eng.step():
                e = got.setdefault(out.seq_id, {"ids": [], "lp": [], "plp": []})
                e["ids"] += out.new_token_ids
                e["lp"] += out.logprobs or []
                e["plp"] += out.prompt_logprobs or []
        return got, sum(len(p) == 2 for p in launched)

    want, _ = go()
    got, split = go(batch_invariant=True)
    assert split >= 3 and got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert g["ids"] == w["ids"] and len(g["lp"]) == len(w["ids"]) and len(g["plp"]) == len(w["plp"])
        for a, b in zip(g["lp"] + g["plp"], w["lp"] + w["plp"]):
            assert a[0] == pytest.approx(b[0], abs=1e-4)
            assert [i for i, _ in a[1]] == [i for i, _ in b[1]]
    assert any(w["plp"] for w in want.values())
