"""Errors raised while finding, converting or loading model weights."""


class ModelLoadError(RuntimeError):
    """A model path could not be resolved, converted or loaded; the message names the path and the problem."""
