"""The error of input data that cannot be used, shared by the readers of data lines and of the
target's tokenizer and chat template (so that neither imports the other)."""


class InputError(ValueError):
    """A data line, or the tokenizer or template it needs, that cannot be used; the message names the file."""
