"""Independent reference: Hugging Face transformers + PEFT, one request at a time, fp32."""

from __future__ import annotations

from pathlib import Path

import torch


class HFReference:
    def __init__(self, model_dir: Path, adapters: dict[str, Path]):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        # eager attention: the soft-capped scores of Gemma-style configs are computed only there
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
        self.model = base
        self.peft = None
        for i, (name, path) in enumerate(adapters.items()):
            if i == 0:
                self.peft = PeftModel.from_pretrained(base, str(path), adapter_name=name).eval()
            else:
                self.peft.load_adapter(str(path), adapter_name=name)

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], adapter: str | None, max_new_tokens: int, eos: int | None = None) -> list[int]:
        ids = torch.tensor([prompt_ids])
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        kwargs["eos_token_id"] = eos
        if self.peft is None:
            out = self.model.generate(ids, **kwargs)
        elif adapter is None:
            with self.peft.disable_adapter():
                out = self.peft.generate(input_ids=ids, **kwargs)
        else:
            self.peft.set_adapter(adapter)
            out = self.peft.generate(input_ids=ids, **kwargs)
        return out[0, len(prompt_ids):].tolist()

    @torch.no_grad()
    def logits(self, ids: list[int], adapter: str | None) -> torch.Tensor:
        t = torch.tensor([ids])
        if self.peft is None:
            return self.model(t).logits[0].float()
        if adapter is None:
            with self.peft.disable_adapter():
                return self.peft(input_ids=t).logits[0].float()
        self.peft.set_adapter(adapter)
        return self.peft(input_ids=t).logits[0].float()
