"""Kernel choices from the environment: LORAFLEET_PREFILL_BACKEND (flashinfer's kernel for prompt rows,
read when the engine builds its attention) and LORAFLEET_SGMV_FUSED (one or two LoRA launches in steps
with prompt rows); a bad value is an error that names the variable and the choices. Also which prefill
kernel `auto` picks per step on sm90."""

import pytest

from lorafleet import env


@pytest.mark.parametrize("var, read, value, want", [
    ("LORAFLEET_PREFILL_BACKEND", env.prefill_backend, None, "auto"),
    ("LORAFLEET_PREFILL_BACKEND", env.prefill_backend, "fa2", "fa2"),
    ("LORAFLEET_PREFILL_BACKEND", env.prefill_backend, "FA3", "fa3"),
    ("LORAFLEET_PREFILL_BACKEND", env.prefill_backend, " auto ", "auto"),
    ("LORAFLEET_PREFILL_BACKEND", env.prefill_backend, "", "auto"),
    ("LORAFLEET_SGMV_FUSED", env.sgmv_fused, None, "auto"),
    ("LORAFLEET_SGMV_FUSED", env.sgmv_fused, "0", "0"),
    ("LORAFLEET_SGMV_FUSED", env.sgmv_fused, "1", "1"),
    ("LORAFLEET_SGMV_FUSED", env.sgmv_fused, " AUTO", "auto"),
    ("LORAFLEET_DECODE_TC", env.decode_tensor_cores, None, "auto"),
    ("LORAFLEET_DECODE_TC", env.decode_tensor_cores, "1", "1"),
    ("LORAFLEET_DECODE_TC", env.decode_tensor_cores, " 0 ", "0"),
    ("LORAFLEET_DECODE_KERNEL", env.decode_kernel, None, "auto"),
    ("LORAFLEET_DECODE_KERNEL", env.decode_kernel, "flashinfer", "flashinfer"),
    ("LORAFLEET_DECODE_KERNEL", env.decode_kernel, " LoraFleet", "lorafleet"),
    ("LORAFLEET_DECODE_STAGES", env.decode_stages, None, 3),
    ("LORAFLEET_DECODE_STAGES", env.decode_stages, "0", 0),
    ("LORAFLEET_DECODE_STAGES", env.decode_stages, "3", 3),
    ("LORAFLEET_DECODE_STAGES", env.decode_stages, "5", 5),
    ("LORAFLEET_DECODE_CHUNK", env.decode_chunk, None, 256),
    ("LORAFLEET_DECODE_CHUNK", env.decode_chunk, "64", 64),
    ("LORAFLEET_DECODE_CHUNK", env.decode_chunk, "4096", 4096),
    ("LORAFLEET_DECODE_INT_CVT", env.decode_int_convert, None, False),
    ("LORAFLEET_DECODE_INT_CVT", env.decode_int_convert, "1", True),
    ("LORAFLEET_DECODE_MMA", env.decode_mma, None, False),
    ("LORAFLEET_DECODE_MMA", env.decode_mma, "1", True),
    ("LORAFLEET_DECODE_CTAS_PER_SM", env.decode_ctas_per_sm, None, 4),
    ("LORAFLEET_DECODE_CTAS_PER_SM", env.decode_ctas_per_sm, "16", 16),
    ("LORAFLEET_DENSE_LORA_ROWS", env.dense_lora_rows, None, 256),
    ("LORAFLEET_DENSE_LORA_ROWS", env.dense_lora_rows, "0", 0),
    ("LORAFLEET_DENSE_LORA_ROWS", env.dense_lora_rows, "1024", 1024),
    ("LORAFLEET_DENSE_LORA_KEXT", env.dense_lora_kext, None, 64),
    ("LORAFLEET_DENSE_LORA_KEXT", env.dense_lora_kext, "0", 0),
    ("LORAFLEET_DENSE_LORA_KEXT", env.dense_lora_kext, "128", 128),
])
def test_values(monkeypatch, var, read, value, want):
    if value is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, value)
    assert read() == want


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("LORAFLEET_PREFILL_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="LORAFLEET_PREFILL_BACKEND must be one of auto, fa2, fa3"):
        env.prefill_backend()
    monkeypatch.setenv("LORAFLEET_DECODE_TC", "yes")
    with pytest.raises(ValueError, match="LORAFLEET_DECODE_TC must be one of auto, 1, 0"):
        env.decode_tensor_cores()
    from lorafleet.runner.config import KernelChoices
    with pytest.raises(ValueError, match="kernel choice decode_tc must be one of auto, 1, 0"):
        KernelChoices(decode_tc="true")
    monkeypatch.setenv("LORAFLEET_DECODE_KERNEL", "own")
    with pytest.raises(ValueError, match="LORAFLEET_DECODE_KERNEL must be one of auto, flashinfer, lorafleet"):
        env.decode_kernel()
    with pytest.raises(ValueError, match="kernel choice decode_kernel must be one of auto, flashinfer, lorafleet"):
        KernelChoices(decode_kernel="own")
    for bad in ("4", "1", "-3", "deep"):
        monkeypatch.setenv("LORAFLEET_DECODE_STAGES", bad)
        with pytest.raises(ValueError, match="LORAFLEET_DECODE_STAGES must be"):
            env.decode_stages()
    with pytest.raises(ValueError, match="decode_stages must be 0, 3 or 5, got 4"):
        KernelChoices(decode_stages=4)
    for bad in ("0", "8", "100", "4112", "-16", "many"):
        monkeypatch.setenv("LORAFLEET_DECODE_CHUNK", bad)
        with pytest.raises(ValueError, match="LORAFLEET_DECODE_CHUNK must be"):
            env.decode_chunk()
    for bad in ("0", "65", "-1", "x"):
        monkeypatch.setenv("LORAFLEET_DECODE_CTAS_PER_SM", bad)
        with pytest.raises(ValueError, match="LORAFLEET_DECODE_CTAS_PER_SM must be"):
            env.decode_ctas_per_sm()
    with pytest.raises(ValueError, match="decode_chunk must be a multiple of 16 from 16 to 4096, got 100"):
        KernelChoices(decode_chunk=100)
    with pytest.raises(ValueError, match="decode_ctas_per_sm must be from 1 to 64, got 0"):
        KernelChoices(decode_ctas_per_sm=0)
    monkeypatch.setenv("LORAFLEET_DECODE_CHUNK", "64")
    monkeypatch.setenv("LORAFLEET_DECODE_CTAS_PER_SM", "16")
    monkeypatch.setenv("LORAFLEET_DECODE_STAGES", "5")
    for var in ("LORAFLEET_PREFILL_BACKEND", "LORAFLEET_DECODE_TC", "LORAFLEET_DECODE_KERNEL"):
        monkeypatch.delenv(var)
    choices = KernelChoices.from_env()
    assert (choices.decode_stages, choices.decode_chunk, choices.decode_ctas_per_sm) == (5, 64, 16)


# --- which kernel a step's prompt rows take under `auto` on sm90 (runner/attention/meta.py) ---

from lorafleet.runner.executor.attention.meta import fa3_tile_rows, prefill_kernel  # noqa: E402

H200_SMS = 132


@pytest.mark.parametrize("lens, want", [
    ([64], "fa2"),            # a 64-row chunk beside the decodes: 1 tile x 32 heads = 32 CTAs <= 132 / 4
    ([128], "fa2"),           # still one tile per head
    ([129], "fa3"),           # 2 tiles: 64 CTAs
    ([256], "fa3"),
    ([2048], "fa3"),          # the default step budget
    ([8000], "fa3"),          # a whole long prompt
    ([64, 64], "fa3"),        # two chunks: 64 CTAs
    ([1], "fa2"),
])
def test_llama2_7b_choice(lens, want):
    assert prefill_kernel(lens, 32, 128, H200_SMS) == want


def test_fa3_counts_query_heads_and_its_tile_size():
    # FA3 does not pack the query heads of a KV head into rows: 64 query heads (70B shape, 8 KV heads)
    assert prefill_kernel([16], 64, 128, H200_SMS) == "fa3"  # 1 tile x 64 heads = 64 CTAs
    assert prefill_kernel([16], 16, 128, H200_SMS) == "fa2"  # 16 CTAs
    # head_dim 64 (the 135M shape, 9 query heads): 192-row tiles
    assert fa3_tile_rows(64) == 192 and fa3_tile_rows(128) == 128
    assert prefill_kernel([500], 9, 64, H200_SMS) == "fa2"  # 3 tiles x 9 = 27 <= 33
    assert prefill_kernel([600], 9, 64, H200_SMS) == "fa3"  # 4 x 9 = 36


def test_fewer_sms_flip_sooner():
    assert prefill_kernel([64], 32, 128, 132) == "fa2"
    assert prefill_kernel([64], 32, 128, 64) == "fa3"


def test_sgmv_fused_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("LORAFLEET_SGMV_FUSED", "yes")
    with pytest.raises(ValueError, match="LORAFLEET_SGMV_FUSED must be one of auto, 1, 0"):
        env.sgmv_fused()


def test_attention_backend_bad_value_is_refused(monkeypatch):
    # a typo must not silently fall back to the torch attention path
    monkeypatch.setenv("LORAFLEET_ATTENTION", "flashinfr")
    with pytest.raises(ValueError, match="LORAFLEET_ATTENTION must be one of auto, flashinfer, torch"):
        env.attention_backend()
    monkeypatch.setenv("LORAFLEET_ATTENTION", " Torch ")
    assert env.attention_backend() == "torch"


def test_blas_lt_rows(monkeypatch):
    monkeypatch.delenv("LORAFLEET_BLAS_LT_ROWS", raising=False)
    assert env.blas_lt_rows() == 64
    monkeypatch.setenv("LORAFLEET_BLAS_LT_ROWS", "0")
    assert env.blas_lt_rows() == 0
    monkeypatch.setenv("LORAFLEET_BLAS_LT_ROWS", "-1")
    with pytest.raises(ValueError, match="LORAFLEET_BLAS_LT_ROWS must be >= 0"):
        env.blas_lt_rows()
    monkeypatch.setenv("LORAFLEET_BLAS_LT_ROWS", "many")
    with pytest.raises(ValueError, match="LORAFLEET_BLAS_LT_ROWS must be an integer"):
        env.blas_lt_rows()


def test_fp8_gemm_switches(monkeypatch):
    from lorafleet.runner.config import KernelChoices

    for var in ("LORAFLEET_FP8_SWAP_ROWS", "LORAFLEET_FP8_GEMM_ROWS", "LORAFLEET_FP8_UNIT_SCALE_ELEMS",
                "LORAFLEET_FP8_GEMM_BF16", "LORAFLEET_FP8_EPILOGUE", "LORAFLEET_FP8_QUANT_IN_SHRINK"):
        monkeypatch.delenv(var, raising=False)
    assert (env.fp8_swap_rows(), env.fp8_gemm_rows(), env.fp8_unit_scale_elems()) == (0, 0, 1)
    assert env.fp8_epilogue() and env.fp8_quant_in_shrink()
    assert KernelChoices.from_env() == KernelChoices()  # the dataclass's defaults are the environment's
    monkeypatch.setenv("LORAFLEET_FP8_EPILOGUE", "0")
    monkeypatch.setenv("LORAFLEET_FP8_QUANT_IN_SHRINK", "0")
    assert KernelChoices.from_env().describe() == "kernel choices: fp8_epilogue=False, fp8_quant_in_shrink=False"
    monkeypatch.delenv("LORAFLEET_FP8_EPILOGUE")
    monkeypatch.delenv("LORAFLEET_FP8_QUANT_IN_SHRINK")
    # each switch: its default (why, in the comment), and the choice it names when set
    for var, read, default, raw, described in (
            ("LORAFLEET_ROPE_KV_FP8", env.rope_kv_fp8, True, "0", "rope_kv_fp8=False"),  # on: +9 % with FP8 pages
            ("LORAFLEET_NORM_SHRINK", env.norm_shrink, False, "1", "norm_shrink=True"),  # off: measured slower
            ("LORAFLEET_NORM_QUANT", env.norm_quant, True, "0", "norm_quant=False"),  # on: measured faster
            ("LORAFLEET_SHRINK_EARLY", env.shrink_early, False, "1", "shrink_early=True"),  # off: no gain end to end
            ("LORAFLEET_DECODE_RANKS", env.decode_ranks, (0, 0, 0, 0), "4",
             "decode_ranks=(4, 4, 4, 4)"),  # 0: the kernel's own choice
            ("LORAFLEET_SHRINK_ROW_ITEMS", env.shrink_row_items, False, "1",
             "shrink_row_items=True"),  # off until measured
            ("LORAFLEET_LORA_BRANCH", env.lora_branch, "off", "Shrink", "lora_branch=shrink"),  # off: measured slower
            ("LORAFLEET_FP8_EPILOGUE_ACT", env.fp8_epilogue_act, True, "0", "fp8_epilogue_act=False"),  # on: measured faster
            ("LORAFLEET_FP8_SM90", env.fp8_sm90, True, "0", "fp8_sm90=False"),  # on: measured faster
            ("LORAFLEET_FP8_SM90_FUSED", env.fp8_sm90_fused, True, "0", "fp8_sm90_fused=False"),  # on: measured faster
            ("LORAFLEET_FP8_SM90_SHRINK", env.fp8_sm90_shrink, True, "0",
             "fp8_sm90_shrink=False"),  # on (with the producer's warps): measured faster
            ("LORAFLEET_FP8_SM90_SHRINK_PRODUCER", env.fp8_sm90_shrink_producer, True, "0",
             "fp8_sm90_shrink_producer=False"),  # on: measured faster
            ("LORAFLEET_FP8_SM90_SPLIT", env.fp8_sm90_split, False, "1", "fp8_sm90_split=True"),
            ("LORAFLEET_FP8_SM90_PERSISTENT", env.fp8_sm90_persistent, False, "1",
             "fp8_sm90_persistent=True"),  # off until measured
            ("LORAFLEET_BF16_SM90", env.bf16_sm90, True, "0", "bf16_sm90=False"),  # on: measured faster
            ("LORAFLEET_SM90_SHRINK", env.sm90_shrink, True, "0", "sm90_shrink=False"),  # on: measured faster
            ("LORAFLEET_SM90_SHRINK_PRODUCER", env.sm90_shrink_producer, False, "1",
             "sm90_shrink_producer=True"),  # off: measured slower in bf16
            ("LORAFLEET_SM90_SHRINK_FIRST", env.sm90_shrink_first, True, "0",
             "sm90_shrink_first=False"),  # on: measured faster
            ("LORAFLEET_NORM_EARLY", env.norm_early, True, "0", "norm_early=False"),  # on: measured faster
            ("LORAFLEET_EPILOGUE_EARLY", env.epilogue_early, True, "0", "epilogue_early=False"),  # on: measured faster
            ("LORAFLEET_ROPE_KV_PDL", env.rope_kv_pdl, True, "0", "rope_kv_pdl=False")):  # on: measured faster
        monkeypatch.delenv(var, raising=False)
        assert read() == default, var
        monkeypatch.setenv(var, raw)
        assert KernelChoices.from_env().describe() == f"kernel choices: {described}"
        monkeypatch.delenv(var)
    for bad in ("1", "0", "on", "both"):  # a choice, not a switch
        monkeypatch.setenv("LORAFLEET_LORA_BRANCH", bad)
        with pytest.raises(ValueError, match="LORAFLEET_LORA_BRANCH must be one of off, addon, shrink"):
            env.lora_branch()
    monkeypatch.delenv("LORAFLEET_LORA_BRANCH")
    with pytest.raises(ValueError, match="kernel choice lora_branch must be one of off, addon, shrink"):
        KernelChoices(lora_branch="on")
    for bad in ("3", "8", "-1", "4,1,2", "4,1,2,1,1", "4,,2,1", "four", "4;1;2;1"):
        monkeypatch.setenv("LORAFLEET_DECODE_RANKS", bad)
        with pytest.raises(ValueError, match="LORAFLEET_DECODE_RANKS must be 0, 1, 2 or 4, or four of them"):
            env.decode_ranks()
    # one per group (qkv, o, gate_up, down), blanks allowed
    monkeypatch.setenv("LORAFLEET_DECODE_RANKS", " 4, 1,2 ,1")
    assert env.decode_ranks() == (4, 1, 2, 1)
    assert KernelChoices.from_env().describe() == "kernel choices: decode_ranks=(4, 1, 2, 1)"
    monkeypatch.delenv("LORAFLEET_DECODE_RANKS")
    assert KernelChoices(decode_ranks=2).decode_ranks == (2, 2, 2, 2)  # one number: every group's
    for bad in (3, (4, 1, 2), (4, 1, 2, 3), (4.0, 1, 2, 1), 4.0, True, (True, 1, 2, 1), "4"):
        with pytest.raises(ValueError, match="decode_ranks must be 0, 1, 2 or 4"):
            KernelChoices(decode_ranks=bad)
    monkeypatch.setenv("LORAFLEET_FP8_UNIT_SCALE_ELEMS", "-5")
    with pytest.raises(ValueError, match="LORAFLEET_FP8_UNIT_SCALE_ELEMS must be >= 0"):
        env.fp8_unit_scale_elems()
    monkeypatch.setenv("LORAFLEET_FP8_UNIT_SCALE_ELEMS", "0")
    assert KernelChoices.from_env().describe() == "kernel choices: fp8_unit_scale_elems=0"
    monkeypatch.delenv("LORAFLEET_FP8_UNIT_SCALE_ELEMS")
    monkeypatch.setenv("LORAFLEET_FP8_SWAP_ROWS", "64")
    monkeypatch.setenv("LORAFLEET_FP8_GEMM_ROWS", "32")
    k = KernelChoices.from_env()
    assert (k.fp8_swap_rows, k.fp8_gemm_rows) == (64, 32)
    assert k.describe() == "kernel choices: fp8_swap_rows=64, fp8_gemm_rows=32"
    monkeypatch.setenv("LORAFLEET_FP8_GEMM_ROWS", "65")  # the kernel takes at most 64 rows
    with pytest.raises(ValueError, match="LORAFLEET_FP8_GEMM_ROWS must be in \\[0, 64\\]"):
        env.fp8_gemm_rows()
    monkeypatch.setenv("LORAFLEET_FP8_SWAP_ROWS", "-1")
    with pytest.raises(ValueError, match="LORAFLEET_FP8_SWAP_ROWS must be >= 0"):
        env.fp8_swap_rows()
    with pytest.raises(ValueError, match="fp8_gemm_rows must be in"):
        KernelChoices(fp8_gemm_rows=-1)
    monkeypatch.delenv("LORAFLEET_FP8_SWAP_ROWS")
    monkeypatch.delenv("LORAFLEET_FP8_GEMM_ROWS")
    monkeypatch.setenv("LORAFLEET_FP8_GEMM_BF16", "0" if KernelChoices().fp8_gemm_bf16 else "1")
    assert KernelChoices.from_env().fp8_gemm_bf16 != KernelChoices().fp8_gemm_bf16


def test_kernel_choices_are_read_once_validated_and_described(monkeypatch):
    from lorafleet.runner.config import KernelChoices

    monkeypatch.setenv("LORAFLEET_PREFILL_BACKEND", "fa2")
    monkeypatch.setenv("LORAFLEET_BLAS_LT_ROWS", "0")
    monkeypatch.setenv("LORAFLEET_ROPE_KV", "0")
    k = KernelChoices.from_env()
    assert (k.prefill, k.blas_lt_rows, k.rope_kv, k.attention) == ("fa2", 0, False, "auto")
    assert k.describe() == "kernel choices: prefill=fa2, rope_kv=False, blas_lt_rows=0"
    assert KernelChoices().describe() == "kernel choices: defaults"
    monkeypatch.setenv("LORAFLEET_SGMV", "cuda ")
    assert KernelChoices.from_env().sgmv == "cuda"
    monkeypatch.setenv("LORAFLEET_SGMV", "gpu")
    with pytest.raises(ValueError, match="LORAFLEET_SGMV must be one of auto, cuda, torch"):
        KernelChoices.from_env()
    with pytest.raises(ValueError, match="prefill must be one of"):
        KernelChoices(prefill="fa4")
    with pytest.raises(ValueError, match="mma_rows"):
        KernelChoices(mma_rows=((1, 1),))


def test_engine_refuses_a_bad_blas_lt_rows_at_start(monkeypatch):
    from lorafleet.runner.engine.engine import Engine

    monkeypatch.setenv("LORAFLEET_BLAS_LT_ROWS", "-5")
    with pytest.raises(ValueError, match="LORAFLEET_BLAS_LT_ROWS"):
        Engine("/nonexistent/model")  # refused before the model path is looked at


def test_cpu_models_never_switch_the_blas_backend(monkeypatch, tmp_path):
    """The cuBLASLt switch is for CUDA only (a CPU build of torch cannot even select it): a CPU model
    keeps lt_rows at 0 whatever the variable says."""
    import torch

    from lorafleet.runner.config import KernelChoices
    from lorafleet.runner.model.decoder import Decoder
    from lorafleet.runner.model.weights import load_model
    from model_helpers import write_random_llama

    write_random_llama(tmp_path)
    cpu = torch.device("cpu")
    loaded = load_model(str(tmp_path), None, cpu, torch.float32)
    model = Decoder(loaded.config, loaded.params, torch.float32, cpu, KernelChoices(blas_lt_rows=1000))
    assert model.lt_rows == 0


def test_prefer_cublaslt_restores_the_backend_under_overlapping_holders(monkeypatch):
    """torch's preferred BLAS backend is process-wide. Nested and concurrent holders of prefer_cublaslt
    (two engines' threads) must leave it as it was, also when a body raises; while any holder is inside,
    it stays cuBLASLt. (A CPU build of torch cannot select cuBLASLt: a stand-in records the setting.)"""
    import threading

    import torch

    from lorafleet.runner.model import ops

    state = {"backend": "cublas", "sets": 0}

    def preferred(backend=None):
        if backend is not None:
            state["backend"] = backend
            state["sets"] += 1
        return state["backend"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    with ops.prefer_cublaslt():
        assert state["backend"] == "cublaslt"
        with ops.prefer_cublaslt():
            assert state["backend"] == "cublaslt"
        assert state["backend"] == "cublaslt"  # the inner exit does not restore under the outer holder
    assert state["backend"] == "cublas"
    with pytest.raises(KeyError):
        with ops.prefer_cublaslt():
            raise KeyError("body")
    assert state["backend"] == "cublas"

    # The holder that entered first leaves first: the second still holds cuBLASLt, and its exit restores
    # the backend of before the first entry.
    step = threading.Barrier(2)
    seen = []

    def holder(first: bool):
        if not first:
            step.wait()  # (1) the first holds it
        with ops.prefer_cublaslt():
            if first:
                step.wait()  # (1)
                step.wait()  # (2) both hold it
            else:
                step.wait()  # (2)
                step.wait()  # (3) the first has left
                seen.append(state["backend"])
        if first:
            step.wait()  # (3)

    threads = [threading.Thread(target=holder, args=(f,)) for f in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == ["cublaslt"]
    assert state["backend"] == "cublas"


@pytest.mark.parametrize("var,read,field,value", [
    ("LORAFLEET_DENSE_LORA_ROWS", env.dense_lora_rows, "dense_lora_rows", 512),
    ("LORAFLEET_DENSE_LORA_KEXT", env.dense_lora_kext, "dense_lora_kext", 32),
])
def test_dense_lora_counts_refuse_a_negative_count(monkeypatch, var, read, field, value):
    monkeypatch.setenv(var, "-1")
    with pytest.raises(ValueError, match=f"{var} must be .*>= 0, got -1"):
        read()
    monkeypatch.setenv(var, str(value))
    from lorafleet.runner.config import KernelChoices

    assert getattr(KernelChoices.from_env(), field) == value
    with pytest.raises(ValueError, match=f"{field} must be >= 0"):
        KernelChoices(**{field: -5})


def test_dense_lora_kext_keeps_rows_16_byte_aligned(monkeypatch):
    from lorafleet.runner.config import KernelChoices

    monkeypatch.setenv("LORAFLEET_DENSE_LORA_KEXT", "12")
    with pytest.raises(ValueError, match="LORAFLEET_DENSE_LORA_KEXT must be a multiple of 8 .* got 12"):
        env.dense_lora_kext()
    with pytest.raises(ValueError, match="dense_lora_kext must be a multiple of 8"):
        KernelChoices(dense_lora_kext=4)


@pytest.mark.parametrize("var,default", [("LORAFLEET_SHRINK_EARLY", False), ("LORAFLEET_FP8_EPILOGUE", True),
                                         ("LORAFLEET_FUSED_OPS", True), ("LORAFLEET_ALLOW_PRIVATE_SOURCES", False)])
def test_switches_take_the_usual_spellings_and_refuse_anything_else(monkeypatch, var, default):
    read = {"LORAFLEET_SHRINK_EARLY": env.shrink_early, "LORAFLEET_FP8_EPILOGUE": env.fp8_epilogue,
            "LORAFLEET_FUSED_OPS": env.fused_ops, "LORAFLEET_ALLOW_PRIVATE_SOURCES": env.allow_private_sources}[var]
    for raw, want in (("", default), ("  ", default), ("1", True), ("TRUE", True), ("yes", True), (" on ", True),
                      ("0", False), ("False", False), ("no", False), ("OFF", False)):
        monkeypatch.setenv(var, raw)
        assert read() is want, (var, raw)
    monkeypatch.delenv(var)
    assert read() is default
    for raw in ("2", "enable", "ture", "-1"):
        monkeypatch.setenv(var, raw)
        with pytest.raises(ValueError, match=f"{var} must be 1 or 0 .*got '{raw}'"):
            read()
