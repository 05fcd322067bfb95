"""The one exception type for user mistakes: a one-line message that names the fix."""


class UserError(Exception):
    """Bad input from the user: config, files or data. The entry point prints it and exits 2."""
