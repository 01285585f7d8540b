"""Model families: the contract (contract.py), the registry (registry.py) and one module per family.

Declarative and torch-free: the runner's generic decoder runs any `ModelConfig`; the operator and the
scheduler read configs and adapter targets through the same tables.
"""
