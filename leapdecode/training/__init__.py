"""Training draft heads on CPU (`leapdecode train-drafter`): conversations and the benchmark split,
the target's states and distributions, the heads' losses, and the resumable training loop."""
