"""The training core: train state and step, objectives, optimizers, the loop."""
