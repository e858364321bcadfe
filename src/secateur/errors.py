"""One exception type for every user-facing failure; the CLI turns it into exit code 2."""


class SecateurError(Exception):
    """A problem with the user's input (model, data, options) or environment, with a one-line message."""


def check_fraction(value, name: str = "sparsity", closed: bool = False, unit: str = "weights") -> float:
    """``value`` as a float in [0, 1) (``closed``: [0, 1]), or one line naming ``name`` and what to pass. The one
    range check of every sparsity and ratio secateur takes (bools and NaN refused)."""
    import math

    try:
        if isinstance(value, bool):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise SecateurError(f"{name} must be a number, got {value!r}; pass the fraction of {unit} to remove, "
                            "e.g. 0.5") from None
    if math.isnan(v) or not (0.0 <= v <= 1.0 if closed else 0.0 <= v < 1.0):
        raise SecateurError(f"{name} must be in [0, 1{']' if closed else ')'}, got {value!r}; pass the fraction of "
                            f"{unit} to remove, e.g. 0.5")
    return v


def one_line(text: str) -> str:
    """``text`` as one printable line: control characters (``\\n``, and the record separators that
    ``str.splitlines`` also breaks on, such as ``\\x1e``) and other unprintable characters escaped, so a value
    echoed from a damaged file can never split the CLI's single error line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
