"""Base-model weights: an HF directory (config.json + *.safetensors), a GGUF file or a synthetic directory,
read through the family's checkpoint plan into the engine's parameters.

    loaded = load_model(path, shard, device, dtype)   # family, whole-model config, lazy parameters
    qkv = loaded.params.pop("layers.0.qkv")           # this rank's rows, stacked, on the device

Readers name tensors as the family's checkpoint does (GGUF names are mapped to those first), so one plan
(lorafleet.models.contract.checkpoint_plan) serves every format, and a tensor-parallel rank reads only its
slices of each. Pickle checkpoints are refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lorafleet.models import registry
from lorafleet.models.contract import (Family, ModelConfig, ModelConfigError, ModelError, checkpoint_plan,
                                       checkpoint_shapes)

log = logging.getLogger(__name__)


class WeightsError(ModelError):
    """Missing, corrupt or unsupported base-model weights."""


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix.lower() == ".gguf"


def read_hf_config(model_dir: Path) -> dict:
    """config.json as a dict, with generation_config.json's eos ids when it has them."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise WeightsError(f"{model_dir} has no config.json (expected a Hugging Face model directory or a .gguf file)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise WeightsError(f"{cfg_path} must hold a JSON object")
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text())
            if isinstance(g, dict) and g.get("eos_token_id") is not None:
                cfg = {**cfg, "eos_token_id": g["eos_token_id"]}
        except (json.JSONDecodeError, UnicodeDecodeError):
            log.warning("ignoring unreadable %s", gen)
    return cfg


def typed_config(fam: Family, hf: dict, name: str) -> ModelConfig:
    """The family's typed config of `hf`; a setting of the wrong kind or out of range that the family's reader
    does not name itself (a string where a number goes, say) -> ModelConfigError saying so, not a traceback."""
    try:
        return fam.config(hf, name)
    except ModelConfigError:
        raise
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as exc:
        raise ModelConfigError(f"the model's config has a setting of the wrong kind or out of range "
                               f"({type(exc).__name__}: {exc})") from None


# --- readers: checkpoint name -> (sliced) tensor ---------------------------------------------------------


class SafetensorsReader:
    """The safetensors files of an HF directory; slices are read from the files, not whole tensors."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._open: dict[Path, object] = {}
        self._safe_open = safe_open
        for f in _safetensors_files(model_dir):
            for name in self._file(f).keys():
                if name in self.where:  # which copy wins would depend on file order: neither does
                    raise WeightsError(f"{model_dir}: tensor {name} is in both {self.where[name].name} and {f.name}")
                self.where[name] = f

    def _file(self, f: Path):
        h = self._open.get(f)
        if h is None:
            try:
                h = self._open[f] = self._safe_open(str(f), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise WeightsError(f"cannot read {f.name}: {exc}") from None
        return h

    def names(self) -> set[str]:
        return set(self.where)

    def read(self, name: str, rows=None, cols=None) -> torch.Tensor | None:
        f = self.where.get(name)
        if f is None:
            return None
        try:
            part = self._file(f).get_slice(name)
            ndim = len(part.get_shape())
            if ndim == 0:  # a scalar (a per-tensor FP8 scale): slices do not apply
                return self._file(f).get_tensor(name)
            if rows is None and cols is None:
                return part[:]
            r = slice(*rows) if rows is not None else slice(None)
            if ndim == 1:
                return part[r]
            return part[r, slice(*cols) if cols is not None else slice(None)]
        except Exception as exc:
            raise WeightsError(f"cannot read tensor {name} from {f.name}: {exc}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.where[name]).get_slice(name).get_shape())

    def close(self) -> None:
        self._open.clear()


def take_slice(t: torch.Tensor, rows=None, cols=None) -> torch.Tensor:
    """Rows [lo, hi) and columns [lo, hi) of a tensor (None: all)."""
    if rows is not None:
        t = t[rows[0]:rows[1]]
    if cols is not None:
        t = t[:, cols[0]:cols[1]]
    return t


class TensorReader:
    """Tensors already in memory (GGUF, dequantized), by checkpoint name."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def read(self, name: str, rows=None, cols=None) -> torch.Tensor | None:
        t = self.tensors.get(name)
        return None if t is None else take_slice(t, rows, cols)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def close(self) -> None:
        self.tensors = {}


def _shard_name(f) -> bool:
    """Whether an index entry names a .safetensors file in the model directory itself."""
    return isinstance(f, str) and f.endswith(".safetensors") and Path(f).name == f and f not in (".", "..")


def _regular(files: list[Path]) -> list[Path]:
    """`files`, each a regular file (or a link to one); WeightsError naming one that is not: opening a named pipe
    blocks until a writer comes (the load hung, out of reach of signals, inside safetensors), a directory or a
    device reads as no weights."""
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{f} is not a regular file (weights must be .safetensors files)")
    return files


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise WeightsError(f"{index.name} is not a valid safetensors index") from None
        if not isinstance(weight_map, dict) or not all(_shard_name(f) for f in weight_map.values()):
            raise WeightsError(f"{index.name} is not a valid safetensors index: its weight_map must map tensor names to "
                               "the names of .safetensors files in the model directory")
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise WeightsError(f"{model_dir}: shards listed in the index are missing: {', '.join(missing)}")
        return _regular(files)
    files = _regular(sorted(model_dir.glob("*.safetensors")))
    if not files:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        if pickled:
            raise WeightsError(
                f"{model_dir} holds only pickle checkpoints ({pickled[0]}); they are never unpickled — convert to safetensors"
            )
        raise WeightsError(f"{model_dir} holds no *.safetensors weights")
    return files


# --- the engine's parameters ------------------------------------------------------------------------------


PROJECTION_PARAMS = ("qkv", "o", "gate_up", "down")  # the engine parameters FP8 applies to
# dtypes whose values the engine converts to its own dtype as the numbers they are
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def plain_float(t: torch.Tensor, name: str) -> torch.Tensor:
    """`t` itself when it holds plain floating-point values; WeightsError naming checkpoint tensor `name` otherwise
    (integers, booleans or FP8 without its scales, cast to the engine's dtype, would stand for other numbers)."""
    if t.dtype in FLOAT_DTYPES:
        return t
    fp8 = " (FP8 only as the projection weights of a pre-quantized checkpoint whose config.json has a " \
          "quantization_config)" if t.dtype.is_floating_point else ""
    raise WeightsError(f"tensor {name} has dtype {str(t.dtype).removeprefix('torch.')}; weights must be float32, "
                       f"float16, bfloat16 or float64{fp8}")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t` (a floating-point tensor). Min and max propagate NaN and reach +-Inf: one vectorized
    pass (isfinite().all() takes ~40x longer)."""
    return not t.numel() or bool(torch.isfinite(torch.stack(torch.aminmax(t.reshape(-1)))).all())


def finite(t: torch.Tensor, name: str) -> torch.Tensor:
    """`t` itself, or WeightsError naming checkpoint tensor `name` when it holds NaN or Inf (a model that would
    load and answer with garbage)."""
    if t.is_floating_point() and not all_finite(t):
        raise WeightsError(f"tensor {name} of the checkpoint contains NaN or Inf values")
    return t


class Params:
    """The engine parameters of a model (this tensor-parallel rank's part), read on `pop` from a reader in
    checkpoint names through the family's plan, on `device` in `dtype`."""

    def __init__(self, family: Family, cfg: ModelConfig, reader, shard=None, device="cpu", dtype=torch.float32,
                 fp8: bool = False, scheme=None):
        """`fp8`: the projection weights as per-row-scaled FP8 (quantized here from a bf16/fp16 checkpoint, or
        as a pre-quantized checkpoint's `scheme` (lorafleet.models.quant) stores them)."""
        self.family, self.cfg, self.reader, self.shard = family, cfg, reader, shard
        self.device, self.dtype = torch.device(device), dtype
        self.fp8, self.scheme = fp8 or scheme is not None, scheme
        self.plan = {p.name: p for p in checkpoint_plan(family, cfg)}
        self.shapes = checkpoint_shapes(family, cfg)
        self.read_names: set[str] = set()
        if cfg.tie_word_embeddings:  # transformers ties lm_head to the embedding, whatever the file holds
            self.read_names.add(family.checkpoint.lm_head)

    def pop(self, name: str) -> torch.Tensor | None:
        """Engine parameter `name` (e.g. `layers.3.qkv`), its parts stacked by rows; None for an optional
        parameter the checkpoint lacks, and for row-parallel biases off rank 0. Missing required -> WeightsError."""
        param = self.plan.pop(name, None)
        if param is None:
            raise KeyError(name)
        if name == "lm_head" and self.cfg.tie_word_embeddings:
            self._check_tied_head()
            return None
        if self.fp8 and name.startswith("layers.") and name.rsplit(".", 1)[1] in PROJECTION_PARAMS:
            return self._pop_fp8(param)
        pieces = []
        for part in param.parts:
            self.read_names.add(part.name)
            if part.rank0_only and self.shard is not None and self.shard.rank != 0:
                return None
            self._check_shape(part.name)
            t = self._read(part)
            if t is None:
                if param.required:
                    raise WeightsError(f"the weights lack tensor {part.name} (is this a {self.family.name} checkpoint?)")
                return None
            pieces.append(finite(plain_float(t, part.name), part.name))
        t = pieces[0] if len(pieces) == 1 else torch.cat([p.to(self.device) for p in pieces], 0)
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def _pop_fp8(self, param):
        """A projection weight as per-row-scaled FP8, this rank's rows (column-parallel) or columns
        (row-parallel: scales of whole rows, so that every tensor-parallel size rounds alike)."""
        from lorafleet.runner.model.fp8 import E4M3, Fp8Weight, from_checkpoint, quantize_rows

        pieces = []
        for part in param.parts:
            self.read_names.add(part.name)
            if part.name not in self.reader.names():
                raise WeightsError(f"the weights lack tensor {part.name} (is this a {self.family.name} checkpoint?)")
            self._check_shape(part.name)
            # block scales cover whole 128 x 128 tiles: read the whole tensor, then take this part's rows
            block = self.scheme is not None and self.scheme.strategy == "block"
            rows = None if block else part.rows
            tp = self.shard is not None and self.shard.size > 1
            if tp and part.split == 0 and not block:
                lo, hi = rows if rows is not None else (0, self.reader.shape(part.name)[0])
                a, b = self.shard.span(hi - lo)
                rows = (lo + a, lo + b)
            t = self.reader.read(part.name, rows, None)
            if t.dtype == E4M3:
                if self.scheme is None:
                    raise WeightsError(f"{part.name} is FP8 but the config has no quantization_config")
                sname = part.name[: -len("weight")] + self.scheme.scale_name
                self.read_names.add(sname)
                if sname not in self.reader.names():
                    raise WeightsError(f"the weights lack the FP8 scale {sname}")
                self._check_scale(sname, self.shapes[part.name])
                srows = rows if self.scheme.strategy == "channel" else None
                finite(t.float(), part.name)  # e4m3fn holds NaN (no Inf)
                scale = finite(plain_float(self.reader.read(sname, srows, None), sname), sname)
                w = from_checkpoint(t, scale, self.scheme.strategy, self.scheme.block)
            else:  # a bf16/fp16 checkpoint, or a module the checkpoint left unquantized
                w = quantize_rows(finite(plain_float(t, part.name), part.name))
            if block:
                lo, hi = part.rows if part.rows is not None else (0, w.q.shape[0])
                if tp and part.split == 0:
                    a, b = self.shard.span(hi - lo)
                    lo, hi = lo + a, lo + b
                w = Fp8Weight(w.q[lo:hi].contiguous(), w.scale[lo:hi].contiguous())
            if tp and part.split == 1:
                w = w.narrow_cols(*self.shard.span(w.q.shape[1]))
            pieces.append(w)
        q = torch.cat([p.q for p in pieces], 0) if len(pieces) > 1 else pieces[0].q
        s = torch.cat([p.scale for p in pieces], 0) if len(pieces) > 1 else pieces[0].scale
        return Fp8Weight(q.contiguous(), s.contiguous()).to(self.device)

    def _check_tied_head(self) -> None:
        """With tied embeddings, an lm_head in the checkpoint must be the embedding itself: a different one is
        used by some transformers versions and dropped by others, so neither reading is safe to pick silently."""
        ck = self.family.checkpoint
        if ck.lm_head not in self.reader.names() or ck.embed not in self.reader.names():
            return
        head, embed = self.reader.read(ck.lm_head), self.reader.read(ck.embed)
        if head.shape != embed.shape or not torch.equal(head, embed.to(head.dtype)):
            raise WeightsError(f"config.json ties the output head to the embeddings (tie_word_embeddings true) but the "
                               f"checkpoint holds a different {ck.lm_head}: set tie_word_embeddings to false to use it, "
                               f"or remove it from the checkpoint")

    def _check_shape(self, name: str) -> None:
        """WeightsError when checkpoint tensor `name` (when present) has another shape than the config implies:
        a wrong shape would fail mid-step or, broadcast, silently compute something else."""
        want = self.shapes.get(name)
        if want is None or name not in self.reader.names():
            return
        got = tuple(self.reader.shape(name))
        if got != want:
            raise WeightsError(f"tensor {name} has shape {list(got)}; the model's config implies {list(want)}")

    def _check_scale(self, sname: str, wshape: tuple[int, ...]) -> None:
        """WeightsError when FP8 scale `sname` of a [N, K] weight does not have its strategy's shape: per channel
        [N] or [N, 1], per tensor one value, per block [ceil(N / rows), ceil(K / cols)]."""
        n, k = wshape
        got = tuple(self.reader.shape(sname))
        strategy = self.scheme.strategy
        if strategy == "channel":
            ok, want = got in ((n,), (n, 1)), f"[{n}] or [{n}, 1]"
        elif strategy == "tensor":
            ok, want = len(got) <= 2 and all(d == 1 for d in got), "one value"
        else:
            br, bc = self.scheme.block
            need = (-(-n // br), -(-k // bc))
            ok, want = got == need, f"{list(need)} ({br} x {bc} blocks)"
        if not ok:
            raise WeightsError(f"FP8 scale {sname} has shape {list(got)}; {strategy} scales of a {[n, k]} weight "
                               f"have shape {want}")

    def _read(self, part) -> torch.Tensor | None:
        rows, cols = part.rows, None
        if self.shard is not None and self.shard.size > 1 and part.split is not None:
            if part.name not in self.reader.names():
                return None
            full = self.reader.shape(part.name)
            if part.split == 0:
                lo, hi = rows if rows is not None else (0, full[0])
                a, b = self.shard.span(hi - lo)
                rows = (lo + a, lo + b)
            else:
                cols = self.shard.span(full[1])
        return self.reader.read(part.name, rows, cols)

    def unexpected(self) -> list[str]:
        """Checkpoint tensors no parameter read (ignoring the family's `ignore` list)."""
        ignore = self.family.checkpoint.ignore
        return sorted(n for n in self.reader.names() - self.read_names if not any(s in n for s in ignore))

    def close(self) -> None:
        self.reader.close()


@dataclass
class Loaded:
    family: Family
    config: ModelConfig  # the whole model (a tensor-parallel rank's part: shard.config(config))
    params: Params
    hf_config: dict


# --- GGUF -------------------------------------------------------------------------------------------------


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _required(reader, key: str) -> int:
    """Integer GGUF metadata `key`; WeightsError when the file lacks it or holds something else."""
    v = _field(reader, key)
    try:
        if v is None or isinstance(v, (bool, str)):
            raise TypeError(v)
        n = int(v)
    except (TypeError, ValueError):
        raise WeightsError(f"the GGUF metadata {'lacks ' + key if v is None else f'{key} is {v!r}, not a count'}") from None
    if n < 1:
        raise WeightsError(f"the GGUF metadata {key} must be at least 1, got {n}")
    return n


def _dequantize(t) -> np.ndarray:
    """A GGUF tensor's values as float32; WeightsError naming a tensor type the gguf library cannot dequantize."""
    from gguf.quants import dequantize

    try:
        return dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    except (NotImplementedError, ValueError) as exc:
        kind = getattr(t.tensor_type, "name", t.tensor_type)
        raise WeightsError(f"GGUF tensor {t.name} has type {kind}, which cannot be loaded ({exc})") from None


def gguf_hf_config(reader, name: str) -> tuple[Family, dict]:
    """(family, an HF-style config dict) from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    fam = registry.family_for_gguf(str(arch))
    a = arch
    heads = _required(reader, f"{a}.attention.head_count")
    hidden = _required(reader, f"{a}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{a}.vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise WeightsError(f"the GGUF metadata has neither {a}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = _field(reader, f"{a}.attention.key_length") or _field(reader, f"{a}.rope.dimension_count") or hidden // heads
    cfg = {
        "architectures": [fam.architectures[0]],
        "model_type": fam.model_types[0],
        "hidden_size": hidden,
        "intermediate_size": _required(reader, f"{a}.feed_forward_length"),
        "num_hidden_layers": _required(reader, f"{a}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{a}.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "_name_or_path": name,
    }
    # chat models end a turn with an end-of-turn token (Gemma's <end_of_turn>, Phi-3's <|end|>): a stop too
    stops = [cfg["eos_token_id"]] + [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    stops = [int(s) for s in dict.fromkeys(stops) if s is not None]
    cfg["eos_token_id"] = stops if len(stops) > 1 else (stops[0] if stops else None)
    scaling_type = _field(reader, f"{a}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {"rope_type": scaling_type, "factor": float(_field(reader, f"{a}.rope.scaling.factor", 1.0))}
    by_name = {t.name: t for t in reader.tensors}

    def tensor(name: str):
        t = by_name.get(name)
        return None if t is None else _dequantize(t).reshape(-1)

    freqs = tensor("rope_freqs.weight")
    if freqs is not None:  # llama.cpp keeps Llama-3.x RoPE scaling as one divisor per frequency
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "ext_factors": [float(f) for f in freqs]}
    if fam.gguf.config is not None:
        fam.gguf.config(lambda key, default=None: _field(reader, f"{a}.{key}", default), tensor, cfg)
    return fam, cfg


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path) -> tuple[Family, dict, dict[str, torch.Tensor]]:
    """(family, HF-style config, float32 tensors in the family's checkpoint names) of a GGUF file."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise WeightsError(f"cannot read GGUF file {path.name} (truncated or not a GGUF file?): {exc}") from None
    fam, cfg = gguf_hf_config(reader, path.stem)
    config = typed_config(fam, cfg, path.stem)
    g, ck = fam.gguf, fam.checkpoint
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in g.skip:
            continue
        if t.name in g.globals:
            name = g.globals[t.name]
        elif t.name.startswith("blk."):
            parts = t.name.split(".", 3)
            if len(parts) != 4 or not parts[1].isdigit() or parts[2] not in g.layer:
                raise WeightsError(f"unexpected GGUF tensor {t.name} for architecture {g.arch}")
            _, idx, kind, suffix = parts
            if kind not in g.layer:
                raise WeightsError(f"unexpected GGUF tensor {t.name} for architecture {g.arch}")
            name = f"{ck.layer.format(i=idx)}{g.layer[kind]}.{suffix}"
        else:
            raise WeightsError(f"unexpected GGUF tensor {t.name} for architecture {g.arch}")
        arr = _dequantize(t)
        arr = arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if g.norm_shift and name.rsplit(".", 2)[-2].endswith("norm"):
            arr = arr + np.float32(g.norm_shift)  # the file's norm weights are shifted (Gemma: 1 + w)
        if g.permute_qk and name.endswith(ck.modules["q"] + ".weight"):
            arr = _unpermute_rope(arr, config.num_heads)
        elif g.permute_qk and name.endswith(ck.modules["k"] + ".weight"):
            arr = _unpermute_rope(arr, config.num_kv_heads)
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return fam, cfg, tensors


# --- any model path ---------------------------------------------------------------------------------------


def load_model(path: str | Path, shard=None, device="cpu", dtype=torch.float32, fp8: bool = False) -> Loaded:
    """Family, whole-model config and (lazy) engine parameters of this tensor-parallel rank from an HF
    directory, a .gguf file or a synthetic model directory (seeded random weights drawn on `device` in
    `dtype`, see runner/model/synthetic.py). `fp8`: projection weights as FP8 (a pre-quantized checkpoint's
    always are)."""
    from lorafleet.runner.model import synthetic

    p = Path(path)
    if not p.exists():
        raise WeightsError(f"model path {p} does not exist")
    try:
        if is_gguf(p):
            fam, hf, tensors = load_gguf(p)
            config, reader = typed_config(fam, hf, p.stem), TensorReader(tensors)
        elif p.is_dir():
            hf = read_hf_config(p)
            fam = registry.family_for(hf)
            config = typed_config(fam, hf, p.name)
            if synthetic.is_synthetic(p):
                declared = hf.get("_name_or_path")
                if isinstance(declared, str) and declared.strip("/"):  # a synthetic model keeps the name it was given
                    config = dataclasses.replace(config, name=declared.rstrip("/").rsplit("/", 1)[-1])
                seed, std = synthetic.synthetic_marker(p)
                reader = synthetic.SyntheticReader(fam, config, seed, device, dtype, std)
            else:
                reader = SafetensorsReader(p)
        else:
            raise WeightsError(f"{p} is neither a model directory nor a .gguf file")
    except ModelConfigError as exc:
        raise WeightsError(f"{p.name}: {exc}") from None
    if shard is not None:
        shard.check(config)
    from lorafleet.models.quant import quant_scheme

    try:
        scheme = quant_scheme(hf)
    except ModelConfigError as exc:
        raise WeightsError(f"{p.name}: {exc}") from None
    return Loaded(fam, config, Params(fam, config, reader, shard, device, dtype, fp8, scheme), hf)
