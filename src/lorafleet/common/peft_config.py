"""Validation of PEFT LoRA adapters against a base model, without torch.

`inspect_adapter` reads `adapter_config.json` and the safetensors header and either
returns an `AdapterSpec` (per-module rank and scaling) or raises `AdapterError` naming
the adapter and the reason. Unsupported PEFT features are refused, never ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.common.safetensors_header import HeaderError, read_header
from lorafleet.models import registry
from lorafleet.models.contract import PROJECTIONS, BaseShape, Checkpoint

__all__ = ["AdapterError", "AdapterSpec", "BaseShape", "ModuleLora", "inspect_adapter", "read_config",
           "scrub_paths", "refusal_reason"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
# The largest |lora_alpha / r| (or / sqrt(r) with rsLoRA) served: published adapters use 0.5-64; a scale past this
# makes the add-on swamp the layer's output, or overflow it to Inf in the serving dtype.
MAX_SCALING = 1e4
# init_lora_weights values (prefixes, as PEFT reads them) whose initialization rewrites the base model's weights
BASE_REWRITING_INITS = ("pissa", "corda", "astra", "olora", "loftq", "lora_ga")
# adapter_config.json is a few kilobytes (rank_pattern over every module of a large model: some hundreds); read whole
MAX_CONFIG_BYTES = 16 * 1024 * 1024



class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it and says why.

    Messages never hold a server path: they reach clients (the scheduler's 4xx) and
    Kubernetes statuses. `str(err)` is `adapter 'NAME': REASON` (see `refusal_reason`).
    """

    def __init__(self, adapter: str, reason: str):
        self.adapter = adapter
        self.reason = reason
        super().__init__(f"adapter {adapter!r}: {reason}")

    def __reduce__(self):  # crosses process boundaries (the adapter reader's workers)
        return type(self), (self.adapter, self.reason)


_ABS_PATH = re.compile(r"(?<![\w.:/])/[^\s'\"(),;]+")


def scrub_paths(text: str) -> str:
    """`text` with absolute filesystem paths replaced by `<path>` (for messages clients see)."""
    return _ABS_PATH.sub("<path>", text)


def refusal_reason(error: str | None, name: str) -> str | None:
    """The REASON of an AdapterError text `adapter 'NAME': REASON` for adapter `name`, else None."""
    prefix = f"adapter {name!r}: "
    if error and error.startswith(prefix):
        return error[len(prefix):]
    return None


@dataclass(frozen=True)
class ModuleLora:
    """One adapted projection: weights `a_key` [rank, in] and rows `b_rows` of `b_key` [out, rank] (None: all).
    A LoRA on a module the checkpoint fuses (Phi-3's fused qkv) is one entry per projection, sharing A and
    splitting B's rows."""

    layer: int
    proj: str
    rank: int
    scaling: float
    a_key: str
    b_key: str
    b_rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: Path
    base_model: str | None
    modules: tuple[ModuleLora, ...]
    size_bytes: int
    dtype: str
    use_rslora: bool = False
    config: dict = field(default_factory=dict, compare=False, repr=False)
    # what its content is, as far as the files say without reading the weights: the config, the tensor
    # table, and the weights file's size and modification time (a rewritten adapter gets a new one)
    fingerprint: str = ""

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(p for p in PROJECTIONS if any(m.proj == p for m in self.modules))

    @property
    def num_layers(self) -> int:
        return 1 + max(m.layer for m in self.modules)


def _head_modules() -> set[str]:
    """The output-head module names of every family (LoRA on them is refused)."""
    return {registry.family(n).checkpoint.lm_head.rsplit(".", 1)[0] for n in registry.FAMILIES}


def _lora_modules(base: BaseShape | None) -> tuple[Checkpoint, dict[str, tuple[str, ...]]]:
    """(checkpoint names, PEFT module -> projections) of the base's family; without a base, every family's
    modules (an adapter is then checked against whichever it names)."""
    if base is not None:
        ck = registry.family(base.family).checkpoint
        return ck, ck.peft_modules()
    known: dict[str, tuple[str, ...]] = {}
    for fam in registry.FAMILIES:
        ck = registry.family(fam).checkpoint
        for module, projs in ck.peft_modules().items():
            known.setdefault(module, projs)
    return registry.family("llama").checkpoint, known


def _key_pattern(ck: Checkpoint, modules) -> re.Pattern:
    """PEFT tensor keys: [base_model.model.][model.]layers.N.<module>.lora_A|lora_B[.adapter].weight."""
    layer = ck.layer[len("model."):] if ck.layer.startswith("model.") else ck.layer
    layer_re = r"(?:model\.)?" + re.escape(layer).replace(re.escape("{i}"), r"(\d+)")
    alts = "|".join(re.escape(m) for m in sorted(modules, key=len, reverse=True))
    return re.compile(rf"^(?:base_model\.model\.)?{layer_re}({alts})\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight$")


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a suffix of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _is_int(v) -> bool:
    """A JSON integer (not true / false, which Python counts as ints)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _targeted(cfg: dict, module_name: str) -> bool:
    """Whether PEFT would put a LoRA layer on `module_name` under this config (target_modules as a list: the
    name or a dotted suffix of it; as a string: "all-linear" or a full regex match; exclude_modules and
    layers_to_transform / layers_pattern as PEFT reads them). Without target_modules (PEFT's per-model defaults)
    or with a setting this does not read, True: nothing to contradict."""
    targets = cfg.get("target_modules")
    if not targets:
        return True
    if isinstance(targets, str):
        ok = targets == "all-linear" or re.fullmatch(targets, module_name) is not None
    elif module_name in targets:  # named in full: PEFT applies no layers_to_transform to it
        ok = True
    else:
        ok = any(module_name.endswith("." + str(t)) for t in targets)
        layers = cfg.get("layers_to_transform")
        if ok and layers is not None and layers != []:  # (PEFT: an empty list transforms every layer)
            ok = _layer_index(module_name, cfg.get("layers_pattern")) in ([layers] if isinstance(layers, int)
                                                                          else layers)
    exclude = cfg.get("exclude_modules")
    if ok and exclude:
        if isinstance(exclude, str):
            ok = re.fullmatch(exclude, module_name) is None
        else:
            ok = not any(module_name == t or module_name.endswith("." + str(t)) for t in exclude)
    return ok


def _layer_index(module_name: str, layers_pattern) -> int | None:
    """The layer number PEFT reads from a module name for layers_to_transform: that of its first numbered segment,
    or with layers_pattern, the number after the first pattern that matches (None: none does, PEFT then adapts
    nothing there)."""
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_name)
    else:
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module_name)
            if m is not None:
                break
    return int(m.group("idx")) if m else None


def _refuse_unsupported(name: str, cfg: dict) -> None:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type {peft_type} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise AdapterError(name, "DoRA adapters (use_dora=true) are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save={cfg['modules_to_save']!r} is not supported (full copies of base modules)")
    for key in ("target_modules", "exclude_modules"):
        v = cfg.get(key)
        if not (v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v))):
            raise AdapterError(name, f"{key} must be a module name, a list of them or a regex, got {v!r}")
        if isinstance(v, str) and v != "all-linear":
            try:
                re.compile(v)
            except re.error as exc:
                raise AdapterError(name, f"{key} {v!r} is not a valid regular expression ({exc})") from None
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for t in targets:
        if "embed" in str(t) or "wte" in str(t) or str(t) in _head_modules():
            raise AdapterError(name, f"LoRA on embeddings or lm_head ({t!r}) is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise AdapterError(name, f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("lora_bias"):
        raise AdapterError(name, "lora_bias=true is not supported")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(name, "fan_in_fan_out=true is not supported (Llama projections are nn.Linear)")
    for key in ("layer_replication", "trainable_token_indices", "target_parameters", "megatron_config"):
        if cfg.get(key):
            raise AdapterError(name, f"{key} is not supported")
    # LoRA variants PEFT turns on by the sub-config's presence, even an empty one: Arrow routes each token among LoRA
    # experts, KaSA truncates the base weights, BD-LoRA has block-diagonal factors; none is the plain add-on served here
    for key in ("arrow_config", "kasa_config", "use_bdlora"):
        if cfg.get(key) is not None and cfg.get(key) is not False:
            raise AdapterError(name, f"{key} is not supported (a LoRA variant other than plain LoRA)")
    init = cfg.get("init_lora_weights")
    # These initializations rewrite the base model's weights (to the residual of an SVD, a QR, a quantization), and
    # PEFT rewrites them again at every load: A and B were trained against that residual, so on the unmodified base,
    # which every adapter here shares, they would give other outputs. PEFT converts PiSSA, CorDA, OLoRA and Astra
    # adapters into plain LoRA ones (saved with init_lora_weights=true).
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise AdapterError(name, f"init_lora_weights={init!r} is not supported: PEFT rewrites the base model's weights "
                           "when it loads such an adapter, and the base model here is shared (save the adapter as "
                           "plain LoRA with PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))")
    if cfg.get("alora_invocation_tokens"):  # served as plain LoRA it would change every token, not only after them
        raise AdapterError(name, "activated LoRA (alora_invocation_tokens) is not supported")
    if cfg.get("use_qalora"):
        raise AdapterError(name, "QALoRA adapters (use_qalora=true) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(key)
        if v is None:
            continue
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise AdapterError(name, f"{key} must map module names (or regular expressions) to numbers, got {v!r}")
        for k, x in v.items():
            try:
                re.compile(rf"(.*\.)?({k})$")  # as _pattern_value matches it
            except re.error as exc:
                raise AdapterError(name, f"{key} key {k!r} is not a valid regular expression ({exc})") from None
            if not isinstance(x, (int, float)) or isinstance(x, bool) or x <= 0:
                raise AdapterError(name, f"{key}[{k!r}] must be a positive number, got {x!r}")
    layers, patterns = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if layers is not None and not (_is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
        raise AdapterError(name, f"layers_to_transform must be a layer number or a list of them, got {layers!r}")
    if patterns is not None and not (isinstance(patterns, str) or (isinstance(patterns, list)
                                                                   and all(isinstance(p, str) for p in patterns))):
        raise AdapterError(name, f"layers_pattern must be a string or a list of them, got {patterns!r}")
    for p in [patterns] if isinstance(patterns, str) else patterns or []:
        try:
            re.compile(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")  # as _layer_index matches it
        except re.error as exc:
            raise AdapterError(name, f"layers_pattern {p!r} is not a valid regular expression ({exc})") from None
    if isinstance(cfg.get("target_modules"), str) and (layers is not None or patterns is not None):
        raise AdapterError(name, "layers_to_transform and layers_pattern cannot be used with target_modules as a "
                                 "string (a regex or all-linear); PEFT refuses this config")
    r = cfg.get("r", 8)
    if not _is_int(r) or r < 1:
        raise AdapterError(name, f"r must be a positive integer, got {r!r}")


def read_config(name: str, path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(name, "the adapter is a file, not a directory" if path.exists()
                           else "adapter directory does not exist")
    if cfg_path.exists() and not cfg_path.is_file():  # a folder, a pipe, a device (or a link to one): never opened
        raise AdapterError(name, f"{CONFIG_FILE} is not a regular file")
    if not cfg_path.is_file():
        raise AdapterError(name, f"{CONFIG_FILE} not found")
    try:
        with cfg_path.open("rb") as f:  # at most one byte past the limit: a sparse file of terabytes takes no disk
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise AdapterError(name, f"cannot read {CONFIG_FILE} ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterError(name, f"{CONFIG_FILE} is larger than the {MAX_CONFIG_BYTES} bytes accepted")
    try:
        cfg = json.loads(raw)
    # ValueError: JSONDecodeError, and an integer past Python's digit limit
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise AdapterError(name, f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(name, f"{CONFIG_FILE} must hold a JSON object")
    _refuse_unsupported(name, cfg)
    return cfg


def weights_file(name: str, path: Path) -> Path:
    """The adapter's weights file, not opened: refuses a missing one, and pickle weights (never unpickled)."""
    weights = path / WEIGHTS_FILE
    if weights.exists() and not weights.is_file():  # a folder, a pipe, a device (or a link to one)
        raise AdapterError(name, f"{WEIGHTS_FILE} is not a regular file")
    if not weights.is_file():
        pickled = [p for p in PICKLE_FILES if (path / p).exists()]
        if pickled:
            raise AdapterError(
                name, f"only {WEIGHTS_FILE} is loaded; {pickled[0]} is a pickle file and is never unpickled "
                "(convert it with safetensors)"
            )
        raise AdapterError(name, f"{WEIGHTS_FILE} not found")
    return weights


def inspect_adapter(
    name: str, path: str | Path, base: BaseShape | None = None, max_rank: int | None = None
) -> AdapterSpec:
    """Validate a PEFT LoRA adapter directory and describe every adapted module.

    Refuses (AdapterError): missing or corrupt files, pickle weights, DoRA, modules_to_save,
    embedding/lm_head LoRA, LoRA biases, tensors that are not LoRA weights of q/k/v/o/gate/up/down,
    ranks above `max_rank`, shapes that do not fit `base`, and weights that contradict the config: a
    tensor of a module it leaves out, a rank other than its own, a module it targets left out.
    """
    path = Path(path)
    cfg = read_config(name, path)
    weights = weights_file(name, path)
    try:
        header = read_header(weights)
    except HeaderError as exc:
        raise AdapterError(name, f"corrupt weights: {exc}") from None
    except OSError as exc:
        raise AdapterError(name, f"cannot read {WEIGHTS_FILE} ({exc.strerror or type(exc).__name__})") from None

    ck, known = _lora_modules(base)
    pattern = _key_pattern(ck, known)
    pairs: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    dtypes = set()
    for key, (dtype, shape) in header.items():
        if "lora_embedding" in key or ".embed" in key:
            raise AdapterError(name, f"embedding LoRA is not supported (tensor {key})")
        if any(f".{m}." in key for m in _head_modules()):
            raise AdapterError(name, f"LoRA on lm_head is not supported (tensor {key})")
        if "lora_magnitude_vector" in key:
            raise AdapterError(name, f"DoRA adapters are not supported (tensor {key})")
        m = pattern.match(key)
        if not m:
            what = ", ".join(sorted(mod.rsplit(".", 1)[-1] for mod in known))
            raise AdapterError(name, f"unexpected tensor {key!r}: only lora_A/lora_B weights of {what} are supported"
                               + (f" on {base.family} models" if base is not None else ""))
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        slot = pairs.setdefault((layer, module), {})
        if ab in slot:
            raise AdapterError(name, f"tensor {key!r} appears twice")
        slot[ab] = (key, shape)
        dtypes.add(dtype)
    if not pairs:
        raise AdapterError(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    if not dtypes <= {"F64", "F32", "F16", "BF16"}:  # (F64: rounded once into the serving dtype at the load)
        raise AdapterError(name, f"LoRA weights must be floating point (F64, F32, F16 or BF16), got "
                                 f"{sorted(dtypes - {'F64', 'F32', 'F16', 'BF16'})}")

    rslora = bool(cfg.get("use_rslora"))
    default_alpha = cfg.get("lora_alpha", 8)
    modules = []
    order = list(known)
    for (layer, module), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        projs = known[module]
        where = f"layer {layer} {module.rsplit('.', 1)[-1]}"
        if "lora_A" not in ab or "lora_B" not in ab:
            raise AdapterError(name, f"{where}: lora_A and lora_B must both be present")
        (a_key, a_shape), (b_key, b_shape) = ab["lora_A"], ab["lora_B"]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] < 1:
            raise AdapterError(name, f"{where}: lora_A {list(a_shape)} and lora_B {list(b_shape)} do not form a LoRA pair")
        rank = a_shape[0]
        if max_rank is not None and rank > max_rank:
            raise AdapterError(name, f"{where}: rank {rank} exceeds this server's maximum LoRA rank {max_rank}")
        rows: list[tuple[int, int] | None] = [None] * len(projs)
        if base is not None:
            if layer >= base.num_layers:
                raise AdapterError(name, f"{where}: the base model{f' {base.name!r}' if base.name else ''} has only "
                                         f"{base.num_layers} layers")
            want_in = base.shape(projs[0])[0]
            outs = [base.shape(p)[1] for p in projs]
            if a_shape[1] != want_in or b_shape[0] != sum(outs):
                raise AdapterError(
                    name,
                    f"{where}: shapes in={a_shape[1]} out={b_shape[0]} do not fit the base model "
                    f"(expects in={want_in} out={sum(outs)}); was it trained for another base model?",
                )
            if len(projs) > 1:
                lo = 0
                for j, n in enumerate(outs):
                    rows[j] = (lo, lo + n)
                    lo += n
        module_name = ck.layer.format(i=layer) + module
        # Tensors PEFT would not load, or load into a layer of another rank, are refused: served, they would
        # give other outputs than the adapter gives under PEFT.
        if not _targeted(cfg, module_name):
            raise AdapterError(name, f"{where}: {WEIGHTS_FILE} holds LoRA weights for {module_name}, which the "
                               f"config's target_modules / exclude_modules / layers_to_transform leave out")
        want_rank = _pattern_value(cfg.get("rank_pattern"), module_name, cfg.get("r", 8))
        if rank != want_rank:
            raise AdapterError(name, f"{where}: the weights have rank {rank} but {CONFIG_FILE} gives "
                               f"{'rank_pattern' if want_rank != cfg.get('r', 8) else 'r'} = {want_rank}")
        alpha = _pattern_value(cfg.get("alpha_pattern"), module_name, default_alpha)
        # a JSON number only: PEFT cannot load a string (its scaling alpha / r raises), nor is true a scale
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise AdapterError(name, f"lora_alpha must be a number, got {alpha!r}")
        try:
            alpha = float(alpha)
        except OverflowError:
            raise AdapterError(name, "lora_alpha must be a finite number, got an integer beyond a float's range "
                               f"(for {module_name})") from None
        if not math.isfinite(alpha):
            raise AdapterError(name, f"lora_alpha must be a finite number, got {alpha!r} (for {module_name})")
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        if abs(scaling) > MAX_SCALING:
            raise AdapterError(name, f"lora_alpha {alpha:g} over {'sqrt(r)' if rslora else 'r'} with r = {rank} "
                               f"scales {module_name}'s add-on by {scaling:g}, beyond the {MAX_SCALING:g} served "
                               f"(it would swamp or overflow the layer's output)")
        for proj, r in zip(projs, rows):
            modules.append(ModuleLora(layer, proj, rank, scaling, a_key, b_key, r))
    _refuse_missing_targets(name, cfg, ck, base, pairs, pattern)

    return AdapterSpec(
        name=name,
        path=path,
        base_model=cfg.get("base_model_name_or_path"),
        modules=tuple(modules),
        size_bytes=weights.stat().st_size,
        dtype=sorted(dtypes)[0],
        use_rslora=rslora,
        config=cfg,
        fingerprint=_fingerprint(cfg, header, weights),
    )


def _checked_modules(base: BaseShape | None, present: set[str]) -> list[str]:
    """The PEFT modules whose absence from the weights counts: the base family's; without a base, those every
    family that has all of the file's modules has (so a module of another family is never asked for)."""
    if base is not None:
        return list(registry.family(base.family).checkpoint.peft_modules())
    fits = [list(ms) for ms in (registry.family(f).checkpoint.peft_modules() for f in registry.FAMILIES)
            if present <= set(ms)]
    return [m for m in fits[0] if all(m in ms for ms in fits[1:])] if fits else []


def _refuse_missing_targets(name: str, cfg: dict, ck: Checkpoint, base: BaseShape | None,
                            pairs: dict[tuple[int, str], dict], pattern: re.Pattern) -> None:
    """Refuse weights that lack a module the config targets (PEFT reports those keys missing and leaves the
    module's lora_B at zero, so it adds nothing; served, the adapter would silently lose that module):
    a targeted module with no tensor in any layer of the file (a truncated or broken file), or a layer of the
    file without a module the config targets there (target_modules, exclude_modules, layers_to_transform as
    `_targeted` reads them) while other layers hold it. Without target_modules (PEFT's per-model defaults)
    there is nothing to hold the file to."""
    if not cfg.get("target_modules"):
        return
    present = {module for _, module in pairs}
    layers = sorted({layer for layer, _ in pairs})
    missing: dict[str, list[int]] = {}
    for module in _checked_modules(base, present):
        for layer in layers:
            if (layer, module) not in pairs and _targeted(cfg, ck.layer.format(i=layer) + module):
                missing.setdefault(module, []).append(layer)
    nowhere = [m for m in missing if m not in present]
    if nowhere:
        short = [m.rsplit(".", 1)[-1] for m in nowhere]
        one = len(short) == 1
        raise AdapterError(name, f"{CONFIG_FILE} targets {', '.join(short)} but {WEIGHTS_FILE} holds no LoRA "
                           f"weights for {'it' if one else 'them'} in any layer (a truncated or broken file? PEFT "
                           f"would load {'that module' if one else 'those modules'} with lora_B = 0, adding "
                           f"nothing)")
    if missing:
        layer, module = min((ls[0], m) for m, ls in missing.items())
        # the key as this file spells it: another layer's lora_A key of the module with this layer's number
        other = next(ab["lora_A"][0] for (_, m), ab in sorted(pairs.items()) if m == module)
        got = pattern.match(other)
        key = other[:got.start(1)] + str(layer) + other[got.end(1):]
        raise AdapterError(name, f"layer {layer} {module.rsplit('.', 1)[-1]}: {WEIGHTS_FILE} has no {key} "
                           f"(nor its lora_B) although {CONFIG_FILE} targets {ck.layer.format(i=layer) + module} "
                           f"and other layers of the file hold {module.rsplit('.', 1)[-1]} weights")


def _fingerprint(cfg: dict, header: dict, weights: Path) -> str:
    st = weights.stat()
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(json.dumps(sorted((k, v[0], list(v[1])) for k, v in header.items())).encode())
    h.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    return h.hexdigest()
