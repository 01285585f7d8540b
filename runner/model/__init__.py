"""The Llama-architecture model, written for one flat token batch per step."""
