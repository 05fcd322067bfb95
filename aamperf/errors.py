"""User mistakes (a one-line message that names the fix) and runs that stop themselves."""

from typing import Any


class UserError(Exception):
    """Bad input from the user: config, files or data. The entry point prints it and exits 2."""


class RunAborted(Exception):
    """The run stopped itself to protect its state (non-finite steps, memory): status `aborted`, a
    checkpoint of the last good state, and a one-line message. The entry point exits 3."""

    def __init__(self, message: str, result: Any = None):
        super().__init__(message)
        self.result = result  # the trainer's FitResult up to the stop
