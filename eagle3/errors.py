"""One base for the errors a user fixes from the message (it names the file, the key or field, and what
was expected): every command catches it once and prints it in one line."""


class Eagle3Error(ValueError):
    """A setting, an input or a file that cannot be used."""


class InputError(Eagle3Error):
    """A data line, or the tokenizer or template it needs, that cannot be used; the message names the file."""


class TargetError(Eagle3Error):
    """The target checkpoint is missing something or is inconsistent; the message names the file."""


class TrainError(Eagle3Error):
    """A training run that cannot start or go on as set up; the message names the setting."""
