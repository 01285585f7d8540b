"""lorafleet: serve hundreds of LoRA fine-tunes of one base model from a shared GPU pool."""

__version__ = "0.1.0"
