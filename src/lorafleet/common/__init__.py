"""Torch-free pieces shared by the runner, the scheduler and the operator."""
