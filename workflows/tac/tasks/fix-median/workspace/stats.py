"""Small statistics helpers used by the reporting scripts."""


def mean(values):
    """Arithmetic mean of a non-empty list."""
    return sum(values) / len(values)


def median(values):
    """Middle value of a non-empty list (the mean of the two middle values for even lengths)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle]
