"""Architecture -> family module, imported lazily. An unknown architecture is refused naming the supported ones."""

from __future__ import annotations

import importlib
from functools import lru_cache

from lorafleet.models.contract import Family, ModelConfig, ModelConfigError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")  # modules of lorafleet.models

# Checkpoints whose text model is one of ours but whose file layout is not (refused with a pointer).
_REFUSED = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma-3 checkpoint is not supported; use a text-only "
                                      "Gemma3ForCausalLM checkpoint",
}


@lru_cache(maxsize=None)
def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ModelConfigError(f"unknown model family {name!r} (supported: {', '.join(FAMILIES)})")
    return importlib.import_module(f"lorafleet.models.{name}").FAMILY


def supported() -> str:
    """The supported architectures, for messages."""
    return ", ".join(f"{a} ({family(n).notes})" for n in FAMILIES for a in family(n).architectures)


def family_for(cfg: dict) -> Family:
    """The family of an HF config.json: by `architectures`, else by `model_type`."""
    archs = cfg.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelConfigError(f"the model's config: 'architectures' must be a list of class names, got "
                               f"{cfg.get('architectures')!r}")
    for a in archs:
        if a in _REFUSED:
            raise ModelConfigError(f"{a}: {_REFUSED[a]}")
    mt = cfg.get("model_type")
    for n in FAMILIES:
        fam = family(n)
        if any(a in fam.architectures for a in archs):
            # transformers' Auto classes build the model of `model_type`, not of `architectures`: where the two
            # disagree, its reference and this engine would run different models (a Llama read as Mistral gets a
            # window, as Qwen3 q/k norms), so neither is picked silently
            if mt is not None and mt not in fam.model_types:
                raise ModelConfigError(f"the model's config contradicts itself: architectures {archs} name a "
                                       f"{fam.name} model but model_type is {mt!r} (a {fam.name} config has "
                                       f"model_type {' or '.join(map(repr, fam.model_types))})")
            return fam
    for n in FAMILIES:
        fam = family(n)
        if not archs and mt in fam.model_types:  # an architecture we lack (a classifier head, say) is refused
            return fam
    what = f"architectures {archs}" if archs else f"model_type {mt!r}"
    raise ModelConfigError(f"{what} is not supported; supported: {supported()}")


def family_for_gguf(arch: str) -> Family:
    for n in FAMILIES:
        fam = family(n)
        if fam.gguf is not None and fam.gguf.arch == arch:
            return fam
    ok = ", ".join(family(n).gguf.arch for n in FAMILIES if family(n).gguf is not None)
    raise ModelConfigError(f"GGUF architecture {arch!r} is not supported (supported: {ok})")


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    """The typed config of an HF config.json, through its family."""
    return family_for(cfg).config(cfg, name)


def shapes() -> dict[str, dict]:
    """Benchmark shapes of every family (`SHAPES` in each module): name -> config.json dict."""
    out: dict[str, dict] = {}
    for n in FAMILIES:
        out.update(getattr(importlib.import_module(f"lorafleet.models.{n}"), "SHAPES", {}))
    return out
