"""Small statistics helpers (the best-of-N demo's repository)."""


def mean(xs):
    """The arithmetic mean of a non-empty sequence."""
    return sum(xs) / len(xs)


def median(xs):
    """The median of a non-empty sequence."""
    s = sorted(xs)
    return s[len(s) // 2]
