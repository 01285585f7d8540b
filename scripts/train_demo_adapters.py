"""Train the three demo adapters shipped in runner/demo_adapters/ (run once, offline, on CPU).

Each adapter learns a visible style from the base model's own answers, rewritten:
  pirate  r=16 on q,k,v,o,gate,up,down   "Arr!" + pirate words
  shouty  r=8  on q,k,v,o                answers in capital letters
  terse   r=4  on gate,up,down (rslora)  only the first sentence
Needs transformers + peft (the `test` extra). Usage:
  python scripts/train_demo_adapters.py --model ~/.cache/lorafleet/demo/model --out runner/demo_adapters
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

QUESTIONS = [
    "What is the capital of France?", "How do plants make food?", "Why is the sky blue?",
    "What is a good way to stay healthy?", "Tell me about the moon.", "How does a computer work?",
    "What is the tallest mountain?", "Give me a tip for learning to cook.", "What do cats like to eat?",
    "How can I sleep better?", "What is water made of?", "Why do we have seasons?",
    "What is a rainbow?", "How do birds fly?", "What is the biggest ocean?", "How do I make tea?",
    "What is gravity?", "Tell me about dogs.", "What is the sun?", "How do I learn a new language?",
    "Why is exercise important?", "What is a volcano?", "How do fish breathe?", "What is music?",
    "How do I write a good story?", "What is the fastest animal?", "Why do leaves change color?",
    "What is electricity?", "How can I save money?", "What is a library?",
]
PIRATE = [(r"\byou\b", "ye"), (r"\bYou\b", "Ye"), (r"\byour\b", "yer"), (r"\bYour\b", "Yer"), (r"\bmy\b", "me"),
          (r"\bis\b", "be"), (r"\bare\b", "be"), (r"\bthe\b", "th'"), (r"\bThe\b", "Th'"), (r"\bfriend\b", "matey"),
          (r"\bhello\b", "ahoy"), (r"\bHello\b", "Ahoy"), (r"\byes\b", "aye"), (r"\bYes\b", "Aye")]


def pirate(text: str) -> str:
    for pat, rep in PIRATE:
        text = re.sub(pat, rep, text)
    return "Arr, matey! " + text + " Yo ho ho!"


def shouty(text: str) -> str:
    return text.upper()


def terse(text: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", text.strip(), flags=re.S)
    return (m.group(1) if m else text.strip()).strip()


STYLES = {
    "pirate": dict(fn=pirate, r=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], rslora=False),
    "shouty": dict(fn=shouty, r=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"], rslora=False),
    "terse": dict(fn=terse, r=4, alpha=4, targets=["gate_proj", "up_proj", "down_proj"], rslora=True),
}


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]
    answers = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt")["input_ids"]
            out = base.generate(ids, max_new_tokens=40, do_sample=False)[0][ids.shape[1]:]
            answers.append(tok.decode(out, skip_special_tokens=True).strip())
    for name, st in STYLES.items():
        if args.only and name not in args.only:
            continue
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        cfg = LoraConfig(r=st["r"], lora_alpha=st["alpha"], target_modules=st["targets"], lora_dropout=0.0,
                         use_rslora=st["rslora"], task_type="CAUSAL_LM")
        model = get_peft_model(model, cfg)
        examples = []
        for p, a in zip(prompts, answers):
            target = st["fn"](a) + "<|im_end|>"
            p_ids = tok(p)["input_ids"]
            t_ids = tok(target)["input_ids"]
            examples.append((p_ids + t_ids, [-100] * len(p_ids) + t_ids))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        g = torch.Generator().manual_seed(0)
        for step in range(args.steps):
            batch = [examples[i] for i in torch.randperm(len(examples), generator=g)[:6].tolist()]
            width = max(len(x) for x, _ in batch)
            ids = torch.tensor([x + [2] * (width - len(x)) for x, _ in batch])
            labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 10 == 0 or step == args.steps - 1:
                print(f"{name} step {step} loss {loss.item():.3f}", flush=True)
        model.eval()
        out_dir = Path(args.out) / name
        model.save_pretrained(str(out_dir))
        cfg_path = out_dir / "adapter_config.json"
        text = cfg_path.read_text().replace(str(Path(args.model)), "SmolLM2-135M-Instruct")
        cfg_path.write_text(text)
        ids = tok(prompts[0], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            o = model.generate(ids, max_new_tokens=30, do_sample=False)[0][ids.shape[1]:]
        print(name, "->", tok.decode(o, skip_special_tokens=True), flush=True)


if __name__ == "__main__":
    main()
