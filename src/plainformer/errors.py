"""Errors every layer may raise for the command line to report."""


class UserError(Exception):
    """An error the user can fix (a bad path, a bad value, a flag that does not apply): the command line
    prints it as one line and exits with status 2."""
