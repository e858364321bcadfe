"""One exception type for every user-facing failure; the CLI turns it into exit code 2."""


class SecateurError(Exception):
    """A problem with the user's input (model, data, options) or environment, with a one-line message."""
